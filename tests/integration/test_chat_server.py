"""The real server (`python -m dflash.cli run`) on the embedded model, driven over loopback by httpx
and the official `openai` SDK. Replies are kept short: the point is the wire, not the prose."""

from __future__ import annotations

import json
import time

import httpx
import openai

MESSAGES = [{"role": "user", "content": "Name a colour."}]


def test_httpx_non_streaming(server):
    base_url, model_id = server
    reply = httpx.post(f"{base_url}/v1/chat/completions", timeout=120,
                       json={"model": "whatever-name", "messages": MESSAGES, "max_tokens": 8})
    assert reply.status_code == 200
    body = reply.json()
    assert body["model"] == "whatever-name"
    assert body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert 0 < usage["completion_tokens"] <= 8
    assert usage["timings"]["prompt_tokens"] == usage["prompt_tokens"] > 0
    assert usage["timings"]["prefill_ms"] > 0


def test_httpx_streaming_ends_with_done(server):
    base_url, _ = server
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", timeout=120,
                      json={"messages": MESSAGES, "max_tokens": 8, "stream": True}) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        data = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(item) for item in data[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)


def test_openai_sdk_non_streaming_and_greedy_is_repeatable(server):
    base_url, model_id = server
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert model_id in [model.id for model in client.models.list()]
    first, second = (client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=8,
                                                    temperature=0) for _ in range(2))
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.usage.prompt_tokens > 0 and first.usage.completion_tokens > 0
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens


def test_openai_sdk_streaming(server):
    base_url, model_id = server
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens > 0


def test_a_dropped_stream_leaves_the_server_ready(server):
    base_url, _ = server
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", timeout=120,
                      json={"messages": MESSAGES, "max_tokens": 200, "stream": True}) as reply:
        for line in reply.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # leave mid-decode
    deadline = time.monotonic() + 30
    while httpx.get(f"{base_url}/", timeout=10).json()["state"] != "idle":
        assert time.monotonic() < deadline, "the cancelled job did not stop"
        time.sleep(0.05)
    reply = httpx.post(f"{base_url}/v1/chat/completions", timeout=120,
                       json={"messages": MESSAGES, "max_tokens": 4})
    assert reply.status_code == 200
