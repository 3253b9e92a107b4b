"""Parsing and rendering of the OpenAI Chat Completions dialect (pure functions)."""

from __future__ import annotations

import json

import pytest

from dflash.protocols import openai_chat
from dflash.protocols.canonical import DEFAULT_MAX_TOKENS, Sampling, Usage
from dflash.protocols.errors import APIError, anthropic_error_body, openai_error_body


def parse(**fields):
    return openai_chat.parse_request(json.dumps(fields).encode())


def test_minimal_request_gets_the_defaults():
    request = parse(messages=[{"role": "user", "content": "hi"}])
    assert request.messages == [{"role": "user", "content": "hi"}]
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
    assert [m["content"] for m in request.messages] == ["look: there", ""]


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
    usage = Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=4, prefilled_tokens=6, prefill_ms=1.5,
                  decode_ms=2.25)
    body = openai_chat.render_completion(header, text="hi", finish_reason="stop", usage=usage)
    assert body["usage"] == {
        "prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 4},
        "timings": {"prompt_tokens": 10, "prefilled_tokens": 6, "cached_tokens": 4, "prefill_ms": 1.5,
                    "decode_ms": 2.25},
    }
