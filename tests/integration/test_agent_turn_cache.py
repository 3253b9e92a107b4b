"""The agent turn cache on the embedded model, through all three dialects: after the model calls a
tool, the follow-up request (the generated turn sent back plus the tool result) restores a state
that already holds the generated turn — even when another request ran in between — and prefills
only what is new."""

from __future__ import annotations

import json

import httpx
import pytest

WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def http(server):
    base_url, _ = server
    with httpx.Client(base_url=base_url, timeout=180) as client:
        yield client


def unrelated(http):
    reply = http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "Say hi."}]})
    assert reply.status_code == 200


def assert_turn_reused(first_usage: dict, second_usage: dict, prompt_key: str, completion_key: str):
    timings = second_usage["timings"]
    assert timings["agent_turn_cache_hit"] is True, (first_usage, timings)
    # Everything of the first request — its prompt and the turn it generated — came from KV state;
    # only the tool result and the new generation prompt were computed.
    generated_turn = first_usage[prompt_key] + first_usage[completion_key] - 1
    assert timings["cached_prefix_tokens"] >= generated_turn, (first_usage, timings)
    assert timings["prefilled_tokens"] == timings["prompt_tokens"] - timings["cached_prefix_tokens"]
    assert timings["prefilled_tokens"] <= 24


def test_chat_completions_follow_up_restores_the_generated_turn(http):
    tools = [{"type": "function", "function": WEATHER}]
    history = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = http.post("/v1/chat/completions", json={"model": "m", "messages": history, "tools": tools,
                                                    "tool_choice": "required", "max_tokens": 40}).json()
    message = first["choices"][0]["message"]
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    unrelated(http)
    follow_up = [*history, message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                                     "content": "sunny"}]
    second = http.post("/v1/chat/completions", json={"model": "m", "messages": follow_up, "tools": tools,
                                                     "max_tokens": 4}).json()
    assert_turn_reused(first["usage"], second["usage"], "prompt_tokens", "completion_tokens")


def test_responses_follow_up_restores_the_generated_turn(http):
    tools = [{"type": "function", **WEATHER}]
    items = [{"role": "user", "content": "What is the weather in Rome?"}]
    first = http.post("/v1/responses", json={"model": "m", "input": items, "tools": tools,
                                             "tool_choice": "required", "max_output_tokens": 40}).json()
    calls = [item for item in first["output"] if item["type"] == "function_call"]
    assert calls
    follow_up = [*items, *first["output"], {"type": "function_call_output", "call_id": calls[0]["call_id"],
                                            "output": "sunny"}]
    second = http.post("/v1/responses", json={"model": "m", "input": follow_up, "tools": tools,
                                              "max_output_tokens": 4}).json()
    assert_turn_reused(first["usage"], second["usage"], "input_tokens", "output_tokens")


def test_anthropic_follow_up_restores_the_generated_turn(http):
    tools = [{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}]
    history = [{"role": "user", "content": "What is the weather in Berlin?"}]
    first = http.post("/v1/messages", json={"model": "claude-opus-4-8", "messages": history, "tools": tools,
                                            "tool_choice": {"type": "any"}, "max_tokens": 40}).json()
    assert first["stop_reason"] == "tool_use"
    tool_use = next(block for block in first["content"] if block["type"] == "tool_use")
    unrelated(http)
    follow_up = [*history, {"role": "assistant", "content": first["content"]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use["id"],
                                               "content": "sunny"}]}]
    second = http.post("/v1/messages", json={"model": "claude-opus-4-8", "messages": follow_up, "tools": tools,
                                             "max_tokens": 4}).json()
    usage = first["usage"]
    first_usage = {"input": usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0),
                   "output": usage["output_tokens"]}
    assert_turn_reused(first_usage, second["usage"], "input", "output")
    assert json.dumps(second["usage"])
