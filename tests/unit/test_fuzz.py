"""Malformed and random request bodies for the three endpoints: always an answer in the dialect's
shape, a 4xx when the request is at fault, never a 500 or a hang.

The pure tests run many examples through the parsers and the prompt template (where a 500 would
come from); the live test sends fewer through the whole server on the fake engine."""

from __future__ import annotations

import json
import threading
from functools import partial

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.app import serve
from dflash.config import Config, ModelConfig, ServerConfig
from dflash.protocols import anthropic, openai_chat, responses
from dflash.protocols.errors import APIError
from tests.unit.fakes import FAKE_TEMPLATE, FakeEngine, fake_loader

JSON_LEAVES = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
               | st.text(max_size=12) | st.sampled_from(["user", "assistant", "system", "tool", "developer", "text",
                                                        "function", "tool_use", "tool_result", "message"]))
JSON = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8) | st.sampled_from(["type", "role", "content", "text",
                                                                              "name", "arguments"]), inner,
                                      max_size=4), max_leaves=12)

CHAT_FIELDS = ["model", "messages", "stream", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
               "seed", "frequency_penalty", "presence_penalty", "repetition_penalty", "rep_pen", "rep_window", "tools",
               "tool_choice", "parallel_tool_calls", "reasoning", "reasoning_effort", "chat_template_kwargs", "stop",
               "n", "logprobs", "top_logprobs", "response_format", "logit_bias", "user", "stream_options", "metadata"]
ANTHROPIC_FIELDS = ["model", "messages", "system", "stream", "max_tokens", "temperature", "top_p", "top_k", "seed",
                    "thinking", "tools", "tool_choice", "output_format", "stop_sequences", "metadata", "output_config"]
RESPONSES_FIELDS = ["model", "input", "instructions", "stream", "max_output_tokens", "temperature", "top_p", "seed",
                    "reasoning", "tools", "tool_choice", "parallel_tool_calls", "store", "include", "text",
                    "service_tier", "previous_response_id", "prompt_cache_key", "stop", "metadata"]

MESSAGE = st.fixed_dictionaries({"role": JSON_LEAVES, "content": JSON}, optional={
    "tool_calls": JSON, "tool_call_id": JSON_LEAVES, "reasoning_content": JSON_LEAVES})
BLOCK = st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image", "x"])},
                              optional={"text": JSON_LEAVES, "input": JSON, "content": JSON, "id": JSON_LEAVES,
                                        "tool_use_id": JSON_LEAVES, "name": JSON_LEAVES, "is_error": JSON_LEAVES})
ANTHROPIC_MESSAGE = st.fixed_dictionaries({"role": JSON_LEAVES, "content": JSON_LEAVES | st.lists(BLOCK, max_size=3)})
ITEM = st.fixed_dictionaries({"type": st.sampled_from(["message", "function_call", "function_call_output",
                                                       "custom_tool_call", "reasoning", "local_shell_call", "other"])},
                             optional={"role": JSON_LEAVES, "content": JSON, "call_id": JSON_LEAVES,
                                       "name": JSON_LEAVES, "arguments": JSON_LEAVES, "output": JSON,
                                       "summary": JSON, "input": JSON_LEAVES})
TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "custom", "namespace", "web_search", None])},
                             optional={"name": JSON_LEAVES, "function": JSON, "parameters": JSON, "tools": JSON,
                                       "input_schema": JSON, "format": JSON})


def bodies(names: list[str], conversation_field: str, conversation) -> st.SearchStrategy[dict]:
    """A body that is mostly well-formed where it matters, with random values in random fields."""
    return st.builds(lambda base, extra: {**base, **extra},
                     st.fixed_dictionaries({conversation_field: conversation}, optional={"tools": st.lists(TOOL)}),
                     st.dictionaries(st.sampled_from(names), JSON, max_size=4))


CHAT_BODIES = bodies(CHAT_FIELDS, "messages", st.lists(MESSAGE, max_size=3) | JSON)
ANTHROPIC_BODIES = bodies(ANTHROPIC_FIELDS, "messages", st.lists(ANTHROPIC_MESSAGE, max_size=3) | JSON)
RESPONSES_BODIES = bodies(RESPONSES_FIELDS, "input", st.lists(ITEM, max_size=3) | JSON)
PARSERS = {"chat": openai_chat.parse_request, "anthropic": anthropic.parse_request,
           "responses": lambda body: responses.parse_request(body).generation}


def parse_and_render(dialect: str, body: bytes) -> None:
    try:
        request = PARSERS[dialect](body)
    except APIError as error:
        assert 400 <= error.status < 500
        return
    FAKE_TEMPLATE.render(request)  # any exception here would be a 400 from the API; none is expected


@settings(max_examples=150, deadline=None)
@given(CHAT_BODIES)
def test_chat_parser_answers_every_body(body):
    parse_and_render("chat", json.dumps(body).encode())


@settings(max_examples=150, deadline=None)
@given(ANTHROPIC_BODIES)
def test_anthropic_parser_answers_every_body(body):
    parse_and_render("anthropic", json.dumps(body).encode())


@settings(max_examples=150, deadline=None)
@given(RESPONSES_BODIES)
def test_responses_parser_answers_every_body(body):
    parse_and_render("responses", json.dumps(body).encode())


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(list(PARSERS)), st.binary(max_size=64) | st.builds(lambda v: json.dumps(v).encode(), JSON))
def test_garbage_is_a_400(dialect, body):
    parse_and_render(dialect, body)


ENDPOINTS = {"/v1/chat/completions": CHAT_BODIES, "/v1/messages": ANTHROPIC_BODIES, "/v1/responses": RESPONSES_BODIES,
             "/v1/messages/count_tokens": ANTHROPIC_BODIES}


@pytest.fixture(scope="module")
def live_port():
    """The fake-engine server in a thread of its own, shared by every example of the live test."""
    engine = FakeEngine(reply="Hi.", max_ctx=4096)
    config = Config(server=ServerConfig(port=0), model=ModelConfig(max_ctx=engine.max_ctx))
    started: dict = {}
    ready = threading.Event()

    async def main():
        async with trio.open_nursery() as nursery:
            started["app"] = await nursery.start(partial(serve, config, loader=fake_loader(engine),
                                                         handle_signals=False))
            started["token"] = trio.lowlevel.current_trio_token()
            ready.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert ready.wait(30)
    yield started["app"].port
    trio.from_thread.run_sync(started["app"].shutdown, trio_token=started["token"])
    thread.join(30)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_live_server_never_fails_or_hangs(live_port, data):
    path = data.draw(st.sampled_from(list(ENDPOINTS)))
    body = data.draw(ENDPOINTS[path])
    if data.draw(st.booleans()):
        body["stream"] = True
    reply = httpx.post(f"http://127.0.0.1:{live_port}{path}", content=json.dumps(body).encode(), timeout=10,
                       headers={"content-type": "application/json"})
    assert reply.status_code in (200, 400), (reply.status_code, reply.text[:300])
    if reply.status_code == 200:
        return
    error = reply.json()
    if path.startswith("/v1/messages"):
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    else:
        assert set(error["error"]) == {"message", "type", "param", "code"}
