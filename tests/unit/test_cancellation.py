"""A client that goes away stops its job within one engine step, wherever the job is, and the next
request is served normally. Real time with slow fake steps: the engine runs in a real thread."""

from __future__ import annotations

import pytest
import trio

from tests.unit.conftest import now, wait_until
from tests.unit.dialects import post_stream
from tests.unit.fakes import FakeEngine
from tests.unit.rawhttp import RawClient, request, sse_data

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 100_000}


async def open_stream(port: int, **fields) -> RawClient:
    client = await RawClient.open(port)
    await client.send_request("POST", CHAT, json_body={**BODY, "stream": True, **fields})
    status, _ = await client.read_head()
    assert status == 200
    return client


async def next_data(records) -> str:
    async for record in records:
        if not record.startswith(":"):
            return record.removeprefix("data: ")
    raise AssertionError("the stream ended")


async def assert_stopped_within_one_step(engine: FakeEngine, disconnected_at: float, step_s: float) -> None:
    await wait_until(lambda: engine.idle, timeout=10 * step_s + 1)
    generation = engine.generations[-1]
    assert generation.closed
    assert generation.finished is None  # cancelled, not run to its end
    assert generation.steps_started_after(disconnected_at) <= 1


async def assert_next_request_is_served(port: int, engine: FakeEngine) -> None:
    engine.prefill_step_s = engine.decode_step_s = 0.0
    reply = await request(port, "POST", CHAT, json_body={**BODY, "max_tokens": 5})
    assert reply.status == 200
    assert reply.json()["choices"][0]["message"]["content"] == engine.reply[:5]
    await wait_until(lambda: engine.idle, timeout=1)


async def test_stream_disconnect_during_prefill(start_server):
    engine = FakeEngine(prefill_chunk=2, prefill_step_s=0.1)
    served = await start_server(engine)
    client = await open_stream(served.port)
    records = client.read_sse_records()
    assert '"role":"assistant"' in await next_data(records)  # the job has started: prefill is running
    await trio.sleep(0.15)
    await client.aclose()
    disconnected_at = now()
    await assert_stopped_within_one_step(engine, disconnected_at, 0.1)
    assert engine.generations[0].stats.generated_tokens == 0
    await assert_next_request_is_served(served.port, served.engine)


async def test_stream_disconnect_during_decode(start_server):
    engine = FakeEngine(decode_step_s=0.05, endless=True)
    served = await start_server(engine)
    client = await open_stream(served.port)
    records = client.read_sse_records()
    for _ in range(4):
        await next_data(records)
    await client.aclose()
    disconnected_at = now()
    await assert_stopped_within_one_step(engine, disconnected_at, 0.05)
    await assert_next_request_is_served(served.port, served.engine)


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_while_queued_removes_the_job(start_server, stream):
    engine = FakeEngine(decode_step_s=0.02, endless=True)
    served = await start_server(engine, keepalive_s=0.05)
    running = await open_stream(served.port)
    await next_data(running.read_sse_records())
    queued = await RawClient.open(served.port)
    await queued.send_request("POST", CHAT, json_body={**BODY, "stream": stream})
    await wait_until(lambda: served.app.scheduler.queue_depth == 1)
    if stream:
        status, _ = await queued.read_head()  # headers go out on acceptance, before the job runs
        assert status == 200
        first = await anext(queued.read_sse_records())
        assert first == ": keep-alive"  # while queued, only keep-alives
    await queued.aclose()
    await wait_until(lambda: served.app.scheduler.queue_depth == 0, timeout=1)
    await running.aclose()
    await wait_until(lambda: engine.idle)
    assert len(engine.generations) == 1  # the queued job never reached the engine
    await assert_next_request_is_served(served.port, served.engine)


async def test_non_streaming_disconnect_during_decode(start_server):
    engine = FakeEngine(decode_step_s=0.05, endless=True)
    served = await start_server(engine)
    client = await RawClient.open(served.port)
    await client.send_request("POST", CHAT, json_body=BODY)
    await wait_until(lambda: engine.generations and engine.generations[0].stats.generated_tokens >= 3)
    await client.aclose()
    disconnected_at = now()
    await assert_stopped_within_one_step(engine, disconnected_at, 0.05)
    await assert_next_request_is_served(served.port, served.engine)


async def test_non_streaming_disconnect_during_prefill(start_server):
    engine = FakeEngine(prefill_chunk=2, prefill_step_s=0.1)
    served = await start_server(engine)
    client = await RawClient.open(served.port)
    await client.send_request("POST", CHAT, json_body=BODY)
    await wait_until(lambda: engine.generations and engine.generations[0].stats.prefilled_tokens >= 2)
    await client.aclose()
    disconnected_at = now()
    await assert_stopped_within_one_step(engine, disconnected_at, 0.1)
    await assert_next_request_is_served(served.port, served.engine)


async def test_keep_alive_comments_during_a_slow_prefill(start_server):
    engine = FakeEngine(prefill_chunk=100, prefill_step_s=0.5)  # one prefill chunk outlasts keepalive_s
    served = await start_server(engine, keepalive_s=0.1)
    client = await open_stream(served.port, max_tokens=3)
    records = [record async for record in client.read_sse_records()]
    role_at = next(i for i, record in enumerate(records) if '"role"' in record)
    content_at = next(i for i, record in enumerate(records) if '"content":"H' in record)
    between = records[role_at + 1:content_at]
    assert between.count(": keep-alive") >= 3, records
    assert sse_data(records)[-1] == "[DONE]"


async def test_a_client_that_stops_reading_is_dropped_and_its_job_cancelled(start_server):
    engine = FakeEngine(endless=True, reply="x" * 2000)  # every token a byte; chunks pile up fast
    served = await start_server(engine, idle_timeout_s=0.3)
    client = await RawClient.open(served.port, receive_buffer=4096)
    await client.send_request("POST", CHAT, json_body={**BODY, "stream": True})
    # Never read. Once the socket buffers are full, the server's send blocks; 0.3 s later it gives up.
    await wait_until(lambda: engine.generations and engine.idle, timeout=20)
    generation = engine.generations[0]
    assert generation.closed and generation.finished is None
    await client.aclose()
    await assert_next_request_is_served(served.port, served.engine)


async def test_engine_work_runs_in_one_dedicated_thread(start_server):
    served = await start_server()
    for _ in range(3):
        await assert_next_request_is_served(served.port, served.engine)
    assert served.engine.threads == {"dflash-engine"}


async def test_responses_streams_repeat_in_progress_during_a_slow_prefill(start_server):
    """Codex times out on silence; its SSE reader may count events, not comments."""
    engine = FakeEngine(prefill_chunk=100, prefill_step_s=0.5)
    served = await start_server(engine, keepalive_s=0.1)
    events = await post_stream(served.port, "/v1/responses", {"model": "m", "max_output_tokens": 3, "input": "hi"})
    names = [name for name, _ in events]
    first_text = names.index("response.output_text.delta")
    assert names[:first_text].count("response.in_progress") >= 3, names
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))


@pytest.mark.parametrize("thinking, block", [(None, "text"), ({"type": "enabled", "budget_tokens": 1024}, "thinking")])
async def test_anthropic_streams_send_empty_content_deltas_during_a_slow_prefill(start_server, thinking, block):
    """Claude Code's stream watchdog counts content events only (its SDK drops `ping`) and gives
    up after 300 s: a long prefill gets empty deltas of a block that the reply then continues."""
    engine = FakeEngine(prefill_chunk=100, prefill_step_s=0.5)
    served = await start_server(engine, keepalive_s=0.1)
    body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}],
            **({"thinking": thinking} if thinking else {})}
    events = await post_stream(served.port, "/v1/messages", body)
    empty_deltas = [data for name, data in events if name == "content_block_delta"
                    and data["delta"].get("text", data["delta"].get("thinking")) == ""]
    assert len(empty_deltas) >= 3 and all(delta["index"] == 0 for delta in empty_deltas)
    starts = [data["content_block"]["type"] for name, data in events if name == "content_block_start"]
    assert starts[0] == block
    text = "".join(data["delta"].get("text", "") for name, data in events if name == "content_block_delta")
    assert text == "Hel"  # the reply itself is unchanged
    assert [name for name, _ in events][-2:] == ["message_delta", "message_stop"]
