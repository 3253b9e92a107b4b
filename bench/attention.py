"""Our causal attention kernel (engine/native/causal_attention.cpp) next to torch's flash kernel, per
layer of the embedded model's shape (9 query heads over 3 KV heads, head dim 64), on random data:
a decode row and a 1+7-row verification at 1K and 16K of context, a 256-row prefill chunk at 2K and 16K,
and a decode row at 16K over 30 layers' caches in turn (one layer's 16K cache fits in a 32 MiB L3;
a decode step reads all 30 from memory, so that case is the one a step at depth pays). Caches in
float32, bfloat16 and, where the CPU has AVX512-VNNI, int8 (kv.Int8KVCache's codes and scales, by
causal_attention_int8; torch has no kernel for them).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/attention.py [--threads 1] [--caches bfloat16,int8]
    DFLASH_ATTENTION_ISA=avx512-bf16 ... bench/attention.py   # on AMX CPUs: without tiles, to compare
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
    parser.add_argument("--caches", default="float32,bfloat16,int8", help="cache dtypes (int8 where the CPU can)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native = extension()
    if native is None or not native.causal_attention_available():
        raise SystemExit("needs the native extension (make install) and an AVX2 CPU")
    print(f"\ncpu={cpu_kind()}  threads={args.threads}  torch {torch.__version__}  (ms per layer, best of 20 or 3)  "
          f"bf16 cache by {native.causal_attention_isa()} (DFLASH_ATTENTION_ISA=avx512-bf16|avx2 forces bf16 dot "
          f"products | fp32 fmas where AMX tiles are the default)")
    print("| cpu | cache | case | ours | torch |")
    print("|---|---|---|---|---|")
    for name in args.caches.split(","):
        if name == "int8" and not native.int8_kv_available():
            print(f"| {cpu_kind()} | int8 | (no AVX512-VNNI here) | - | - |")
            continue
        dtype = getattr(torch, name)
        for label, start, rows, caches in CASES:
            length = start + rows + 64
            q = torch.randn(rows, 9, 64).to(torch.bfloat16 if dtype == torch.int8 else dtype)
            layers = [random_layer(native, dtype, length) for _ in range(caches)]
            repeats = 20 if rows < 100 and caches == 1 else 3

            def per_layer(attention):  # ms per call, over every cache in turn
                return best_ms(lambda: [attention(q, layer, start) for layer in layers], repeats) / caches

            if dtype == torch.int8:
                ours, theirs = per_layer(lambda q, layer, start: native.causal_attention_int8(q, *layer, start)), None
            else:
                ours = per_layer(lambda q, layer, start: native.causal_attention(q, *layer, start))
                theirs = per_layer(lambda q, layer, start: torch_attention(q, *layer, start))
            del layers
            print(f"| {cpu_kind()} | {name} | {label} | {ours:.2f} | {'-' if theirs is None else f'{theirs:.2f}'} |", flush=True)


def random_layer(native, dtype: torch.dtype, length: int) -> tuple:
    """One layer's keys and values of random data ([3, length, 64]); int8: quantized from bf16 as an
    Int8KVCache stores them, with their scales."""
    if dtype != torch.int8:
        return torch.randn(3, length, 64).to(dtype), torch.randn(3, length, 64).to(dtype)
    keys, values = torch.empty(3, length, 64, dtype=torch.uint8), torch.empty(3, length, 64, dtype=torch.int8)
    key_scales, value_scales = torch.empty(3, length), torch.empty(3, length)
    k, v = (torch.randn(length, 3, 64).to(torch.bfloat16) for _ in range(2))
    native.quantize_kv(k, v, keys, values, key_scales, value_scales, 0)
    return keys, values, key_scales, value_scales


if __name__ == "__main__":
    main()
