"""A drafter trained at scale in one sitting on an accelerator (or, slowly, on the CPU).

`train-drafter` (train_drafter.py) writes one shard per reply and trains one sample a step: right
for a 2-core CPU, where a day makes ~300K reply tokens. Here everything stays in the device's
memory and runs in batches, in three timed stages:

1. User turns. Besides the rendered prompt pool (prompt_pool.py, made by `prepare` on a machine
   with the tokenizer), the target writes user turns itself: it samples after the chat template's
   `<|im_start|>user\n`, the way it would continue a conversation. These are the chat most like
   what the target has seen, in numbers no word list reaches.
2. Replies. The target answers every prompt greedily in batches (batched_replies.batched_greedy),
   its hidden rows at the drafter's layers kept in one preallocated device buffer.
3. Training. Each step draws `sequences` replies, `anchors` blocks in each, and trains them all in
   one forward (`batched_training_forward`: the objective of train_drafter.training_forward, with
   a batch dimension); the learning rate follows a cosine over the stage's time, not a step count,
   since the stage ends at a deadline.

`prepare` runs where the tokenizer is (it renders prompts); `run` needs only torch, numpy, the
`gguf` package and the GGUF file, so it can run on a machine that has nothing else of ours.
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dflash.engine.drafters.dflash import load_dflash_checkpoint, random_draft_model, save_dflash_checkpoint
from dflash.training.objective import (
    acceptance_estimate,
    batched_training_forward,
    slot_loss,
    slot_weights,
    warmup_cosine,
)
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


def generate_replies(model, store: ReplyStore, prompts: Sequence[Sequence[int]], kinds: Sequence[int],
                     layer_ids: Sequence[int], eos_ids: set[int], tokens: int, batch: int, deadline: float,
                     log) -> int:
    """Greedy replies into `store`, batches of similar length; stops at the deadline or when full."""
    from dflash.training.batched_replies import batched_greedy

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[k : k + batch] for k in range(0, len(order), batch)]
    random.Random(0).shuffle(batches)  # any prefix of the batches mixes lengths and kinds
    done = 0
    for number, members in enumerate(batches):
        if time.perf_counter() > deadline or store.full > 0.97:
            break
        started = time.perf_counter()
        replies = batched_greedy(model, [prompts[i] for i in members], tokens, eos_ids, layer_ids, rows_to_cpu=False)
        for i, (output, rows) in zip(members, replies):
            if len(output) >= 2 and store.add(list(prompts[i]) + output[:-1], len(prompts[i]), rows, kinds[i]):
                done += 1
        log(f"replies batch {number + 1}/{len(batches)}: {len(members)} prompts, "
            f"{time.perf_counter() - started:.1f} s, store {store.full:.0%}")
    return done


# -- training batches (the objective itself: objective.py) -------------------------------------

def training_batch(store: ReplyStore, indices: Sequence[int], anchors: int, block: int, generator: torch.Generator
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(rows, tokens, lengths, anchors [S, N], labels [S, N, B-1]) of the stored replies `indices`;
    up to `anchors` distinct anchors per reply at its reply positions, -1 labels where none."""
    device = store.tokens.device
    starts = torch.tensor([store.starts[i] for i in indices], device=device)
    lengths = torch.tensor([store.lengths[i] for i in indices], device=device)
    firsts = torch.tensor([store.reply_starts[i] for i in indices], device=device)
    L = int(lengths.max())
    span = torch.arange(L, device=device)
    inside = span[None] < lengths[:, None]
    flat = (starts[:, None] + span[None]).where(inside, starts[:, None])
    rows, tokens = store.rows[flat], store.tokens[flat]
    # An anchor needs a successor: positions first..length-2.
    candidate = (span[None] >= firsts[:, None]) & (span[None] <= lengths[:, None] - 2)
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
                        mask_token: int, anchors: int = 64) -> dict[str, float]:
    """τ estimated on held-out replies per kind: 1 + the run of correct leading slots per block
    (the target's greedy reply is the label, so a block that is right is what verification accepts)."""
    generator = torch.Generator(device=store.tokens.device).manual_seed(1234)
    by_kind: dict[str, list[float]] = {}
    for k in range(0, len(indices), 16):
        chunk = list(indices[k : k + 16])
        rows, tokens, lengths, chosen, labels = training_batch(store, chunk, anchors, block, generator)
        with torch.autocast(rows.device.type, dtype=torch.bfloat16, enabled=rows.device.type == "cuda"):
            out = batched_training_forward(draft, embed, rows, tokens, lengths, chosen, block, mask_token)
        logits = F.linear(out.to(lm_head_weight.dtype), lm_head_weight).float()
        for s, index in enumerate(chunk):
            valid = labels[s, :, 0] >= 0
            if valid.any():
                estimate = acceptance_estimate(logits[s][valid], labels[s][valid])
                by_kind.setdefault(KINDS[store.kinds[index]], []).append(estimate)
    return {kind: round(sum(v) / len(v), 3) for kind, v in sorted(by_kind.items())}


# -- the run -------------------------------------------------------------------------------------

def guarded(log, stage: str, function, fallback):
    """A stage that fails leaves what it made: the run goes on to train on it and save, and says why."""
    import traceback

    try:
        return function()
    except Exception:
        log(f"{stage} stopped by an error; going on with what it made:\n{traceback.format_exc()}")
        return fallback


def train_stage(draft, embed, head: Tensor, store: ReplyStore, train_indices: Sequence[int], held: Sequence[int],
                args: argparse.Namespace, mask_token: int, stage_start: float, stage_seconds: float, progress: dict,
                log) -> None:
    """Steps of `args.sequences` replies until the stage's time (or `args.steps`) is spent; the
    learning rate warms up, then follows a cosine over the stage's time."""
    device = store.tokens.device
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.learning_rate, weight_decay=0.0,
                                  fused=device.type == "cuda")
    weights = slot_weights(args.block_size, args.gamma)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    next_eval = args.eval_every
    while (elapsed := time.perf_counter() - stage_start) < stage_seconds and (
            not args.steps or progress["step"] < args.steps):
        done = elapsed / stage_seconds if not args.steps else progress["step"] / args.steps
        for group in optimizer.param_groups:
            group["lr"] = warmup_cosine(args.learning_rate, done, args.warmup)
        picks = torch.randint(len(train_indices), (args.sequences,), generator=generator, device=device).tolist()
        rows, tokens, lengths, anchors, labels = training_batch(store, [train_indices[i] for i in picks], args.anchors,
                                                                args.block_size, generator)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = batched_training_forward(draft, embed, rows, tokens, lengths, anchors, args.block_size, mask_token)
            loss = slot_loss(out, labels, head, weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        progress["step"] += 1
        if progress["step"] % 50 == 0 or progress["step"] == 1:
            progress["losses"].append((progress["step"], round(float(loss.detach()), 4)))
        if elapsed > next_eval:
            next_eval += args.eval_every
            draft.eval()
            estimate = held_out_acceptance(draft, embed, head, store, held, args.block_size, mask_token)
            draft.train()
            progress["curve"].append({"step": progress["step"], "seconds": round(elapsed, 1),
                                      "loss": round(float(loss.detach()), 4), **estimate})
            log(json.dumps(progress["curve"][-1]))


def run(args: argparse.Namespace) -> dict:
    from dflash.engine.gguf_tensors import read_gguf_state
    from dflash.engine.model import ModelArgs, build_transformer

    began = time.perf_counter()
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
    log(f"target on {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}); "
        f"{len(prompts)} rendered prompts")
    a = target.args
    layer_ids = tuple(int(i) for i in args.target_layer_ids.split(","))
    mask_token = meta["mask_token_id"]
    eos_ids = set(meta["eos_ids"])

    dconfig = draft_config(a, args.layers, args.block_size, layer_ids, mask_token)
    if args.init_from:
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

    # 1. sampled user turns
    stage_end = began + args.seconds * args.user_share
    sampled = guarded(log, "user turns", lambda: sampled_user_turns(
        target, meta, args.sampled_prompts, args.batch, args.user_tokens, args.seed, stage_end), [])
    log(f"sampled user turns: {len(sampled)}")
    rng = random.Random(args.seed)
    pool = list(zip(prompts, kinds)) + [(p, KINDS.index("sampled chat")) for p in sampled]
    rng.shuffle(pool)
    if args.prompt_limit:
        pool = pool[: args.prompt_limit]

    # 2. replies
    width = len(layer_ids) * a.hidden_size
    store = ReplyStore(args.store_tokens, width, device)
    stage_end = began + args.seconds * (args.user_share + args.reply_share)
    answered = guarded(log, "replies", lambda: generate_replies(
        target, store, [p for p, _ in pool], [k for _, k in pool], layer_ids, eos_ids, args.tokens, args.batch,
        stage_end, log), 0)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the decode batches' K/V go back before training allocates
    indices = list(range(len(store.starts)))
    # Held out evenly across the store: it fills batch by batch, each of prompts of one length.
    held = indices[:: max(1, len(indices) // max(args.held_out, 1))][: args.held_out]
    train_indices = sorted(set(indices) - set(held)) or indices
    tally = {KINDS[k]: sum(1 for i in indices if store.kinds[i] == k) for k in range(len(KINDS))}
    log(f"replies: {answered} answered, {store.reply_tokens()} reply tokens, {store.used} tokens in all; "
        f"per kind {tally}")

    # 3. training
    draft = draft.to(device).train()
    head = target.lm_head.weight
    stage_start = time.perf_counter()
    stage_seconds = max(began + args.seconds - args.save_seconds - stage_start, 1.0)
    progress = {"step": 0, "losses": [], "curve": []}
    guarded(log, "training", lambda: train_stage(draft, target.embed, head, store, train_indices, held, args,
                                                  mask_token, stage_start, stage_seconds, progress, log), None)
    draft.eval()
    final = held_out_acceptance(draft, target.embed, head, store, held, args.block_size, mask_token)
    step, losses, curve = progress["step"], progress["losses"], progress["curve"]
    curve.append({"step": step, "seconds": round(time.perf_counter() - stage_start, 1),
                  "loss": losses[-1][1] if losses else None, **final})
    log(f"trained {step} steps: held-out τ {final}")
    save_dflash_checkpoint(draft.to(torch.bfloat16).cpu(), out / "drafter")
    summary = {
        "recipe": "at_scale", "device": (torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
        "seconds": round(time.perf_counter() - began, 1), "training_seconds": round(time.perf_counter() - stage_start, 1),
        "steps": step, "sequences_per_step": args.sequences, "anchors": args.anchors, "layers": args.layers,
        "block_size": args.block_size, "learning_rate": args.learning_rate, "gamma": args.gamma,
        "init_from": args.init_from,
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
    r.add_argument("--batch", type=int, default=1024, help="prompts decoded together")
    r.add_argument("--store-tokens", type=int, default=8_000_000, help="device buffer for prompt + reply rows")
    r.add_argument("--held-out", type=int, default=256)
    r.add_argument("--layers", type=int, default=3)
    r.add_argument("--block-size", type=int, default=8)
    r.add_argument("--target-layer-ids", default="1,10,18,27")
    r.add_argument("--sequences", type=int, default=32, help="replies per training step")
    r.add_argument("--anchors", type=int, default=128, help="blocks per reply per step")
    r.add_argument("--init-from", help="a drafter folder to continue training (default: random weights)")
    r.add_argument("--learning-rate", type=float, default=6e-4)
    r.add_argument("--warmup", type=float, default=0.04)
    r.add_argument("--gamma", type=float, default=4.0)
    r.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: at the deadline)")
    r.add_argument("--eval-every", type=float, default=60.0, help="seconds of training between held-out τ")
    r.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        print(json.dumps(prepare(Path(args.out), args.count, args.seed, args.max_prompt_tokens)))
    else:
        summary = run(args)
        print(json.dumps({k: v for k, v in summary.items() if k not in ("curve", "loss")}))


if __name__ == "__main__":
    main()
