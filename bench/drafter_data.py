"""What a `dflash train-drafter` folder's data holds: prompts, prompt and reply tokens by kind of
prompt over a range of prompt indices, teacher-forced tokens, and the folder's own record of each
sitting's data stages (OUT/data-runs.jsonl: tokens made, seconds, tok/s; written since that file
exists, so older folders lack it). Reply tokens count what the target generated: each reply shard
stores all but the last.

    .venv/bin/python bench/drafter_data.py DIR --prompt-count 2239 --first 1100
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.training.prompts import CHAT, EVERYDAY_CHAT, EXTRA_CHAT, default_prompts  # noqa: E402
from dflash.training.train_drafter import data_tally, shard_path  # noqa: E402


def prompt_kind(prompt: str) -> str:
    if prompt in EVERYDAY_CHAT:
        return "everyday chat"
    if prompt in CHAT or prompt in EXTRA_CHAT:
        return "chat"
    return "coding, editing, tools"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the --out folder of train-drafter")
    parser.add_argument("--prompt-count", type=int, default=400, help="as given to train-drafter")
    parser.add_argument("--prompts", help="the --prompts file given to train-drafter, if one was")
    parser.add_argument("--first", type=int, default=0, help="first prompt index counted")
    parser.add_argument("--last", type=int, default=None, help="last prompt index counted (default: the last)")
    args = parser.parse_args()
    if args.prompts:
        prompts = [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    else:
        prompts = default_prompts(args.prompt_count)
    prompts = prompts[: args.prompt_count]
    last = len(prompts) - 1 if args.last is None else args.last
    by_kind: dict[str, list[Path]] = {}
    for index in range(args.first, last + 1):
        if shard_path(args.folder, index).exists():
            by_kind.setdefault(prompt_kind(prompts[index]), []).append(shard_path(args.folder, index))
    print(f"{args.folder}: reply shards of prompts {args.first}..{last}\n")
    print("| kind of prompt | replies | prompt tokens | reply tokens |")
    print("|---|---|---|---|")
    total = {"reply_prompts": 0, "prompt_tokens": 0, "reply_tokens": 0}
    for kind, shards in sorted(by_kind.items()):
        tally = data_tally(shards)
        total = {key: total[key] + tally[key] for key in total}
        print(f"| {kind} | {tally['reply_prompts']} | {tally['prompt_tokens']} | {tally['reply_tokens']} |")
    print(f"| all | {total['reply_prompts']} | {total['prompt_tokens']} | {total['reply_tokens']} |")
    forced = data_tally(sorted((args.folder / "data").glob("prefill-*.pt")))["teacher_forced_tokens"]
    print(f"\nteacher-forced tokens in the folder: {forced}")
    runs = args.folder / "data-runs.jsonl"
    if runs.exists():
        print("\nsittings (data-runs.jsonl):")
        for line in runs.read_text().splitlines():
            print(" ", line)


if __name__ == "__main__":
    main()
