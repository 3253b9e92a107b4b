"""Whether torch's half-precision CPU kernels are row-invariant on this CPU, as model.py assumes.

Lossless speculation needs a row's result not to depend on the other rows of its call
(model.py: half_linear_rows_invariant, torch_attention_rows_invariant). For the embedded model's
linear shapes this prints which row counts of a bf16 `F.linear` give each row exactly what a 1-row
call gives, and for torch's flash attention (bf16, its grouped-query layout) which rows of an 8-row
verification block differ from the same row alone; then what one 256-row bf16 call costs against
16-row blocks (model.Linear's prefill choice). Run it on a new kind of CPU before trusting its
bf16 path.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/row_invariance.py [--threads 1,2]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dflash.engine.cpu import cpu_kind  # noqa: E402

# The embedded model's projections (N, K): qkv, o, gate+up, down, LM head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
KEY_COUNTS = (32, 64, 288, 1024)
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def invariant_row_counts(weight: torch.Tensor, x: torch.Tensor) -> list[int]:
    one_by_one = torch.cat([F.linear(x[i : i + 1], weight) for i in range(16)])
    return [rows for rows in range(1, 17) if torch.equal(F.linear(x[:rows], weight), one_by_one[:rows])]


def attention_rows_that_differ(keys: int) -> list[int]:
    k = torch.randn(1, KV_HEADS, keys, HEAD_DIM).bfloat16().repeat_interleave(HEADS // KV_HEADS, 1)
    v = torch.randn(1, KV_HEADS, keys, HEAD_DIM).bfloat16().repeat_interleave(HEADS // KV_HEADS, 1)
    q = torch.randn(1, HEADS, 8, HEAD_DIM).bfloat16()
    mask = torch.ones(8, keys, dtype=torch.bool).tril(keys - 8)  # the block's last 8 positions
    block = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return [i for i in range(8) if not torch.equal(
        F.scaled_dot_product_attention(q[:, :, i : i + 1], k, v, attn_mask=mask[i : i + 1])[:, :, 0], block[:, :, i])]


def best_us(call, repeats: int = 10) -> float:
    call()
    fastest = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        fastest = min(fastest, time.perf_counter() - started)
    return fastest * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    torch.manual_seed(0)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        print(f"\ncpu={cpu_kind()}  threads={threads}  torch {torch.__version__}")
        print("| bf16 linear (N, K) | row counts equal to 1-row calls | 256 rows: one call | 16-row blocks |")
        print("|---|---|---|---|")
        for n, k in SHAPES:
            weight = (torch.randn(n, k) * 0.05).bfloat16()
            x = torch.randn(256, k).bfloat16()
            rows = invariant_row_counts(weight, x)
            shown = "1-16 (all)" if rows == list(range(1, 17)) else ", ".join(map(str, rows))
            whole = best_us(lambda: F.linear(x, weight))
            blocks = best_us(lambda: torch.cat([F.linear(b, weight) for b in x.split(16)]))
            print(f"| ({n}, {k}) | {shown} | {whole:.0f} µs | {blocks:.0f} µs |")
        print("| flash attention, keys | rows of an 8-row block unlike the row alone |")
        print("|---|---|")
        for keys in KEY_COUNTS:
            differ = attention_rows_that_differ(keys)
            print(f"| {keys} | {', '.join(map(str, differ)) or 'none'} |")


if __name__ == "__main__":
    main()
