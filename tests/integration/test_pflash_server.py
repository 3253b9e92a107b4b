"""Speculative prefill on a real server (embedded model, `[prefill] compression = "fit"`): a
conversation longer than the context is compressed instead of refused, every dialect reports it in
`usage.timings`, the same conversation through another dialect continues on the compressed prompt
(no second scoring), and the request log lines say so."""

from __future__ import annotations

import json

import httpx

from tests.integration.conftest import running_server, server_config

MAX_CTX = 1024
DOCUMENT = " ".join(f"Line {i}: the harbor keeps {i * 7 % 13} boats and {i * 5 % 11} nets." for i in range(160))
HISTORY = [{"role": "user", "content": f"Read this log.\n{DOCUMENT}"}, {"role": "assistant", "content": "Done."}]
QUESTION = "How many lines were there? Answer briefly."


def post(base_url: str, path: str, body: dict) -> dict:
    reply = httpx.post(f"{base_url}{path}", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_an_overlong_conversation_is_compressed_to_fit_and_reported_in_every_dialect(tmp_path):
    config = server_config() .replace("max_ctx = 2048", f"max_ctx = {MAX_CTX}") + '[prefill]\ncompression = "fit"\n'
    messages = HISTORY + [{"role": "user", "content": QUESTION}]
    with running_server(tmp_path, config) as started:
        base = started["listening"]
        chat = post(base, "/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 8})
        anthropic = post(base, "/v1/messages", {"model": "m", "messages": messages, "max_tokens": 8})
        responses = post(base, "/v1/responses", {"model": "m", "input": messages, "max_output_tokens": 8})
    first = chat["usage"]["timings"]
    assert first["prompt_tokens"] == first["compressed_from_tokens"] > MAX_CTX
    assert first["prefilled_tokens"] < MAX_CTX and first["scoring_ms"] > 0
    for body in (anthropic, responses):
        timings = body["usage"]["timings"]
        # the same conversation: it continues on the remembered compression, nothing is scored again
        assert timings["compressed_from_tokens"] == timings["prompt_tokens"] > MAX_CTX
        assert timings["scoring_ms"] == 0 and timings["prefilled_tokens"] < MAX_CTX
    lines = [json.loads(line) for line in (tmp_path / "server.log").read_text().splitlines() if line.startswith("{")]
    requests = [line for line in lines if line.get("path") in ("/v1/chat/completions", "/v1/messages", "/v1/responses")]
    assert len(requests) == 3 and all(line["compressed_from_tokens"] > MAX_CTX for line in requests)
    assert requests[0]["scoring_ms"] > 0
