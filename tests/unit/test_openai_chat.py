"""Parsing and rendering of the OpenAI Chat Completions dialect (pure functions)."""

from __future__ import annotations

import json

import pytest

from dflash.protocols import openai_chat
from dflash.protocols.canonical import (DEFAULT_MAX_TOKENS, Finished, Message, Sampling, TextDelta, ToolCall,
                                        ToolChoice, ToolSpec, Usage)
from dflash.protocols.errors import APIError, anthropic_error_body, openai_error_body


def parse(**fields):
    return openai_chat.parse_request(json.dumps(fields).encode())


def test_minimal_request_gets_the_defaults():
    request = parse(messages=[{"role": "user", "content": "hi"}])
    assert request.messages == (Message("user", "hi"),)
    assert request.sampling == Sampling()
    assert request.max_tokens == DEFAULT_MAX_TOKENS
    assert request.stop == () and request.stream is False and request.model is None


def test_fields_are_read_and_null_means_default():
    request = parse(model="m", messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                    temperature=0.7, top_p=0.9, seed=42, stop="###", stream=True, max_tokens=None,
                    max_completion_tokens=77, stream_options={"include_usage": True}, tools=[], n=1)
    assert request.model == "m"
    assert request.sampling == Sampling(temperature=0.7, top_p=0.9, seed=42)
    assert request.stop == ("###",)
    assert request.max_tokens == 77
    assert request.stream and request.include_usage


def test_content_parts_keep_text_and_drop_images():
    request = parse(messages=[{"role": "user", "content": [
        {"type": "text", "text": "look: "}, {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "text", "text": "there"}]}, {"role": "assistant", "content": None}])
    assert [m.content for m in request.messages] == ["look: there", ""]


@pytest.mark.parametrize("fields, param, shown", [
    ({"messages": None}, "messages", None),
    ({"messages": "hi"}, "messages", '"hi"'),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "5"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "null"),
    ({"temperature": -1}, "temperature", "-1"),
    ({"top_p": 2}, "top_p", "2"),
    ({"seed": "7"}, "seed", '"7"'),
    ({"max_tokens": True}, "max_tokens", "true"),
    ({"stop": 3}, "stop", "3"),
])
def test_bad_fields_name_the_param_and_value(fields, param, shown):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(APIError) as caught:
        openai_chat.parse_request(json.dumps(body).encode())
    assert caught.value.status == 400
    assert caught.value.param == param
    if shown is not None:
        assert caught.value.message.endswith(f"got {shown}")


def test_not_json_and_not_an_object():
    for body in (b"{", b"[1]", b"\xff"):
        with pytest.raises(APIError) as caught:
            openai_chat.parse_request(body)
        assert caught.value.status == 400


def test_error_bodies_per_dialect():
    error = APIError(401, "invalid or missing API key")
    assert openai_error_body(error) == {"error": {"message": "invalid or missing API key",
                                                  "type": "invalid_request_error", "param": None,
                                                  "code": "invalid_api_key"}}
    assert anthropic_error_body(error) == {"type": "error", "error": {"type": "authentication_error",
                                                                      "message": "invalid or missing API key"}}


def test_usage_carries_timings():
    header = openai_chat.CompletionHeader(id="chatcmpl-1", created=1, model="m")
    request = parse(messages=[{"role": "user", "content": "hi"}])
    render = openai_chat.ChatCompletionRender(header, request)
    usage = Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=4, prefilled_tokens=6, prefill_ms=1.5,
                  decode_ms=2.25, draft_tokens=4, accepted_tokens=2, verification_steps=2,
                  compressed_from_tokens=25, scoring_ms=3.5)
    render.opening()
    render.events(TextDelta("hi"))
    render.events(Finished("stop", usage))
    body = render.body()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert body["usage"] == {
        "prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 4},
        "timings": {"prompt_tokens": 10, "agent_turn_cache_hit": False, "cached_prefix_tokens": 4, "prefilled_tokens": 6, "prefill_ms": 1.5,
                    "decode_ms": 2.25, "draft_tokens": 4, "accepted_tokens": 2, "acceptance_length": 2.0,
                    "compressed_from_tokens": 25, "scoring_ms": 3.5},
    }


def test_sampling_fields_and_their_aliases():
    request = parse(messages=[{"role": "user", "content": "hi"}], top_k=40, rep_pen=1.1, frequency_penalty=-2,
                    presence_penalty=2, rep_window=64, logit_bias={"5": -100, "7": 2.5})
    assert request.sampling == Sampling(top_k=40, repetition_penalty=1.1, frequency_penalty=-2.0,
                                        presence_penalty=2.0, rep_window=64, logit_bias={5: -100.0, 7: 2.5})


@pytest.mark.parametrize("fields, param", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"n": 0}, "n"),
    ({"logit_bias": {"x": 1}}, "logit_bias.x"),
    ({"logit_bias": {"3": 101}}, "logit_bias.3"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
])
def test_out_of_range_values_are_refused(fields, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(APIError) as caught:
        openai_chat.parse_request(json.dumps(body).encode())
    assert (caught.value.status, caught.value.param) == (400, param)


def test_history_with_tool_calls_reasoning_and_results():
    request = parse(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "need a tool",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"c":"P"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ], tools=[{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}],
        tool_choice={"type": "function", "function": {"name": "w"}}, parallel_tool_calls=False,
        reasoning_effort="high", user="u1")
    assert request.messages == (
        Message("system", "be brief"), Message("user", "weather?"),
        Message("assistant", "", reasoning="need a tool", tool_calls=(ToolCall("call_1", "w", '{"c":"P"}'),)),
        Message("tool", "sunny", tool_call_id="call_1"))
    assert request.tools == (ToolSpec("w", parameters={"type": "object"}),)
    assert request.tool_choice == ToolChoice("required", "w")
    assert request.parallel_tool_calls is False
    assert request.thinking.enabled is True and request.thinking.effort == "high"
    assert request.metadata == {"user": "u1"}


def test_thinking_switch_order():
    def thinking(**fields):
        return parse(messages=[{"role": "user", "content": "hi"}], **fields).thinking

    assert thinking().enabled is None
    assert thinking(reasoning_effort="none").enabled is False
    assert thinking(reasoning={"effort": "low"}, reasoning_effort="none").enabled is True
    assert thinking(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}).enabled is False
    assert thinking(chat_template_kwargs={"preserve_thinking": True}).preserve is True


@pytest.mark.parametrize("status", [429, 500, 503])
def test_an_error_in_the_stream_has_the_type_and_code_of_the_error_body(status):
    from dflash.protocols import responses

    error = APIError(status, "refused")
    before = openai_error_body(error)["error"]
    render = openai_chat.ChatCompletionRender(openai_chat.CompletionHeader("chatcmpl-1", 0, "m"), parse(
        messages=[{"role": "user", "content": "hi"}]))
    render.opening()
    (_, in_stream), done = render.failure(error)
    assert in_stream == {"error": before} and done == (None, "[DONE]")
    response = responses.ResponseRender(responses.parse_request(b'{"input": "hi"}'), model="m", created_at=0)
    response.opening()
    [(_, failed)] = response.failure(error)
    assert failed["response"]["error"] == {"code": before["code"] or before["type"], "message": "refused"}
