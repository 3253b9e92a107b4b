"""Long-context quality of the embedded model per RoPE scaling: perplexity by position and needles.

For each scaling in `--scalings`, one pass over a haystack of `--max-ctx` tokens: the local Python
install's standard-library sources (top-level `*.py` of its stdlib dir, sorted by name,
concatenated) with needles inserted — comment lines `# Remember: the value of KEY is 1234567.`, a
random key and 7-digit value each, three per needle length, at 20%, 50% and 80% of that length.
The pass prefills the haystack in chunks and scores every next token (perplexity by position
bucket, needle lines excluded). Where the haystack reaches a needle length L, it pauses and asks for
each of that length's three keys: the first L - (question + answer) haystack tokens, then
`# Question: what is the value of KEY?` / `# Answer: the value of KEY is`, and a greedy reply of
8 tokens; a needle is found when the reply's first 7-digit number is its value. The haystack up to
L is computed once and shared by that length's three questions (the engine keeps it), and the
needles of the other lengths that lie before L are in that context as distractors. A 4096-token
length inside the trained context is the control: it shows whether the model retrieves at all.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/long_context.py [--scalings yarn,yarn-static,yarn:1,none] [--weights int4 --kv-cache int8]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from dflash.engine.cpu import cpu_kind  # noqa: E402
from dflash.engine.loading import EMBEDDED_DEFAULT, KV_CACHES, load_model  # noqa: E402
from dflash.engine.sampling import SamplingParams  # noqa: E402

CHUNK_TOKENS = 256
ANSWER_TOKENS = 8
NEEDLE_DEPTHS = (0.2, 0.5, 0.8)
BUCKETS = ((0, 8192), (8192, 16384), (16384, 32768))
WORDS = ("amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper",
         "kestrel", "lagoon", "marble", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra")


def stdlib_tokens(tokenizer, count: int) -> list[int]:
    """At least `count` tokens of the standard library's top-level modules, in name order."""
    ids: list[int] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        ids += tokenizer(f"# file: {path.name}\n{path.read_text(errors='replace')}\n")["input_ids"]
        if len(ids) >= count:
            return ids
    raise SystemExit(f"the standard library has fewer than {count} tokens of sources")


def make_needles(lengths: list[int], seed: int) -> list[dict]:
    rng = random.Random(seed)
    keys = rng.sample([f"{a}-{b}" for a in WORDS for b in WORDS if a != b], len(lengths) * len(NEEDLE_DEPTHS))
    return [
        {"length": length, "depth": int(length * depth), "key": keys.pop(), "value": str(rng.randrange(10**6, 10**7))}
        for length in lengths
        for depth in NEEDLE_DEPTHS
    ]


def build_haystack(tokenizer, total: int, needles: list[dict]) -> tuple[list[int], set[int]]:
    """`total` tokens of filler with each needle's line starting at its depth; also the needle positions."""
    filler = iter(stdlib_tokens(tokenizer, total))
    haystack: list[int] = []
    needle_positions: set[int] = set()
    for needle in sorted(needles, key=lambda n: n["depth"]):
        while len(haystack) < needle["depth"]:
            haystack.append(next(filler))
        line = tokenizer(f"\n# Remember: the value of {needle['key']} is {needle['value']}.\n")["input_ids"]
        needle_positions.update(range(len(haystack), len(haystack) + len(line)))
        haystack += line
    while len(haystack) < total:
        haystack.append(next(filler))
    return haystack[:total], needle_positions


def question_ids(tokenizer, key: str) -> list[int]:
    return tokenizer(f"\n# Question: what is the value of {key}?\n# Answer: the value of {key} is")["input_ids"]


def run_scaling(args, scaling: str, haystack: list[int], needle_positions: set[int], needles: list[dict]):
    mode, _, attention_factor = scaling.partition(":")  # "yarn:1": [model] rope_attention_factor = 1
    static = mode.endswith("-static")  # "yarn-static": [model] rope_scaling_static = true
    loaded = load_model(args.model, dtype=args.dtype, weights=args.weights, kv_cache=args.kv_cache, max_ctx=args.max_ctx,
                        rope_scaling=mode.removesuffix("-static"), rope_attention_factor=float(attention_factor or 0),
                        rope_scaling_static=static, prefill_chunk=CHUNK_TOKENS, threads=args.threads)
    engine, tokenizer = loaded.engine, loaded.tokenizer
    longest_question = max(len(question_ids(tokenizer, n["key"])) for n in needles)
    # Where the haystack is cut for each length's questions: question and answer fit inside it.
    pauses = {length - longest_question - ANSWER_TOKENS: length for length in sorted({n["length"] for n in needles})}
    nll_sums = [0.0] * len(BUCKETS)
    counts = [0] * len(BUCKETS)
    answers = []
    started = time.perf_counter()
    prefill_s = 0.0
    position = 0
    while position < len(haystack) - 1:
        end = min([position + CHUNK_TOKENS, len(haystack) - 1] + [p for p in pauses if p > position])
        chunk_started = time.perf_counter()
        logits = engine.forward(haystack[position:end], logits_positions=None)  # [T, vocab]
        prefill_s += time.perf_counter() - chunk_started
        targets = torch.tensor(haystack[position + 1 : end + 1])
        nll = -torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
        for offset, value in enumerate(nll.tolist()):
            target = position + 1 + offset
            for index, (low, high) in enumerate(BUCKETS):
                if low <= target < high and target not in needle_positions:
                    nll_sums[index] += value
                    counts[index] += 1
        position = end
        if position in pauses:
            for needle in (n for n in needles if n["length"] == pauses[position]):
                prompt = haystack[:position] + question_ids(tokenizer, needle["key"])
                reply = tokenizer.decode(engine.start(prompt, SamplingParams(), max_tokens=ANSWER_TOKENS).run())
                found = re.search(r"\d{7}", reply)
                answers.append((needle, found.group(0) if found else repr(reply.strip()[:16])))
            engine.rollback(position)
        print(f"  {scaling}: {position} tokens, {time.perf_counter() - started:.0f} s", flush=True)
    perplexity = [math.exp(s / c) if c else float("nan") for s, c in zip(nll_sums, counts)]
    kv_dtype = str(engine.model.kv_dtype).removeprefix("torch.")
    return perplexity, answers, prefill_s, loaded.engine.model.args.rope_scaling, kv_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_DEFAULT)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--weights", default=None, help="a weight format (auto, bf16, fp32, int8, int4); default: --dtype as it is")
    parser.add_argument("--kv-cache", default="auto", choices=KV_CACHES, help="[model] kv_cache")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-ctx", type=int, default=32768)
    parser.add_argument("--lengths", default="4096,16384,24576,32768", help="needle context lengths")
    parser.add_argument("--scalings", default="yarn,none",
                        help="[model] rope_scaling values, comma-separated; yarn:F also sets rope_attention_factor F "
                             "(yarn:1 is YaRN's frequencies without its attention temperature); yarn-static sets "
                             "rope_scaling_static (YaRN from position 0, not from the first past the trained context)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if max(lengths) > args.max_ctx:
        raise SystemExit(f"needle length {max(lengths)} exceeds --max-ctx {args.max_ctx}")
    needles = make_needles(lengths, args.seed)
    tokenizer = load_model(args.model, dtype=args.dtype, max_ctx=64).tokenizer
    haystack, needle_positions = build_haystack(tokenizer, args.max_ctx, needles)
    kind = cpu_kind()
    results = {scaling: run_scaling(args, scaling, haystack, needle_positions, needles)
               for scaling in args.scalings.split(",")}

    print(f"\ncpu={kind}  threads={args.threads}  dtype={args.dtype}  weights={args.weights or args.dtype}  "
          f"kv_cache={args.kv_cache}  torch {torch.__version__}  "
          f"haystack: {args.max_ctx} tokens of {sysconfig.get_paths()['stdlib']}")
    buckets = [f"ppl {low // 1024}–{high // 1024}K" for low, high in BUCKETS]
    header = ("cpu", "rope_scaling", "KV dtype", *buckets, f"prefill {args.max_ctx // 1024}K")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for scaling, (perplexity, _, prefill_s, rope, kv_dtype) in results.items():
        cells = " | ".join(f"{p:.2f}" for p in perplexity)
        temperature = f", attention factor {rope['attention_factor']:g}" if rope and "attention_factor" in rope else ""
        switch = f", from position {rope['plain_within']}" if rope and "plain_within" in rope else ""
        label = f"{scaling} (factor {rope['factor']:g}{temperature}{switch})" if rope else scaling
        print(f"| {kind} | {label} | {kv_dtype} | {cells} | {prefill_s:.0f} s |")

    print("\n| cpu | rope_scaling | context | found | expected → answered |")
    print("|---|---|---|---|---|")
    for scaling, (_, answers, *_rest) in results.items():
        for length in lengths:
            mine = [(n, got) for n, got in answers if n["length"] == length]
            found = sum(got == n["value"] for n, got in mine)
            detail = ", ".join(f"{n['value']} → {got}" for n, got in mine)
            print(f"| {kind} | {scaling} | {length} | {found}/{len(mine)} | {detail} |")


if __name__ == "__main__":
    main()
