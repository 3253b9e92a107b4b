"""Caches across server lifetimes and configurations, on the embedded model: a restart with the
same disk_dir restores an earlier conversation from disk, and a multi-turn tool conversation gives
the same greedy replies with every cache on and with every cache off, through all three dialects."""

from __future__ import annotations

import httpx

from tests.integration.conftest import running_server, server_config

SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 6
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def chat(base_url: str, messages: list[dict], **extra) -> dict:
    reply = httpx.post(f"{base_url}/v1/chat/completions", timeout=180,
                       json={"model": "m", "messages": messages, "max_tokens": 12, **extra})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_restart_with_the_same_disk_dir_restores_the_conversation(tmp_path):
    disk = tmp_path / "kv"
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a fruit."}]
    with running_server(tmp_path / "a", server_config(disk_dir=str(disk))) as started:
        first = chat(started["listening"], conversation)
    with running_server(tmp_path / "b", server_config(disk_dir=str(disk))) as started:
        again = chat(started["listening"], conversation)
    assert again["usage"]["timings"]["cached_prefix_tokens"] > 0
    assert again["choices"][0]["message"] == first["choices"][0]["message"]


def tool_conversation(base_url: str) -> tuple[list[str], int]:
    """Three turns through the three dialects: every reply's text/arguments, and the prompt tokens
    the second turn restored instead of computing."""
    tools = [{"type": "function", "function": WEATHER}]
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the weather in Oslo?"}]
    first = chat(base_url, history, tools=tools, tool_choice="required", max_tokens=40)
    message = first["choices"][0]["message"]
    history += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "snow"}]
    second = chat(base_url, history, tools=tools)
    anthropic = httpx.post(f"{base_url}/v1/messages", timeout=180, json={
        "model": "m", "max_tokens": 12, "system": SYSTEM,
        "messages": [{"role": "user", "content": "What is the weather in Oslo?"}]}).json()
    responses = httpx.post(f"{base_url}/v1/responses", timeout=180, json={
        "model": "m", "max_output_tokens": 12, "instructions": SYSTEM,
        "input": "What is the weather in Oslo?"}).json()
    return ([message["tool_calls"][0]["function"]["arguments"], second["choices"][0]["message"]["content"],
             anthropic["content"][0]["text"], responses["output"][-1]["content"][0]["text"]],
            second["usage"]["timings"]["cached_prefix_tokens"])


def test_replies_are_the_same_with_every_cache_on_and_off(tmp_path, server):
    base_url, _ = server  # the suite's server: every cache on
    cached, restored = tool_conversation(base_url)
    off = server_config(prefix_cache_slots=0, prefill_cache_slots=0, reuse_live_state=False)
    with running_server(tmp_path, off) as started:
        uncached, restored_off = tool_conversation(started["listening"])
    assert restored > 0 and restored_off == 0  # the second turn: its first turn reused, or computed again
    assert cached == uncached
