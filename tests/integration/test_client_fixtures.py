"""Every captured real-client request in ../shared/fixtures/clients/ is accepted and answered with a
valid reply in its dialect, parsed by the official SDK of that dialect.

The small SDK requests go to the real server on the embedded model. Codex's and Claude Code's
requests are 11k and 22k tokens, minutes of prefill for the embedded model on a CPU, so they go
to a server that renders them with the embedded model's real chat template and tokenizer and
answers from the fake engine (scripted to call one of the client's own tools)."""

from __future__ import annotations

import inspect
import json
import threading
from functools import partial
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import trio
from transformers import AutoTokenizer
from websockets.sync.client import connect

from dflash.api import ModelText
from dflash.app import serve
from dflash.chat.template import chat_template_for
from dflash.config import Config, ModelConfig, ServerConfig
from dflash.engine.loading import DEFAULT_CACHE_DIR, EMBEDDED_DEFAULT, resolve_source
from tests.unit.fakes import VOCAB_SIZE, FakeDetokenizer, FakeEngine

FIXTURES = Path(__file__).parents[3] / "shared" / "fixtures" / "clients"
LARGE_CONTEXT = 32768


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def split_for(method, body: dict) -> dict:
    """The body as SDK keyword arguments: the parameters the method knows, the rest as extra_body."""
    known = set(inspect.signature(method).parameters)
    arguments = {key: value for key, value in body.items() if key in known and key != "stream"}
    extra = {key: value for key, value in body.items() if key not in known and key != "stream"}
    return {**arguments, "extra_body": extra} if extra else arguments


def client_headers(captured: dict, *names: str) -> dict[str, str]:
    return {key: value for key, value in captured["headers"] if key.lower() in names}


# ---- the small requests, on the real model -----------------------------------------------------

def test_openai_sdk_chat_request(server):
    base_url, _ = server
    captured = fixture("openai-sdk-request-1.json")
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="dummy-oa", max_retries=0, timeout=300)
    chunks = list(client.chat.completions.create(**split_for(client.chat.completions.create, captured["body"]),
                                                 stream=True, max_tokens=12))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] in ("stop", "length")


def test_openai_sdk_responses_request(server):
    base_url, _ = server
    captured = fixture("openai-sdk-request-2.json")
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="dummy-oa", max_retries=0, timeout=300)
    events = list(client.responses.create(**split_for(client.responses.create, captured["body"]), stream=True,
                                          max_output_tokens=12))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.model == "m"


def test_anthropic_sdk_request(server):
    base_url, _ = server
    captured = fixture("anthropic-sdk-request.json")
    client = anthropic.Anthropic(base_url=base_url, auth_token="dummy-an", api_key=None, max_retries=0, timeout=300,
                                 default_headers={"anthropic-version": "2026-10-21"})
    with client.messages.stream(**split_for(client.messages.create, captured["body"])) as stream:
        message = stream.get_final_message()
    assert message.model == "m" and message.stop_reason in ("max_tokens", "end_turn")
    assert message.usage.output_tokens >= 1


# ---- Codex and Claude Code, with the real template and the fake engine --------------------------

@pytest.fixture(scope="module")
def templated():
    """(base URL, fake engine, tokenizer) of a server with the embedded model's text side and a fake engine."""
    _, folder = resolve_source(EMBEDDED_DEFAULT, DEFAULT_CACHE_DIR)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = ModelText(model_id="smollm2-135m-instruct", max_ctx=LARGE_CONTEXT, template=chat_template_for(tokenizer),
                     new_detokenizer=FakeDetokenizer, token_bytes=lambda token_id: bytes([token_id % 256]),
                     vocab_size=VOCAB_SIZE)
    engine = FakeEngine(max_ctx=LARGE_CONTEXT, prefill_chunk=4096)
    config = Config(server=ServerConfig(port=0), model=ModelConfig(max_ctx=LARGE_CONTEXT))
    started: dict = {}
    ready = threading.Event()

    async def main():
        async with trio.open_nursery() as nursery:
            started["app"] = await nursery.start(partial(serve, config, loader=lambda _: (engine, text),
                                                         handle_signals=False))
            started["token"] = trio.lowlevel.current_trio_token()
            ready.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert ready.wait(60)
    yield f"http://127.0.0.1:{started['app'].port}", engine, tokenizer
    trio.from_thread.run_sync(started["app"].shutdown, trio_token=started["token"])
    thread.join(30)


def test_codex_request(templated):
    base_url, engine, _ = templated
    captured = fixture("codex-exec-0.171-responses-request.json")
    engine.reply = 'I will look.\n<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>'
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="dummy-local-key", max_retries=0, timeout=120)
    with client.responses.stream(**split_for(client.responses.create, captured["body"]),
                                 extra_headers=client_headers(captured, "x-codex-turn-metadata")) as stream:
        events = list(stream)
        response = stream.get_final_response()
    assert [item.type for item in response.output] == ["message", "function_call"]
    call = response.output[1]
    assert (call.name, json.loads(call.arguments)) == ("exec_command", {"cmd": "ls"})
    assert response.model == "smollm2-135m" and response.usage.input_tokens > 8000
    done_ids = [event.item.id for event in events if event.type == "response.output_item.done"]
    assert done_ids == [item.id for item in response.output]
    snapshot_at = engine.generations[-1].snapshot_at
    assert len(snapshot_at) == 3  # after the system turn (both developer messages) and each user turn
    catalog = httpx.get(f"{base_url}/v1/models?client_version=0.171.0").json()
    assert catalog["models"][0]["slug"] == "smollm2-135m-instruct"


def test_codex_websocket_handshake_and_request(templated):
    """Codex's own handshake headers open the socket; its captured request, sent as
    `response.create`, is answered with the same events as over SSE."""
    base_url, engine, _ = templated
    handshake = fixture("codex-exec-0.171-websocket-handshake.json")
    captured = fixture("codex-exec-0.171-responses-request.json")
    engine.reply = 'I will look.\n<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>'
    framing = {"host", "connection", "upgrade", "sec-websocket-version", "sec-websocket-key",
               "sec-websocket-extensions"}
    headers = [(key, value) for key, value in handshake["headers"] if key.lower() not in framing]
    url = base_url.replace("http://", "ws://") + handshake["path"]
    with connect(url, additional_headers=headers, proxy=None, max_size=2**26) as socket:
        socket.send(json.dumps({"type": "response.create", **captured["body"]}))
        events = []
        while not events or events[-1]["type"] not in ("response.completed", "response.failed", "error"):
            events.append(json.loads(socket.recv(timeout=120)))
    response = events[-1]["response"]
    assert [item["type"] for item in response["output"]] == ["message", "function_call"]
    assert response["usage"]["input_tokens"] > 8000
    assert [event["sequence_number"] for event in events] == list(range(len(events)))


def test_claude_code_request(templated):
    base_url, engine, tokenizer = templated
    captured = fixture("claude-code-2.1.197-messages-request.json")
    engine.reply = ('<tool_call>\n{"name": "Bash", "arguments": {"command": "echo hello", "timeout": "5000", '
                    '"description": "Say hello"}}\n</tool_call>')
    client = anthropic.Anthropic(base_url=base_url, api_key="dummy", max_retries=0, timeout=120)
    headers = client_headers(captured, "anthropic-beta", "anthropic-version")
    with client.messages.stream(**split_for(client.messages.create, captured["body"]), extra_query={"beta": "true"},
                                extra_headers=headers) as stream:
        message = stream.get_final_message()
    assert message.model == "claude-opus-4-8" and message.stop_reason == "tool_use"
    (tool_use,) = message.content
    # Typed by the tool's input_schema: Claude Code validates it.
    assert (tool_use.name, tool_use.input) == ("Bash", {"command": "echo hello", "timeout": 5000,
                                                        "description": "Say hello"})
    prompt = tokenizer.decode(engine.generations[-1].prompt_ids)
    # The per-request billing header is gone, so two requests of a session share their prefix.
    assert prompt.startswith("<|im_start|>system\nYou are a Claude agent, built on Anthropic's Claude Agent SDK.")
    assert "x-anthropic-billing-header" not in prompt and '"name": "Bash"' in prompt
    counted = client.messages.count_tokens(**split_for(client.messages.count_tokens, captured["body"]))
    assert counted.input_tokens == len(engine.generations[-1].prompt_ids)
