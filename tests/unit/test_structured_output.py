"""Structured output through the three dialects on the fake engine: the grammar reaches the engine,
an invalid schema or an impossible tool_choice is a 400 in the dialect's shape before anything
streams, and tool_choice none hides the tools. (Replies that follow the grammar: tests/integration.)"""

from __future__ import annotations

import pytest

from tests.unit.dialects import ONE_CALL, WEATHER_TOOL, post
from tests.unit.fakes import FakeEngine

BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": "m", "messages": USER, **fields}


def messages(**fields) -> tuple[str, dict]:
    return "/v1/messages", {"model": "m", "max_tokens": 500, "messages": USER, **fields}


def responses(**fields) -> tuple[str, dict]:
    return "/v1/responses", {"model": "m", "input": "hi", "store": False, **fields}


ANTHROPIC_TOOL = {"name": WEATHER_TOOL["name"], "input_schema": WEATHER_TOOL["parameters"]}
RESPONSES_TOOL = {"type": "function", **WEATHER_TOOL}

BAD_SCHEMAS = {
    "chat": chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}),
    "anthropic": messages(output_format={"type": "json_schema", "schema": BAD_SCHEMA}),
    "anthropic-output-config": messages(output_config={"format": {"type": "json_schema", "schema": BAD_SCHEMA}}),
    "responses": responses(text={"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}),
}
WHERE = {"chat": "response_format.json_schema.schema", "anthropic": "output_format.schema",
         "anthropic-output-config": "output_config.format.schema", "responses": "text.format.schema"}


def error_of(path: str, body: dict) -> str:
    """The error message, checked to be in the dialect's shape."""
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


@pytest.mark.parametrize("case", list(BAD_SCHEMAS))
@pytest.mark.parametrize("stream", [False, True])
async def test_an_invalid_schema_is_a_400_naming_the_field_before_anything_streams(start_server, case, stream):
    served = await start_server()
    path, body = BAD_SCHEMAS[case]
    reply = await post(served.port, path, {**body, "stream": stream})
    assert reply.status == 400
    assert reply.headers["content-type"].startswith("application/json")
    message = error_of(path, reply.json())
    assert WHERE[case] in message and "nonsense" in message
    assert served.engine.generations == []


@pytest.mark.parametrize("path, body", [
    chat(tools=[{"type": "function", "function": WEATHER_TOOL}], tool_choice={"type": "function",
                                                                              "function": {"name": "nope"}}),
    messages(tools=[ANTHROPIC_TOOL], tool_choice={"type": "tool", "name": "nope"}),
    responses(tools=[RESPONSES_TOOL], tool_choice={"type": "function", "name": "nope"}),
    chat(tool_choice="required"),
    messages(tool_choice={"type": "any"}),
])
async def test_a_tool_choice_that_cannot_be_met_is_a_400(start_server, path, body):
    served = await start_server()
    reply = await post(served.port, path, body)
    assert reply.status == 400
    assert "tool_choice" in error_of(path, reply.json())


async def test_an_invalid_custom_tool_grammar_is_a_400_naming_the_tool(start_server):
    served = await start_server()
    tool = {"type": "custom", "name": "apply_patch",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: ("}}
    reply = await post(served.port, *responses(tools=[tool], tool_choice="required"))
    assert reply.status == 400
    assert "the lark grammar of tool 'apply_patch'" in error_of("/v1/responses", reply.json())


@pytest.mark.parametrize("path, body", [
    chat(response_format={"type": "json_object"}),
    chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}),
    messages(output_format={"type": "json_schema", "schema": SCHEMA}),
    responses(text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}),
])
async def test_the_format_reaches_the_engine_as_a_grammar(start_server, path, body):
    served = await start_server(FakeEngine(reply='{"n":1}'))
    reply = await post(served.port, path, body)
    assert reply.status == 200
    [generation] = served.engine.generations
    assert generation.grammar is not None and "%json" in generation.grammar


async def test_free_requests_have_no_grammar(start_server):
    served = await start_server()
    assert (await post(served.port, *chat())).status == 200
    assert served.engine.generations[0].grammar is None


@pytest.mark.parametrize("path, body, finish", [
    (*chat(tools=[{"type": "function", "function": WEATHER_TOOL}], tool_choice="required"), "tool_calls"),
    (*messages(tools=[ANTHROPIC_TOOL], tool_choice={"type": "tool", "name": "get_weather"}), "tool_use"),
    (*responses(tools=[RESPONSES_TOOL], tool_choice="required"), None),
])
async def test_a_forced_call_is_constrained_and_ends_the_turn_as_a_call(start_server, path, body, finish):
    served = await start_server(FakeEngine(reply=ONE_CALL))
    reply = await post(served.port, path, body)
    assert reply.status == 200
    grammar = served.engine.generations[0].grammar
    assert "<tool_call>" in grammar and "get_weather" in grammar
    result = reply.json()
    if path == "/v1/chat/completions":
        assert result["choices"][0]["finish_reason"] == finish
    elif path == "/v1/messages":
        assert result["stop_reason"] == finish
    else:
        assert [item["type"] for item in result["output"]][-1] == "function_call"


async def test_tool_choice_none_hides_the_tools_and_reads_calls_as_text(start_server):
    served = await start_server(FakeEngine(reply=ONE_CALL))
    reply = await post(served.port, *chat(tools=[{"type": "function", "function": WEATHER_TOOL}], tool_choice="none"))
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert "<tool_call>" in choice["message"]["content"]
    prompt = bytes(served.engine.generations[0].prompt_ids).decode()
    assert "get_weather" not in prompt
