"""Cost of one decode step and one verification forward (1 + 7 rows), per weight format.

Best of `--repeats` forwards at a 256-token context, rolled back after each. With `--threads 1` it
reports the thread's CPU time, which another process on a shared VM does not inflate the way it
inflates wall time (memory bandwidth stays shared); with more threads, wall time.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/step.py [--weights bf16,int8,int4] [--threads 1]
    DFLASH_NATIVE=0 ... bench/step.py      # the Python decode loop, for comparison
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from dflash.engine.cpu import cpu_kind  # noqa: E402
from dflash.engine.loading import EMBEDDED_DEFAULT, load_model  # noqa: E402

CONTEXT = 256


def load(source: str, weights: str, threads: int):
    try:
        return load_model(source, weights=weights, max_ctx=1024, threads=threads)
    except TypeError:  # a checkout from before weight formats: only bf16 and fp32, as dtypes
        return load_model(source, dtype={"bf16": "bfloat16", "fp32": "float32"}[weights], max_ctx=1024, threads=threads)


def best_ms(model, kv, tokens: torch.Tensor, rows: int, repeats: int, clock) -> float:
    fastest = float("inf")
    for _ in range(repeats):
        kv.length = CONTEXT
        started = clock()
        model(tokens[CONTEXT : CONTEXT + rows], CONTEXT, kv, logits_positions=None)
        fastest = min(fastest, clock() - started)
    return fastest * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_DEFAULT)
    parser.add_argument("--weights", default="fp32,bf16,int8,int4")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    rows = []
    for weights in args.weights.split(","):
        loaded = load(args.model, weights, args.threads)
        model = loaded.engine.model
        kv = model.new_kv_cache(1024)
        tokens = torch.arange(100, 100 + CONTEXT + 8)
        model(tokens[:CONTEXT], 0, kv)
        best_ms(model, kv, tokens, 8, 3, clock)  # warm-up
        one = min(best_ms(model, kv, tokens, 1, args.repeats, clock) for _ in range(2))
        eight = min(best_ms(model, kv, tokens, 8, args.repeats, clock) for _ in range(2))
        rows.append((weights, one, eight))
        del loaded, model, kv
    try:
        from dflash.engine.native import extension

        loop = "native" if extension() is not None else "python"
    except ImportError:  # a checkout from before the native loop
        loop = "python"
    measure = "thread CPU time" if args.threads == 1 else "wall time"
    print(f"\ncpu={cpu_kind()}  threads={args.threads} ({measure})  decode loop={loop}  context={CONTEXT}  "
          f"torch {torch.__version__}  load {os.getloadavg()[0]:.2f}")
    print("| weights | decode step | tok/s equivalent | verify 1+7 rows | ratio |")
    print("|---|---|---|---|---|")
    for weights, one, eight in rows:
        print(f"| {weights} | {one:.1f} ms | {1000 / one:.1f} | {eight:.1f} ms | {eight / one:.2f}x |")


if __name__ == "__main__":
    main()
