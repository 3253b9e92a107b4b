"""Quality of each weight format: perplexity on held-out offline text and greedy agreement with bf16.

The text is Python standard-library sources from the local install (modules that no prompt or
training set of this project uses), cut into windows of `--window` tokens; perplexity is
exp(mean cross-entropy) of each next token. Greedy agreement runs the bench prompts (bench/decode.py,
bench/speculative.py) for `--tokens` tokens in each format and counts the tokens that equal bf16's
up to the first divergence. The quality bar (issue 13): int8 within 1% of bf16 perplexity, int4
within 5%.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/quality.py [--weights fp32,bf16,int8,int4] [--windows 8]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from decode import PROMPT as DECODE_PROMPT  # noqa: E402
from speculative import CHAT, CODE_EDITING, CODING  # noqa: E402

from dflash.chat.template import render_prompt  # noqa: E402
from dflash.engine.cpu import cpu_kind  # noqa: E402
from dflash.engine.loading import EMBEDDED_DEFAULT, load_model  # noqa: E402
from dflash.engine.sampling import SamplingParams  # noqa: E402

HELD_OUT_MODULES = ("textwrap", "heapq", "fractions", "calendar", "shlex", "difflib")
QUALITY_BAR = {"int8": 0.01, "int4": 0.05}  # allowed perplexity increase over bf16


def held_out_text() -> str:
    import importlib

    return "\n\n".join(Path(importlib.import_module(name).__file__).read_text() for name in HELD_OUT_MODULES)


def perplexity(loaded, windows: list[list[int]]) -> float:
    engine = loaded.engine
    total_nll, count = 0.0, 0
    for window in windows:
        engine.rollback(0)
        logits = engine.forward(window[:-1], logits_positions=None)  # [T-1, vocab] fp32
        targets = torch.tensor(window[1:])
        total_nll += F.cross_entropy(logits, targets, reduction="sum").item()
        count += len(window) - 1
    engine.rollback(0)
    return math.exp(total_nll / count)


def greedy(loaded, prompts: list[str], tokens: int) -> list[list[int]]:
    engine = loaded.engine
    outputs = []
    for prompt in prompts:
        engine.rollback(0)
        ids = render_prompt(loaded.tokenizer, [{"role": "user", "content": prompt}])
        outputs.append(engine.start(ids, SamplingParams(), max_tokens=tokens).run())
    return outputs


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Mean fraction of each reply that equals the reference up to the first differing token."""
    fractions = []
    for out, ref in zip(outputs, reference):
        same = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        fractions.append(same / max(len(ref), 1))
    return statistics.mean(fractions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_DEFAULT)
    parser.add_argument("--weights", default="fp32,bf16,int8,int4")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    formats = args.weights.split(",")
    if "bf16" not in formats:
        formats.insert(0, "bf16")  # the reference
    formats.sort(key=lambda f: f != "bf16")
    prompts = [DECODE_PROMPT, *CODE_EDITING, *CHAT, *CODING]
    rows, reference_ppl, reference_out = [], None, None
    for weights in formats:
        loaded = load_model(args.model, weights=weights, max_ctx=max(2048, args.window + 1), threads=args.threads,
                            prefill_chunk=args.window)
        ids = loaded.tokenizer(held_out_text())["input_ids"]
        windows = [ids[i : i + args.window] for i in range(0, args.windows * args.window, args.window)]
        ppl = perplexity(loaded, windows)
        outputs = greedy(loaded, prompts, args.tokens)
        if weights == "bf16":
            reference_ppl, reference_out = ppl, outputs
        rows.append((loaded.weights, ppl, ppl / reference_ppl - 1, agreement(outputs, reference_out)))
        del loaded
    print(f"\ncpu={cpu_kind()}  model={args.model}  held-out text: {', '.join(HELD_OUT_MODULES)} "
          f"({args.windows} x {args.window} tokens)  greedy: {len(prompts)} prompts x {args.tokens} tokens")
    print("| weights | perplexity | vs bf16 | bar | greedy tokens equal to bf16 (to first difference) |")
    print("|---|---|---|---|---|")
    for weights, ppl, delta, agree in rows:
        bar = QUALITY_BAR.get(weights)
        verdict = "—" if bar is None else ("holds" if delta <= bar else "FAILS") + f" (≤{bar:.0%})"
        print(f"| {weights} | {ppl:.3f} | {delta:+.2%} | {verdict} | {agree:.0%} |")


if __name__ == "__main__":
    main()
