"""Cost of one decode step and one verification forward (1 + 7 rows), per weight format and context.

Best of `--repeats` forwards at each context of `--contexts` (default 256), rolled back after each.
Up to 1024 tokens the context is a real prefill; past that the first 1024 positions' keys and values
are copied over the rest of the cache (a step's cost does not depend on what the keys hold, and a 16K
prefill would take minutes here). With `--threads 1` it reports the thread's CPU time, which another
process on a shared VM does not inflate the way it inflates wall time (memory bandwidth stays
shared); with more threads, wall time.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/step.py [--weights bf16,int8,int4] [--threads 1]
        [--contexts 1024,16384] [--tree-chains 3,7]
    DFLASH_NATIVE=0 ... bench/step.py      # the Python decode loop, for comparison
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from dflash.engine.cpu import cpu_kind  # noqa: E402
from dflash.engine.loading import EMBEDDED_DEFAULT, KV_CACHES, load_model  # noqa: E402

REAL_CONTEXT = 1024  # longest context filled by a real prefill


def load(source: str, weights: str, threads: int, max_ctx: int, kv_cache: str = "auto"):
    try:
        return load_model(source, weights=weights, max_ctx=max_ctx, threads=threads, kv_cache=kv_cache)
    except TypeError:  # a checkout from before weight formats: only bf16 and fp32, as dtypes
        return load_model(source, dtype={"bf16": "bfloat16", "fp32": "float32"}[weights], max_ctx=max_ctx, threads=threads)


def fill(model, kv, context: int) -> None:
    """Positions 0..context-1 of the cache hold keys and values: a real prefill of up to REAL_CONTEXT
    tokens, then copies of those rows."""
    real = min(context, REAL_CONTEXT)
    model(torch.arange(100, 100 + real), 0, kv)
    for start in range(real, context, real):
        end = min(start + real, context)
        kv.keys[:, :, start:end] = kv.keys[:, :, : end - start]
        kv.values[:, :, start:end] = kv.values[:, :, : end - start]
        if getattr(kv, "quantized", False):  # an int8 cache: its scales too
            kv.key_scales[:, :, start:end] = kv.key_scales[:, :, : end - start]
            kv.value_scales[:, :, start:end] = kv.value_scales[:, :, : end - start]
    kv.length = context


def best_ms(model, kv, context: int, rows: int, repeats: int, clock, parents: list[int] | None = None) -> float:
    """With `parents`, the rows are a draft tree's (model.TreeRows): its chains attended one by one."""
    from dflash.engine.model import TreeRows

    tokens = torch.arange(200, 200 + rows)
    fastest = float("inf")
    for _ in range(repeats):
        kv.length = context
        tree = None if parents is None else TreeRows.of(parents, model.args, model.dtype, model.device)
        started = clock()
        model(tokens, context, kv, logits_positions=None, **({} if tree is None else {"tree": tree}))
        fastest = min(fastest, clock() - started)
    return fastest * 1000


def tree_of_chains(rows: int, chains: int) -> list[int]:
    """Parents of a draft tree of `rows` rows (the pending token's included): `chains` chains of
    equal length hanging off the pending token, the rest of the rows added to the last."""
    parents, per = [-1], (rows - 1) // chains
    for chain in range(chains):
        for i in range(per if chain < chains - 1 else rows - 1 - per * (chains - 1)):
            parents.append(0 if i == 0 else len(parents) - 1)
    return parents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_DEFAULT)
    parser.add_argument("--weights", default="fp32,bf16,int8,int4")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--contexts", default="256", help="context lengths, comma-separated")
    parser.add_argument("--kv-cache", default="auto", choices=KV_CACHES, help="[model] kv_cache")
    parser.add_argument("--tree-chains", default="",
                        help="also 1+15 rows as one chain and as a draft tree of this many chains (comma-separated)")
    args = parser.parse_args()
    trees = [int(c) for c in args.tree_chains.split(",") if c]
    contexts = [int(c) for c in args.contexts.split(",")]
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    rows = []
    for weights in args.weights.split(","):
        loaded = load(args.model, weights, args.threads, max(contexts) + 16, args.kv_cache)
        model = loaded.engine.model
        kv = model.new_kv_cache(max(contexts) + 16)
        for context in contexts:
            fill(model, kv, context)
            best_ms(model, kv, context, 8, 3, clock)  # warm-up
            one = min(best_ms(model, kv, context, 1, args.repeats, clock) for _ in range(2))
            eight = min(best_ms(model, kv, context, 8, args.repeats, clock) for _ in range(2))
            sixteen = [min(best_ms(model, kv, context, 16, args.repeats, clock, tree_of_chains(16, chains))
                           for _ in range(2)) for chains in ([1] + trees if trees else [])]
            rows.append((weights, context, one, eight, sixteen))
        del loaded, model, kv
    try:
        from dflash.engine.native import extension

        loop = "native" if extension() is not None else "python"
        if extension() is not None and hasattr(extension(), "causal_attention_isa"):
            loop += f"  attention values={extension().causal_attention_isa()}"  # over a bf16 cache
    except ImportError:  # a checkout from before the native loop
        loop = "python"
    measure = "thread CPU time" if args.threads == 1 else "wall time"
    print(f"\ncpu={cpu_kind()}  threads={args.threads} ({measure})  decode loop={loop}  "
          f"torch {torch.__version__}  load {os.getloadavg()[0]:.2f}")
    tree_columns = "".join(f" 1+15 rows, {c} chains |" for c in [1] + trees) if trees else ""
    print("| weights | context | decode step | tok/s equivalent | vs the first context | verify 1+7 rows | ratio |"
          + tree_columns)
    print("|---|---|---|---|---|---|---|" + "---|" * len(tree_columns.split("|")[:-1]))
    first = {}
    for weights, context, one, eight, sixteen in rows:
        first.setdefault(weights, one)
        print(f"| {weights} | {context} | {one:.1f} ms | {1000 / one:.1f} | {first[weights] / one:.0%} | {eight:.1f} ms "
              f"| {eight / one:.2f}x |" + "".join(f" {ms:.1f} ms ({ms / one:.2f}x) |" for ms in sixteen))


if __name__ == "__main__":
    main()
