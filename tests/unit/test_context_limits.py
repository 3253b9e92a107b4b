"""A prompt that fits with a max_tokens that does not is served up to the room left, in every
dialect (Claude Code always asks for 32000); only a prompt that alone does not fit is refused,
in the dialect's error shape, before anything streams."""

from __future__ import annotations

import pytest

from tests.unit.dialects import post
from tests.unit.fakes import FakeEngine, prompt_tokens

ROOM = 3


def anthropic_body(content: str, **fields) -> dict:
    return {"model": "claude", "max_tokens": 32000, "messages": [{"role": "user", "content": content}], **fields}


def responses_body(content: str, **fields) -> dict:
    return {"model": "gpt-codex", "input": [{"role": "user", "content": content}], "max_output_tokens": 32000,
            **fields}


async def test_anthropic_max_tokens_past_the_room_left_ends_with_max_tokens(start_server):
    served = await start_server(FakeEngine(max_ctx=prompt_tokens("hi") + ROOM))
    reply = (await post(served.port, "/v1/messages", anthropic_body("hi"))).json()
    assert reply["stop_reason"] == "max_tokens" and reply["usage"]["output_tokens"] == ROOM


async def test_responses_max_output_tokens_past_the_room_left_is_incomplete(start_server):
    served = await start_server(FakeEngine(max_ctx=prompt_tokens("hi") + ROOM))
    reply = (await post(served.port, "/v1/responses", responses_body("hi"))).json()
    assert reply["status"] == "incomplete" and reply["incomplete_details"] == {"reason": "max_output_tokens"}
    assert reply["usage"]["output_tokens"] == ROOM


@pytest.mark.parametrize("stream", [False, True])
async def test_an_anthropic_prompt_that_does_not_fit_is_a_400_in_anthropics_shape(start_server, stream):
    served = await start_server(FakeEngine(max_ctx=64))
    reply = await post(served.port, "/v1/messages", anthropic_body("x" * 100, stream=stream))
    assert reply.status == 400 and reply.headers["content-type"] == "application/json"
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "maximum context length is 64 tokens" in body["error"]["message"]
    assert not served.engine.generations


@pytest.mark.parametrize("stream", [False, True])
async def test_a_responses_prompt_that_does_not_fit_says_context_length_exceeded(start_server, stream):
    served = await start_server(FakeEngine(max_ctx=64))
    reply = await post(served.port, "/v1/responses", responses_body("x" * 100, stream=stream))
    assert reply.status == 400
    assert reply.json()["error"]["code"] == "context_length_exceeded"  # Codex shows its own message for it
    assert not served.engine.generations
