"""OpenAI Responses golden sequences on the fake engine (streaming and not), Codex's item and tool
shapes, custom tools, store / GET / previous_response_id, and error shapes."""

from __future__ import annotations

import json

import pytest

from dflash.protocols import responses
from dflash.protocols.canonical import Message, ToolCall
from dflash.protocols.errors import APIError
from tests.unit.dialects import (ONE_CALL, PLAIN, REASONING, STOPPED, TWO_CALLS, WEATHER_TOOL, merged, post,
                                 post_stream)
from tests.unit.fakes import FakeEngine
from tests.unit.rawhttp import request

RESPONSES = "/v1/responses"
TOOLS = [{"type": "function", **WEATHER_TOOL}]


def body(**fields) -> dict:
    return {"model": "gpt-codex", "input": "hi", **fields}


def signatures(events) -> list[str]:
    out = []
    for name, data in events:
        assert data["type"] == name
        kind = name.removeprefix("response.")
        if kind in ("output_item.added", "output_item.done"):
            out.append(f"{kind}:{data['output_index']}:{data['item']['type']}")
        elif kind == "output_text.delta":
            out.append(f"text:{data['delta']}")
        elif kind in ("reasoning_summary_text.delta", "reasoning_text.delta"):
            out.append(f"reasoning:{data['delta']}")
        elif kind in ("function_call_arguments.delta", "custom_tool_call_input.delta"):
            out.append(f"args:{data['delta']}")
        else:
            out.append(kind)
    return merged(out)


MESSAGE_OPEN = ["output_item.added:0:message", "content_part.added"]
MESSAGE_CLOSE = ["output_text.done", "content_part.done", "output_item.done:0:message"]


def call_events(index: int, arguments: str) -> list[str]:
    return [f"output_item.added:{index}:function_call", f"args:{arguments}", "function_call_arguments.done",
            f"output_item.done:{index}:function_call"]


CASES = {
    "plain": (PLAIN, {}, ["created", "in_progress", *MESSAGE_OPEN, "text:Hello there.", *MESSAGE_CLOSE,
                          "completed"], "completed"),
    "reasoning": (REASONING, {"reasoning": {"effort": "high", "summary": "auto"}},
                  ["created", "in_progress", "output_item.added:0:reasoning", "reasoning_summary_part.added",
                   "reasoning:The user greets me.", "reasoning_summary_text.done", "reasoning_summary_part.done",
                   "output_item.done:0:reasoning", "output_item.added:1:message", "content_part.added",
                   "text:Hello there.", "output_text.done", "content_part.done", "output_item.done:1:message",
                   "completed"], "completed"),
    "one tool call": (ONE_CALL, {"tools": TOOLS},
                      ["created", "in_progress", *MESSAGE_OPEN, "text:Checking.", *MESSAGE_CLOSE,
                       *call_events(1, '{"city":"Paris","days":2}'), "completed"], "completed"),
    "two tool calls": (TWO_CALLS, {"tools": TOOLS},
                       ["created", "in_progress", *MESSAGE_OPEN, *MESSAGE_CLOSE, *call_events(1, '{"city":"Paris"}'),
                        *call_events(2, '{"city":"Rome"}'), "completed"], "completed"),
    "stop sequence": (STOPPED, {"stop": ["STOP"]},
                      ["created", "in_progress", *MESSAGE_OPEN, "text:Hello there. ", *MESSAGE_CLOSE, "completed"],
                      "completed"),
    "max tokens": (PLAIN, {"max_output_tokens": 5},
                   ["created", "in_progress", *MESSAGE_OPEN, "text:Hello", *MESSAGE_CLOSE, "incomplete"],
                   "incomplete"),
}


@pytest.mark.parametrize("case", CASES)
async def test_stream_golden(start_server, case):
    reply, fields, expected, status = CASES[case]
    served = await start_server(FakeEngine(reply=reply))
    events = await post_stream(served.port, RESPONSES, body(**fields))
    assert signatures(events) == expected
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    final = events[-1][1]["response"]
    assert final["status"] == status and final["model"] == "gpt-codex"
    assert final["id"] == events[0][1]["response"]["id"]
    # Item ids in the stream are the ids of the final response.
    done_items = [data["item"] for name, data in events if name == "response.output_item.done"]
    assert done_items == final["output"]
    added_ids = [data["item"]["id"] for name, data in events if name == "response.output_item.added"]
    assert added_ids == [item["id"] for item in final["output"]]
    usage = final["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"] == {"cached_tokens": 0} and "timings" in usage
    if status == "incomplete":
        assert final["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize("case", CASES)
async def test_body_golden(start_server, case):
    reply, fields, expected, status = CASES[case]
    served = await start_server(FakeEngine(reply=reply))
    answer = (await post(served.port, RESPONSES, body(**fields))).json()
    assert answer["object"] == "response" and answer["status"] == status
    stream_items = [event.split(":")[2] for event in expected if event.startswith("output_item.done")]
    assert [item["type"] for item in answer["output"]] == stream_items
    calls = [item for item in answer["output"] if item["type"] == "function_call"]
    assert all(call["call_id"].startswith("call_") and call["id"].startswith("fc_") for call in calls)
    assert [json.loads(call["arguments"]) for call in calls] == {
        "one tool call": [{"city": "Paris", "days": 2}],
        "two tool calls": [{"city": "Paris"}, {"city": "Rome"}]}.get(case, [])


async def test_reasoning_without_summary_is_reasoning_text(start_server):
    served = await start_server(FakeEngine(reply=REASONING))
    events = await post_stream(served.port, RESPONSES, body())
    assert signatures(events)[2:5] == ["output_item.added:0:reasoning", "content_part.added",
                                       "reasoning:The user greets me."]
    assert events[-1][1]["response"]["output"][0]["content"] == [{"type": "reasoning_text",
                                                                   "text": "The user greets me."}]


async def test_custom_tool_call_comes_back_as_custom_tool_call_with_raw_input(start_server):
    patch = "*** Begin Patch\n*** End Patch"
    reply = f'<tool_call>{json.dumps({"name": "apply_patch", "arguments": {"input": patch}})}</tool_call>'
    served = await start_server(FakeEngine(reply=reply))
    tools = [{"type": "custom", "name": "apply_patch", "description": "Apply a patch",
              "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
             {"type": "web_search", "external_web_access": False}, {"type": "local_shell"}]
    events = await post_stream(served.port, RESPONSES, body(tools=tools))
    assert signatures(events)[-5:] == ["output_item.added:1:custom_tool_call", f"args:{patch}",
                                       "custom_tool_call_input.done", "output_item.done:1:custom_tool_call",
                                       "completed"]
    item = events[-1][1]["response"]["output"][1]
    assert (item["type"], item["name"], item["input"]) == ("custom_tool_call", "apply_patch", patch)
    prompt = bytes(served.engine.generations[0].prompt_ids).decode()
    assert '"name": "apply_patch"' in prompt and "start: /.+/" in prompt and "web_search" not in prompt


async def test_namespace_tools_are_flattened_and_the_call_names_its_namespace(start_server):
    reply = '<tool_call>{"name": "close_agent", "arguments": {"id": "a1"}}</tool_call>'
    served = await start_server(FakeEngine(reply=reply))
    tools = [{"type": "namespace", "name": "multi_agent_v1", "description": "agents", "tools": [
        {"type": "function", "name": "close_agent", "parameters": {"type": "object",
                                                                   "properties": {"id": {"type": "string"}}}}]}]
    answer = (await post(served.port, RESPONSES, body(tools=tools))).json()
    call = answer["output"][1]
    assert (call["name"], call["namespace"], call["arguments"]) == ("close_agent", "multi_agent_v1", '{"id":"a1"}')


async def test_store_get_and_previous_response_id(start_server):
    served = await start_server(FakeEngine(reply=PLAIN))
    first = (await post(served.port, RESPONSES, body(instructions="Be brief."))).json()
    fetched = await request(served.port, "GET", f"{RESPONSES}/{first['id']}")
    assert fetched.status == 200 and fetched.json() == first
    second = (await post(served.port, RESPONSES, body(input="and again?", previous_response_id=first["id"],
                                                      instructions="Be terse."))).json()
    # The earlier turns carry over, the earlier instructions do not.
    prompt = bytes(served.engine.generations[1].prompt_ids).decode()
    assert prompt.startswith("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                             f"<|im_start|>assistant\n{PLAIN}<|im_end|>\n<|im_start|>user\nand again?<|im_end|>")
    await post(served.port, RESPONSES, body(input="third", previous_response_id=second["id"]))
    prompt = bytes(served.engine.generations[2].prompt_ids).decode()
    assert "Be terse." not in prompt and prompt.count(f"<|im_start|>assistant\n{PLAIN}<|im_end|>") == 2
    unstored = (await post(served.port, RESPONSES, body(store=False))).json()
    missing = await request(served.port, "GET", f"{RESPONSES}/{unstored['id']}")
    assert missing.status == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    unknown = await post(served.port, RESPONSES, body(previous_response_id="resp_nope"))
    assert unknown.status == 404 and unknown.json()["error"]["param"] == "previous_response_id"


async def test_tool_follow_up_replays_the_turn_once(start_server):
    served = await start_server(FakeEngine(reply=TWO_CALLS))
    first = (await post(served.port, RESPONSES, body(tools=TOOLS))).json()
    follow_up = [{"role": "user", "content": "hi"}, *first["output"],
                 *({"type": "function_call_output", "call_id": item["call_id"], "output": "sunny"}
                   for item in first["output"] if item["type"] == "function_call")]
    await post(served.port, RESPONSES, body(input=follow_up, tools=TOOLS))
    prompt = bytes(served.engine.generations[1].prompt_ids).decode()
    assert prompt.count(TWO_CALLS) == 1
    assert f"<|im_start|>assistant\n{TWO_CALLS}<|im_end|>\n<|im_start|>user\n<tool_response>" in prompt


async def test_errors_before_and_after_streaming(start_server):
    served = await start_server(FakeEngine(fail_on_step=4, prefill_chunk=4096))
    refused = await post(served.port, RESPONSES, body(input=[{"type": "message", "role": "wizard", "content": "x"}]))
    assert refused.status == 400 and refused.json()["error"]["param"] == "input[0].role"
    events = await post_stream(served.port, RESPONSES, body())
    assert signatures(events) == ["created", "in_progress", *MESSAGE_OPEN, "text:He", *MESSAGE_CLOSE, "failed"]
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and "fake engine failure" in failed["error"]["message"]


async def test_codex_models_catalog(start_server):
    served = await start_server()
    catalog = (await request(served.port, "GET", "/v1/models?client_version=0.171.0")).json()
    assert catalog["models"][0]["slug"] == "fake-model" and catalog["data"][0]["id"] == "fake-model"
    plain = (await request(served.port, "GET", "/v1/models")).json()
    assert "models" not in plain


def parse(**fields):
    return responses.parse_request(json.dumps(fields).encode())


def test_codex_input_items_normalize_to_turns():
    request = parse(input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "do it"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}], "encrypted_content": "xx"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "function_call", "call_id": "c1", "name": "exec", "arguments": '{"cmd":"ls"}'},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "done"}]},
        {"type": "web_search_call", "id": "ws1"}, {"type": "compaction", "encrypted_content": "zz"}],
        instructions="sys", parallel_tool_calls=True, store=False, include=["reasoning.encrypted_content"],
        service_tier="default", prompt_cache_key="k", client_metadata={"a": 1}, reasoning={"summary": "auto"})
    assert request.generation.messages == (
        Message("system", "sys"), Message("system", "rules"), Message("user", "do it"),
        Message("assistant", "ok", reasoning="think", tool_calls=(
            ToolCall("c1", "exec", '{"cmd":"ls"}'), ToolCall("c2", "apply_patch", "*** Begin Patch", "custom"))),
        Message("tool", "a.txt", tool_call_id="c1"), Message("tool", "done", tool_call_id="c2"))
    assert request.store is False and request.include == ("reasoning.encrypted_content",)


def test_bad_inputs():
    for fields in ({"input": 5}, {"input": [{"type": "message", "role": "user", "content": 7}]},
                   {"input": "x", "text": {"format": {"type": "yaml"}}}, {"input": "x", "include": [1]},
                   {"input": "x", "max_output_tokens": 0}, {}):
        with pytest.raises(APIError) as caught:
            parse(**fields)
        assert caught.value.status == 400
