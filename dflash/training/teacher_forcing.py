"""Drafter data at prefill speed: the target reads offline text (corpus.py) teacher-forced, and each
window's hidden rows at the drafter's target layers are kept with the target's greedy prediction at
every position.

Why the greedy predictions: the drafter must guess what the target will generate, not what the text
says next. From one teacher-forced pass the target's greedy continuation after an anchor is known
exactly for as long as the text agrees with it: if text[a+1..a+k-1] are the target's own greedy
tokens, its next greedy token is the prediction at a+k-1. train_drafter.block_labels turns that
into labels; nothing past the first disagreement is guessed.

Shards are `data/prefill-NNNNNN.pt`, one per window, named by the window's index in the corpus
stream (fixed for given settings), so a rerun or another worker skips what exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from dflash.training.corpus import corpus_windows
from dflash.training.train_drafter import run_workers


def prefill_shard_path(out: Path, index: int) -> Path:
    return out / "data" / f"prefill-{index:06d}.pt"


def planned_windows(tokenizer, budget_tokens: int, window: int, mix: dict[str, float] | None) -> list[tuple[str, list[int]]]:
    """The corpus windows that fit the token budget, in stream order (every worker computes the same)."""
    planned, total = [], 0
    for kind, ids in corpus_windows(tokenizer, window, mix):
        if total >= budget_tokens:
            break
        planned.append((kind, ids))
        total += len(ids)
    return planned


@torch.inference_mode()
def prefill_data(loaded, out: Path, layer_ids: Sequence[int], budget_tokens: int, window: int = 1024,
                 mix: dict[str, float] | None = None, part: tuple[int, int] = (0, 1), progress: bool = True) -> list[Path]:
    """Write the shards of the windows whose index is part[0] modulo part[1]; returns every shard of
    the plan that exists afterwards (this worker's and the others')."""
    from tqdm import tqdm

    (out / "data").mkdir(parents=True, exist_ok=True)
    plan = planned_windows(loaded.tokenizer, budget_tokens, window, mix)
    engine = loaded.engine
    model = engine.model
    if window > engine.kv.max_ctx:
        raise ValueError(f"window {window} exceeds the target's KV cache of {engine.kv.max_ctx} tokens")
    mine = [index for index in range(len(plan)) if index % part[1] == part[0]]
    try:
        for index in tqdm(mine, desc="teacher forcing", disable=not progress):
            shard = prefill_shard_path(out, index)
            if shard.exists():
                continue
            kind, ids = plan[index]
            engine.rollback(0)
            tokens = torch.tensor(ids)
            logits, hidden = model(tokens, 0, engine.kv, capture_layers=tuple(layer_ids), logits_positions=None)
            temporary = shard.with_suffix(".tmp")
            torch.save({"tokens": tokens, "greedy": logits.argmax(-1).to(torch.int32),
                        "rows": torch.cat(hidden, dim=-1).to(torch.bfloat16), "kind": kind,
                        "layer_ids": list(layer_ids)}, temporary)
            temporary.replace(shard)
    finally:
        engine.rollback(0)
    return [prefill_shard_path(out, i) for i in range(len(plan)) if prefill_shard_path(out, i).exists()]


def _prefill_part(source: str, dtype: str, weights: str | None, threads: int, out: Path, layer_ids: Sequence[int],
                  budget_tokens: int, window: int, mix: dict[str, float] | None, part: tuple[int, int]) -> int:
    from dflash.engine.loading import load_model

    loaded = load_model(source, dtype=dtype, weights=weights, threads=threads, max_ctx=window)
    return len(prefill_data(loaded, out, layer_ids, budget_tokens, window, mix, part, progress=False))


def prefill_data_parallel(source: str, dtype: str, weights: str | None, threads: int, tokenizer, out: Path,
                          layer_ids: Sequence[int], budget_tokens: int, window: int = 1024,
                          mix: dict[str, float] | None = None, workers: int = 2, progress: bool = True) -> list[Path]:
    """`prefill_data` split over `workers` processes of threads // workers threads each."""
    count = len(planned_windows(tokenizer, budget_tokens, window, mix))
    paths = [prefill_shard_path(out, i) for i in range(count)]
    run_workers(_prefill_part, [(source, dtype, weights, max(1, threads // workers), out, tuple(layer_ids),
                                 budget_tokens, window, mix, (k, workers)) for k in range(workers)],
                paths, "teacher forcing", progress)
    return [p for p in paths if p.exists()]

