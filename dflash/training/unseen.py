"""The fixed prompts a drafter's acceptance is measured on: none of them, nor their code, comes from
the training data (the built-in prompt set and the corpus draw on the standard library; these are
written here), so the number says what a user's unseen prompt gets.

`unseen_acceptance` decodes each prompt greedily with the drafter proposing a full block every step
(no adaptive policy) and reports τ, tokens committed per verification, per prompt type;
`slot_hit_rates` says where in the block the drafts fail.
"""

from __future__ import annotations

import json
from typing import Sequence

import torch

from dflash.chat.template import builtin_call_text, builtin_tool_prompt, render_prompt
from dflash.engine.drafters.dflash import CONTEXT_WINDOW
from dflash.protocols.canonical import ToolCall, ToolSpec

_INVENTORY = '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise ValueError(f"not enough {name}")
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())
'''
_PARSER = '''def parse_duration(text):
    units = {"s": 1, "m": 60, "h": 3600}
    number, unit = text[:-1], text[-1]
    if unit not in units:
        raise ValueError(f"unknown unit {unit}")
    return int(number) * units[unit]
'''
_TOOLS = [
    ToolSpec("read_file", "Read a file.", {"type": "object", "properties": {"path": {"type": "string"}},
                                           "required": ["path"]}),
    ToolSpec("shell", "Run a command.", {"type": "object", "properties": {"cmd": {"type": "string"}},
                                         "required": ["cmd"]}),
]


def _tool_turn(ask: str, path: str, content: str) -> list[dict]:
    call = builtin_call_text(ToolCall(id="", name="read_file", arguments=json.dumps({"path": path})))
    return [{"role": "system", "content": builtin_tool_prompt(_TOOLS)}, {"role": "user", "content": ask},
            {"role": "assistant", "content": call},
            {"role": "user", "content": f"<tool_response>\n{content}</tool_response>"}]


UNSEEN_PROMPTS: dict[str, list[list[dict]]] = {
    "chat": [[{"role": "user", "content": text}] for text in (
        "How do I stay focused when working from home?",
        "What is the difference between weather and climate?",
        "Give me three ideas for a short weekend trip.",
    )],
    "coding": [[{"role": "user", "content": text}] for text in (
        "Write a Python function that merges two sorted lists into one sorted list.",
        "Write a Python class for a stack with push, pop and peek.",
        "Write a Python function that counts the vowels in a string.",
    )],
    "code editing": [[{"role": "user", "content": text}] for text in (
        f"Rename the method `total` to `count_all` and print the whole class again:\n\n{_INVENTORY}",
        f"Add type hints to this function and show the complete function:\n\n{_PARSER}",
        f"Add a docstring to every method and show the complete class:\n\n{_INVENTORY}",
    )],
    "tool use": [
        _tool_turn("Fix the bug in inventory.py: remove() should accept removing all items.", "inventory.py",
                   _INVENTORY),
        _tool_turn("Add support for days ('d') to parse_duration in duration.py.", "duration.py", _PARSER),
        [{"role": "system", "content": builtin_tool_prompt(_TOOLS)},
         {"role": "user", "content": "List the files of the repository, then run its tests."}],
    ],
}


def unseen_acceptance(target, tokenizer, draft, tokens: int = 48, max_ctx: int = 2048,
                      eos_token_ids: Sequence[int] = ()) -> dict[str, float]:
    """Mean τ per prompt type for `draft` (a DFlashDraftModel) on the target; the draft is not changed."""
    verifications = unseen_verifications(target, tokenizer, draft, tokens, max_ctx, eos_token_ids=eos_token_ids)
    return {kind: acceptance_length(steps) for kind, steps in verifications.items()}


def acceptance_length(steps: list[tuple[int, int]]) -> float:
    """τ, tokens committed per verification, of (proposed, accepted) verification steps."""
    return round((sum(accepted for _, accepted in steps) + len(steps)) / max(len(steps), 1), 3)


def slot_hit_rates(steps: list[tuple[int, int]], slots: int) -> list[float | None]:
    """For slots 1..`slots`: the share of verifications that proposed the slot and accepted it, among
    those that accepted every slot before it (None where none did). Slot 1 is where τ starts."""
    rates = []
    for slot in range(1, slots + 1):
        reached = [accepted for proposed, accepted in steps if proposed >= slot and accepted >= slot - 1]
        rates.append(round(sum(accepted >= slot for accepted in reached) / len(reached), 3) if reached else None)
    return rates


def full_block_engine(target, draft, max_ctx: int = 2048, vocabulary: Sequence[int] | None = None,
                      eos_token_ids: Sequence[int] = (), tree_rows: int = 0, window: int | None = CONTEXT_WINDOW):
    """An Engine on `target` whose DFlash drafter (`draft`, proposing from `vocabulary`'s ids where
    given) drafts a full block at every step, with no adaptive policy: what τ is measured with.
    Its drafter (`engine.dflash_drafter`) holds the target's captured rows of what it decoded.
    `tree_rows` > 0: each step verifies a tree of that many rows (speculative.DraftTree, as served)
    instead of the chain of the drafter's first choices (0: what training measures). `window`: the
    drafter's context window (drafters/dflash.py CONTEXT_WINDOW, as served; None: the whole context)."""
    from dflash.engine.drafters.dflash import DFlashDrafter
    from dflash.engine.generate import Engine
    from dflash.engine.speculative import SpeculationConfig

    config = SpeculationConfig(drafter="dflash", max_draft_tokens=draft.config.block_size - 1, adaptive=False,
                               tree_rows=tree_rows)
    return Engine(target, max_ctx=max_ctx, speculation=config, eos_token_ids=eos_token_ids,
                  dflash_drafter=DFlashDrafter(draft, target, max_ctx, vocabulary, window=window))


def unseen_verifications(target, tokenizer, draft, tokens: int = 48, max_ctx: int = 2048,
                         vocabulary: Sequence[int] | None = None,
                         eos_token_ids: Sequence[int] = (), tree_rows: int = 0, window: int | None = CONTEXT_WINDOW,
                         conversations: dict[str, list[list[dict]]] | None = None) -> dict[str, list[tuple[int, int]]]:
    """Per prompt type, every verification step's (drafts proposed, drafts accepted), decoding each
    prompt greedily with `draft` proposing a full block every step (from `vocabulary`'s ids only,
    where given: a draft vocabulary); the draft is not changed.

    A reply ends at `tokens` or at one of `eos_token_ids` (the model's end-of-turn tokens), as a
    server's does. Why: decoded past the end, the model writes a new turn of its own (a system
    header, a made-up user ask) that no client sees, and the drafter's misses there counted against
    it (a code edit that ended after 50 tokens spent 12 of its 45 verifications past its end).
    `conversations`: other conversations per prompt type than UNSEEN_PROMPTS (bench/unseen_acceptance.py
    puts a long system prompt before them)."""
    from dflash.engine.sampling import SamplingParams

    was_training = draft.training
    draft.eval()
    engine = full_block_engine(target, draft, max_ctx, vocabulary, eos_token_ids, tree_rows, window)
    result: dict[str, list[tuple[int, int]]] = {}
    try:
        with torch.no_grad():
            for kind, kind_conversations in (conversations or UNSEEN_PROMPTS).items():
                steps = result[kind] = []
                for messages in kind_conversations:
                    # The live state keeps what this prompt shares with the last (a long system
                    # prompt: computed once, not per prompt); the rest is computed afresh.
                    generation = engine.start(render_prompt(tokenizer, messages), SamplingParams(), tokens)
                    stats = generation.stats
                    while generation.finished is None:
                        before = (stats.verification_steps, stats.draft_tokens, stats.accepted_tokens)
                        generation.step()
                        if stats.verification_steps > before[0]:
                            steps.append((stats.draft_tokens - before[1], stats.accepted_tokens - before[2]))
                    generation.close()
    finally:
        draft.train(was_training)
    return result
