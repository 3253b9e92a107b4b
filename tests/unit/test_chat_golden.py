"""Chat Completions golden sequences on the fake engine: the chunks of a stream and the body of a
plain reply, for text, reasoning, one and two tool calls, a stop string, max tokens, and errors
before and after the stream began. Also n, logprobs, tool memory and prefix-cache boundaries."""

from __future__ import annotations

import json
import math

import pytest

from tests.unit.dialects import (ONE_CALL, PLAIN, REASONING, STOPPED, TWO_CALLS, WEATHER_TOOL, merged, post,
                                 post_stream)
from tests.unit.fakes import SCRIPTED_LOGIT, VOCAB_SIZE, FakeEngine

CHAT = "/v1/chat/completions"
TOOLS = [{"type": "function", "function": WEATHER_TOOL}]


def body(**fields) -> dict:
    return {"model": "client-name", "messages": [{"role": "user", "content": "hi"}], **fields}


def signatures(events) -> list[str]:
    out = []
    for _, chunk in events:
        if chunk == "[DONE]":
            out.append("[DONE]")
        elif "error" in chunk:
            out.append(f"error:{chunk['error']['type']}")
        elif not chunk["choices"]:
            out.append("usage")
        else:
            choice = chunk["choices"][0]
            delta = choice["delta"]
            if "role" in delta:
                out.append("role")
            elif "content" in delta:
                out.append(f"content:{delta['content']}")
            elif "reasoning_content" in delta:
                out.append(f"reasoning:{delta['reasoning_content']}")
            elif "tool_calls" in delta:
                call = delta["tool_calls"][0]
                if "id" in call:
                    out.append(f"call{call['index']}:{call['function']['name']}")
                else:
                    out.append(f"args:{call['function']['arguments']}")
            else:
                out.append(f"finish:{choice['finish_reason']}")
    return merged(out)


CASES = {
    "plain": (PLAIN, {}, ["role", "content:Hello there.", "finish:stop", "[DONE]"],
              {"role": "assistant", "content": "Hello there."}, "stop"),
    "reasoning": (REASONING, {}, ["role", "reasoning:The user greets me.", "content:Hello there.", "finish:stop",
                                  "[DONE]"],
                  {"role": "assistant", "content": "Hello there.", "reasoning_content": "The user greets me."},
                  "stop"),
    "one tool call": (ONE_CALL, {"tools": TOOLS},
                      ["role", "content:Checking.", "call0:get_weather", 'args:{"city":"Paris","days":2}',
                       "finish:tool_calls", "[DONE]"],
                      {"role": "assistant", "content": "Checking.", "tool_calls": [
                          {"id": "ID", "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":2}'}}]},
                      "tool_calls"),
    "two tool calls": (TWO_CALLS, {"tools": TOOLS},
                       ["role", "call0:get_weather", 'args:{"city":"Paris"}', "call1:get_weather",
                        'args:{"city":"Rome"}', "finish:tool_calls", "[DONE]"],
                       {"role": "assistant", "content": None, "tool_calls": [
                           {"id": "ID", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
                           {"id": "ID", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
                       "tool_calls"),
    "stop sequence": (STOPPED, {"stop": ["STOP"]}, ["role", "content:Hello there. ", "finish:stop", "[DONE]"],
                      {"role": "assistant", "content": "Hello there. "}, "stop"),
    "max tokens": (PLAIN, {"max_tokens": 5}, ["role", "content:Hello", "finish:length", "[DONE]"],
                   {"role": "assistant", "content": "Hello"}, "length"),
}


def _without_ids(message: dict) -> dict:
    message = json.loads(json.dumps(message))
    for call in message.get("tool_calls", []):
        assert call["id"].startswith("call_")
        call["id"] = "ID"
    return message


@pytest.mark.parametrize("case", CASES)
async def test_stream_golden(start_server, case):
    reply, fields, expected, _, _ = CASES[case]
    served = await start_server(FakeEngine(reply=reply))
    events = await post_stream(served.port, CHAT, body(**fields))
    assert signatures(events) == expected
    chunks = [chunk for _, chunk in events if chunk != "[DONE]"]
    assert {chunk["id"] for chunk in chunks} == {chunks[0]["id"]}
    assert all(chunk["model"] == "client-name" and chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("case", CASES)
async def test_body_golden(start_server, case):
    reply, fields, _, message, finish_reason = CASES[case]
    served = await start_server(FakeEngine(reply=reply))
    answer = (await post(served.port, CHAT, body(**fields))).json()
    assert answer["object"] == "chat.completion" and answer["model"] == "client-name"
    (choice,) = answer["choices"]
    assert _without_ids(choice["message"]) == message
    assert choice["finish_reason"] == finish_reason


async def test_error_before_streaming_is_a_400_body(start_server):
    served = await start_server()
    reply = await post(served.port, CHAT, body(stream=True, temperature=3))
    assert reply.status == 400
    assert reply.json()["error"]["param"] == "temperature"


async def test_error_after_streaming_began_rides_in_the_stream(start_server):
    # One prefill step, two decode steps ("H", "e"), then the engine fails.
    served = await start_server(FakeEngine(fail_on_step=4, prefill_chunk=4096))
    events = await post_stream(served.port, CHAT, body())
    assert signatures(events) == ["role", "content:He", "error:server_error", "[DONE]"]
    assert "fake engine failure" in events[-2][1]["error"]["message"]


async def test_include_usage_and_usage_numbers(start_server):
    served = await start_server(FakeEngine(reply=PLAIN))
    events = await post_stream(served.port, CHAT, body(stream_options={"include_usage": True}))
    assert signatures(events)[-3:] == ["finish:stop", "usage", "[DONE]"]
    usage = events[-2][1]["usage"]
    assert usage["completion_tokens"] == len(PLAIN) + 1
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage["timings"]["prompt_tokens"] == usage["prompt_tokens"]


async def test_n_runs_completions_one_after_another(start_server):
    served = await start_server(FakeEngine(reply=PLAIN))
    answer = (await post(served.port, CHAT, body(n=2))).json()
    assert [choice["index"] for choice in answer["choices"]] == [0, 1]
    assert all(choice["message"]["content"] == PLAIN for choice in answer["choices"])
    assert answer["usage"]["completion_tokens"] == 2 * (len(PLAIN) + 1)
    assert len(served.engine.generations) == 2
    events = await post_stream(served.port, CHAT, body(n=2))
    indexes = [chunk["choices"][0]["index"] for _, chunk in events if chunk != "[DONE]" and chunk["choices"]]
    assert indexes == sorted(indexes) and set(indexes) == {0, 1}


async def test_logprobs_come_from_the_sampling_distribution(start_server):
    served = await start_server(FakeEngine(reply="Hi"))
    answer = (await post(served.port, CHAT, body(logprobs=True, top_logprobs=2))).json()
    content = answer["choices"][0]["logprobs"]["content"]
    expected = SCRIPTED_LOGIT - math.log(math.exp(SCRIPTED_LOGIT) + VOCAB_SIZE - 1)
    assert [entry["token"] for entry in content] == ["H", "i"]
    assert [entry["bytes"] for entry in content] == [[72], [105]]
    assert all(abs(entry["logprob"] - expected) < 1e-4 for entry in content)
    assert [len(entry["top_logprobs"]) for entry in content] == [2, 2]
    assert content[0]["top_logprobs"][0]["token"] == "H"
    events = await post_stream(served.port, CHAT, body(logprobs=True))
    streamed = [entry["token"] for _, chunk in events if chunk != "[DONE]" and chunk["choices"]
                for entry in (chunk["choices"][0]["logprobs"] or {}).get("content", [])]
    assert streamed == ["H", "i"]


async def test_logit_bias_outside_the_vocabulary_is_a_400(start_server):
    served = await start_server()
    reply = await post(served.port, CHAT, body(logit_bias={"300": 1}))
    assert (reply.status, reply.json()["error"]["param"]) == (400, "logit_bias")


async def test_sampling_reaches_the_engine(start_server):
    served = await start_server()
    await post(served.port, CHAT, body(temperature=0.5, top_p=0.9, top_k=7, repetition_penalty=1.2,
                                       frequency_penalty=0.5, presence_penalty=-0.5, rep_window=32,
                                       logit_bias={"65": 3}, seed=9))
    sampling = served.engine.generations[0].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.repetition_penalty) == (0.5, 0.9, 7, 1.2)
    assert (sampling.frequency_penalty, sampling.presence_penalty, sampling.rep_window) == (0.5, -0.5, 32)
    assert (sampling.logit_bias, sampling.seed) == ({65: 3.0}, 9)


async def test_snapshot_boundaries_follow_each_closed_message(start_server):
    served = await start_server()
    await post(served.port, CHAT, body(messages=[{"role": "system", "content": "S"},
                                                 {"role": "user", "content": "U"}]))
    generation = served.engine.generations[0]
    prompt = bytes(generation.prompt_ids).decode()
    assert [prompt[:position] for position in generation.snapshot_at] == [
        "<|im_start|>system\nS<|im_end|>\n", "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"]


async def test_tool_memory_replays_the_generated_turn(start_server):
    served = await start_server(FakeEngine(reply=TWO_CALLS))
    first = (await post(served.port, CHAT, body(tools=TOOLS))).json()
    message = first["choices"][0]["message"]
    # The client sends the turn back re-serialized, as clients do.
    for call in message["tool_calls"]:
        call["function"]["arguments"] = json.dumps(json.loads(call["function"]["arguments"]), indent=2)
    history = [{"role": "user", "content": "hi"}, message,
               *({"role": "tool", "tool_call_id": call["id"], "content": "sunny"} for call in message["tool_calls"])]
    await post(served.port, CHAT, body(messages=history, tools=TOOLS))
    prompt = bytes(served.engine.generations[1].prompt_ids).decode()
    assert f"<|im_start|>assistant\n{TWO_CALLS}<|im_end|>\n" in prompt
    assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nsunny\n</tool_response>" in prompt


async def test_without_tool_memory_calls_render_in_the_builtin_format(start_server):
    served = await start_server()
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "Let me look.", "tool_calls": [
                   {"id": "call_unknown", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_unknown", "content": "rain"}]
    await post(served.port, CHAT, body(messages=history, tools=TOOLS))
    prompt = bytes(served.engine.generations[0].prompt_ids).decode()
    assert ('<|im_start|>assistant\nLet me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call><|im_end|>') in prompt
    assert "<tools>\n" in prompt and '"name": "get_weather"' in prompt


async def test_tool_choice_none_hides_the_tools(start_server):
    served = await start_server(FakeEngine(reply=ONE_CALL))
    answer = (await post(served.port, CHAT, body(tools=TOOLS, tool_choice="none"))).json()
    assert "<tools>" not in bytes(served.engine.generations[0].prompt_ids).decode()
    assert answer["choices"][0]["message"]["content"].startswith("Checking.\n<tool_call>")
    assert answer["choices"][0]["finish_reason"] == "stop"


async def test_parallel_tool_calls_false_keeps_the_first_call(start_server):
    served = await start_server(FakeEngine(reply=TWO_CALLS))
    answer = (await post(served.port, CHAT, body(tools=TOOLS, parallel_tool_calls=False))).json()
    assert len(answer["choices"][0]["message"]["tool_calls"]) == 1


async def test_a_tool_call_reply_asks_the_engine_for_a_turn_checkpoint(start_server):
    import trio

    served = await start_server(FakeEngine(reply=ONE_CALL))
    first = (await post(served.port, CHAT, body(tools=TOOLS))).json()
    with trio.fail_after(5):
        while not served.engine.checkpoints:
            await trio.sleep(0.01)
    (checkpoint,) = served.engine.checkpoints
    # The prompt plus the turn as the follow-up will render it, through the turn's closing tokens.
    message = first["choices"][0]["message"]
    history = [{"role": "user", "content": "hi"}, message,
               {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "sunny"}]
    await post(served.port, CHAT, body(messages=history, tools=TOOLS))
    follow_up = served.engine.generations[1].prompt_ids
    assert follow_up[: len(checkpoint)] == checkpoint
    assert bytes(checkpoint).decode().endswith(f"<|im_start|>assistant\n{ONE_CALL}<|im_end|>\n")


async def test_a_plain_reply_asks_for_no_turn_checkpoint(start_server):
    import trio

    served = await start_server()
    await post(served.port, CHAT, body())
    await trio.sleep(0.2)
    assert served.engine.checkpoints == []
