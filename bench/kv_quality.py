"""Perplexity with quantized keys and values: the cache formats we serve, and narrower ones simulated.

Why: at 16K of context a decode step reads the whole cache once, so decode speed at depth is set by
the cache's bytes per token (README, Numbers). The int8 cache halves bf16's bytes; this bench says
what narrower formats would cost in quality before anyone writes kernels for them. Perplexity is
measured as bench/quality.py does (the held-out standard-library text, windows of `--window` tokens,
each one forward from an empty cache), on bf16 weights: their prefill goes through Python's
attention, which writes the cache with `KVCache.write`, where a simulated format rounds each key and
value row to its codes and back before storing it (the bench checks every write went through it).

Simulated formats: `kN` / `vN` = N-bit codes, symmetric, one float scale per (token, KV head) as the
int8 cache has; `h` = the row is turned by the normalized Hadamard matrix first (and back after), so
that a few large channels do not set the scale of all (a rotation keeps dot products, so the kernel
would turn the queries and the output instead); `bf16` = not quantized.

Then the served weights (`auto`) with the float cache and with the int8 one: greedy replies to the
bench prompts (bench/quality.py's), and how many tokens of each equal the float cache's before the
first difference. A reply that differs is not a worse one; it is other text for a drafter to guess.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/kv_quality.py [--window 2048] [--windows 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from quality import CHAT, CODE_EDITING, CODING, DECODE_PROMPT, agreement, greedy, held_out_text  # noqa: E402

from dflash.engine.cpu import cpu_kind  # noqa: E402
from dflash.engine.kv import KVCache  # noqa: E402
from dflash.engine.loading import EMBEDDED_DEFAULT, load_model  # noqa: E402

# (label, keys, values): the simulated formats, each side "bf16" or (bits, hadamard)
SIMULATED = [
    ("k8 v8 (the int8 cache, simulated)", (8, False), (8, False)),
    ("bf16 keys, v4h", "bf16", (4, True)),
    ("k6h v4h", (6, True), (4, True)),
    ("k5h v4h", (5, True), (4, True)),
    ("k4 v4", (4, False), (4, False)),
    ("k4h v4h", (4, True), (4, True)),
]


def hadamard(n: int) -> torch.Tensor:
    """The n x n Hadamard matrix over sqrt(n) (orthogonal and symmetric: its own inverse)."""
    if n & (n - 1):
        raise SystemExit(f"head dim {n} is not a power of two: no Hadamard matrix of that size here")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def round_trip(x: torch.Tensor, side, turn: torch.Tensor) -> torch.Tensor:
    """x [T, KV, D] through one side's codes and back, in x's dtype."""
    if side == "bf16":
        return x
    bits, rotated = side
    rows = x.float() @ turn if rotated else x.float()
    largest = 2 ** (bits - 1) - 1
    scale = rows.abs().amax(-1, keepdim=True) / largest
    codes = torch.where(scale > 0, (rows / torch.where(scale > 0, scale, 1)).round().clamp(-largest, largest), 0)
    back = codes * scale
    return (back @ turn if rotated else back).to(x.dtype)


class SimulatedCache(KVCache):
    """A bf16 cache whose rows are rounded through a narrower format as they are written."""

    def __init__(self, model, max_ctx: int, keys, values):
        a = model.args
        super().__init__(a.num_layers, a.num_kv_heads, max_ctx, a.head_dim, model.kv_dtype, model.device, model.dtype)
        self.sides, self.turn, self.writes = (keys, values), hadamard(a.head_dim), 0

    def write(self, layer, start, k, v):
        self.writes += 1
        return super().write(layer, start, round_trip(k, self.sides[0], self.turn), round_trip(v, self.sides[1], self.turn))


def perplexity(model, kv, windows: list[list[int]]) -> float:
    total, count = 0.0, 0
    for window in windows:
        kv.length = 0
        logits, _ = model(torch.tensor(window[:-1]), 0, kv, logits_positions=None)
        total += F.cross_entropy(logits.float(), torch.tensor(window[1:]), reduction="sum").item()
        count += len(window) - 1
    return math.exp(total / count)


def bytes_per_token(side, head_dim: int) -> float:
    """One KV head's key (or value) row: its codes and, quantized, a float32 scale."""
    return 2 * head_dim if side == "bf16" else side[0] * head_dim / 8 + 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_DEFAULT)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens a prompt")
    args = parser.parse_args()
    rows = []
    for kv_cache in ("float", "int8"):
        try:
            loaded = load_model(args.model, weights="bf16", max_ctx=args.window + 8, threads=args.threads,
                                kv_cache=kv_cache, prefill_chunk=args.window)
        except Exception as error:  # the int8 cache needs AVX512-VNNI
            print(f"kv_cache {kv_cache!r} not measured: {error}")
            continue
        model = loaded.engine.model
        ids = loaded.tokenizer(held_out_text())["input_ids"]
        windows = [ids[i : i + args.window] for i in range(0, args.windows * args.window, args.window)]
        D = model.args.head_dim
        kv = model.new_kv_cache(args.window + 8)
        side = "bf16" if kv_cache == "float" else (8, False)
        rows.append((f"served: {kv_cache} ({kv.keys.dtype})", bytes_per_token(side, D) * 2, perplexity(model, kv, windows)))
        if kv_cache == "float":
            for label, keys, values in SIMULATED:
                cache = SimulatedCache(model, args.window + 8, keys, values)
                ppl = perplexity(model, cache, windows)
                if cache.writes != model.args.num_layers * len(windows):
                    raise SystemExit(f"{label}: {cache.writes} writes went through the simulation, not one per layer "
                                     "and window (the forward did not take Python's attention)")
                rows.append((f"simulated: {label}", bytes_per_token(keys, D) + bytes_per_token(values, D), ppl))
        del loaded, model, kv
    reference = rows[0][2]
    print(f"\ncpu={cpu_kind()}  model={args.model}  weights=bf16  held-out text: {args.windows} windows of {args.window} "
          "tokens, each from an empty cache")
    print("| cache | bytes a token per KV head (keys + values) | perplexity | vs bf16 |")
    print("|---|---|---|---|")
    for label, size, ppl in rows:
        print(f"| {label} | {size:.0f} | {ppl:.3f} | {ppl / reference - 1:+.2%} |")
    print_greedy_agreement(args)


def print_greedy_agreement(args) -> None:
    prompts = [DECODE_PROMPT, *CODE_EDITING, *CHAT, *CODING]
    replies = {}
    for kv_cache in ("float", "int8"):
        try:
            loaded = load_model(args.model, weights="auto", max_ctx=2048, threads=args.threads, kv_cache=kv_cache)
        except Exception as error:
            print(f"kv_cache {kv_cache!r} not measured: {error}")
            return
        replies[kv_cache] = (loaded.weights, greedy(loaded, prompts, args.tokens))
        del loaded
    weights, reference = replies["float"]
    # the first token that differs, 1-based ('-': the same reply); a reply that ended first differs there
    firsts = ["-" if out == ref else str(next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref))) + 1)
              for out, ref in zip(replies["int8"][1], reference)]
    print(f"\ngreedy replies, weights {weights}, {len(prompts)} prompts x {args.tokens} tokens: the int8 cache's equal "
          f"the float cache's for {agreement(replies['int8'][1], reference):.0%} of their tokens before the first "
          f"difference (the first different token of each: {', '.join(firsts)})")


if __name__ == "__main__":
    main()
