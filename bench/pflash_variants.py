"""Which scorer variant keeps needles best per unit of cost (speculative prefill, engine/pflash.py).

Model-independent: for bench/niah.py's cases, one scorer pass per attention window (0: each token
attends over the whole prompt; W: over the first tokens and the W before its chunk) with the
target's first `max(--layers)` layers and the last 32 prompt tokens' queries gives per-layer scores
before and after RoPE; each variant (window, first N layers, pre/post RoPE, 8 or 32 lookahead rows,
tail n-gram forcing on/off) then selects at each keep ratio, and a case counts when its whole needle
line was kept. The cost column is the scorer's own time for N layers and that window, measured on
the first case.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python bench/pflash_variants.py --length 4096 --cases 10
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from niah import make_cases  # noqa: E402

from dflash.engine.cpu import cpu_kind  # noqa: E402
from dflash.engine.loading import EMBEDDED_DEFAULT, load_model  # noqa: E402
from dflash.engine.pflash import (AttentionScorer, combine, droppable_chunks, run, select_positions,  # noqa: E402
                                  tail_ngram_chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_DEFAULT)
    parser.add_argument("--weights", default="auto", help="weight format, as [model] weights")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--cases", type=int, default=10)
    parser.add_argument("--layers", default="2,4,8,15")
    parser.add_argument("--windows", default="0", help="scorer attention windows in tokens, 0 = whole prompt")
    parser.add_argument("--lookahead", default="8,32", help="lookahead rows to compare")
    parser.add_argument("--ratios", default="0.1,0.2")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    layer_counts = [int(x) for x in args.layers.split(",")]
    windows = [int(x) for x in args.windows.split(",")]
    lookaheads = [int(x) for x in args.lookahead.split(",")]
    ratios = [float(x) for x in args.ratios.split(",")]
    loaded = load_model(args.model, weights=args.weights, max_ctx=max(8192, args.length + 64), threads=2)
    model, tokenizer = loaded.engine.model, loaded.tokenizer
    cases = make_cases(tokenizer, [args.length], args.cases, args.seed)[args.length]
    cost = {}
    for window in windows:
        for n in layer_counts:
            started = time.perf_counter()
            AttentionScorer(model, n, window=window).score(cases[0]["ids"])
            cost[window, n] = time.perf_counter() - started
            print(f"  scorer self:{n} window {window}: {cost[window, n]:.1f} s", flush=True)
    kept: dict[tuple, int] = {}
    for index, case in enumerate(cases):
        ids = case["ids"]
        chunks = droppable_chunks(len(ids), case["protected"], 32)
        forced = tail_ngram_chunks(ids, chunks, case["protected"])
        needle = set(range(*case["needle"]))
        for window in windows:
            deepest = AttentionScorer(model, max(layer_counts), lookahead=max(lookaheads), window=window)
            q_pre, q_post, kv = run(deepest._prefill(ids))
            for rope, queries in (("pre", q_pre), ("post", q_post)):
                for rows in lookaheads:
                    layer_scores = deepest._layer_scores(queries[:, -rows:], kv, len(ids), rope == "pre")
                    for n in layer_counts:
                        scores = combine(layer_scores, n)
                        for ngrams in (False, True):
                            for ratio in ratios:
                                keep = round(ratio * len(ids))
                                chosen = select_positions(scores, case["protected"], keep, 32,
                                                          forced if ngrams else set(), chunks)
                                key = (window, n, rope, rows, ngrams, ratio)
                                kept[key] = kept.get(key, 0) + (needle <= set(chosen))
        print(f"  case {index} depth {case['depth']:.2f} done", flush=True)
    print(f"\ncpu {cpu_kind()}, weights {args.weights}, length {args.length}, {args.cases} cases: needles kept\n")
    print("| window | layers N | RoPE | lookahead | tail n-grams | " + " | ".join(f"keep {r}" for r in ratios) + " | scorer s |")
    print("|---|---|---|---|---|" + "---|" * len(ratios) + "---|")
    for window in windows:
        for n in layer_counts:
            for rope in ("pre", "post"):
                for rows in lookaheads:
                    for ngrams in (False, True):
                        cells = " | ".join(f"{kept[(window, n, rope, rows, ngrams, r)]}/{len(cases)}" for r in ratios)
                        print(f"| {window or 'whole'} | {n} | {rope} | {rows} | {'on' if ngrams else 'off'} | {cells} "
                              f"| {cost[window, n]:.1f} |")


if __name__ == "__main__":
    main()
