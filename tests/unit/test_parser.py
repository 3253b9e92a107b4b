"""chat/parser.py: reasoning, tool calls in every form, typed arguments, stop strings, and the
same result however the text is split into pieces."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from dflash.chat.parser import OutputParser
from dflash.protocols.canonical import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart, ToolSpec

WEATHER = ToolSpec("get_weather", parameters={"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "ratio": {"type": "number"}, "tags": {"type": "array"}, "note": {"type": ["string", "null"]}}})
PATCH = ToolSpec("apply_patch", kind="custom")
TOOLS = (WEATHER, PATCH)


def parse(pieces, **settings):
    parser = OutputParser(**{"tools": TOOLS, **settings})
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return summary(events), parser


def summary(events) -> list[tuple[str, str]]:
    """Events as (kind, text), text pieces joined and call ids left out."""
    out: list[tuple[str, str]] = []
    for event in events:
        if isinstance(event, (TextDelta, ReasoningDelta)):
            kind = "text" if isinstance(event, TextDelta) else "reasoning"
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + event.text)
            else:
                out.append((kind, event.text))
        elif isinstance(event, ToolCallStart):
            out.append(("call", f"{event.index}:{event.name}:{event.kind}"))
        elif isinstance(event, ToolCallDelta):
            out.append(("args", event.arguments))
        elif isinstance(event, ToolCallEnd):
            out.append(("end", event.call.arguments))
    return out


def by_char(text: str) -> list[str]:
    return list(text)


def test_plain_text_passes_through():
    assert parse(by_char("Hello, world!"))[0] == [("text", "Hello, world!")]


def test_reasoning_is_split_from_content():
    assert parse(by_char("<think>\nLet me think.\n</think>\n\nThe answer."))[0] == [
        ("reasoning", "Let me think."), ("text", "The answer.")]


def test_a_prompt_that_opened_think_starts_in_reasoning():
    assert parse(by_char("Hmm.</think>Yes."), starts_in_thinking=True)[0] == [("reasoning", "Hmm."), ("text", "Yes.")]


def test_a_repeated_think_tag_is_dropped():
    assert parse(by_char("<think>Hmm.</think>Yes."), starts_in_thinking=True)[0] == [
        ("reasoning", "Hmm."), ("text", "Yes.")]


def test_hermes_json_call_with_preamble():
    events, parser = parse(by_char('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                   '{"city": "Paris", "days": "3"}}\n</tool_call>'))
    assert events == [("text", "Sure."), ("call", "0:get_weather:function"), ("args", '{"city":"Paris","days":3}'),
                      ("end", '{"city":"Paris","days":3}')]
    assert parser.tool_calls[0].id.startswith("call_")


def test_qwen3_coder_xml_call_types_every_parameter_by_schema():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n4\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
            "<parameter=ratio>\n0.5\n</parameter>\n<parameter=tags>\n[\"a\"]\n</parameter>\n"
            "<parameter=note>\nnull\n</parameter>\n<parameter=extra>\n{\"k\": 1}\n</parameter>\n"
            "</function>\n</tool_call>")
    events, _ = parse(by_char(text))
    arguments = json.loads(events[-1][1])
    assert arguments == {"city": "New York", "days": 4, "metric": True, "ratio": 0.5, "tags": ["a"], "note": None,
                         "extra": {"k": 1}}


def test_bare_function_block_and_parallel_calls_keep_their_order():
    text = ('<function=get_weather><parameter=city>A</parameter></function>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "B"}}</tool_call>')
    events, parser = parse(by_char(text))
    assert [call.arguments for call in parser.tool_calls] == ['{"city":"A"}', '{"city":"B"}']
    assert [event for event in events if event[0] == "call"] == [("call", "0:get_weather:function"),
                                                                  ("call", "1:get_weather:function")]


def test_bare_json_call_at_the_start():
    events, parser = parse(by_char('{"name": "get_weather", "arguments": {"city": "Oslo"}}'))
    assert events[0] == ("call", "0:get_weather:function") and len(parser.tool_calls) == 1


def test_json_that_is_not_a_call_stays_text():
    assert parse(by_char('{"answer": 42}'))[0] == [("text", '{"answer": 42}')]


def test_a_call_that_does_not_parse_is_text_not_dropped():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> done'
    assert parse(by_char(text))[0] == [("text", text)]


def test_an_unknown_tool_is_text():
    text = '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
    assert parse(by_char(text))[0] == [("text", text)]


def test_an_unterminated_call_at_the_end_still_parses():
    events, _ = parse(by_char('<tool_call>{"name": "get_weather", "arguments": {"city": "X"}}'))
    assert events[0] == ("call", "0:get_weather:function")


def test_without_tools_tags_are_text():
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert parse(by_char(text), tools=())[0] == [("text", text)]


def test_custom_tool_call_carries_raw_input():
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    events, parser = parse(by_char(f'<tool_call>{json.dumps({"name": "apply_patch", "arguments": {"input": patch}})}'
                                   '</tool_call>'))
    assert events[0] == ("call", "0:apply_patch:custom")
    assert parser.tool_calls[0].arguments == patch and parser.tool_calls[0].kind == "custom"


def test_stop_string_cuts_exactly_and_ends_the_parse():
    events, parser = parse(["Hello wo", "rld and more"], stop=["world"])
    assert events == [("text", "Hello ")]
    assert parser.stop_sequence == "world" and parser.done
    assert parser.raw_text == "Hello "


def test_one_call_when_parallel_calls_are_off():
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "B"}}</tool_call>')
    events, parser = parse(by_char(text), parallel_tool_calls=False)
    assert len(parser.tool_calls) == 1 and parser.done
    assert parser.raw_text == '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'


def test_raw_text_is_everything_generated():
    text = "<think>x</think>Sure.\n<tool_call>{\"name\": \"get_weather\", \"arguments\": {}}</tool_call>"
    assert parse(by_char(text))[1].raw_text == text


SAMPLES = [
    "<think>\nplan\n</think>\n\nAnswer <b>bold</b> and </think> stray.",
    'Text.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n</tool_call>\ntail <tool',
    "<function=get_weather>\n<parameter=city>\nR\n</parameter>\n</function>\n</tool_call>",
    '  {"name": "get_weather", "arguments": {"days": 1}}  {"x": 1}',
    "Plain text with < and <t and <function and {braces}",
]


@given(st.sampled_from(SAMPLES), st.data())
def test_any_split_gives_the_same_result(text, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    whole, _ = parse([text])
    assert parse(pieces)[0] == whole


@given(st.text(max_size=60))
def test_plain_text_without_tags_is_unchanged(text):
    events, _ = parse(list(text), tools=())
    expected = text.lstrip()
    assert "".join(piece for kind, piece in events if kind == "text") == expected or "<think>" in text \
        or "</think>" in text


def test_an_announced_call_starts_when_its_name_is_read():
    parser = OutputParser(tools=TOOLS, announce_calls_early=True)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    name_read = text.index('",') + 2
    before = parser.feed(text[:name_read - 3])
    assert summary(before) == []
    started = parser.feed(text[name_read - 3:name_read])
    assert summary(started) == [("call", "0:get_weather:function")]
    rest = parser.feed(text[name_read:]) + parser.finish()
    assert summary(rest) == [("args", '{"city":"Oslo"}'), ("end", '{"city":"Oslo"}')]
    assert started[0].id == rest[-1].call.id == parser.tool_calls[0].id


def test_an_announced_call_in_the_xml_form_starts_at_its_tag_and_keeps_raw_input():
    text = "<tool_call>\n<function=apply_patch>\n<parameter=input>\n*** Begin\n</parameter>\n</function>\n</tool_call>"
    parser = OutputParser(tools=TOOLS, announce_calls_early=True)
    started = parser.feed(text[: text.index("<parameter")])
    assert summary(started) == [("call", "0:apply_patch:custom")]
    assert summary(parser.feed(text[len(text[: text.index("<parameter")]):]) + parser.finish()) == [
        ("args", "*** Begin"), ("end", "*** Begin")]


def test_an_announced_call_cut_short_still_ends_with_empty_arguments():
    events, parser = parse(by_char('<tool_call>\n{"name": "get_weather", "arguments": {"ci'), announce_calls_early=True)
    assert events == [("call", "0:get_weather:function"), ("args", "{}"), ("end", "{}")]
    assert len(parser.tool_calls) == 1


@given(st.lists(st.integers(min_value=1, max_value=len(SPLIT_TEXT := (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "x"}}\n</tool_call>'))), max_size=8))
def test_announced_calls_give_the_same_calls_however_the_text_is_split(cuts):
    bounds = sorted(set(cuts))
    pieces = [SPLIT_TEXT[a:b] for a, b in zip([0, *bounds], [*bounds, len(SPLIT_TEXT)])]
    early, _ = parse(pieces, announce_calls_early=True)
    late, _ = parse([SPLIT_TEXT])
    assert early == late
