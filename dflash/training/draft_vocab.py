"""The draft vocabulary: the token ids a DFlash drafter may propose, most frequent first in what
agents read and write, written beside its checkpoint as `draft_vocab.json`.

Why: the drafter scores its block against the target's LM head, 7 rows x 49,152 tokens, which was
~40% of a proposal on a 2-core Zen 4 (bench/propose.py). Scored against the K most frequent tokens
only, a proposal costs a third as much there. A token outside them is never proposed, so a draft
that needed it is cut short; the target verifies every draft, so the output is the same as plain
greedy decoding whatever the vocabulary.

Counted over text of the kinds the drafter serves (none of it from training/unseen.py's prompts):
the Python standard library's sources (code, docstrings, comments) and the prompt pool's rendered
conversations (chat, coding, code editing, tool use; prompt_pool.py). The tokenizer's special
tokens are always in.

    .venv/bin/python -m dflash.training.draft_vocab dflash/drafters/smollm2-135m-instruct-b8 --size 16384
"""

from __future__ import annotations

import argparse
import collections
import json
import sysconfig
from pathlib import Path
from typing import Sequence

FILE_NAME = "draft_vocab.json"  # read by engine/loading.draft_vocabulary


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)


def count_tokens(tokenizer, texts) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for text in texts:
        counts.update(tokenizer.encode(text, add_special_tokens=False))
    return counts


def choose(counts: collections.Counter, size: int, always: Sequence[int], vocab_size: int) -> list[int]:
    """The `size` ids that occur most (ties by id), the `always` ids among them; a multiple of 16
    (the int8 kernel's channel block), ascending."""
    if size % 16 or not 0 < size <= vocab_size:
        raise ValueError(f"--size {size}: a positive multiple of 16 up to the vocabulary's {vocab_size}")
    chosen = set(int(i) for i in always if 0 <= i < vocab_size)
    by_count = (token for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])))
    by_id = iter(range(vocab_size))  # fewer distinct tokens seen than asked for: fill by id
    for token in (*by_count, *by_id):
        if len(chosen) >= size:
            break
        chosen.add(token)
    return sorted(chosen)


def build(size: int, pool: int, seed: int = 0) -> dict:
    from dflash.chat.template import render_prompt
    from dflash.engine.loading import EMBEDDED_DEFAULT, load_tokenizer
    from dflash.training.prompt_pool import scaled_conversations

    tokenizer = load_tokenizer(EMBEDDED_DEFAULT)
    sources = stdlib_sources()
    counts = count_tokens(tokenizer, (p.read_text(errors="replace") for p in sources))
    for _, messages in scaled_conversations(pool, seed):
        counts.update(render_prompt(tokenizer, messages))
    always = sorted(set(tokenizer.all_special_ids))
    ids = choose(counts, size, always, len(tokenizer))
    total = sum(counts.values())
    covered = sum(counts[i] for i in ids)
    return {"ids": ids, "size": size, "counted_tokens": total, "coverage": round(covered / total, 5),
            "sources": {"stdlib_files": len(sources), "pool_conversations": pool, "seed": seed}}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the drafter's checkpoint folder (draft_vocab.json is written there)")
    parser.add_argument("--size", type=int, default=16384)
    parser.add_argument("--pool", type=int, default=4000, help="prompt-pool conversations counted")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = build(args.size, args.pool, args.seed)
    out = Path(args.folder) / FILE_NAME
    out.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    print(f"{out}: {args.size} ids covering {result['coverage']:.2%} of {result['counted_tokens']} counted tokens")


if __name__ == "__main__":
    main()
