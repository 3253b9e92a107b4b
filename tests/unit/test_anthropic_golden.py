"""Anthropic Messages golden sequences on the fake engine (streaming and not), history with
tool_use / tool_result / thinking blocks, count_tokens, auth headers and error shapes."""

from __future__ import annotations

import json

import pytest

from dflash.protocols import anthropic
from dflash.protocols.canonical import Message, ToolCall, ToolChoice
from dflash.protocols.errors import APIError
from tests.unit.dialects import (ONE_CALL, PLAIN, REASONING, STOPPED, TWO_CALLS, WEATHER_TOOL, merged, post,
                                 post_stream)
from tests.unit.fakes import FakeEngine

MESSAGES = "/v1/messages"
TOOLS = [{"name": WEATHER_TOOL["name"], "description": WEATHER_TOOL["description"],
          "input_schema": WEATHER_TOOL["parameters"]}]


def body(**fields) -> dict:
    return {"model": "claude-opus-4-8", "max_tokens": 1000, "messages": [{"role": "user", "content": "hi"}], **fields}


def signatures(events) -> list[str]:
    out = []
    for name, data in events:
        assert data["type"] == name  # every payload repeats its event name
        if name == "content_block_start":
            block = data["content_block"]
            out.append(f"start{data['index']}:{block['type']}" + (f":{block['name']}" if "name" in block else ""))
        elif name == "content_block_delta":
            delta = data["delta"]
            if delta["type"] == "text_delta":
                out.append(f"text:{delta['text']}")
            elif delta["type"] == "thinking_delta":
                out.append(f"thinking:{delta['thinking']}")
            else:
                out.append(f"args:{delta['partial_json']}")
        elif name == "content_block_stop":
            out.append(f"stop{data['index']}")
        elif name == "message_delta":
            out.append(f"message_delta:{data['delta']['stop_reason']}:{data['delta']['stop_sequence']}")
        elif name == "error":
            out.append(f"error:{data['error']['type']}")
        else:
            out.append(name)
    return merged(out)


CASES = {
    "plain": (PLAIN, {}, ["message_start", "ping", "start0:text", "text:Hello there.", "stop0",
                          "message_delta:end_turn:None", "message_stop"],
              [{"type": "text", "text": "Hello there."}], "end_turn"),
    "reasoning": (REASONING, {"thinking": {"type": "enabled", "budget_tokens": 1024}},
                  ["message_start", "ping", "start0:thinking", "thinking:The user greets me.", "stop0",
                   "start1:text", "text:Hello there.", "stop1", "message_delta:end_turn:None", "message_stop"],
                  [{"type": "thinking", "thinking": "The user greets me.", "signature": ""},
                   {"type": "text", "text": "Hello there."}], "end_turn"),
    "one tool call": (ONE_CALL, {"tools": TOOLS},
                      ["message_start", "ping", "start0:text", "text:Checking.", "stop0",
                       "start1:tool_use:get_weather", 'args:{"city":"Paris","days":2}', "stop1",
                       "message_delta:tool_use:None", "message_stop"],
                      [{"type": "text", "text": "Checking."},
                       {"type": "tool_use", "id": "ID", "name": "get_weather", "input": {"city": "Paris", "days": 2}}],
                      "tool_use"),
    "two tool calls": (TWO_CALLS, {"tools": TOOLS},
                       ["message_start", "ping", "start0:tool_use:get_weather", 'args:{"city":"Paris"}', "stop0",
                        "start1:tool_use:get_weather", 'args:{"city":"Rome"}', "stop1",
                        "message_delta:tool_use:None", "message_stop"],
                       [{"type": "tool_use", "id": "ID", "name": "get_weather", "input": {"city": "Paris"}},
                        {"type": "tool_use", "id": "ID", "name": "get_weather", "input": {"city": "Rome"}}],
                       "tool_use"),
    "stop sequence": (STOPPED, {"stop_sequences": ["STOP"]},
                      ["message_start", "ping", "start0:text", "text:Hello there. ", "stop0",
                       "message_delta:stop_sequence:STOP", "message_stop"],
                      [{"type": "text", "text": "Hello there. "}], "stop_sequence"),
    "max tokens": (PLAIN, {"max_tokens": 5},
                   ["message_start", "ping", "start0:text", "text:Hello", "stop0", "message_delta:max_tokens:None",
                    "message_stop"],
                   [{"type": "text", "text": "Hello"}], "max_tokens"),
}


def _without_ids(content: list[dict]) -> list[dict]:
    for block in content:
        if block["type"] == "tool_use":
            assert block["id"].startswith("toolu_")
            block["id"] = "ID"
    return content


@pytest.mark.parametrize("case", CASES)
async def test_stream_golden(start_server, case):
    reply, fields, expected, _, _ = CASES[case]
    served = await start_server(FakeEngine(reply=reply))
    events = await post_stream(served.port, MESSAGES, body(**fields))
    assert signatures(events) == expected
    start = events[0][1]["message"]
    assert start["model"] == "claude-opus-4-8" and start["id"].startswith("msg_") and start["content"] == []
    usage = [data for name, data in events if name == "message_delta"][0]["usage"]
    assert usage["output_tokens"] > 0 and usage["cache_read_input_tokens"] == 0
    assert usage["input_tokens"] == usage["timings"]["prompt_tokens"]


@pytest.mark.parametrize("case", CASES)
async def test_body_golden(start_server, case):
    reply, fields, _, content, stop_reason = CASES[case]
    served = await start_server(FakeEngine(reply=reply))
    answer = (await post(served.port, MESSAGES, body(**fields))).json()
    assert (answer["type"], answer["role"], answer["model"]) == ("message", "assistant", "claude-opus-4-8")
    assert _without_ids(answer["content"]) == content
    assert answer["stop_reason"] == stop_reason
    assert answer["stop_sequence"] == ("STOP" if case == "stop sequence" else None)
    assert set(answer["usage"]) >= {"input_tokens", "output_tokens", "cache_read_input_tokens", "timings"}


async def test_error_before_streaming_has_the_anthropic_shape(start_server):
    served = await start_server()
    reply = await post(served.port, MESSAGES, body(stream=True, messages=[{"role": "robot", "content": "x"}]))
    assert reply.status == 400
    assert reply.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "'messages[0].role' must be one of user, assistant, system, "
                                                    'got "robot"'}}


async def test_error_after_streaming_began_is_an_error_event(start_server):
    served = await start_server(FakeEngine(fail_on_step=4, prefill_chunk=4096))
    events = await post_stream(served.port, MESSAGES, body())
    assert signatures(events) == ["message_start", "ping", "start0:text", "text:He", "error:api_error"]


async def test_a_prompt_longer_than_the_context_is_a_400_in_anthropic_shape(start_server):
    served = await start_server(FakeEngine(max_ctx=64))
    reply = await post(served.port, MESSAGES, body(messages=[{"role": "user", "content": "x" * 100}]))
    assert reply.status == 400
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert reply.json()["error"]["message"].startswith("This model's maximum context length is 64 tokens.")


async def test_missing_max_tokens_is_not_an_error_and_x_api_key_works(start_server):
    served = await start_server(api_keys=("sekret",))
    fields = body()
    del fields["max_tokens"]
    reply = await post(served.port, MESSAGES, fields, headers=[("x-api-key", "sekret"),
                                                             ("anthropic-version", "2023-06-01")])
    assert reply.status == 200
    reply = await post(served.port, MESSAGES, fields, headers=[("authorization", "Bearer sekret"),
                                                             ("anthropic-version", "2099-01-01")])
    assert reply.status == 200
    refused = await post(served.port, MESSAGES, fields)
    assert refused.status == 401 and refused.json()["error"]["type"] == "authentication_error"


async def test_count_tokens_counts_the_rendered_prompt(start_server):
    served = await start_server()
    fields = {"model": "m", "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    counted = (await post(served.port, "/v1/messages/count_tokens?beta=true", fields)).json()
    await post(served.port, MESSAGES, {**fields, "max_tokens": 3})
    assert counted == {"input_tokens": len(served.engine.generations[0].prompt_ids)}
    bad = await post(served.port, "/v1/messages/count_tokens", {"messages": "nope"})
    assert bad.status == 400 and bad.json()["type"] == "error"


async def test_tool_loop_history_replays_the_generated_turn(start_server):
    served = await start_server(FakeEngine(reply=ONE_CALL))
    first = (await post(served.port, MESSAGES, body(tools=TOOLS))).json()
    tool_use = first["content"][1]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first["content"]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use["id"],
                                             "content": [{"type": "text", "text": "sunny"}]},
                                            {"type": "text", "text": "thanks"}]}]
    await post(served.port, MESSAGES, body(messages=history, tools=TOOLS))
    prompt = bytes(served.engine.generations[1].prompt_ids).decode()
    assert f"<|im_start|>assistant\n{ONE_CALL}<|im_end|>\n" in prompt
    assert "<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>user\nthanks<|im_end|>" in prompt


def parse(**fields):
    return anthropic.parse_request(json.dumps({"max_tokens": 10, **fields}).encode())


def test_claude_code_shapes_parse():
    request = parse(
        system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=1;"},
                {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "go", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Agents: a, b"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "plan", "signature": "sig"},
                {"type": "text", "text": "Running."},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "boom",
                                          "is_error": True}, {"type": "image", "source": {}}]}],
        tools=[{"name": "Bash", "input_schema": {"type": "object"}},
               {"type": "web_search_20250305", "name": "web_search"}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking={"type": "adaptive"}, metadata={"user_id": "u"}, output_config={"effort": "high"},
        context_management={"edits": []})
    assert request.messages == (
        Message("system", "x-anthropic-billing-header: cc_version=2; cch=1;\nYou are Claude Code."),
        Message("user", "go"), Message("system", "Agents: a, b"),
        Message("assistant", "Running.", reasoning="plan",
                tool_calls=(ToolCall("toolu_1", "Bash", '{"command": "ls"}'),)),
        Message("tool", "Error: boom", tool_call_id="toolu_1"))
    assert [tool.name for tool in request.tools] == ["Bash"]
    assert request.tool_choice == ToolChoice("required") and request.parallel_tool_calls is False
    assert request.thinking.enabled is None and request.thinking.effort == "high"
    assert request.metadata == {"user_id": "u"}


def test_thinking_types():
    hello = [{"role": "user", "content": "x"}]
    assert parse(messages=hello, thinking={"type": "enabled", "budget_tokens": 99}).thinking.budget_tokens == 99
    assert parse(messages=hello, thinking={"type": "disabled"}).thinking.enabled is False
    for bad in ({"thinking": {"type": "sometimes"}}, {"system": 5}, {"stop_sequences": "END"},
                {"tool_choice": {"type": "tool"}}, {"messages": [{"role": "user", "content": [{"text": "x"}]}]}):
        with pytest.raises(APIError) as caught:
            parse(**{"messages": [{"role": "user", "content": "x"}], **bad})
        assert caught.value.status == 400
