"""Constrained vs unconstrained decoding on the embedded model, with and without speculation,
and the cost of computing one token mask.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/structured.py [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from dflash.chat.template import render_prompt  # noqa: E402
from dflash.engine.grammar import json_schema_grammar  # noqa: E402
from dflash.engine.loading import EMBEDDED_DEFAULT, load_model  # noqa: E402
from dflash.engine.sampling import SamplingParams  # noqa: E402
from dflash.engine.speculative import SpeculationConfig  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 6},
        "summary": {"type": "string"},
    },
    "required": ["name", "tags", "summary"],
    "additionalProperties": False,
}
PROMPT = "Describe the Python programming language as a JSON object with a name, tags and a summary."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_DEFAULT)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    loaded = load_model(args.model, threads=args.threads, max_ctx=2048)
    engine = loaded.engine
    ids = render_prompt(loaded.tokenizer, [{"role": "user", "content": PROMPT}])
    grammar = json_schema_grammar(SCHEMA)
    engine.grammar_tokenizer()  # build once, outside the timings
    print(f"\nmodel={args.model} dtype=bfloat16 threads={args.threads} tokens={args.tokens}")
    print("| decoding | speculation | decode tok/s | constraint ms/token | constraint share of decode |")
    print("|---|---|---|---|---|")
    for speculation in (SpeculationConfig(), SpeculationConfig(drafter="ngram")):
        for constrained in (False, True):
            engine.speculation = speculation
            engine.rollback(0)
            generation = engine.start(ids, SamplingParams(), args.tokens, grammar=grammar if constrained else None)
            while generation.prefilling:
                generation.step()
            mask_seconds = 0.0
            if constrained:  # time everything the constraint adds: masks and commits
                constraint = generation.constraint
                for method in ("apply", "consume"):
                    original = getattr(constraint, method)

                    def timed(*a, _original=original):
                        nonlocal mask_seconds
                        started = time.perf_counter()
                        result = _original(*a)
                        mask_seconds += time.perf_counter() - started
                        return result

                    setattr(constraint, method, timed)
            generation.run()
            decode_s = generation.stats.decode_ms / 1000
            tokens = max(len(generation.output) - 1, 1)
            mask_ms = 1000 * mask_seconds / tokens if constrained else 0.0
            share = f"{100 * mask_seconds / decode_s:.1f}%" if constrained else "-"
            print(f"| {'constrained' if constrained else 'free'} | {speculation.drafter} | "
                  f"{tokens / decode_s:.1f} | {mask_ms:.2f} | {share} |")
    engine.speculation = SpeculationConfig()


if __name__ == "__main__":
    main()
