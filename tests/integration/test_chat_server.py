"""The real server (`python -m dflash.cli run`) on the embedded model, driven over loopback by httpx
and the official `openai` SDK. Replies are kept short: the point is the wire, not the prose."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).parents[2]
START_TIMEOUT_S = 300
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    config = folder / "server.toml"
    config.write_text('[server]\nport = 0\nshutdown_grace_s = 5\n[model]\nmax_ctx = 1024\n'
                      '[logging]\nformat = "json"\n')
    log_path = folder / "server.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "dflash.cli", "run", str(config)], cwd=ROOT,
                                   stdout=log_file, stderr=log_file,
                                   env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    try:
        started = _wait_for_start(process, log_path)
        yield started["listening"], started["model"]
        process.send_signal(signal.SIGTERM)
        exit_code = process.wait(timeout=30)
        assert exit_code == 0, f"exit code {exit_code} after SIGTERM:\n{log_path.read_text()[-3000:]}"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _wait_for_start(process: subprocess.Popen, log_path: Path) -> dict:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if line.startswith("{") and json.loads(line).get("event") == "started":
                return json.loads(line)
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"the server did not start within {START_TIMEOUT_S}s")


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
