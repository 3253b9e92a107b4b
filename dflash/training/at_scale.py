"""A drafter trained at scale: in one sitting on an accelerator, or over resumable sittings on a
CPU with bf16 hardware.

`train-drafter` (train_drafter.py) writes one shard per reply and trains one sample a step: right
for a 2-core CPU without bf16 hardware, where a day makes ~300K reply tokens. Here the data sits in
the device's memory and everything runs in batches, in three timed stages:

1. User turns. Besides the rendered prompt pool (prompt_pool.py, made by `prepare` on a machine
   with the tokenizer), the target writes user turns itself: it samples after the chat template's
   `<|im_start|>user\n`, the way it would continue a conversation. These are the chat most like
   what the target has seen, in numbers no word list reaches.
2. Replies. The target answers every prompt greedily in batches (batched_replies.batched_greedy),
   its hidden rows at the drafter's target layers kept in one preallocated buffer.
3. Training. Each step draws `sequences` replies, `anchors` blocks in each, and trains them all in
   one forward (`batched_training_forward`: the objective of train_drafter.training_forward, with
   a batch dimension); the learning rate follows a cosine over the training's time (or steps),
   not a step count, since a sitting ends at a deadline.

Sittings: the sampled turns and each batch of replies are written under `OUT/data` as they are
made, and the training state (drafter, optimizer, step, seconds trained, random state) to
`OUT/checkpoint.pt` every `--checkpoint-every` seconds and at the end. A later sitting with
`--resume` reads them back, answers the batches not yet answered, and trains on from the same
point: two sittings make the drafter one would, bit for bit (tests/model/test_at_scale.py).

`prepare` runs where the tokenizer is (it renders prompts); `run` needs only torch, numpy, the
`gguf` package and the GGUF file, so it can run on a machine that has nothing else of ours.
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import shutil
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dflash.engine.drafters.dflash import DraftLoadError, load_dflash_checkpoint, random_draft_model, save_dflash_checkpoint
from dflash.engine.loading import draft_vocabulary
from dflash.training.batched_replies import fp32_copy
from dflash.training.objective import (
    batched_training_forward,
    decoded_acceptance,
    slot_loss,
    slot_weights,
    vocabulary_head,
    vocabulary_labels,
    warmup_cosine,
)
from dflash.training.draft_vocab import FILE_NAME as VOCAB_FILE
from dflash.training.train_drafter import draft_config

# prompt_pool.KINDS, then this run's own two (not imported: `run` must not need the chat package's
# imports on the accelerator machine; tests/model/test_at_scale.py checks they agree).
KINDS = ("chat", "coding", "code editing", "tool use", "sampled chat", "built-in")


# -- prompts: rendered where the tokenizer is, read where the accelerator is ----------------------

def prepare(out: Path, count: int, seed: int = 0, max_prompt_tokens: int = 900) -> dict:
    """Render `count` pool conversations and the built-in prompt set into one compressed file:
    token ids, each prompt's kind, and the template pieces that frame a sampled user turn."""
    from dflash.chat.template import render_prompt
    from dflash.engine.loading import EMBEDDED_DEFAULT, eos_token_ids, load_tokenizer, resolve_source, DEFAULT_CACHE_DIR
    from dflash.training.prompts import default_prompts
    from dflash.training.train_drafter import choose_mask_token

    tokenizer = load_tokenizer(EMBEDDED_DEFAULT)
    conversations = [("built-in", [{"role": "user", "content": p}]) for p in default_prompts(2239, seed)]
    if count:
        from dflash.training.prompt_pool import scaled_conversations

        conversations += scaled_conversations(count, seed)
    ids, kinds, dropped = [], [], 0
    for kind, messages in conversations:
        rendered = render_prompt(tokenizer, messages)
        if len(rendered) > max_prompt_tokens:
            dropped += 1
            continue
        ids.append(rendered)
        kinds.append(KINDS.index(kind) if kind in KINDS else KINDS.index("chat"))
    # The frame of a sampled user turn: what render_prompt puts before and after a user message.
    marker = "\u2063"  # a character no prompt holds, to split the rendering at the message
    framed = render_prompt(tokenizer, [{"role": "user", "content": marker}])
    marker_ids = tokenizer.encode(marker, add_special_tokens=False)
    at = next(i for i in range(len(framed)) if framed[i : i + len(marker_ids)] == marker_ids)
    _, folder = resolve_source(EMBEDDED_DEFAULT, DEFAULT_CACHE_DIR)
    meta = {"user_prefix": framed[:at], "user_suffix": framed[at + len(marker_ids):],
            "eos_ids": eos_token_ids(folder, json.loads((folder / "config.json").read_text()), tokenizer),
            "mask_token_id": choose_mask_token(tokenizer), "kinds": list(KINDS), "seed": seed,
            "pool_count": count, "dropped_over_length": dropped}
    flat = np.concatenate([np.asarray(p, dtype=np.uint16) for p in ids])
    lengths = np.asarray([len(p) for p in ids], dtype=np.int32)
    payload = {"meta": json.dumps(meta), "tokens": flat, "lengths": lengths, "kinds": np.asarray(kinds, np.uint8)}
    out.parent.mkdir(parents=True, exist_ok=True)
    with lzma.open(out, "wb", preset=6) as f:
        np.savez(f, **payload)
    return {**meta, "prompts": len(ids), "tokens": int(flat.size)}


def read_prompts(path: Path) -> tuple[list[list[int]], list[int], dict]:
    with lzma.open(path, "rb") as f:
        data = np.load(f)
        meta = json.loads(str(data["meta"]))
        flat, lengths, kinds = data["tokens"].astype(np.int64), data["lengths"], data["kinds"]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    prompts = [flat[offsets[i] : offsets[i + 1]].tolist() for i in range(len(lengths))]
    return prompts, kinds.tolist(), meta


def save_whole(value, path: Path) -> None:
    """torch.save to a side file, then a rename: a sitting killed mid-write leaves no half file."""
    partial = path.with_suffix(".partial")
    torch.save(value, partial)
    partial.rename(path)


# -- the data, resident on the device ------------------------------------------------------------

class ReplyStore:
    """Prompt + reply tokens and their target rows, packed into buffers allocated once."""

    def __init__(self, capacity: int, width: int, device):
        self.tokens = torch.zeros(capacity, dtype=torch.long, device=device)
        self.rows = torch.empty(capacity, width, dtype=torch.bfloat16, device=device)
        self.used = 0
        self.starts: list[int] = []
        self.lengths: list[int] = []
        self.reply_starts: list[int] = []
        self.kinds: list[int] = []

    def add(self, sequence: Sequence[int], reply_start: int, rows: Tensor, kind: int) -> bool:
        n = len(sequence)
        if self.used + n > self.tokens.shape[0]:
            return False
        self.tokens[self.used : self.used + n] = torch.tensor(sequence, device=self.tokens.device)
        self.rows[self.used : self.used + n] = rows
        self.starts.append(self.used)
        self.lengths.append(n)
        self.reply_starts.append(reply_start)
        self.kinds.append(kind)
        self.used += n
        return True

    def save(self, path: Path, first: int) -> None:
        """The replies from index `first` on, in one file."""
        at, end = self.starts[first] if first < len(self.starts) else self.used, self.used
        # Copies: a slice is a view, and torch.save writes a view's whole storage (the store).
        part = {"tokens": self.tokens[at:end].to(torch.int32).cpu(), "rows": self.rows[at:end].cpu().clone(),
                "lengths": self.lengths[first:], "reply_starts": self.reply_starts[first:],
                "kinds": self.kinds[first:]}
        save_whole(part, path)

    def load(self, path: Path) -> bool:
        """Append a file `save` wrote; False where the store has no room for it."""
        part = torch.load(path, weights_only=True)
        n = part["tokens"].shape[0]
        if self.used + n > self.tokens.shape[0]:
            return False
        at = 0
        for length, reply_start, kind in zip(part["lengths"], part["reply_starts"], part["kinds"]):
            self.add(part["tokens"][at : at + length].tolist(), reply_start, part["rows"][at : at + length], kind)
            at += length
        return True

    @property
    def full(self) -> float:
        return self.used / self.tokens.shape[0]

    def reply_tokens(self) -> int:
        """Reply tokens the target generated (a stored reply lacks its last, which has no successor)."""
        return sum(length - start + 1 for length, start in zip(self.lengths, self.reply_starts))


def sampler(temperature: float, top_p: float, generator: torch.Generator):
    """Logits [B, V] -> tokens [B], nucleus sampling."""

    def choose(logits: Tensor) -> Tensor:
        probs = torch.softmax(logits / temperature, dim=-1)
        ordered, order = probs.sort(dim=-1, descending=True)
        outside = ordered.cumsum(-1) - ordered > top_p
        ordered = ordered.masked_fill(outside, 0.0)
        picked = torch.multinomial(ordered, 1, generator=generator)
        return order.gather(-1, picked).squeeze(-1)

    return choose


def sampled_user_turns(model, meta: dict, count: int, batch: int, max_tokens: int, seed: int,
                       deadline: float) -> list[list[int]]:
    """Prompts whose user turn the target wrote: it continues the template after `<|im_start|>user\n`."""
    from dflash.training.batched_replies import batched_greedy

    generator = torch.Generator(device=model.device).manual_seed(seed)
    choose = sampler(1.0, 0.95, generator)
    end_ids = set(meta["eos_ids"])
    prompts = []
    while len(prompts) < count and time.perf_counter() < deadline:
        turns = batched_greedy(model, [meta["user_prefix"]] * min(batch, count - len(prompts)), max_tokens,
                               end_ids, [], choose=choose, rows_to_cpu=False)
        for output, _ in turns:
            if output and output[-1] in end_ids and len(output) >= 4:  # a whole turn, not a cut one
                prompts.append(meta["user_prefix"] + output[:-1] + meta["user_suffix"])
    return prompts


def reply_batches(prompts: Sequence[Sequence[int]], batch: int) -> list[list[int]]:
    """The pool's prompts in batches of similar length, in a fixed shuffled order: any prefix of
    the batches mixes lengths and kinds, and a later sitting finds batch k where an earlier left it."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[k : k + batch] for k in range(0, len(order), batch)]
    random.Random(0).shuffle(batches)
    return batches


def batch_file(data: Path, number: int) -> Path:
    return data / f"replies-{number:05d}.pt"


def load_replies(store: ReplyStore, data: Path, count: int, log) -> int:
    """The batches earlier sittings wrote (0, 1, ... up to the first missing), into `store`."""
    loaded = 0
    while loaded < count and batch_file(data, loaded).exists():
        if not store.load(batch_file(data, loaded)):
            log(f"the store is full after {loaded} saved batches: raise --store-tokens to train on all of them")
            break
        loaded += 1
    return loaded


def rope_for_factor(args, factor: float) -> tuple[Tensor, float]:
    """The target's RoPE (inverse frequencies, attention scale) at a YaRN `factor`; 1: as its config
    declares (unscaled for the embedded model)."""
    from dflash.engine.model import rope_inverse_frequencies, with_rope_scaling

    if factor <= 1.0:
        return rope_inverse_frequencies(args)
    scaled = with_rope_scaling(args, round(factor * args.max_position_embeddings), "yarn", factor)
    return rope_inverse_frequencies(scaled)


def generate_replies(model, store: ReplyStore, prompts: Sequence[Sequence[int]], kinds: Sequence[int],
                     layer_ids: Sequence[int], eos_ids: set[int], tokens: int, batch: int, deadline: float,
                     log, data: Path | None = None, first_batch: int = 0, rope_factors: Sequence[float] = (1.0,)) -> int:
    """Greedy replies into `store`, batches of similar length from `first_batch` on; stops at the
    deadline or when full. With `data`, each batch's replies go to a file as soon as it ends.

    Batch n runs the target at YaRN factor rope_factors[n % len]. Why: a server whose max_ctx passes
    the trained context (the default set-up: 32768, factor 4) runs the target scaled past it (at
    every position with [model] rope_scaling_static), and a drafter trained only on the unscaled
    target's rows lost τ under the scaling (mean 3.13 -> 2.64 on the unseen prompts, code editing
    3.44 -> 2.58; bench/unseen_acceptance.py --max-ctx --rope-scaling-static)."""
    from dflash.training.batched_replies import batched_greedy

    batches = reply_batches(prompts, batch)
    ropes = {factor: rope_for_factor(model.args, factor) for factor in set(rope_factors)}
    done = 0
    for number in range(first_batch, len(batches)):
        if time.perf_counter() > deadline or store.full > 0.97:
            break
        members, first, started = batches[number], len(store.starts), time.perf_counter()
        factor = rope_factors[number % len(rope_factors)]
        inv_freq, model.rope_attention_scale = ropes[factor]
        model.inv_freq = inv_freq.to(model.inv_freq.device)
        replies = batched_greedy(model, [prompts[i] for i in members], tokens, eos_ids, layer_ids, rows_to_cpu=False)
        for i, (output, rows) in zip(members, replies):
            if len(output) >= 2 and store.add(list(prompts[i]) + output[:-1], len(prompts[i]), rows, kinds[i]):
                done += 1
        if data is not None:
            store.save(batch_file(data, number), first)
        seconds = time.perf_counter() - started
        made = sum(store.lengths[k] - store.reply_starts[k] + 1 for k in range(first, len(store.starts)))
        log(f"replies batch {number + 1}/{len(batches)} (RoPE factor {factor:g}): {len(members)} prompts, {made} reply tokens, "
            f"{seconds:.1f} s ({made / seconds:.0f} tok/s), store {store.full:.0%}")
    return done


# -- training batches (the objective itself: objective.py) -------------------------------------

# Sequences of a step are padded to a multiple of this. Few distinct shapes matter on the CPU:
# oneDNN keeps a primitive (with memory of its own) for every matmul shape it meets, so a length per
# step grew a 2-core AMX run by ~0.1 GB a step until it was killed for memory at step ~115.
LENGTH_BUCKET = 128


def training_batch(store: ReplyStore, indices: Sequence[int], anchors: int, block: int,
                   generator: torch.Generator | None, bucket: int = LENGTH_BUCKET
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(rows, tokens, lengths, anchors [S, N], labels [S, N, B-1]) of the stored replies `indices`,
    padded to a multiple of `bucket` positions; up to `anchors` distinct anchors per reply at its
    reply positions, drawn at random with `generator` (None: its first ones, one after another),
    -1 labels where none."""
    device = store.tokens.device
    starts = torch.tensor([store.starts[i] for i in indices], device=device)
    lengths = torch.tensor([store.lengths[i] for i in indices], device=device)
    firsts = torch.tensor([store.reply_starts[i] for i in indices], device=device)
    L = -(-int(lengths.max()) // bucket) * bucket
    span = torch.arange(L, device=device)
    inside = span[None] < lengths[:, None]
    flat = (starts[:, None] + span[None]).where(inside, starts[:, None])
    rows, tokens = store.rows[flat], store.tokens[flat]
    # An anchor needs a successor: positions first..length-2.
    candidate = (span[None] >= firsts[:, None]) & (span[None] <= lengths[:, None] - 2)
    if generator is None:
        score = (L - span).float()[None].expand(len(indices), -1).masked_fill(~candidate, -1.0)
    else:
        score = torch.rand(len(indices), L, device=device, generator=generator).masked_fill(~candidate, -1.0)
    n = min(anchors, L)
    top, chosen = score.topk(n, dim=1)
    valid = top >= 0
    chosen = chosen.where(valid, firsts[:, None].clamp(max=L - 1))
    chosen, order = chosen.sort(dim=1)
    valid = valid.gather(1, order)
    targets = chosen[:, :, None] + torch.arange(1, block, device=device)  # [S, N, B-1]
    labels = tokens.gather(1, targets.clamp(max=L - 1).reshape(len(indices), -1)).view_as(targets)
    labels = labels.masked_fill((targets >= lengths[:, None, None]) | ~valid[:, :, None], -1)
    return rows, tokens, lengths, chosen, labels


@torch.no_grad()
def held_out_acceptance(draft, embed, lm_head_weight, store: ReplyStore, indices: Sequence[int], block: int,
                        mask_token: int, anchors: int = 96, row_of: Tensor | None = None) -> dict[str, float]:
    """τ per kind on held-out replies: tokens per verification of a greedy decode with a full block
    through each reply's first `anchors` positions (objective.decoded_acceptance; the target's
    greedy reply is the label, so a block that is right is what verification accepts), as
    bench/unseen_acceptance.py decodes its prompts' first 96 tokens. Before session 31 this was the
    mean over 64 random anchors, which overrated τ (decoded_acceptance says by how much). With
    `row_of` the head is a draft vocabulary's rows (objective.vocabulary_head), as the server's."""
    by_kind: dict[str, list[int]] = {}
    for k in range(0, len(indices), 16):
        chunk = list(indices[k : k + 16])
        rows, tokens, lengths, chosen, labels = training_batch(store, chunk, anchors, block, None)
        with torch.autocast(rows.device.type, dtype=torch.bfloat16, enabled=half_autocast(rows.device)):
            out = batched_training_forward(draft, embed, rows, tokens, lengths, chosen, block, mask_token)
        logits = F.linear(out.to(lm_head_weight.dtype), lm_head_weight).float()
        if row_of is not None:
            labels = vocabulary_labels(labels, row_of, miss=lm_head_weight.shape[0])
        for s, index in enumerate(chunk):
            valid = labels[s, :, 0] >= 0  # the first anchors of the reply, one after another
            if valid.any():
                committed, verifications = decoded_acceptance(logits[s][valid], labels[s][valid])
                totals = by_kind.setdefault(KINDS[store.kinds[index]], [0, 0])
                totals[0] += committed
                totals[1] += verifications
    return {kind: round(committed / verifications, 3) for kind, (committed, verifications) in sorted(by_kind.items())}


# -- the run -------------------------------------------------------------------------------------

def guarded(log, stage: str, function, fallback):
    """A stage that fails leaves what it made: the run goes on to train on it and save, and says why."""
    import traceback

    try:
        return function()
    except Exception:
        log(f"{stage} stopped by an error; going on with what it made:\n{traceback.format_exc()}")
        return fallback


def resident_gib() -> float:
    """This process's resident memory (Linux; 0 elsewhere): a CPU run holds its data in RAM."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**30
    except (OSError, IndexError, ValueError):
        return 0.0


def half_autocast(device: torch.device) -> bool:
    """Whether training runs under bf16 autocast: on an accelerator, and on CPUs with bf16
    hardware (AMX, AVX512-BF16), where a bf16 GEMM is ~4x an fp32 one; not where bf16 is emulated."""
    from dflash.engine.model import has_bf16_hardware

    return device.type == "cuda" or (device.type == "cpu" and has_bf16_hardware())


def save_checkpoint(path: Path, draft, optimizer, progress: dict, generator: torch.Generator) -> None:
    """What a later sitting needs to go on training exactly where this one stopped."""
    state = {"draft": draft.state_dict(), "optimizer": optimizer.state_dict(), "progress": progress,
             "generator": generator.get_state()}
    save_whole(state, path)


def train_stage(draft, embed, head: Tensor, store: ReplyStore, train_indices: Sequence[int], held: Sequence[int],
                args: argparse.Namespace, mask_token: int, stage_start: float, stage_seconds: float, progress: dict,
                log, checkpoint: Path | None = None, resumed: dict | None = None, row_of: Tensor | None = None) -> None:
    """Steps of `args.sequences` replies until the sitting's stage time (or `args.steps` steps, or
    `args.train_seconds` of training over all sittings) is spent; the learning rate warms up, then
    follows a cosine over the training time (`args.train_seconds`, or this stage's time). With a
    `checkpoint` path the state is saved there every `args.checkpoint_every` seconds and at the end;
    `resumed` is a saved state to go on from. With `row_of` the head is a draft vocabulary's rows
    (objective.vocabulary_head) and slots whose token lies outside it are not trained."""
    device = store.tokens.device
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.learning_rate, weight_decay=0.0,
                                  fused=device.type == "cuda")
    weights = slot_weights(args.block_size, args.gamma)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    if resumed is not None:
        optimizer.load_state_dict(resumed["optimizer"])
        generator.set_state(resumed["generator"])
    half = half_autocast(device)
    trained_before = progress["trained_seconds"]
    schedule = args.train_seconds or (trained_before + stage_seconds)
    next_eval = trained_before + args.eval_every
    next_save = args.checkpoint_every

    def trained() -> float:
        return trained_before + time.perf_counter() - stage_start

    last_step = progress["step"] + args.sitting_steps if args.sitting_steps else None
    while (time.perf_counter() - stage_start) < stage_seconds and trained() < schedule and (
            not args.steps or progress["step"] < args.steps) and (not last_step or progress["step"] < last_step):
        done = trained() / schedule if not args.steps else progress["step"] / args.steps
        for group in optimizer.param_groups:
            group["lr"] = warmup_cosine(args.learning_rate, done, args.warmup)
        picks = torch.randint(len(train_indices), (args.sequences,), generator=generator, device=device).tolist()
        rows, tokens, lengths, anchors, labels = training_batch(store, [train_indices[i] for i in picks], args.anchors,
                                                                args.block_size, generator)
        if row_of is not None:
            labels = vocabulary_labels(labels, row_of)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=half):
            out = batched_training_forward(draft, embed, rows, tokens, lengths, anchors, args.block_size, mask_token)
            loss = slot_loss(out, labels, head, weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        progress["step"] += 1
        progress["trained_seconds"] = round(trained(), 1)
        if progress["step"] % 10 == 0 or progress["step"] == 1:
            progress["losses"].append((progress["step"], round(float(loss.detach()), 4)))
            log(f"step {progress['step']}: loss {float(loss.detach()):.4f}, {progress['trained_seconds']:.0f} s trained, "
                f"{resident_gib():.1f} GiB resident")
        if trained() > next_eval:
            next_eval += args.eval_every
            draft.eval()
            estimate = held_out_acceptance(draft, embed, head, store, held, args.block_size, mask_token, row_of=row_of)
            draft.train()
            progress["curve"].append({"step": progress["step"], "seconds": round(trained(), 1),
                                      "loss": round(float(loss.detach()), 4), **estimate})
            log(json.dumps(progress["curve"][-1]))
        if checkpoint is not None and time.perf_counter() - stage_start > next_save:
            next_save += args.checkpoint_every
            save_checkpoint(checkpoint, draft, optimizer, progress, generator)
    if checkpoint is not None:
        save_checkpoint(checkpoint, draft, optimizer, progress, generator)


def run(args: argparse.Namespace) -> dict:
    from dflash.engine.cpu import cpu_kind
    from dflash.engine.gguf_tensors import read_gguf_state
    from dflash.engine.model import ModelArgs, build_transformer

    began = time.perf_counter()
    loss_ids = None
    if args.loss_vocabulary:  # before anything is loaded or written
        try:
            loss_ids = draft_vocabulary(args.loss_vocabulary)
        except DraftLoadError as error:
            raise SystemExit(f"--loss-vocabulary: {error}") from None
        if loss_ids is None:
            raise SystemExit(f"--loss-vocabulary {args.loss_vocabulary}: no {VOCAB_FILE} there")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "at-scale.log", "a")

    def log(message: str) -> None:
        line = f"[{time.perf_counter() - began:7.1f} s] {message}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    state, config = read_gguf_state(args.gguf)
    target = build_transformer(ModelArgs.from_hf_config(config), state, torch.bfloat16, str(device))
    del state
    target.requires_grad_(False)
    prompts, kinds, meta = read_prompts(Path(args.prompts))
    log(f"target on {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else cpu_kind()}); "
        f"{len(prompts)} rendered prompts")
    a = target.args
    layer_ids = tuple(int(i) for i in args.target_layer_ids.split(","))
    rope_factors = [float(f) for f in args.rope_factors.split(",")]
    if any(f < 1.0 for f in rope_factors):
        raise SystemExit(f"--rope-factors {args.rope_factors!r}: each factor is 1 (unscaled) or more (YaRN)")
    mask_token = meta["mask_token_id"]
    eos_ids = set(meta["eos_ids"])
    if loss_ids is not None and max(loss_ids) >= a.vocab_size:
        raise SystemExit(f"--loss-vocabulary {args.loss_vocabulary}: ids up to {max(loss_ids)}, "
                         f"outside the target's {a.vocab_size}")

    dconfig = draft_config(a, args.layers, args.block_size, layer_ids, mask_token)
    data, checkpoint = out / "data", out / "checkpoint.pt"
    # What the saved data depends on: a later sitting must ask for the same, or its batches would
    # not be the ones on disk.
    recipe = {"prompts": Path(args.prompts).name, "prompts_bytes": Path(args.prompts).stat().st_size,
              "seed": args.seed, "batch": args.batch, "tokens": args.tokens, "target_layer_ids": list(layer_ids),
              "sampled_prompts": args.sampled_prompts, "user_tokens": args.user_tokens,
              "prompt_limit": args.prompt_limit, "rope_factors": rope_factors}
    if (data / "recipe.json").exists() or checkpoint.exists():
        if not args.resume:
            raise SystemExit(f"{out} holds an earlier sitting's data or checkpoint: pass --resume to go on "
                             "with it, or another --out")
        saved = json.loads((data / "recipe.json").read_text()) if (data / "recipe.json").exists() else recipe
        if saved != recipe:
            changed = sorted(k for k in recipe if saved.get(k) != recipe[k])
            raise SystemExit(f"--resume: {out} was made with " + ", ".join(f"{k}={saved.get(k)!r}" for k in changed)
                             + "; this sitting asks for " + ", ".join(f"{k}={recipe[k]!r}" for k in changed))
    data.mkdir(exist_ok=True)
    (data / "recipe.json").write_text(json.dumps(recipe, indent=2))

    resumed = torch.load(checkpoint, weights_only=False) if checkpoint.exists() else None
    draft_source = args.init_from
    if resumed is not None:
        draft_source = resumed["progress"]["init_from"]
        draft = random_draft_model(dconfig, seed=args.seed, dtype=torch.float32)
        if draft.state_dict().keys() != resumed["draft"].keys() or any(
                draft.state_dict()[k].shape != v.shape for k, v in resumed["draft"].items()):
            raise SystemExit(f"--resume: {checkpoint} holds a drafter of another shape than --layers "
                             f"{args.layers}, --block-size {args.block_size}")
        draft.load_state_dict(resumed["draft"])
        if resumed["progress"].get("loss_vocabulary") != args.loss_vocabulary:
            raise SystemExit(f"--resume: {checkpoint} was trained with --loss-vocabulary "
                             f"{resumed['progress'].get('loss_vocabulary')!r}; this sitting asks for {args.loss_vocabulary!r}")
        log(f"training goes on from {checkpoint}: step {resumed['progress']['step']}, "
            f"{resumed['progress']['trained_seconds']:.0f} s trained")
    elif args.init_from:
        # Continue a drafter (the shipped one's curve was still rising when its run ended): its
        # shape must be the one asked for, since the data's rows are of these layers. Checked
        # before any data is made.
        draft = load_dflash_checkpoint(Path(args.init_from), torch.float32)
        if draft.config != dconfig:
            raise SystemExit(f"--init-from {args.init_from} is a drafter of {draft.config}, not of {dconfig}: "
                             "pass its --layers, --block-size and --target-layer-ids")
        log(f"training continues from {args.init_from}")
    else:
        draft = random_draft_model(dconfig, seed=args.seed, dtype=torch.float32)

    # 1. sampled user turns (once: a later sitting reads them back, so its pool is this one's)
    sampled_file = data / "sampled-turns.json"
    if sampled_file.exists():
        sampled = json.loads(sampled_file.read_text())
        log(f"sampled user turns: {len(sampled)}, from {sampled_file}")
    else:
        stage_end = began + args.seconds * args.user_share
        sampled = guarded(log, "user turns", lambda: sampled_user_turns(
            target, meta, args.sampled_prompts, args.batch, args.user_tokens, args.seed, stage_end), [])
        sampled_file.write_text(json.dumps(sampled))
        log(f"sampled user turns: {len(sampled)}")
    rng = random.Random(args.seed)
    pool = list(zip(prompts, kinds)) + [(p, KINDS.index("sampled chat")) for p in sampled]
    rng.shuffle(pool)
    if args.prompt_limit:
        pool = pool[: args.prompt_limit]

    # 2. replies: earlier sittings' batches from disk, then new ones within this sitting's share
    width = len(layer_ids) * a.hidden_size
    store = ReplyStore(args.store_tokens, width, device)
    batches = len(reply_batches([p for p, _ in pool], args.batch))
    saved = load_replies(store, data, batches, log)
    if saved:
        log(f"replies: {saved} batches ({len(store.starts)} replies) from {data}")
    stage_end = began + args.seconds * (args.user_share + args.reply_share)
    answered = guarded(log, "replies", lambda: generate_replies(
        target, store, [p for p, _ in pool], [k for _, k in pool], layer_ids, eos_ids, args.tokens, args.batch,
        stage_end, log, data if args.save_data else None, saved, rope_factors), 0)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the decode batches' K/V go back before training allocates
    indices = list(range(len(store.starts)))
    if resumed is not None:
        held = [i for i in resumed["progress"]["held"] if i < len(indices)]  # trained on by none of the sittings
    else:
        # Held out evenly across the store: it fills batch by batch, each of prompts of one length.
        held = indices[:: max(1, len(indices) // max(args.held_out, 1))][: args.held_out]
    train_indices = sorted(set(indices) - set(held)) or indices
    tally = {KINDS[k]: sum(1 for i in indices if store.kinds[i] == k) for k in range(len(KINDS))}
    log(f"replies: {answered} answered in this sitting, {store.reply_tokens()} reply tokens, {store.used} tokens "
        f"in all; per kind {tally}")

    # 3. training
    draft = draft.to(device).train()
    # The frozen LM head of the loss (objective.HeadCrossEntropy) in fp32 where bf16 is emulated:
    # its gradient GEMM, probabilities [rows, 49,152] @ head, took 7.4 s for 128 rows with the
    # bf16 head against 0.05 s in fp32 (AVX2 Zen 3, 2 threads), 15 s of a 4-sequence test step.
    head = target.lm_head.weight if half_autocast(device) else fp32_copy(target.lm_head)[0]
    row_of = None
    if loss_ids is not None:
        head, row_of = vocabulary_head(head, loss_ids)
    stage_start = time.perf_counter()
    stage_seconds = max(began + args.seconds - args.save_seconds - stage_start, 1.0)
    progress = (resumed["progress"] if resumed is not None else
                {"step": 0, "trained_seconds": 0.0, "losses": [], "curve": [], "held": held,
                 "init_from": draft_source, "loss_vocabulary": args.loss_vocabulary, "sittings": []})
    progress["sittings"].append({"replies": len(indices), "reply_tokens": store.reply_tokens(),
                                 "from_step": progress["step"]})
    guarded(log, "training", lambda: train_stage(draft, target.embed, head, store, train_indices, held, args,
                                                  mask_token, stage_start, stage_seconds, progress, log,
                                                  checkpoint, resumed, row_of), None)
    draft.eval()
    final = held_out_acceptance(draft, target.embed, head, store, held, args.block_size, mask_token, row_of=row_of)
    step, losses, curve = progress["step"], progress["losses"], progress["curve"]
    curve.append({"step": step, "seconds": progress["trained_seconds"],
                  "loss": losses[-1][1] if losses else None, **final})
    log(f"trained {step} steps: held-out τ {final}")
    save_dflash_checkpoint(draft.to(torch.bfloat16).cpu(), out / "drafter")
    if args.loss_vocabulary:  # the vocabulary it was trained to propose from
        shutil.copyfile(Path(args.loss_vocabulary) / VOCAB_FILE, out / "drafter" / VOCAB_FILE)
    elif draft_source and (Path(draft_source) / VOCAB_FILE).exists():
        # A drafter continued keeps the vocabulary it proposes from (counted from text, not trained).
        shutil.copyfile(Path(draft_source) / VOCAB_FILE, out / "drafter" / VOCAB_FILE)
    summary = {
        "recipe": "at_scale", "device": (torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({cpu_kind()})"),
        "autocast_bf16": half_autocast(device), "sittings": progress["sittings"],
        "trained_seconds": progress["trained_seconds"],
        "seconds": round(time.perf_counter() - began, 1), "training_seconds": round(time.perf_counter() - stage_start, 1),
        "steps": step, "sequences_per_step": args.sequences, "anchors": args.anchors, "layers": args.layers,
        "block_size": args.block_size, "learning_rate": args.learning_rate, "gamma": args.gamma,
        "init_from": draft_source, "loss_vocabulary": args.loss_vocabulary,
        "loss_vocabulary_size": None if loss_ids is None else len(set(loss_ids)),
        "target_layer_ids": list(layer_ids), "mask_token_id": mask_token, "target_dtype": "bfloat16 (from the GGUF)",
        "prompts_rendered": len(prompts), "sampled_user_turns": len(sampled), "replies": len(indices),
        "replies_per_kind": tally, "reply_tokens": store.reply_tokens(), "stored_tokens": store.used,
        "held_out": len(held), "held_out_acceptance": final, "curve": curve, "loss": losses,
    }
    (out / "drafter" / "training.json").write_text(json.dumps(summary, indent=2))
    log_file.close()
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash.training.at_scale", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="render the prompt pool (needs the tokenizer)")
    p.add_argument("--out", required=True)
    p.add_argument("--count", type=int, default=40000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt-tokens", type=int, default=900)
    # The defaults are the run that made the shipped drafter (README: the at-scale recipe; one H200).
    r = sub.add_parser("run", help="sample, answer and train on one device, within --seconds")
    r.add_argument("--gguf", required=True)
    r.add_argument("--prompts", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    r.add_argument("--seconds", type=float, default=520.0, help="wall-clock budget of the whole run")
    r.add_argument("--user-share", type=float, default=0.05, help="share of --seconds for sampled user turns")
    r.add_argument("--reply-share", type=float, default=0.4, help="share of --seconds for replies")
    r.add_argument("--save-seconds", type=float, default=15.0, help="kept at the end for the last evaluation and saving")
    r.add_argument("--sampled-prompts", type=int, default=1024)
    r.add_argument("--user-tokens", type=int, default=80)
    r.add_argument("--prompt-limit", type=int, default=0, help="answer at most this many prompts (0: all)")
    r.add_argument("--tokens", type=int, default=160, help="reply tokens per prompt")
    r.add_argument("--rope-factors", default="1",
                   help="YaRN factors the target answers at, batch by batch in turn (1: unscaled; 4: the default "
                        "set-up's max_ctx 32768), e.g. 1,4")
    r.add_argument("--batch", type=int, default=1024, help="prompts decoded together")
    r.add_argument("--store-tokens", type=int, default=8_000_000, help="device buffer for prompt + reply rows")
    r.add_argument("--held-out", type=int, default=256)
    r.add_argument("--layers", type=int, default=3)
    r.add_argument("--block-size", type=int, default=8)
    r.add_argument("--target-layer-ids", default="1,10,18,27")
    r.add_argument("--sequences", type=int, default=32, help="replies per training step")
    r.add_argument("--anchors", type=int, default=128, help="blocks per reply per step")
    r.add_argument("--init-from", help="a drafter folder to continue training (default: random weights)")
    r.add_argument("--loss-vocabulary",
                   help="a folder with a draft_vocab.json: the loss scores the drafter against those rows of the LM "
                        "head only, as the server proposes from them (slots whose token lies outside are not "
                        "trained); the head is most of a CPU step. Default: the whole head")
    r.add_argument("--learning-rate", type=float, default=6e-4)
    r.add_argument("--warmup", type=float, default=0.04)
    r.add_argument("--gamma", type=float, default=4.0)
    r.add_argument("--steps", type=int, default=0,
                   help="train this many steps over all sittings, the learning rate's cosine over them (0: by time)")
    r.add_argument("--sitting-steps", type=int, default=0, help="end this sitting's training after this many steps")
    r.add_argument("--eval-every", type=float, default=60.0, help="seconds of training between held-out τ")
    r.add_argument("--train-seconds", type=float, default=0.0,
                   help="the learning rate's cosine over this much training, summed over sittings (0: this sitting's)")
    r.add_argument("--checkpoint-every", type=float, default=600.0, help="seconds between saved training states")
    r.add_argument("--save-data", action=argparse.BooleanOptionalAction, default=True,
                   help="write each batch of replies under OUT/data (a later sitting trains on them; "
                        "4.6 KB a token for the embedded model)")
    r.add_argument("--resume", action="store_true",
                   help="go on with --out's saved replies and training state (an earlier sitting's)")
    r.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        print(json.dumps(prepare(Path(args.out), args.count, args.seed, args.max_prompt_tokens)))
    else:
        summary = run(args)
        print(json.dumps({k: v for k, v in summary.items() if k not in ("curve", "loss")}))


if __name__ == "__main__":
    main()
