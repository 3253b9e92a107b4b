"""One log line per request with the numbers operators need; text only when log_text is set."""

from __future__ import annotations

import json

import structlog
from structlog.testing import capture_logs

from dflash import logs
from dflash.config import LoggingConfig
from tests.unit.conftest import wait_until
from tests.unit.fakes import FakeEngine
from tests.unit.rawhttp import RawClient, request

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
BODY = {"messages": [{"role": "user", "content": "secret code"}], "max_tokens": 5}
FIELDS = {"id", "method", "path", "status", "dialect", "prompt_tokens", "cached_tokens", "prefilled_tokens",
          "completion_tokens", "finish_reason", "queue_ms", "prefill_ms", "decode_ms", "client_disconnected",
          "draft_tokens", "accepted_tokens", "acceptance_length", "ttft_ms"}


def request_lines(captured: list[dict]) -> list[dict]:
    return [entry for entry in captured if entry["event"] == "request"]


async def test_request_line_has_the_numbers_and_no_text(start_server):
    served = await start_server()
    with capture_logs() as captured:
        reply = await request(served.port, "POST", CHAT, json_body=BODY)
        await wait_until(lambda: request_lines(captured))  # written just after the reply
    (line,) = request_lines(captured)
    assert FIELDS <= line.keys()
    assert line["id"] == reply.headers["x-request-id"]
    assert (line["status"], line["finish_reason"], line["completion_tokens"]) == (200, "length", 5)
    assert line["client_disconnected"] is False
    assert 0 < line["ttft_ms"] <= line["duration_ms"]
    assert "secret" not in json.dumps(captured)


async def test_log_text_adds_prompt_and_completion(start_server):
    served = await start_server(logging=LoggingConfig(log_text=True))
    with capture_logs() as captured:
        await request(served.port, "POST", CHAT, json_body=BODY)
        await wait_until(lambda: request_lines(captured))
    (line,) = request_lines(captured)
    assert line["prompt_text"].endswith("<|im_start|>user\nsecret code<|im_end|>\n<|im_start|>assistant\n")
    assert line["completion_text"] == "Hello"


async def test_a_continued_response_logs_the_id_it_continues(start_server):
    served = await start_server()
    with capture_logs() as captured:
        first = (await request(served.port, "POST", RESPONSES, json_body={"input": "hi"})).json()
        await request(served.port, "POST", RESPONSES, json_body={"input": "more", "previous_response_id": first["id"]})
        await wait_until(lambda: len(request_lines(captured)) == 2)
    assert [line.get("previous_response_id") for line in request_lines(captured)] == [None, first["id"]]


async def test_a_disconnect_is_logged_as_such(start_server):
    served = await start_server(FakeEngine(decode_step_s=0.02, endless=True))
    with capture_logs() as captured:
        client = await RawClient.open(served.port)
        await client.send_request("POST", CHAT, json_body={**BODY, "max_tokens": 10_000})
        await wait_until(lambda: served.engine.generations)
        await client.aclose()
        await wait_until(lambda: request_lines(captured)
                         and any(entry["event"] == "job_cancelled" for entry in captured))
    (line,) = request_lines(captured)
    assert line["client_disconnected"] is True
    assert line["status"] is None and line["finish_reason"] is None


def test_json_format_is_one_object_per_line_with_tracebacks(capsys):
    try:
        logs.configure("info", "json")
        log = logs.get_logger("dflash.test")
        log.info("started", version="x")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
        log.debug("hidden")
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 2
        started, failed = (json.loads(line) for line in lines)
        assert started["event"] == "started" and started["level"] == "info" and started["timestamp"]
        assert failed["exception"][0]["exc_type"] == "ValueError"
    finally:
        structlog.reset_defaults()
