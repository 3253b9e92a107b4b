"""τ of DFlash drafters on the fixed unseen prompts (dflash/training/unseen.py), per prompt type.

Greedy, a full block every verification (no adaptive policy), the same measurement that
`dflash train-drafter --eval-every` writes to training.json, but on the served weight format.
`--slots` adds each block slot's hit rate per prompt type: slot k's share of accepted drafts among
the verifications whose slots before k were all accepted. Each drafter gets two rows: "chain", the
drafter's first choice at each slot (what training measures), and "tree of N", a tree of N rows
(speculative.DraftTree: what the server verifies; `--tree-rows`); for a tree "slot k" is depth k.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/unseen_acceptance.py --weights int4 --tokens 32 \\
        dflash/drafters/smollm2-135m-instruct-b8 [OTHER_DRAFTER_DIR ...]

`--system-tokens N` puts the captured Claude Code system prompt (~N tokens) before every prompt, as
`bench/speculative.py --system-tokens` does: drafts deep in a context, as an agent's are;
`--windows 256,none` measures the drafter's context window (drafters/dflash.py CONTEXT_WINDOW, as
served) against others (none: the whole context), a row each.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from speculative import add_context_arguments, target_context, with_system  # noqa: E402  (bench/ is on the path: this script's folder)

from dflash.chat.template import render_prompt  # noqa: E402
from dflash.engine.cpu import cpu_kind  # noqa: E402
from dflash.engine.drafters.dflash import CONTEXT_WINDOW  # noqa: E402
from dflash.engine.loading import EMBEDDED_DEFAULT, draft_vocabulary, load_model, serving_draft  # noqa: E402
from dflash.training.unseen import (  # noqa: E402
    UNSEEN_PROMPTS,
    acceptance_length,
    slot_hit_rates,
    unseen_verifications,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafters", nargs="+", help="DFlash checkpoint folders for the target")
    parser.add_argument("--model", default=EMBEDDED_DEFAULT)
    parser.add_argument("--weights", default="auto", help="auto, bf16, fp32, int8, int4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per prompt")
    parser.add_argument("--full-vocabulary", action="store_true",
                        help="propose from every token, not the checkpoint's draft_vocab.json")
    parser.add_argument("--tree-rows", default="7", help="rows of the trees, comma-separated for several (a row each)")
    parser.add_argument("--system-tokens", type=int, default=0,
                        help="put about this many tokens of the captured Claude Code request (its system prompt, "
                             "then its tool definitions) before every conversation")
    parser.add_argument("--windows", default=str(CONTEXT_WINDOW),
                        help="the drafter's context windows to measure, comma-separated (none: the whole context)")
    add_context_arguments(parser)
    parser.add_argument("--slots", action="store_true",
                        help="also each block slot's hit rate per prompt type (among blocks right up to it)")
    args = parser.parse_args()
    max_ctx = target_context(args)
    loaded = load_model(args.model, weights=args.weights, max_ctx=max_ctx, threads=args.threads,
                        rope_attention_factor=args.rope_attention_factor, rope_scaling_static=args.rope_scaling_static)
    windows = [None if w.strip() == "none" else int(w) for w in args.windows.split(",")]
    conversations = {kind: [with_system(messages, args.system_tokens) for messages in kind_conversations]
                     for kind, kind_conversations in UNSEEN_PROMPTS.items()} if args.system_tokens else None
    lengths = [len(render_prompt(loaded.tokenizer, messages))
               for kind_conversations in (conversations or UNSEEN_PROMPTS).values() for messages in kind_conversations]
    print(f"\ncpu={cpu_kind()} model={args.model} weights={loaded.weights} threads={args.threads} tokens={args.tokens} "
          f"system_tokens={args.system_tokens} prompts={min(lengths)}-{max(lengths)} tokens max_ctx={max_ctx} "
          f"rope_scaling={loaded.engine.model.args.rope_scaling}")
    print("| drafter | window | drafts | " + " | ".join(UNSEEN_PROMPTS) + " | mean |")
    print("|---" * (len(UNSEEN_PROMPTS) + 4) + "|")
    slots = []
    for folder in args.drafters:
        draft = serving_draft(folder, loaded.dtype, loaded.weights)  # int8 (AVX2 alone: int4) linears, as served
        vocabulary = None if args.full_vocabulary else draft_vocabulary(folder)  # as the server proposes
        shapes = [("chain", 0)] + [(f"tree of {rows}", int(rows)) for rows in args.tree_rows.split(",")]
        for window in windows:
            for shape, rows in shapes:
                verifications = unseen_verifications(loaded.engine.model, loaded.tokenizer, draft, tokens=args.tokens,
                                                     max_ctx=max_ctx, vocabulary=vocabulary,
                                                     eos_token_ids=loaded.engine.eos_token_ids, tree_rows=rows,
                                                     window=window, conversations=conversations)
                taus = {kind: acceptance_length(steps) for kind, steps in verifications.items()}
                mean = sum(taus.values()) / len(taus)
                print(f"| {folder} | {window or 'whole context'} | {shape} | "
                      + " | ".join(f"{taus[k]:.2f}" for k in UNSEEN_PROMPTS) + f" | {mean:.2f} |", flush=True)
                slots += [(f"{folder} ({shape}, window {window or 'whole context'})", kind,
                           slot_hit_rates(steps, draft.config.block_size - 1)) for kind, steps in verifications.items()]
    if args.slots:
        width = max(len(rates) for _, _, rates in slots)
        print("\nhit rate of each block slot, among the blocks right up to it:\n")
        print("| drafter | prompt type | " + " | ".join(f"slot {i}" for i in range(1, width + 1)) + " |")
        print("|---|---" + "|---" * width + "|")
        for folder, kind, rates in slots:
            print(f"| {folder} | {kind} | " + " | ".join("-" if r is None else f"{r:.2f}" for r in rates) + " |")


if __name__ == "__main__":
    main()
