"""POST /v1/chat/completions end to end on the fake engine, plus GET /, /health and /v1/models."""

from __future__ import annotations

import functools
import json

import trio

from tests.unit.conftest import wait_until
from tests.unit.fakes import REPLY, FakeEngine, prompt_tokens
from tests.unit.rawhttp import RawClient, request, sse_data

CHAT = "/v1/chat/completions"


def chat_body(**fields) -> dict:
    return {"model": "my-model", "messages": [{"role": "user", "content": "hi"}], **fields}


async def stream_records(port: int, body: dict) -> list[str]:
    client = await RawClient.open(port)
    await client.send_request("POST", CHAT, json_body={**body, "stream": True})
    status, headers = await client.read_head()
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    records = [record async for record in client.read_sse_records()]
    await client.aclose()
    return records


async def test_non_streaming_reply_has_the_openai_shape_and_usage(start_server):
    served = await start_server()
    reply = await request(served.port, "POST", CHAT, json_body=chat_body(max_tokens=100))
    assert reply.status == 200
    body = reply.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "my-model"  # echoed
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": REPLY}
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["prompt_tokens"] == prompt_tokens("hi")
    assert usage["completion_tokens"] == len(REPLY) + 1  # the EOS counts
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    timings = usage["timings"]
    assert timings["prompt_tokens"] == timings["prefilled_tokens"] == prompt_tokens("hi")
    assert timings["cached_prefix_tokens"] == 0
    assert {"prefill_ms", "decode_ms", "draft_tokens", "accepted_tokens", "acceptance_length"} <= timings.keys()


async def test_streaming_reply_chunks_end_with_done(start_server):
    served = await start_server()
    data = sse_data(await stream_records(served.port, chat_body(max_tokens=100)))
    assert data[-1] == "[DONE]"
    chunks = [json.loads(item) for item in data[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" and chunk["model"] == "my-model" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
    assert text == REPLY
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == len(REPLY) + 1


async def test_stream_options_include_usage_adds_a_usage_chunk(start_server):
    served = await start_server()
    data = sse_data(await stream_records(served.port, chat_body(stream_options={"include_usage": True})))
    usage_chunk = json.loads(data[-2])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens"] > 0
    assert "usage" not in json.loads(data[-3])


async def test_max_tokens_ends_with_length(start_server):
    served = await start_server()
    body = (await request(served.port, "POST", CHAT, json_body=chat_body(max_tokens=5))).json()
    assert body["choices"][0]["message"]["content"] == REPLY[:5]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5


async def test_max_tokens_is_clamped_to_the_room_left_in_the_context(start_server):
    served = await start_server(FakeEngine(max_ctx=prompt_tokens("hi") + 3))
    body = (await request(served.port, "POST", CHAT, json_body=chat_body(max_tokens=1000))).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


async def test_a_prompt_that_does_not_fit_gets_openais_context_length_error(start_server):
    served = await start_server(FakeEngine(max_ctx=64))
    reply = await request(served.port, "POST", CHAT, json_body=chat_body(
        messages=[{"role": "user", "content": "x" * 100}], max_tokens=10))
    assert reply.status == 400
    error = reply.json()["error"]
    length = prompt_tokens("x" * 100)
    assert error["message"].startswith(f"This model's maximum context length is 64 tokens. However, you requested "
                                       f"{length + 10} tokens ({length} in the messages, 10 in the completion).")
    assert error["code"] == "context_length_exceeded"
    assert not served.engine.generations


async def test_stop_string_split_across_tokens_is_cut_exactly(start_server):
    served = await start_server(FakeEngine(endless=True, decode_step_s=0.005))
    body = (await request(served.port, "POST", CHAT, json_body=chat_body(stop=["fake en"], max_tokens=500))).json()
    assert body["choices"][0]["message"]["content"] == "Hello from the "
    assert body["choices"][0]["finish_reason"] == "stop"
    await wait_until(lambda: served.engine.idle)
    # Generation stopped at once, not at max_tokens: the engine runs at most a step or two ahead
    # of the handler that sees the stop string.
    assert served.engine.generations[0].stats.generated_tokens <= len("Hello from the fake en") + 2


async def test_stop_string_in_a_stream_is_never_emitted(start_server):
    served = await start_server(FakeEngine(endless=True))
    data = sse_data(await stream_records(served.port, chat_body(stop=["engine", "zzz"], max_tokens=500)))
    chunks = [json.loads(item) for item in data[:-1]]
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
    assert text == "Hello from the fake "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_bad_input_gets_400_in_openai_shape_naming_the_field(start_server):
    served = await start_server()
    cases = [
        (b"{not json", None),
        (json.dumps({"messages": []}).encode(), "messages"),
        (json.dumps(chat_body(temperature=7)).encode(), "temperature"),
        (json.dumps(chat_body(max_tokens=0)).encode(), "max_tokens"),
        (json.dumps(chat_body(stop=[1])).encode(), "stop"),
        (json.dumps(chat_body(stream="yes")).encode(), "stream"),
        (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), "messages[0].role"),
    ]
    for body, param in cases:
        reply = await request(served.port, "POST", CHAT, body=body, headers=[("content-type", "application/json")])
        assert reply.status == 400, body
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param


async def test_queue_full_gets_429_with_retry_after(start_server):
    served = await start_server(FakeEngine(decode_step_s=0.05, endless=True), queue_max=1)
    async with trio.open_nursery() as nursery:
        running = await RawClient.open(served.port)
        queued = await RawClient.open(served.port)
        await running.send_request("POST", CHAT, json_body=chat_body(max_tokens=50, stream=True))
        await running.read_head()
        await queued.send_request("POST", CHAT, json_body=chat_body(max_tokens=50, stream=True))
        await queued.read_head()
        refused = await request(served.port, "POST", CHAT, json_body=chat_body(max_tokens=5))
        assert refused.status == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        await running.aclose()
        await queued.aclose()
        nursery.cancel_scope.cancel()


async def test_root_health_and_models(start_server):
    served = await start_server()
    root = (await request(served.port, "GET", "/")).json()
    assert root["model"] == "fake-model"
    assert root["state"] == "idle"
    assert root["queue_depth"] == 0
    assert root["uptime_s"] >= 0 and root["version"]
    assert (await request(served.port, "GET", "/health")).json() == {"status": "ok"}
    models = (await request(served.port, "GET", "/v1/models")).json()
    assert models["object"] == "list"
    assert [model["id"] for model in models["data"]] == ["fake-model"]
    assert models["data"][0]["object"] == "model" and models["data"][0]["owned_by"] == "dflash"


async def test_engine_failure_is_a_500_and_the_engine_serves_the_next_request(start_server):
    engine = FakeEngine(fail_on_step=3)
    served = await start_server(engine)
    failed = await request(served.port, "POST", CHAT, json_body=chat_body())
    assert failed.status == 500
    assert failed.json()["error"]["type"] == "server_error"
    engine.fail_on_step = None
    assert (await request(served.port, "POST", CHAT, json_body=chat_body())).status == 200
    assert all(generation.closed for generation in engine.generations)


async def test_root_shows_how_far_a_long_prefill_has_come(start_server):
    engine = FakeEngine(prefill_chunk=4, prefill_step_s=0.05)
    served = await start_server(engine)
    long_text = "word " * 200
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(request, served.port, "POST", CHAT,
                                             json_body=chat_body(messages=[{"role": "user", "content": long_text}])))

        async def prefilled() -> int:
            running = (await request(served.port, "GET", "/")).json()["running"]
            return running[0]["prefilled_tokens"] if running else -1

        seen = []
        with trio.fail_after(10):
            while len(set(seen) - {-1, 0}) < 2:  # two different counts, mid-prefill
                seen.append(await prefilled())
                await trio.sleep(0.06)
        (running,) = (await request(served.port, "GET", "/")).json()["running"]
        assert running["prompt_tokens"] > running["prefilled_tokens"] > 0
        assert running["generated_tokens"] == 0 and running["running_s"] > 0
        nursery.cancel_scope.cancel()
    await wait_until(lambda: engine.idle)
    assert (await request(served.port, "GET", "/")).json()["running"] == []
