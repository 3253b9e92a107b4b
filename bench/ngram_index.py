"""What the n-gram drafter's index costs a request, per context length: built afresh (what a new
conversation pays), the same with Python's cyclic GC left running through it (as every request
paid it before session 40, inside a decode step), kept from the request before when the
conversation goes on (a prompt that extends the indexed text by a turn), and cut back to an earlier
point of it (a turn retried from an earlier message). The median of --repeats, on random tokens
(the cost does not depend on what they are).

    .venv/bin/python bench/ngram_index.py [--contexts 2000,8000,20000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time

from dflash.engine.cpu import cpu_kind
from dflash.engine.drafters import ngram
from dflash.engine.drafters.ngram import NgramDrafter

TURN = 200  # tokens a conversation grows by between requests


def timed(drafter: NgramDrafter, tokens: list[int], collector_paused: bool = True) -> float:
    pausing = ngram.collector_paused
    if not collector_paused:
        ngram.collector_paused = lambda tokens: contextlib.nullcontext()
    try:
        started = time.perf_counter()
        drafter.begin(tokens)
        return time.perf_counter() - started
    finally:
        ngram.collector_paused = pausing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="2000,8000,20000", help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(0)
    print(f"\ncpu={cpu_kind()} turn={TURN} tokens repeats={args.repeats}")
    print("| cpu | context | built afresh | built afresh, the GC running | kept: the conversation goes on | "
          "kept: cut back by a turn |")
    print("|---|---|---|---|---|---|")
    for context in (int(c) for c in args.contexts.split(",")):
        fresh, collected, goes_on, cut_back = [], [], [], []
        for _ in range(args.repeats):
            before = [rng.randrange(49152) for _ in range(context)]
            after = before + [rng.randrange(49152) for _ in range(TURN)]
            fresh.append(timed(NgramDrafter(), after))
            collected.append(timed(NgramDrafter(), after, collector_paused=False))
            kept = NgramDrafter()
            kept.begin(before)
            goes_on.append(timed(kept, after))
            cut_back.append(timed(kept, before[: context - TURN] + [rng.randrange(49152) for _ in range(TURN)]))
        cells = [f"{statistics.median(times) * 1000:.2f} ms" for times in (fresh, collected, goes_on, cut_back)]
        print(f"| {cpu_kind()} | {context} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
