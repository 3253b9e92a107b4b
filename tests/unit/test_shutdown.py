"""Shutdown: stop accepting, queued jobs get 503, the running job finishes within the grace, exit 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import trio

from dflash.app import serve
from dflash.config import Config, ServerConfig
from tests.unit.conftest import wait_until
from tests.unit.fakes import FakeEngine, fake_loader
from tests.unit.rawhttp import RawClient, request, sse_data

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
ROOT = Path(__file__).parents[2]


async def test_shutdown_drains_running_and_refuses_queued(nursery):
    engine = FakeEngine(decode_step_s=0.02, endless=True)
    config = Config(server=ServerConfig(port=0, shutdown_grace_s=5))
    done = trio.Event()

    async def run_server(task_status=trio.TASK_STATUS_IGNORED):
        await serve(config, loader=fake_loader(engine), handle_signals=False, task_status=task_status)
        done.set()

    app = await nursery.start(run_server)
    running = await RawClient.open(app.port)
    await running.send_request("POST", CHAT, json_body={**BODY, "stream": True})
    await running.read_head()
    queued_stream = await RawClient.open(app.port)
    await queued_stream.send_request("POST", CHAT, json_body={**BODY, "stream": True})
    await queued_stream.read_head()
    queued_plain = await RawClient.open(app.port)
    await queued_plain.send_request("POST", CHAT, json_body=BODY)
    await trio.sleep(0.05)
    assert app.scheduler.queue_depth == 2

    app.shutdown()

    refused = await queued_plain.read_reply()
    assert refused.status == 503
    assert refused.json()["error"]["type"] == "server_error"
    queued_data = sse_data([record async for record in queued_stream.read_sse_records()])
    assert "shutting down" in json.loads(queued_data[0])["error"]["message"]
    assert queued_data[-1] == "[DONE]"
    running_data = sse_data([record async for record in running.read_sse_records()])
    assert json.loads(running_data[-2])["choices"][0]["finish_reason"] == "length"  # ran to its end
    with trio.fail_after(5):
        await done.wait()
    # The engine thread has ended too: a live one at interpreter exit aborts the process.
    assert "dflash-engine" not in [thread.name for thread in threading.enumerate()]
    with trio.fail_after(1), pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", app.port)


async def test_past_the_grace_the_running_job_is_stopped(nursery):
    engine = FakeEngine(decode_step_s=0.02, endless=True)
    config = Config(server=ServerConfig(port=0, shutdown_grace_s=0.2))
    app = await nursery.start(lambda task_status: serve(config, loader=fake_loader(engine), handle_signals=False,
                                                        task_status=task_status))
    client = await RawClient.open(app.port)
    await client.send_request("POST", CHAT, json_body={**BODY, "max_tokens": 100_000})
    await trio.sleep(0.1)
    app.shutdown()
    with trio.fail_after(3):
        reply = await client.read_reply()
    assert reply.status == 503
    await wait_until(lambda: engine.idle, timeout=1)


def test_sigterm_exits_0(tmp_path):
    config = tmp_path / "server.toml"
    config.write_text('[server]\nport = 0\nshutdown_grace_s = 2\n[logging]\nformat = "json"\n')
    process = subprocess.Popen([sys.executable, "-m", "tests.unit.fakes", str(config)], cwd=ROOT,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    try:
        port = None
        deadline = time.monotonic() + 30
        while port is None and time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line and process.poll() is not None:
                break
            if '"event": "started"' in line:
                port = int(json.loads(line)["listening"].rsplit(":", 1)[1])
        assert port is not None, "the server did not start"
        reply = trio.run(request, port, "GET", "/health")
        assert reply.status == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        process.kill()
        process.wait()
