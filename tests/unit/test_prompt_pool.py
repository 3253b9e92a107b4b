"""The scaled prompt pool (prompt_pool.py): deterministic, mixed by the shares in every prefix, well
formed, large without repeats, and free of the unseen prompts and their code."""

import ast
import collections
import re

import pytest

from dflash.chat.template import builtin_tool_prompt
from dflash.training.prompt_pool import _TOOL_SETS, DEFAULT_SHARES, KINDS, scaled_conversations
from dflash.training.unseen import _INVENTORY, _PARSER, UNSEEN_PROMPTS


@pytest.fixture(scope="module")
def pool():
    return scaled_conversations(50_000)


def test_the_pool_is_the_same_for_a_seed_and_another_for_another_seed(pool):
    assert scaled_conversations(2000) == pool[:2000]  # a shorter pool is the longer one's prefix
    assert scaled_conversations(300, seed=1) == scaled_conversations(300, seed=1)
    other = scaled_conversations(300, seed=1)
    assert other != pool[:300]
    assert len({str(m) for _, m in other} & {str(m) for _, m in pool[:300]}) < 30


def test_every_prefix_mixes_the_kinds_by_their_shares(pool):
    assert KINDS == tuple(DEFAULT_SHARES)
    for prefix in (200, 2000):
        counts = collections.Counter(kind for kind, _ in pool[:prefix])
        for kind, share in DEFAULT_SHARES.items():
            assert abs(counts[kind] / prefix - share) < 0.03, (prefix, counts)
    only = scaled_conversations(50, shares={"chat": 1.0, "tool use": 1.0})
    assert {kind for kind, _ in only} == {"chat", "tool use"}
    with pytest.raises(ValueError):
        scaled_conversations(10, shares={"poetry": 1.0})


def test_every_conversation_is_a_list_of_message_dicts(pool):
    for kind, messages in pool:
        assert kind in KINDS
        assert messages and messages[-1]["role"] == "user"
        for message in messages:
            assert set(message) == {"role", "content"}
            assert message["role"] in ("system", "user", "assistant")
            assert isinstance(message["content"], str) and message["content"].strip()


def test_no_conversation_holds_an_unseen_prompt_or_its_code(pool):
    unseen = {m["content"] for conversations in UNSEEN_PROMPTS.values() for messages in conversations
              for m in messages if m["role"] == "user" and not m["content"].startswith("<tool_response>")}
    forbidden = sorted(unseen) + [_INVENTORY, _PARSER, "class Inventory", "def parse_duration"]
    for _, messages in pool:
        text = "\n".join(m["content"] for m in messages)
        assert not any(piece in text for piece in forbidden), text[:200]


def test_code_editing_asks_an_edit_of_real_code(pool):
    edits = [messages for kind, messages in pool[:3000] if kind == "code editing"]
    fenced = 0
    for messages in edits:
        assert len(messages) == 1
        instruction, _, code = messages[0]["content"].partition("\n\n")
        assert instruction and "\n" not in instruction
        if code.startswith("```python\n"):
            fenced += 1
            code = code.removeprefix("```python\n").removesuffix("```")
        tree = ast.parse(code)
        assert isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        assert 3 <= code.count("\n") <= 40
    assert 0.15 < fenced / len(edits) < 0.6
    instructions = {m[0]["content"].partition("\n\n")[0] for m in edits}
    assert len(instructions) > 100  # renames name real locals, so instructions vary past the templates
    assert any(re.match(r"Rename the variable `\w+` to `\w+`", i) for i in instructions)


def test_tool_use_starts_with_the_builtin_tool_prompt_and_calls_tools(pool):
    prompts = {builtin_tool_prompt(tools) for tools, _ in _TOOL_SETS}
    turns = [messages for kind, messages in pool[:3000] if kind == "tool use"]
    shapes = collections.Counter()
    for messages in turns:
        assert messages[0]["role"] == "system" and messages[0]["content"] in prompts
        assert messages[1]["role"] == "user" and not messages[1]["content"].startswith("<tool_response>")
        for call, result in zip(messages[2::2], messages[3::2]):
            assert call["role"] == "assistant" and call["content"].startswith("<tool_call>\n{")
            assert result["content"].startswith("<tool_response>\n") and result["content"].endswith("</tool_response>")
        shapes[len(messages)] += 1
    assert shapes[2] > 0.1 * len(turns) and shapes[4] > 0.4 * len(turns) and shapes[6] > 0
    assert len({m[0]["content"] for m in turns}) == len(_TOOL_SETS)
    assert sum("def " in m[-1]["content"] for m in turns if len(m) > 2) > 0.3 * len(turns)


def test_fifty_thousand_conversations_barely_repeat(pool):
    assert len(pool) == 50_000
    distinct = collections.defaultdict(set)
    for kind, messages in pool:
        distinct[kind].add(str(messages))
    # 49,999 distinct on Python 3.11: nothing repeats within a kind's supply
    assert sum(len(s) for s in distinct.values()) > 48_000
    for kind, conversations in distinct.items():
        assert len(conversations) > 0.95 * DEFAULT_SHARES[kind] * 50_000, kind
