"""Responses over WebSocket on the fake engine: handshake, events equal to the SSE stream's, the
per-socket chain (previous_response_id), the warm-up, errors with `status`, one response at a
time, cancellation on a dropped connection, limits and keep-alive events."""

from __future__ import annotations

import pytest
import trio
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.unit.conftest import wait_until
from tests.unit.dialects import ONE_CALL, PLAIN, WEATHER_TOOL, post_stream
from tests.unit.fakes import FakeEngine
from tests.unit.rawhttp import request
from tests.unit.test_responses_golden import CASES, signatures
from tests.unit.wsclient import ResponsesClient

TOOLS = [{"type": "function", **WEATHER_TOOL}]
CODEX_HEADERS = [("openai-beta", "responses_websockets=2026-02-06"), ("session_id", "s-1")]


def body(**fields) -> dict:
    return {"model": "gpt-codex", "input": "hi", "stream": True, "store": False, **fields}


def without_volatile(event: dict) -> dict:
    """An event with the ids and times that differ between two runs taken out."""
    def clean(value):
        if isinstance(value, dict):
            return {key: clean(item) for key, item in value.items()
                    if key not in ("id", "item_id", "call_id", "created_at", "timings")}
        if isinstance(value, list):
            return [clean(item) for item in value]
        return value
    return clean(event)


@pytest.mark.parametrize("case", CASES)
async def test_events_are_the_sse_streams_json(start_server, case):
    reply, fields, expected, _ = CASES[case]
    served = await start_server(FakeEngine(reply=reply))
    client = await ResponsesClient.open(served.port, CODEX_HEADERS)
    events = await client.create(body(**fields))
    await client.aclose()
    assert signatures([(event["type"], event) for event in events]) == expected
    sse = await post_stream(served.port, "/v1/responses", body(**fields))
    assert [without_volatile(event) for event in events] == [without_volatile(data) for _, data in sse]


async def test_permessage_deflate_is_negotiated_and_plain_sockets_work_too(start_server):
    served = await start_server(FakeEngine(reply=PLAIN))
    compressed = await ResponsesClient.open(served.port)
    assert "permessage-deflate" in (compressed.connection.response.headers.get("sec-websocket-extensions") or "")
    plain = await ResponsesClient.open(served.port, compression=None)
    assert plain.connection.response.headers.get("sec-websocket-extensions") is None
    for client in (compressed, plain):
        events = await client.create(body())
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == PLAIN
        await client.aclose()


async def test_previous_response_id_rebuilds_the_conversation_from_the_socket_chain(start_server):
    engine = FakeEngine(reply=ONE_CALL)
    served = await start_server(engine)
    client = await ResponsesClient.open(served.port, CODEX_HEADERS)
    first = await client.create(body(input="What is the weather in Paris?", tools=TOOLS))
    response = first[-1]["response"]
    call = response["output"][1]
    engine.reply = PLAIN
    follow_up = [{"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny, 24 C"}]
    second = await client.create(body(input=follow_up, tools=TOOLS, previous_response_id=response["id"]))
    assert second[-1]["type"] == "response.completed"
    assert second[-1]["response"]["previous_response_id"] == response["id"]
    prompt = bytes(engine.generations[-1].prompt_ids).decode()
    assert prompt.index("What is the weather in Paris?") < prompt.rindex("get_weather") < prompt.index("Sunny, 24 C")
    await client.aclose()


async def test_warm_up_is_answered_without_the_model_and_chains(start_server):
    engine = FakeEngine(reply=PLAIN)
    served = await start_server(engine)
    client = await ResponsesClient.open(served.port, CODEX_HEADERS)
    warm_up = await client.create(body(input=[{"role": "developer", "content": "You are Codex."}], generate=False))
    assert [event["type"] for event in warm_up] == ["response.created", "response.in_progress",
                                                    "response.completed"]
    assert warm_up[-1]["response"]["output"] == [] and engine.generations == []
    events = await client.create(body(input="hello", previous_response_id=warm_up[-1]["response"]["id"]))
    assert events[-1]["type"] == "response.completed"
    prompt = bytes(engine.generations[0].prompt_ids).decode()
    assert prompt.index("You are Codex.") < prompt.index("hello")
    await client.aclose()


async def test_errors_carry_status_and_the_socket_stays_usable(start_server):
    served = await start_server(FakeEngine(reply=PLAIN, max_ctx=256))
    client = await ResponsesClient.open(served.port)
    (unknown,) = await client.create(body(previous_response_id="resp_nope"))
    assert unknown["type"] == "error" and unknown["status"] == 400
    assert unknown["error"]["code"] == "previous_response_not_found" and "resp_nope" in unknown["error"]["message"]
    (too_long,) = await client.create(body(input="x" * 400))
    assert too_long["status"] == 400 and too_long["error"]["code"] == "context_length_exceeded"
    (bad_field,) = await client.create(body(input=42))
    assert bad_field["status"] == 400 and bad_field["error"]["type"] == "invalid_request_error"
    await client.send("not json")
    not_json = await client.receive()
    assert not_json["type"] == "error" and not_json["status"] == 400
    await client.send({"type": "response.cancel"})
    unsupported = await client.receive()
    assert unsupported["status"] == 400 and "response.cancel" in unsupported["error"]["message"]
    await client.send({"type": "response.processed", "response_id": "resp_x"})  # no answer expected
    events = await client.create(body())
    assert events[-1]["type"] == "response.completed"
    await client.aclose()


async def test_a_second_create_waits_for_the_first(start_server):
    engine = FakeEngine(reply=PLAIN, decode_step_s=0.01)
    served = await start_server(engine)
    client = await ResponsesClient.open(served.port)
    await client.send({"type": "response.create", **body(input="first")})
    await client.send({"type": "response.create", **body(input="second")})
    first = await client.until_terminal()
    second = await client.until_terminal()
    assert first[-1]["type"] == second[-1]["type"] == "response.completed"
    assert [event["sequence_number"] for event in first] == list(range(len(first)))
    assert first[0]["response"]["id"] != second[0]["response"]["id"]
    assert [event["sequence_number"] for event in second] == list(range(len(second)))
    assert len(engine.generations) == 2
    await client.aclose()


async def test_a_dropped_connection_cancels_the_job(start_server):
    engine = FakeEngine(endless=True, decode_step_s=0.01)
    served = await start_server(engine)
    client = await ResponsesClient.open(served.port)
    await client.send({"type": "response.create", **body(max_output_tokens=100000)})
    await wait_until(lambda: engine.generations and engine.generations[0].stats.generated_tokens >= 3)
    client.drop()
    await wait_until(lambda: engine.idle, timeout=5)
    assert engine.generations[0].stats.generated_tokens < 100000
    health = await request(served.port, "GET", "/health")
    assert health.status == 200


async def test_the_handshake_needs_the_api_key(start_server):
    served = await start_server(FakeEngine(reply=PLAIN), api_keys=["k-1"])
    with pytest.raises(InvalidStatus) as refused:
        await ResponsesClient.open(served.port)
    assert refused.value.response.status_code == 401
    client = await ResponsesClient.open(served.port, [("authorization", "Bearer k-1")])
    events = await client.create(body())
    assert events[-1]["type"] == "response.completed"
    await client.aclose()


async def test_a_bad_handshake_is_a_plain_http_error(start_server):
    served = await start_server(FakeEngine(reply=PLAIN))
    reply = await request(served.port, "GET", "/v1/responses",
                          headers=[("upgrade", "websocket"), ("connection", "Upgrade"),
                                   ("sec-websocket-version", "8"), ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")])
    assert reply.status == 426 and "Sec-WebSocket-Version" in reply.json()["error"]["message"]
    missing_key = await request(served.port, "GET", "/v1/responses",
                                headers=[("upgrade", "websocket"), ("connection", "Upgrade"),
                                         ("sec-websocket-version", "13")])
    assert missing_key.status == 400


async def test_a_message_over_the_body_limit_closes_with_1009(start_server):
    served = await start_server(FakeEngine(reply=PLAIN), max_body_bytes=4096)
    client = await ResponsesClient.open(served.port)
    await client.send({"type": "response.create", **body(input="x" * 10000)})
    with pytest.raises(ConnectionClosed) as closed:
        await client.receive()
    assert closed.value.rcvd.code == 1009


async def test_long_prefills_send_in_progress_events(start_server):
    engine = FakeEngine(reply=PLAIN, prefill_chunk=1, prefill_step_s=0.05)
    served = await start_server(engine, keepalive_s=0.2)
    client = await ResponsesClient.open(served.port)
    events = await client.create(body(input="a long enough prompt " * 3))
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.count("response.in_progress") >= 3 and kinds[-1] == "response.completed"
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    await client.aclose()


async def test_pings_are_answered(start_server):
    served = await start_server(FakeEngine(reply=PLAIN))
    client = await ResponsesClient.open(served.port)
    pong = await trio.to_thread.run_sync(client.connection.ping)
    assert await trio.to_thread.run_sync(lambda: pong.wait(5))
    await client.aclose()
