"""`dflash train-drafter`: train a DFlash drafter for a target model (shared notes §4).

1. Data: the target answers each prompt greedily, the way it will be served, and the hidden states
   of the chosen target layers are recorded during that generation (a recorder rides along as the
   engine's drafter, so no second pass). Samples go to numbered shards; a rerun skips done prompts.
2. Objective (objective.py): blocks anchored at random response positions, each seeing the
   context before its anchor and itself; slot k scored by weighted cross-entropy through the
   frozen target LM head. One sample a step.
3. Output: a z-lab layout checkpoint (config.json + model.safetensors) the server loads by path.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Iterable, Sequence

import attrs
import torch
from torch import Tensor

from dflash.engine.drafters.dflash import (
    DFlashConfig,
    build_target_layer_ids,
    random_draft_model,
    save_dflash_checkpoint,
)
from dflash.engine.model import has_bf16_hardware
from dflash.engine.sampling import SamplingParams
from dflash.training.objective import acceptance_estimate, slot_loss, slot_weights, training_forward, warmup_cosine


@attrs.frozen
class TrainOptions:
    layers: int = 1
    block_size: int = 8
    target_layer_ids: tuple[int, ...] | None = None
    tokens_per_response: int = 128  # reply length the target generates per prompt
    steps: int = 1000
    anchors: int = 16  # blocks per sample per step
    learning_rate: float = 6e-4
    warmup: float = 0.04  # share of the steps over which the learning rate rises linearly
    gamma: float = 4.0
    held_out: int = 8  # reply samples kept out of training for the acceptance estimate
    reply_share: float = 0.3  # share of steps on reply shards when teacher-forced shards exist too
    eval_every: int = 0  # steps between τ measurements on the unseen prompts (unseen.py); 0 = never
    eval_tokens: int = 48  # tokens decoded per unseen prompt
    seed: int = 0
    # Target layers whose weights start the draft layers (one per draft layer), instead of random ones.
    init_from_target_layers: tuple[int, ...] | None = None


class HiddenRecorder:
    """Rides along as the engine's drafter: keeps the captured target rows of the committed tokens."""

    name = "recorder"

    def __init__(self, layer_ids: Sequence[int], hidden_size: int, device):
        self.capture_layers = tuple(layer_ids)
        self.width = len(self.capture_layers) * hidden_size
        self.device = device
        self.rows: list[Tensor] = []
        self.length = 0
        self._pending: Tensor | None = None

    def rows_at(self, start: int, count: int) -> Tensor:
        """Where the target's forward writes the rows of `count` tokens from `start` (the engine's
        drafter protocol: Engine.forward passes it as capture_into, then calls `observed`)."""
        self.crop(start)
        self._pending = torch.empty(count, self.width, dtype=torch.bfloat16, device=self.device)
        return self._pending

    def observed(self, start: int, count: int) -> None:
        self.rows.append(self._pending)
        self.length = start + count

    def crop(self, length: int) -> None:
        if length >= self.length:
            return
        joined = torch.cat(self.rows)[:length] if self.rows else None
        self.rows = [joined] if joined is not None and length else []
        self.length = length

    def propose(self, tokens, max_tokens):
        return []

    def all_rows(self) -> Tensor:
        return torch.cat(self.rows)


def training_dtype(requested: str) -> str:
    """`auto`: bf16 where the CPU has bf16 hardware, else fp32. Without it a bf16 matmul runs one
    row at a time (5 GFLOP/s against fp32's 47 on the AVX2 VM), and the frozen LM head over every
    labelled slot is most of a training step."""
    if requested != "auto":
        return requested
    return "bfloat16" if has_bf16_hardware() else "float32"


def choose_mask_token(tokenizer) -> int:
    """An existing, rarely used special token: the highest-id added token that is not one the
    model uses as BOS, EOS, PAD or UNK (for SmolLM2, `<empty_output>`)."""
    roles = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id)
    reserved = {i for i in roles if i is not None}
    added = sorted(i for i in getattr(tokenizer, "added_tokens_decoder", {}) if i not in reserved)
    if not added:
        raise ValueError("the tokenizer has no spare special token to use as the DFlash mask token")
    return added[-1]


def shard_path(out: Path, index: int) -> Path:
    return out / "data" / f"sample-{index:05d}.pt"


def write_reply_shard(shard: Path, sequence: Sequence[int], response_start: int, rows: Tensor,
                      layer_ids: Sequence[int]) -> None:
    """One reply shard: prompt + reply tokens (the reply from `response_start` on), their rows in bf16.
    Written under another name and renamed, so a shard that exists is whole."""
    temporary = shard.with_suffix(".tmp")
    torch.save({"tokens": torch.tensor(list(sequence)), "response_start": response_start,
                "rows": rows.to(torch.bfloat16), "layer_ids": list(layer_ids)}, temporary)
    temporary.replace(shard)


def generate_data(loaded, prompts: Sequence[str], out: Path, layer_ids: Sequence[int], tokens: int,
                  progress: bool = True, part: tuple[int, int] = (0, 1)) -> list[Path]:
    """Greedy replies with their hidden rows, one shard per prompt; existing shards are kept.
    `part` = (k, n) handles only the prompts whose index is k modulo n (one of n workers)."""
    from tqdm import tqdm

    from dflash.chat.template import render_prompt

    (out / "data").mkdir(parents=True, exist_ok=True)
    engine = loaded.engine
    saved = engine.dflash_drafter
    recorder = HiddenRecorder(layer_ids, engine.model.args.hidden_size, engine.model.device)
    engine.dflash_drafter = recorder
    shards = []
    mine = [(i, p) for i, p in enumerate(prompts) if i % part[1] == part[0]]
    try:
        for index, prompt in tqdm(mine, desc="generating", disable=not progress):
            shard = shard_path(out, index)
            shards.append(shard)
            if shard.exists():
                continue
            engine.rollback(0)
            recorder.crop(0)
            prompt_ids = render_prompt(loaded.tokenizer, [{"role": "user", "content": prompt}])
            generation = engine.start(prompt_ids, SamplingParams(), tokens)
            output = generation.run()
            if len(output) < 2:
                continue
            # The last emitted token was never fed back: rows cover prompt + output[:-1].
            sequence = prompt_ids + output[:-1]
            rows = recorder.all_rows()[: len(sequence)]
            write_reply_shard(shard, sequence, len(prompt_ids), rows, layer_ids)
    finally:
        engine.dflash_drafter = saved
        engine.rollback(0)
    return [s for s in shards if s.exists()]


def _generate_part(source: str, dtype: str, threads: int, max_ctx: int, prompts: Sequence[str], out: Path,
                   layer_ids: Sequence[int], tokens: int, part: tuple[int, int]) -> int:
    from dflash.engine.loading import load_model

    loaded = load_model(source, dtype=dtype, threads=threads, max_ctx=max_ctx)
    return len(generate_data(loaded, prompts, out, layer_ids, tokens, progress=False, part=part))


def run_workers(function, arguments: Sequence[tuple], paths: Sequence[Path], description: str,
                progress: bool = True) -> None:
    """`function(*arguments[k])` in one spawned process each, with a bar over the `paths` that exist."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, wait

    from tqdm import tqdm

    done = lambda: sum(p.exists() for p in paths)  # noqa: E731
    with ProcessPoolExecutor(len(arguments), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(function, *args) for args in arguments]
        with tqdm(total=len(paths), initial=done(), desc=description, disable=not progress) as bar:
            while wait(futures, timeout=2.0).not_done:
                bar.update(done() - bar.n)
            bar.update(done() - bar.n)
        for future in futures:
            future.result()  # a worker's exception surfaces here


def generate_data_parallel(source: str, dtype: str, threads: int, max_ctx: int, prompts: Sequence[str], out: Path,
                           layer_ids: Sequence[int], tokens: int, workers: int, progress: bool = True) -> list[Path]:
    """`generate_data` split over `workers` processes of threads // workers threads each. On a small
    CPU several one-thread decoders beat one two-thread decoder (single-row decode does not scale
    with threads), so data comes nearly `workers` times faster."""
    (out / "data").mkdir(parents=True, exist_ok=True)
    paths = [shard_path(out, i) for i in range(len(prompts))]
    per_worker = max(1, threads // workers)
    run_workers(_generate_part, [(source, dtype, per_worker, max_ctx, list(prompts), out, tuple(layer_ids), tokens,
                                  (k, workers)) for k in range(workers)], paths, "generating", progress)
    return [p for p in paths if p.exists()]


def load_sample(path: Path) -> dict:
    """A shard, memory-mapped: its rows are read from disk (or the page cache) when a step uses them."""
    return torch.load(path, mmap=True, weights_only=False)


def data_tally(shards: Iterable[Path]) -> dict[str, int]:
    """What a set of shards holds, in tokens: for reply shards the prompts, their prompt tokens and
    the reply tokens the target generated (a shard stores every reply token but the last, which has
    no successor to train on, so one more than it stores); for teacher-forced shards their tokens."""
    tally = {"reply_prompts": 0, "prompt_tokens": 0, "reply_tokens": 0, "teacher_forced_tokens": 0}
    for shard in shards:
        sample = load_sample(shard)
        length = int(sample["tokens"].shape[0])
        if "greedy" in sample:
            tally["teacher_forced_tokens"] += length
        else:
            tally["reply_prompts"] += 1
            tally["prompt_tokens"] += sample["response_start"]
            tally["reply_tokens"] += length - sample["response_start"] + 1
    return tally


def draft_config(a, layers: int, block_size: int, layer_ids: Sequence[int], mask_token: int) -> DFlashConfig:
    """A drafter for the target of ModelArgs `a`: its layers shaped as the target's."""
    return DFlashConfig(
        hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, num_layers=layers,
        num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, block_size=block_size,
        mask_token_id=mask_token, target_layer_ids=tuple(layer_ids), num_target_layers=a.num_layers,
        vocab_size=a.vocab_size, rms_norm_eps=a.rms_norm_eps, rope_theta=a.rope_theta,
        max_position_embeddings=a.max_position_embeddings,
    )


@torch.no_grad()
def copy_target_layers(draft, target, layer_ids: Sequence[int]) -> None:
    """Start draft layer i from target layer layer_ids[i] (its attention, MLP and norms; the draft's
    q/k norms from the target's where it has them, else left at one) and the draft's final norm from
    the target's, which feeds the same LM head. A warm start: the draft layers read other inputs
    (block embeddings, and the context's projected rows as keys and values) than the target's did."""
    if len(layer_ids) != len(draft.layers):
        raise ValueError(f"{len(layer_ids)} target layers {list(layer_ids)} for {len(draft.layers)} draft layers")
    for layer_id in layer_ids:
        if not 0 <= layer_id < len(target.layers):
            raise ValueError(f"target layer {layer_id} does not exist: the target has {len(target.layers)} layers")
    for mine, layer_id in zip(draft.layers, layer_ids):
        theirs = target.layers[layer_id]
        attention, feed_forward = theirs.attention, theirs.feed_forward
        if attention.wqkv.bias is not None:
            raise ValueError(f"target layer {layer_id} has attention biases, which draft layers do not")
        q, k, v = attention.wqkv.weight.split([mine.self_attn.q_proj.weight.shape[0],
                                               mine.self_attn.k_proj.weight.shape[0],
                                               mine.self_attn.v_proj.weight.shape[0]])
        for param, value in ((mine.self_attn.q_proj.weight, q), (mine.self_attn.k_proj.weight, k),
                             (mine.self_attn.v_proj.weight, v), (mine.self_attn.o_proj.weight, attention.wo.weight),
                             (mine.mlp.down_proj.weight, feed_forward.w2.weight),
                             (mine.input_layernorm.weight, theirs.attention_norm.weight),
                             (mine.post_attention_layernorm.weight, theirs.ffn_norm.weight)):
            param.copy_(value)
        gate, up = feed_forward.w13.weight.split(feed_forward.intermediate_size)
        mine.mlp.gate_proj.weight.copy_(gate)
        mine.mlp.up_proj.weight.copy_(up)
        if attention.q_norm is not None:
            mine.self_attn.q_norm.weight.copy_(attention.q_norm.weight)
            mine.self_attn.k_norm.weight.copy_(attention.k_norm.weight)
    draft.norm.weight.copy_(target.norm.weight)


def anchor_candidates(sample: dict) -> Tensor:
    """Positions a block may start at. A reply shard's tokens from `response_start` on are the
    target's greedy output, so every reply position with a successor qualifies. In a teacher-forced
    shard the anchor plays the pending token, which the target itself chose, so only positions
    where the text equals the target's greedy prediction qualify."""
    tokens = sample["tokens"]
    length = tokens.shape[0]
    if "greedy" not in sample:
        return torch.arange(sample["response_start"], max(length - 1, sample["response_start"]))
    agrees = torch.zeros(length, dtype=torch.bool)
    agrees[1:] = tokens[1:] == sample["greedy"][:-1].to(tokens.dtype)
    agrees[-1] = False
    return agrees.nonzero().flatten()


def block_batch(sample: dict, anchors: int, rng: random.Random) -> list[int]:
    """Up to `anchors` distinct anchor positions, sorted."""
    candidates = anchor_candidates(sample).tolist()
    return sorted(rng.sample(candidates, min(anchors, len(candidates)))) if candidates else []


def block_labels(sample: dict, anchors: list[int], block: int) -> Tensor:
    """[N, B-1] labels of the masked slots of each block, -1 where the label is unknown. Reply
    shards: the following tokens. Teacher-forced shards: slot k's label is the target's greedy
    prediction at a+k-1, valid while the text at a+1..a+k-1 equals the target's greedy tokens (then
    the text so far is the target's own continuation); nothing past the first disagreement."""
    tokens = sample["tokens"]
    length = tokens.shape[0]
    greedy = sample.get("greedy")
    labels = torch.full((len(anchors), block - 1), -1, dtype=torch.long)
    for b, a in enumerate(anchors):
        end = min(a + block, length)
        if greedy is None:
            labels[b, : end - a - 1] = tokens[a + 1 : end]
            continue
        for k in range(1, end - a):
            labels[b, k - 1] = int(greedy[a + k - 1])
            if int(tokens[a + k]) != labels[b, k - 1]:
                break
    return labels


def learning_rate(options: TrainOptions, step: int) -> float:
    """Linear warm-up over whole steps (the first step already above zero), then cosine decay to zero."""
    warmup = int(options.warmup * options.steps)
    done = (step + 1 if step < warmup else step) / options.steps
    return warmup_cosine(options.learning_rate, done, warmup / options.steps)


def train(loaded, shards: list[Path], out: Path, options: TrainOptions, mask_token: int,
          resume: bool = False, progress: bool = True) -> dict:
    """Train on reply shards (generate_data) and teacher-forced shards (teacher_forcing.py), mixed
    by `reply_share` of the steps when both kinds are given."""
    from tqdm import tqdm

    target = loaded.engine.model
    target.requires_grad_(False)  # frozen: only the drafter learns
    a = target.args
    layer_ids = options.target_layer_ids or tuple(build_target_layer_ids(a.num_layers, options.layers))
    config = draft_config(a, options.layers, options.block_size, layer_ids, mask_token)
    torch.manual_seed(options.seed)
    draft = random_draft_model(config, seed=options.seed, dtype=torch.float32).train()
    if options.init_from_target_layers:
        copy_target_layers(draft, target, options.init_from_target_layers)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=options.learning_rate, weight_decay=0.0)
    state_path = out / "train_state.pt"
    step = 0
    history = {"loss": [], "acceptance": [], "unseen": []}
    if resume and state_path.exists():
        state = torch.load(state_path, weights_only=False)
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        history["unseen"] = state.get("unseen", [])
    samples = [load_sample(s) for s in shards]
    for shard, sample in zip(shards, samples):
        recorded = sample.get("layer_ids")
        if recorded is not None and tuple(recorded) != tuple(layer_ids):
            raise ValueError(f"{shard} holds target layers {recorded}, not {list(layer_ids)}: "
                             "delete its data folder or pass the same --target-layer-ids")
    replies = [s for s in samples if "greedy" not in s]
    forced = [s for s in samples if "greedy" in s]
    held_out = replies[: options.held_out] if len(replies) > options.held_out else []
    replies = replies[len(held_out):]
    if not replies and not forced:
        raise ValueError("no training data: every shard is held out or the data folder is empty")
    weights = slot_weights(options.block_size, options.gamma)
    embed, lm_head = target.embed, target.lm_head
    rng = random.Random(options.seed + step)

    def checkpoint() -> None:
        torch.save({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                    "unseen": history["unseen"]}, state_path)

    bar = tqdm(total=options.steps, initial=step, desc="training", disable=not progress)
    started = time.perf_counter()
    while step < options.steps:
        pool = replies if not forced or (replies and rng.random() < options.reply_share) else forced
        sample = pool[rng.randrange(len(pool))]
        anchors = block_batch(sample, options.anchors, rng)
        if not anchors:
            continue
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(options, step)
        draft_out = training_forward(draft, embed, sample["rows"].float(), sample["tokens"], anchors,
                                     options.block_size, mask_token)
        loss = slot_loss(draft_out, block_labels(sample, anchors, options.block_size), lm_head.weight, weights)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        step += 1
        history["loss"].append(float(loss.detach()))
        if step % 25 == 0 or step == options.steps:
            estimate = evaluate(draft, embed, lm_head, held_out or (replies or forced)[:1], options, mask_token)
            history["acceptance"].append(estimate)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", accept=f"{estimate:.2f}")
            checkpoint()
        if options.eval_every and (step % options.eval_every == 0 or step == options.steps):
            from dflash.training.unseen import unseen_acceptance

            history["unseen"].append({"step": step, **unseen_acceptance(
                target, loaded.tokenizer, draft, options.eval_tokens, eos_token_ids=loaded.engine.eos_token_ids)})
            bar.write(json.dumps(history["unseen"][-1]))
            checkpoint()
        bar.update(1)
    bar.close()
    draft.eval()
    save_dflash_checkpoint(draft.to(torch.bfloat16), out)
    summary = {"steps": step, "seconds": round(time.perf_counter() - started, 1),
               "final_loss": history["loss"][-1] if history["loss"] else None,
               "held_out_acceptance": history["acceptance"][-1] if history["acceptance"] else None,
               "unseen_acceptance": history["unseen"],
               "samples": len(samples), "reply_samples": len(replies) + len(held_out),
               "teacher_forced_tokens": sum(int(s["tokens"].shape[0]) for s in forced),
               "mask_token_id": mask_token, "target_layer_ids": list(layer_ids)}
    (out / "training.json").write_text(json.dumps(summary, indent=2))
    return {**summary, "history": history}


@torch.no_grad()
def evaluate(draft, embed, lm_head, samples: Iterable[dict], options: TrainOptions, mask_token: int) -> float:
    """The acceptance estimate on held-out samples: 1 + the run of slots the drafter gets right."""
    rng = random.Random(1234)
    estimates = []
    for sample in samples:
        anchors = block_batch(sample, options.anchors, rng)
        if anchors:
            draft_out = training_forward(draft, embed, sample["rows"].float(), sample["tokens"], anchors,
                                         options.block_size, mask_token)
            logits = lm_head(draft_out.to(lm_head.weight.dtype)).float()
            estimates.append(acceptance_estimate(logits, block_labels(sample, anchors, options.block_size)))
    return sum(estimates) / max(len(estimates), 1)
