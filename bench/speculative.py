"""Speculative decoding on the embedded model: plain vs n-gram vs DFlash vs auto, greedy.

For (a) code-editing prompts whose answer repeats the input, (b) ordinary chat questions, (c)
coding tasks and (d) agent turns with tools — none of them in the drafter's training set — prints
decode tok/s, mean acceptance length τ and the ratio to plain decoding, and checks that every mode's
output is identical to plain greedy decoding.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/speculative.py [--draft DIR] [--weights auto]
        [--prompts chat] [--rounds 3]   # modes interleaved over rounds, averaged
        [--paired --rounds 40]          # each prompt in every mode back to back: a ratio ± its error

Without --draft, DFlash runs a random-weight drafter (it shows the cost of drafting, not its gain).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import attrs  # noqa: E402
import torch  # noqa: E402

from dflash.chat.template import render_prompt  # noqa: E402
from dflash.engine.drafters.dflash import (  # noqa: E402
    DFlashConfig,
    DFlashDrafter,
    build_target_layer_ids,
    random_draft_model,
)
from dflash.engine.cpu import cpu_kind  # noqa: E402
from dflash.engine.loading import EMBEDDED_DEFAULT, KV_CACHES, draft_vocabulary, load_model, serving_draft  # noqa: E402
from dflash.engine.sampling import SamplingParams  # noqa: E402
from dflash.engine.speculative import SpeculationConfig  # noqa: E402
from dflash.training.unseen import UNSEEN_PROMPTS  # noqa: E402

CODE = '''def load_users(path):
    users = []
    with open(path) as handle:
        for line in handle:
            name, email, age = line.strip().split(",")
            users.append({"name": name, "email": email, "age": int(age)})
    return users


def adults(users):
    return [user for user in users if user["age"] >= 18]
'''
CODE_EDITING = [
    f"Rename the function `adults` to `grown_ups` and print the whole file again:\n\n{CODE}",
    f"Add a docstring to each function and show the complete updated code:\n\n{CODE}",
]
CHAT = [
    "What are three good habits for a software engineer?",
    "Explain what a hash table is in two sentences.",
]
CODING = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that checks whether a string is a palindrome.",
]


def run(engine, prompt_ids, tokens):
    generation = engine.start(prompt_ids, SamplingParams(), max_tokens=tokens)
    generation.run()
    s = generation.stats
    return generation.output, len(generation.output) / max(s.decode_ms / 1000, 1e-9), s.acceptance_length


def round_rates(runs: list, rounds: int) -> list[float]:
    """A mode's mean decode rate in each round (its runs are in round order, as many each round)."""
    per = len(runs) // rounds
    return [statistics.mean(r[1] for r in runs[i * per : (i + 1) * per]) for i in range(rounds)]


def ratio_spread(ratios: list[float]) -> str:
    """The middle half of the rounds' ratios to plain: a mode and plain measured in the same round
    ran minutes apart at most, so on a VM whose speed drifts this says how far one run's ratio can
    be trusted (with fewer than 4 rounds: their range)."""
    ordered = sorted(ratios)
    if len(ordered) < 4:
        return f"{ordered[0]:.2f}–{ordered[-1]:.2f}"
    q = statistics.quantiles(ordered, n=4)
    return f"{q[0]:.2f}–{q[2]:.2f}"


def paired_ratio(runs: list, baseline: list) -> str:
    """The geometric mean of each run's rate over plain's run of the same prompt in the same round
    (the lists hold their runs in the same order), ± one standard error. Why: the VM's speed drifts
    by ±8% over minutes, and a mode's mean over plain's could not tell a 2% loss from none; paired
    runs (--paired: seconds apart) and the error say how far the ratio can be trusted."""
    logs = [math.log(r[1] / b[1]) for r, b in zip(runs, baseline)]
    mean = math.exp(statistics.mean(logs))
    if len(logs) < 2:
        return f"{mean:.3f}"
    return f"{mean:.3f} ± {mean * statistics.stdev(logs) / math.sqrt(len(logs)):.3f}"


def with_system(messages: list[dict], tokens: int) -> list[dict]:
    """The conversation after ~`tokens` tokens of the captured Claude Code request (its own system
    message, if any, after it): its system prompt (~1.5K tokens), then its 24 tool definitions as
    JSON (~64K characters more), the bulk of that client's ~20K-token first prompt; cut at ~4
    characters a token. Before session 39 it stopped at the system prompt."""
    from agent_loop import FIXTURE, conversation_start

    system, _ = conversation_start(tokens)
    if len(system) < tokens * 4:
        request = json.loads(FIXTURE.read_text())
        tools = json.dumps(request.get("body", request)["tools"], indent=1)
        system = (system + "\n\n# Tools\n\n" + tools)[: tokens * 4]
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": system + "\n\n" + messages[0]["content"]}] + messages[1:]
    return [{"role": "system", "content": system}] + messages


def add_context_arguments(parser: argparse.ArgumentParser) -> None:
    """--max-ctx, --rope-attention-factor and --rope-scaling-static: the target's context and its YaRN
    (also bench/unseen_acceptance.py)."""
    parser.add_argument("--max-ctx", type=int, default=0,
                        help="the target's context (0: 2048 + 2 x --system-tokens); past the model's trained context "
                             "the target runs with YaRN, as the default set-up (examples/default.toml, 32768) does")
    parser.add_argument("--rope-attention-factor", type=float, default=0.0,
                        help="[model] rope_attention_factor: YaRN's attention factor where --max-ctx makes the target "
                             "scaled (0: YaRN's own, 0.1 ln(factor) + 1; 1: YaRN's frequencies without its temperature)")
    parser.add_argument("--rope-scaling-static", action="store_true",
                        help="[model] rope_scaling_static: the target's YaRN at every position, not only past its "
                             "trained context (the default set-up before session 39)")


def target_context(args: argparse.Namespace) -> int:
    """--max-ctx, or room for the prompts after --system-tokens (a token is ~4 characters of the
    system prompt, at most 2 here)."""
    return args.max_ctx or 2048 + 2 * args.system_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_DEFAULT)
    parser.add_argument("--draft", help="a DFlash checkpoint folder for the target")
    parser.add_argument("--weights", default="auto", help="auto, bf16, fp32, int8, int4")
    parser.add_argument("--kv-cache", default="auto", choices=KV_CACHES, help="[model] kv_cache")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every mode this many times, interleaved, and average (steadier on a shared VM)")
    parser.add_argument("--tree-rows", type=int, help="rows of DFlash's draft trees ([speculative] tree_rows)")
    parser.add_argument("--chain", action="store_true",
                        help="also DFlash's modes with chains of its first choices (the default verifies trees)")
    parser.add_argument("--interleave", action="store_true",
                        help="the sets' prompts take turns within each mode's round (chat, coding, chat, ...), "
                             "as a server's replies may, instead of each set's rounds one after another")
    parser.add_argument("--paired", action="store_true",
                        help="each prompt runs in every mode back to back (the order rotating by round), so that "
                             "each run is compared with plain's run of the same prompt seconds apart, not minutes")
    parser.add_argument("--modes", help="which modes to run, comma-separated (default: all); plain always runs, first, "
                                        "as the baseline. Fewer modes put a mode's runs closer to plain's on a VM "
                                        "whose speed drifts")
    parser.add_argument("--system-tokens", type=int, default=0,
                        help="put the captured Claude Code system prompt, cut to about this many tokens, before every "
                             "conversation (as bench/agent_loop.py does): drafts verified deep in a context, as an "
                             "agent's are")
    add_context_arguments(parser)
    parser.add_argument("--prompts", default="code editing,chat,coding",
                        help="which prompt sets: code editing, chat, coding, tool use (agent turns with the built-in "
                             "tool prompt, from dflash/training/unseen.py)")
    args = parser.parse_args()
    # Loaded as a server would be: where it would not speculate (speculation_off: a verified row
    # could differ from a decoded one on this CPU with these weights) there is nothing to measure.
    max_ctx = target_context(args)
    loaded = load_model(args.model, weights=args.weights, max_ctx=max_ctx, threads=args.threads, kv_cache=args.kv_cache,
                        rope_attention_factor=args.rope_attention_factor, rope_scaling_static=args.rope_scaling_static,
                        speculation=SpeculationConfig(drafter="ngram"))
    if loaded.engine.speculation.drafter == "none":
        raise SystemExit(f"a server with weights {loaded.weights!r} on this CPU ({cpu_kind()}) does not speculate "
                         "(see the speculation_off log line); try --weights int4 or int8")
    args.dtype = loaded.dtype
    engine = loaded.engine
    target = engine.model
    if args.draft:
        draft = serving_draft(args.draft, args.dtype, loaded.weights)  # as the server runs it
    else:
        layers = target.args.num_layers
        draft = random_draft_model(
            DFlashConfig(hidden_size=target.args.hidden_size, intermediate_size=2 * target.args.hidden_size,
                         num_layers=1, num_heads=target.args.num_heads, num_kv_heads=target.args.num_kv_heads,
                         head_dim=target.args.head_dim, block_size=8, mask_token_id=0,
                         target_layer_ids=tuple(build_target_layer_ids(layers, 2)), num_target_layers=layers,
                         vocab_size=target.args.vocab_size),
            dtype=getattr(torch, args.dtype),
        )
    drafter = DFlashDrafter(draft, target, max_ctx, draft_vocabulary(args.draft) if args.draft else None)  # as served
    block = draft.config.block_size - 1
    rows = args.tree_rows or SpeculationConfig().tree_rows
    modes = {
        "plain": (SpeculationConfig(), None),
        "ngram": (SpeculationConfig(drafter="ngram", max_draft_tokens=8), None),
        "dflash": (SpeculationConfig(drafter="dflash", max_draft_tokens=block, tree_rows=rows), drafter),
        "dflash, fixed block": (SpeculationConfig(drafter="dflash", max_draft_tokens=block, adaptive=False, tree_rows=rows),
                                drafter),
        "auto": (SpeculationConfig(drafter="auto", max_draft_tokens=block, tree_rows=rows), drafter),
    }
    if args.chain:  # DFlash's modes again, proposing the chain of its first choices instead of a tree
        modes |= {f"{mode} (chain)": (attrs.evolve(config, tree_rows=0), mode_drafter)
                  for mode, (config, mode_drafter) in list(modes.items()) if mode_drafter is not None}
    if args.modes:
        wanted = ["plain"] + [mode.strip() for mode in args.modes.split(",") if mode.strip() != "plain"]
        unknown = [mode for mode in wanted if mode not in modes]
        if unknown:
            raise SystemExit(f"--modes: unknown {unknown}; the modes are {list(modes)}")
        modes = {mode: modes[mode] for mode in wanted}
    print(f"\ncpu={cpu_kind()} model={args.model} weights={loaded.weights} kv={loaded.kv_cache} threads={args.threads} tokens={args.tokens} "
          f"system_tokens={args.system_tokens} max_ctx={max_ctx} rope_scaling={engine.model.args.rope_scaling} "
          f"draft={'random weights' if not args.draft else args.draft} tree_rows={rows}")
    print("| prompts | mode | decode tok/s | τ | vs plain | per round: middle half | paired vs plain, ± 1 s.e. | identical |")
    print("|---|---|---|---|---|---|---|---|")
    user = lambda prompts: [[{"role": "user", "content": p}] for p in prompts]  # noqa: E731
    sets = {"code editing": ("(a) code editing", user(CODE_EDITING)), "chat": ("(b) chat", user(CHAT)),
            "coding": ("(c) coding", user(CODING)), "tool use": ("(d) tool use", UNSEEN_PROMPTS["tool use"])}
    chosen = [sets[name] for name in args.prompts.split(",")]
    if args.system_tokens:
        chosen = [(label, [with_system(messages, args.system_tokens) for messages in conversations])
                  for label, conversations in chosen]
    ids = {label: [render_prompt(loaded.tokenizer, messages) for messages in conversations]
           for label, conversations in chosen}
    results: dict[str, dict[str, list]] = {label: {mode: [] for mode in modes} for label, _ in chosen}
    order = list(modes)
    def run_in(mode: str, label: str, i: int) -> None:
        engine.speculation, engine.dflash_drafter = modes[mode]
        engine.rollback(0)
        results[label][mode].append(run(engine, ids[label][i], args.tokens))

    # Each set's rounds one after another; or (--interleave) the sets' prompts taking turns within
    # each mode's round: chat, coding, chat, coding... as a server's replies may, so that what one
    # reply's policy learned (SpeculationMemory) meets the next reply's other text. Within a round,
    # each mode's prompts in turn, or (--paired) each prompt's modes in turn; either way each mode's
    # runs are in the same order (round, prompt), which paired_ratio relies on.
    for labels in ([[label for label, _ in chosen]] if args.interleave else [[label] for label, _ in chosen]):
        prompts = [(i, label) for i in range(max(len(ids[label]) for label in labels)) for label in labels
                   if i < len(ids[label])]
        for round_ in range(args.rounds):  # modes interleaved: a shared machine's load changes over minutes
            # Each round starts one mode later, so that no mode always runs right after the same
            # one (auto ran after the fixed-block DFlash mode, the heaviest, in every round).
            rotated = order[round_ % len(order):] + order[: round_ % len(order)]
            if args.paired:
                for i, label in prompts:
                    for mode in rotated:
                        run_in(mode, label, i)
            else:
                for mode in rotated:
                    for i, label in prompts:
                        run_in(mode, label, i)
        for label in labels:  # each set's rows as soon as they are measured
            baseline_rate, baseline_out, baseline_rounds = None, None, None
            baseline_runs = results[label]["plain"]
            for mode, runs in results[label].items():
                outputs = [r[0] for r in runs]
                rate = statistics.mean(r[1] for r in runs)
                tau = statistics.mean(r[2] for r in runs)
                per_round = round_rates(runs, args.rounds)
                if baseline_rate is None:
                    baseline_rate, baseline_out, baseline_rounds = rate, outputs, per_round
                same = "yes" if outputs == baseline_out else "NO"
                spread = ratio_spread([r / b for r, b in zip(per_round, baseline_rounds)])
                paired = paired_ratio(runs, baseline_runs) if mode != "plain" else "1"
                print(f"| {label} | {mode} | {rate:.1f} | {tau:.2f} | {rate / baseline_rate:.2f}x | {spread} | {paired} | {same} |",
                      flush=True)
    engine.speculation, engine.dflash_drafter = attrs.evolve(SpeculationConfig()), None


if __name__ == "__main__":
    main()
