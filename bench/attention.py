"""Our causal attention kernel (engine/native/causal_attention.cpp) next to torch's flash kernel, per
layer of the embedded model's shape (9 query heads over 3 KV heads, head dim 64), on random data:
a decode row and a 1+7-row verification at 1K and 16K of context, a 256-row prefill chunk at 2K and 16K,
and a decode row at 16K over 30 layers' caches in turn (one layer's 16K cache fits in a 32 MiB L3;
a decode step reads all 30 from memory, so that case is the one a step at depth pays).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/attention.py [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dflash.engine.cpu import cpu_kind  # noqa: E402
from dflash.engine.model import attention_row_groups, grouped_query_attention  # noqa: E402
from dflash.engine.native import extension  # noqa: E402

# (label, position of the first row, rows, distinct caches the calls cycle through)
CASES = [("decode at 1K", 1024, 1, 1), ("verify 1+7 at 1K", 1024, 8, 1), ("decode at 16K", 16384, 1, 1),
         ("verify 1+7 at 16K", 16384, 8, 1), ("decode at 16K, 30 caches", 16384, 1, 30),
         ("prefill 256 at 2K", 1792, 256, 1), ("prefill 256 at 16K", 16384, 256, 1)]


def torch_attention(q, keys, values, start):  # model.Attention's torch path
    groups = attention_row_groups(start, q.shape[0], keys.shape[1], 3, keys.dtype, "cpu")
    return torch.cat([grouped_query_attention(q[g.rows], keys[:, : g.keys], values[:, : g.keys], g.mask) for g in groups])


def best_ms(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native = extension()
    if native is None or not native.causal_attention_available():
        raise SystemExit("needs the native extension (make install) and an AVX2 CPU")
    print(f"\ncpu={cpu_kind()}  threads={args.threads}  torch {torch.__version__}  (ms per layer, best of 20 or 3)  "
          f"bf16 values by {native.causal_attention_isa()} (DFLASH_ATTENTION_ISA=avx2 forces fp32 fmas)")
    print("| cpu | cache | case | ours | torch |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for label, start, rows, caches in CASES:
            length = start + rows + 64
            q = torch.randn(rows, 9, 64).to(dtype)
            layers = [(torch.randn(3, length, 64).to(dtype), torch.randn(3, length, 64).to(dtype)) for _ in range(caches)]
            repeats = 20 if rows < 100 and caches == 1 else 3

            def per_layer(attention):  # ms per call, over every cache in turn
                return best_ms(lambda: [attention(q, keys, values, start) for keys, values in layers], repeats) / caches

            ours = per_layer(native.causal_attention)
            theirs = per_layer(torch_attention)
            del layers
            print(f"| {cpu_kind()} | {str(dtype).removeprefix('torch.')} | {label} | {ours:.2f} | {theirs:.2f} |", flush=True)


if __name__ == "__main__":
    main()
