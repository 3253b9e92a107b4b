"""Needle in a haystack for speculative prefill (PFlash): pass rate, needles kept, TTFT.

Each case is one prompt of `length` tokens: filler from the local Python install's standard-library
sources (top-level `*.py`, sorted by name, tokenized once; each case starts at a random offset),
one needle line `# Remember: the value of KEY is NNNNNNN.` (a random two-word key, a random
7-digit value) at a depth from 10% to 90% of the filler (spread evenly over the cases), and a
protected tail `# Question: what is the value of KEY?` / `# Answer: the value of KEY is`. This is
the completion form bench/long_context.py measured the embedded model retrieving; the chat form
with a key-value needle is one it fails even uncompressed (shared/notes/pflash.md), and a pass rate
against a 0% baseline says nothing. The prompt's first token and the tail are protected, as the
chat template's spans would be.

Every case runs with compression off, then at each keep ratio (`compression = "always"`, a fresh
compressor each time, the live state not reused: nothing is cached between runs). A case passes
when the first 7-digit number of the greedy 8-token reply is the needle's value; "needle kept"
counts cases whose whole needle line survived the selection (model-independent); TTFT is from
`start` to the first generated token, scoring included. `--off-cases N` runs the uncompressed
prompt for only the first N cases of each length (an uncompressed 32K case takes a quarter of an
hour on a 2-core AVX2 VM); the speed-up column compares mean TTFTs. `--results FILE` appends each
run to a JSON-lines file and skips the runs it already holds for the same command and CPU kind, so
a long table is filled over several sittings: rerun the same command to go on.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/niah.py --lengths 4096,8192 --cases 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.long_context import WORDS, stdlib_tokens  # noqa: E402 (one needle vocabulary and filler)
from dflash.engine.cpu import cpu_kind  # noqa: E402
from dflash.engine.loading import EMBEDDED_DEFAULT, load_model  # noqa: E402
from dflash.engine.pflash import AttentionScorer, CompressionSettings, PromptCompressor, self_scorer_layers  # noqa: E402
from dflash.engine.sampling import SamplingParams  # noqa: E402

ANSWER_TOKENS = 8
def make_case(rng: random.Random, tokenizer, pool: list[int], length: int, depth: float) -> dict:
    key = "-".join(rng.sample(WORDS, 2))
    value = str(rng.randrange(10**6, 10**7))
    needle = tokenizer(f"\n# Remember: the value of {key} is {value}.\n")["input_ids"]
    question = tokenizer(f"\n# Question: what is the value of {key}?\n# Answer: the value of {key} is")["input_ids"]
    filler_length = length - len(needle) - len(question)
    start = rng.randrange(len(pool) - filler_length)
    filler = pool[start:start + filler_length]
    at = int(depth * filler_length)
    ids = filler[:at] + needle + filler[at:] + question
    return {"ids": ids, "value": value, "depth": depth, "needle": (at, at + len(needle)),
            "protected": [(0, 1), (len(ids) - len(question), len(ids))]}


def make_cases(tokenizer, lengths: list[int], count: int, seed: int) -> dict[int, list[dict]]:
    pool = stdlib_tokens(tokenizer, max(lengths) * 3)
    rng = random.Random(seed)
    depths = [0.1 + 0.8 * i / max(1, count - 1) for i in range(count)]
    return {length: [make_case(rng, tokenizer, pool, length, depth) for depth in depths] for length in lengths}


def original_positions(model, kept: list[int], prompt_length: int, max_ctx: int):
    """Make KV row j rotate as original position kept[j], and generated tokens continue from the
    prompt's length (SpecPrefill's position ids, against the engine's renumbering); returns the
    tables to put back. A measuring hack: the engine itself always renumbers."""
    cos, sin = model._rope_tables(prompt_length + max_ctx)
    mapping = kept + list(range(prompt_length, prompt_length + max_ctx - len(kept)))
    saved = model._rope_cache
    model._rope_cache = (cos[mapping], sin[mapping])
    return saved


def run_case(engine, tokenizer, case: dict, keep_positions: bool = False) -> dict:
    started = time.perf_counter()
    generation = engine.start(case["ids"], SamplingParams(), max_tokens=ANSWER_TOKENS, protected=case["protected"])
    saved = None
    while not generation.output and generation.finished is None:
        generation.step()
        if keep_positions and saved is None and generation.kept_positions is not None:
            saved = original_positions(engine.model, generation.kept_positions, len(case["ids"]), engine.max_ctx)
    ttft = time.perf_counter() - started
    output = generation.run()
    if saved is not None:
        engine.model._rope_cache = saved
    found = re.search(r"\d{7}", tokenizer.decode(output))
    kept = generation.kept_positions
    needle_kept = kept is None or set(range(*case["needle"])) <= set(kept)
    return {"pass": bool(found and found.group(0) == case["value"]), "needle_kept": needle_kept, "ttft": ttft,
            "scoring": generation.stats.scoring_ms / 1000, "prefilled": generation.stats.prefilled_tokens}


class RecordedRuns:
    """The runs of one command (`settings`) in a JSON-lines file: those already there, and each new
    one appended as soon as it is done (an interrupted bench loses at most the run in progress)."""

    def __init__(self, path: Path | None, settings: dict):
        self.path = path
        self.settings = settings
        self.runs: dict[tuple, dict] = {}
        if path is not None and path.exists():
            for line in path.read_text().splitlines():
                record = json.loads(line)
                if record.pop("settings") == settings:
                    self.runs[record.pop("length"), record.pop("mode"), record.pop("case")] = record

    def get(self, length: int, mode: str, case: int) -> dict | None:
        return self.runs.get((length, mode, case))

    def add(self, length: int, mode: str, case: int, result: dict) -> None:
        self.runs[length, mode, case] = result
        if self.path is not None:
            with self.path.open("a") as out:
                out.write(json.dumps({"settings": self.settings, "length": length, "mode": mode, "case": case,
                                      **result}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_DEFAULT)
    parser.add_argument("--weights", default="auto", help="weight format, as [model] weights")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", default="4096,8192,16384,32768")
    parser.add_argument("--cases", type=int, default=40)
    parser.add_argument("--ratios", default="0.1,0.2,0.3")
    parser.add_argument("--no-off", action="store_true", help="skip the uncompressed runs")
    parser.add_argument("--off-cases", type=int, default=None,
                        help="run uncompressed only the first N cases of each length (a 32K full prefill is long)")
    parser.add_argument("--scorer", default=CompressionSettings().scorer, help="self:N")
    parser.add_argument("--scorer-window", type=int, default=CompressionSettings().scorer_window,
                        help="the scorer's attention window in tokens, 0 = whole prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-positions", action="store_true",
                        help="compressed prompts keep their original position ids (measuring only)")
    parser.add_argument("--results", type=Path, default=None,
                        help="JSON lines: each run appended; runs already there are not run again")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    ratios = [float(x) for x in args.ratios.split(",")]
    # Unscaled RoPE up to the trained 8K (YaRN costs retrieval even inside it; README, long context).
    max_ctx = max(8192, max(lengths) + ANSWER_TOKENS + 8)
    loaded = load_model(args.model, weights=args.weights, max_ctx=max_ctx, threads=args.threads, reuse_live_state=False)
    engine, tokenizer = loaded.engine, loaded.tokenizer
    layers = self_scorer_layers(args.scorer)
    scorer = AttentionScorer(engine.model, layers, window=args.scorer_window)
    cases = make_cases(tokenizer, lengths, args.cases, args.seed)
    print(f"cpu {cpu_kind()}, weights {loaded.weights}, {args.threads} threads, scorer {args.scorer} "
          f"window {args.scorer_window or 'whole'}, max_ctx {max_ctx}, "
          f"rope {engine.model.args.rope_scaling}, {args.cases} cases per length", flush=True)
    recorded = RecordedRuns(args.results, {
        "cpu": cpu_kind(), "weights": loaded.weights, "threads": args.threads, "lengths": args.lengths,
        "cases": args.cases, "seed": args.seed, "scorer": args.scorer, "window": args.scorer_window,
        "keep_positions": args.keep_positions})
    rows = []
    for length in lengths:
        modes = ([] if args.no_off or args.off_cases == 0 else ["off"]) + [f"keep {r}" for r in ratios]
        results: dict[str, list[dict]] = {mode: [] for mode in modes}
        for index, case in enumerate(cases[length]):
            for mode in modes:  # interleaved: a shared machine's load changes over minutes
                if mode == "off" and args.off_cases is not None and index >= args.off_cases:
                    continue
                result = recorded.get(length, mode, index)
                if result is None:
                    if mode == "off":
                        engine.compressor = None
                    else:
                        settings = CompressionSettings(mode="always", keep_ratio=float(mode.split()[1]),
                                                       scorer=args.scorer, scorer_window=args.scorer_window)
                        engine.compressor = PromptCompressor(settings, scorer)
                    result = run_case(engine, tokenizer, case, args.keep_positions and mode != "off")
                    recorded.add(length, mode, index, result)
                results[mode].append(result)
                print(f"  {length} {mode} case {index} depth {case['depth']:.2f}: pass {result['pass']} "
                      f"kept {result['needle_kept']} ttft {result['ttft']:.1f} s", flush=True)
        off_ttft = sum(r["ttft"] for r in results["off"]) / len(results["off"]) if "off" in results else float("nan")
        for mode, runs in results.items():
            n = len(runs)
            ttft = sum(r["ttft"] for r in runs) / n
            rows.append((length, mode, sum(r["pass"] for r in runs), sum(r["needle_kept"] for r in runs), n,
                         sum(r["prefilled"] for r in runs) / n, ttft, sum(r["scoring"] for r in runs) / n,
                         off_ttft / ttft))
    positions = "original position ids" if args.keep_positions else "renumbered positions"
    print(f"\ncpu {cpu_kind()}, weights {loaded.weights}, scorer {args.scorer} window {args.scorer_window or 'whole'}, "
          f"{positions}, {args.cases} cases per length\n")
    print("| length | mode | pass | needle kept | prefilled tokens | TTFT s | scoring s | TTFT speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for length, mode, passed, kept, n, prefilled, ttft, scoring, speedup in rows:
        print(f"| {length} | {mode} | {passed}/{n} | {kept}/{n} | {prefilled:.0f} | {ttft:.1f} | {scoring:.1f} | {speedup:.1f}x |")


if __name__ == "__main__":
    main()
