"""Soak: a steady mix of every kind of client against a live server for N minutes (loopback only).

A few generation clients (plus a /health prober every 0.5 s and a few idle keep-alive holders)
loop over: the three dialects streaming and not; forced tool calls with the tool's result sent
back for a final answer; structured output; Responses over WebSocket (turns chained by
previous_response_id, now and then a malformed message or a dropped socket); clients that
disconnect while queued or mid-stream; malformed requests (bad JSON, wrong field types: 4xx);
oversized bodies (declared or chunked past `max_body_bytes`: 413).

Every request ends as one outcome: ok, 4xx expected, 429 (queue full: counted, not a failure),
5xx, disconnected (by us), hang (no answer within the limit) or unexpected (any other status, an
in-stream error, a broken reply). Each minute ends with a quiet point: new work waits, running
work finishes, the server goes idle, and its resident memory, open descriptors and threads are
read from /proc. The verdict: no 5xx, hangs or unexpected outcomes; memory and descriptors flat
(the last quiet point within 5% of the one after warm-up); /health p99 under 100 ms while
generation requests are in flight; no handler_failed / connection_failed (or any error) in the
server's log; exit code 0 after SIGTERM.

    python bench/soak.py [--minutes 5] [--fake] [--clients 4] [--seed 0] [--warmup-s 30]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import attrs
import h11
import trio
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.live_server import LiveServer, percentile, report_verdict  # noqa: E402
from dflash.engine.cpu import cpu_kind  # noqa: E402
from tests.unit.dialects import sse_event  # noqa: E402
from tests.unit.rawhttp import RawClient, request  # noqa: E402
from tests.unit.wsclient import ResponsesClient  # noqa: E402

OUTCOMES = ("ok", "4xx expected", "429", "5xx", "disconnected", "hang", "unexpected")
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
DIALECTS = tuple(PATHS)
MODEL = "soak-model"
MAX_BODY_BYTES = 2**20
IDLE_TIMEOUT_S = 10.0
IDLE_HOLDERS = 4
PROBE_EVERY_S = 0.5
HEALTH_P99_LIMIT_S = 0.1
FLAT_FRACTION = 0.05
WARMUP_S = 30.0
ERROR_EVENTS = ("handler_failed", "connection_failed")
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
               "required": ["city", "population"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOL_RESULT = "Sunny, 24 C, light wind from the west."
PROMPTS = ("What is the capital of France?", "Write a Python function that reverses a string.",
           "Explain what a hash map is in two sentences.", "Name three prime numbers.",
           "What does `git rebase` do?", "Suggest a name for a cat.")
# The fake model's script for every request: some text, then a call the tool turns can answer.
FAKE_REPLY = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@attrs.frozen
class Profile:
    """What differs between the fake engine and the real model."""

    fake: bool
    max_tokens: int
    hang_limit_s: float  # a request without its answer this long is a hang
    queued_disconnect_s: float  # disconnect-while-queued clients leave within this

    @property
    def engine(self) -> str:
        return "fake" if self.fake else "embedded:smollm2-135m-instruct"


FAKE = Profile(fake=True, max_tokens=128, hang_limit_s=10.0, queued_disconnect_s=0.5)
REAL = Profile(fake=False, max_tokens=40, hang_limit_s=300.0, queued_disconnect_s=3.0)
FAKE_ARGS = ("--prefill-step-ms", "5", "--decode-step-ms", "5", "--prefill-chunk", "64", "--reply", FAKE_REPLY)


@attrs.frozen
class Sample:
    """The server process at a quiet point."""

    rss_bytes: int
    fds: int
    threads: int
    cache_bytes: int = 0  # every cache tier's bytes, from /metrics


@attrs.define
class Tally:
    outcomes: Counter = attrs.Factory(Counter)
    ttft_s: list[float] = attrs.Factory(list)
    health_s: list[float] = attrs.Factory(list)
    health_busy_s: list[float] = attrs.Factory(list)  # probes sent while generation requests ran
    problems: list[str] = attrs.Factory(list)  # what each 5xx, hang or unexpected outcome was


@attrs.frozen
class Minute:
    index: int
    tally: Tally
    sample: Sample


@attrs.define
class Report:
    profile: Profile
    cpu: str
    baseline: Sample | None = None
    minutes: list[Minute] = attrs.Factory(list)
    warmup: Tally | None = None  # counted in the verdict, not in the table's rows
    log_errors: list[str] = attrs.Factory(list)
    exit_code: int | None = None

    def tallies(self) -> list[Tally]:
        return ([self.warmup] if self.warmup is not None else []) + [minute.tally for minute in self.minutes]

    def count(self, outcome: str) -> int:
        return sum(tally.outcomes[outcome] for tally in self.tallies())

    @property
    def health_busy_s(self) -> list[float]:
        return [latency for tally in self.tallies() for latency in tally.health_busy_s]

    @property
    def problems(self) -> list[str]:
        return [problem for tally in self.tallies() for problem in tally.problems]

    def fds_flat(self) -> bool:
        # Compared at quiet points only (no connection of ours open, the server idle, the count
        # steady), where every descriptor left is the server's own: listener, epoll, log, pipes.
        # A leaked socket or file shows as a count that does not come back; one descriptor of
        # slack covers a lazily opened one (e.g. a worker thread's wakeup pipe).
        last = self.minutes[-1].sample.fds
        return abs(last - self.baseline.fds) <= max(1, FLAT_FRACTION * self.baseline.fds)

    def rss_flat(self) -> bool:
        return abs(self.minutes[-1].sample.rss_bytes - self.baseline.rss_bytes) <= FLAT_FRACTION * self.baseline.rss_bytes

    def failures(self) -> list[str]:
        checks = [
            (self.count("5xx") == 0, f"{self.count('5xx')} 5xx replies"),
            (self.count("hang") == 0, f"{self.count('hang')} hangs"),
            (self.count("unexpected") == 0, f"{self.count('unexpected')} unexpected outcomes"),
            (self.rss_flat(), f"memory not flat: {mib(self.baseline.rss_bytes)} MiB after warm-up, "
                              f"{mib(self.minutes[-1].sample.rss_bytes)} MiB at the end"),
            (self.fds_flat(), f"descriptors not flat: {self.baseline.fds} after warm-up, "
                              f"{self.minutes[-1].sample.fds} at the end"),
            (percentile(self.health_busy_s, 0.99) < HEALTH_P99_LIMIT_S,
             f"/health p99 while busy {percentile(self.health_busy_s, 0.99) * 1000:.1f} ms"),
            (not self.log_errors, f"{len(self.log_errors)} error events in the server log"),
            (self.exit_code == 0, f"exit code {self.exit_code} after SIGTERM"),
        ]
        return [failure for holds, failure in checks if not holds]


class Load:
    """Where the client tasks record outcomes, and the gate that pauses them for a quiet point."""

    def __init__(self, port: int, profile: Profile):
        self.port = port
        self.profile = profile
        self.tally = Tally()
        self.generating = 0  # generation requests in flight: the engine is busy
        self._running = 0  # scenarios in progress
        self._open = trio.Event()
        self._open.set()
        self._pausing = trio.Event()

    @contextlib.asynccontextmanager
    async def scenario(self):
        # Event.wait() yields even when set: look again before counting in, or a quiet point that
        # began meanwhile would sample with this scenario running.
        while not self._open.is_set():
            await self._open.wait()
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1

    async def nap(self, seconds: float) -> bool:
        """Sleep; False when a quiet point cut it short."""
        with trio.move_on_after(seconds):
            await self._pausing.wait()
            return False
        return True

    async def pause(self) -> None:
        self._open = trio.Event()
        self._pausing.set()
        while self._running:
            await trio.sleep(0.05)

    def resume(self) -> None:
        self._pausing = trio.Event()
        self._open.set()

    def take_tally(self) -> Tally:
        tally, self.tally = self.tally, Tally()
        return tally

    def record(self, outcome: str, problem: str = "", ttft_s: float | None = None) -> None:
        self.tally.outcomes[outcome] += 1
        if ttft_s is not None:
            self.tally.ttft_s.append(ttft_s)
        if outcome in ("5xx", "hang", "unexpected"):
            self.tally.problems.append(f"{outcome}: {problem}")


@attrs.frozen
class Result:
    outcome: str
    problem: str = ""
    ttft_s: float | None = None
    final: object = None  # the JSON reply, or the stream's last event


def status_outcome(status: int, *, expected: int = 200) -> str:
    if status == expected:
        return "ok" if expected == 200 else "4xx expected"
    if status == 429:
        return "429"
    if status >= 500:
        return "5xx"
    return "unexpected"


# ---- request bodies ----------------------------------------------------------------------------

def plain_body(dialect: str, text: str, max_tokens: int, stream: bool) -> dict:
    if dialect == "responses":
        return {"model": MODEL, "input": text, "max_output_tokens": max_tokens, "stream": stream, "store": False}
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "stream": stream}


def structured_body(dialect: str, text: str, max_tokens: int, stream: bool) -> dict:
    body = plain_body(dialect, f"{text} Answer with a city and its population as JSON.", max_tokens, stream)
    if dialect == "chat":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}
    elif dialect == "messages":
        body["output_format"] = {"type": "json_schema", "schema": CITY_SCHEMA}
    else:
        body["text"] = {"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA}}
    return body


def tools_of(dialect: str) -> list[dict]:
    if dialect == "chat":
        return [{"type": "function", "function": WEATHER}]
    if dialect == "messages":
        return [{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}]
    return [{"type": "function", **WEATHER}]


def forced_call_body(dialect: str, max_tokens: int) -> dict:
    body = plain_body(dialect, "What is the weather in Paris right now?", max_tokens, stream=False)
    body["tools"] = tools_of(dialect)
    body["tool_choice"] = {"type": "any"} if dialect == "messages" else "required"
    return body


def follow_up_body(dialect: str, first: dict, reply: dict, stream: bool) -> dict | None:
    """The tool's result for the first call in `reply`, for a final answer; None without a call."""
    body = {**first, "stream": stream, "tool_choice": {"type": "auto"} if dialect == "messages" else "auto"}
    if dialect == "chat":
        message = reply["choices"][0]["message"]
        if not message.get("tool_calls"):
            return None
        call = message["tool_calls"][0]
        body["messages"] = [*first["messages"], {key: message[key] for key in ("role", "content", "tool_calls")},
                            {"role": "tool", "tool_call_id": call["id"], "content": TOOL_RESULT}]
    elif dialect == "messages":
        calls = [block for block in reply["content"] if block["type"] == "tool_use"]
        if not calls:
            return None
        body["messages"] = [*first["messages"], {"role": "assistant", "content": reply["content"]},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0]["id"],
                                                          "content": TOOL_RESULT}]}]
    else:
        calls = [item for item in reply["output"] if item["type"] == "function_call"]
        if not calls:
            return None
        call = {key: calls[0][key] for key in ("type", "call_id", "name", "arguments")}
        body["input"] = [{"role": "user", "content": first["input"]}, call,
                         {"type": "function_call_output", "call_id": call["call_id"], "output": TOOL_RESULT}]
    return body


WRONG_TYPES = {
    "chat": {"model": MODEL, "messages": "hello", "max_tokens": "ten"},
    "messages": {"model": MODEL, "max_tokens": "ten", "messages": [{"role": "user", "content": 5}]},
    "responses": {"model": MODEL, "input": 5, "stream": "yes"},
}


# ---- streams -----------------------------------------------------------------------------------

def stream_failed(dialect: str, name: str | None, data) -> bool:
    if dialect == "chat":
        return isinstance(data, dict) and "error" in data
    if dialect == "messages":
        return name == "error"
    return data["type"] in ("response.failed", "error")


def stream_output(dialect: str, name: str | None, data) -> bool:
    """Whether this event carries generated output (the first one is the TTFT)."""
    if dialect == "chat":
        delta = data["choices"][0]["delta"] if isinstance(data, dict) and data.get("choices") else {}
        return any(delta.get(key) for key in ("content", "reasoning_content", "tool_calls"))
    if dialect == "messages":
        return name in ("content_block_start", "content_block_delta")
    return data["type"].endswith(".delta") or data["type"] == "response.output_item.added"


def stream_end(dialect: str, name: str | None, data) -> bool:
    if dialect == "chat":
        return data == "[DONE]"
    if dialect == "messages":
        return name == "message_stop"
    return data["type"] in ("response.completed", "response.incomplete")


# ---- one HTTP request --------------------------------------------------------------------------

async def generate(load: Load, dialect: str, body: dict, *, leave_after_events: int | None = None) -> Result:
    """POST a generation request, record its outcome and return it. With `leave_after_events`
    the client disconnects after that many stream events."""
    load.generating += 1
    try:
        with trio.move_on_after(load.profile.hang_limit_s):
            result = await _post(load.port, dialect, body, leave_after_events)
            load.record(result.outcome, f"{dialect} {result.problem}", result.ttft_s)
            return result
        load.record("hang", f"{dialect} stream={body.get('stream')} after {load.profile.hang_limit_s:g}s")
        return Result("hang")
    finally:
        load.generating -= 1


async def _post(port: int, dialect: str, body: dict, leave_after_events: int | None) -> Result:
    client = await RawClient.open(port)
    try:
        began = time.monotonic()
        await client.send_request("POST", PATHS[dialect], json_body=body)
        status, _ = await client.read_head()
        if status != 200:
            answer = b"".join([piece async for piece in client.read_body_pieces()])
            return Result(status_outcome(status), f"status {status}: {answer[:300]!r}")
        if not body.get("stream"):
            return Result("ok", final=json.loads(b"".join([piece async for piece in client.read_body_pieces()])))
        return await _read_stream(client, dialect, began, leave_after_events)
    finally:
        await client.aclose()


async def _read_stream(client: RawClient, dialect: str, began: float, leave_after_events: int | None) -> Result:
    ttft_s, last, events = None, None, 0
    async for record in client.read_sse_records():
        name, data = sse_event(record)
        if data is None:
            continue
        if stream_failed(dialect, name, data):
            return Result("unexpected", f"in-stream error: {json.dumps(data)[:300]}")
        if ttft_s is None and stream_output(dialect, name, data):
            ttft_s = time.monotonic() - began
        if stream_end(dialect, name, data):
            last = data
        events += 1
        if events == leave_after_events:
            return Result("disconnected", ttft_s=ttft_s)
    if last is None:
        return Result("unexpected", "the stream ended without its final event")
    return Result("ok", ttft_s=ttft_s, final=last)


async def expect_refusal(load: Load, target: str, send, expected: int) -> None:
    """Record the status the server answers to what `send(client)` writes (a 4xx expected)."""
    with trio.move_on_after(load.profile.hang_limit_s):
        client = await RawClient.open(load.port)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_sending, send, client)
                status, _ = await client.read_head()
                nursery.cancel_scope.cancel()
            load.record(status_outcome(status, expected=expected), f"{target}: expected {expected}, got {status}")
        finally:
            await client.aclose()
        return
    load.record("hang", f"{target}: no answer (expected {expected})")


async def _sending(send, client: RawClient) -> None:
    # The server answers 413 before the body is all sent, and then stops reading it.
    with contextlib.suppress(OSError, trio.BrokenResourceError, trio.ClosedResourceError):
        await send(client)


# ---- scenarios ---------------------------------------------------------------------------------

async def plain_turn(load: Load, rng: random.Random) -> None:
    dialect = rng.choice(DIALECTS)
    await generate(load, dialect, plain_body(dialect, rng.choice(PROMPTS), load.profile.max_tokens, rng.random() < 0.5))


async def structured_turn(load: Load, rng: random.Random) -> None:
    dialect = rng.choice(DIALECTS)
    body = structured_body(dialect, rng.choice(PROMPTS), load.profile.max_tokens, rng.random() < 0.5)
    await generate(load, dialect, body)


async def tool_turns(load: Load, rng: random.Random) -> None:
    """A forced call, then its result sent back for the final answer."""
    dialect = rng.choice(DIALECTS)
    first = forced_call_body(dialect, load.profile.max_tokens)
    result = await generate(load, dialect, first)
    if result.outcome == "ok":
        follow_up = follow_up_body(dialect, first, result.final, rng.random() < 0.5)
        if follow_up is not None:
            await generate(load, dialect, follow_up)


async def disconnect_while_queued(load: Load, rng: random.Random) -> None:
    """Send a request and leave before (most likely) its answer, whatever it was doing."""
    dialect = rng.choice(DIALECTS)
    body = plain_body(dialect, rng.choice(PROMPTS), load.profile.max_tokens, rng.random() < 0.5)
    client = await RawClient.open(load.port)
    try:
        await client.send_request("POST", PATHS[dialect], json_body=body)
        await trio.sleep(rng.uniform(0, load.profile.queued_disconnect_s))
    finally:
        await client.aclose()
    load.record("disconnected")


async def disconnect_mid_stream(load: Load, rng: random.Random) -> None:
    dialect = rng.choice(DIALECTS)
    body = plain_body(dialect, rng.choice(PROMPTS), load.profile.max_tokens, stream=True)
    await generate(load, dialect, body, leave_after_events=rng.randint(1, 6))


async def malformed(load: Load, rng: random.Random) -> None:
    dialect = rng.choice(DIALECTS)
    body = b'{"model": "soak", "messages": [' if rng.random() < 0.5 else json.dumps(WRONG_TYPES[dialect]).encode()

    async def send(client: RawClient) -> None:
        await client.send_request("POST", PATHS[dialect], body=body, headers=[("content-type", "application/json")])

    await expect_refusal(load, f"malformed {dialect}", send, 400)


async def oversized(load: Load, rng: random.Random) -> None:
    dialect = rng.choice(DIALECTS)
    chunked = rng.random() < 0.5

    async def send(client: RawClient) -> None:
        headers = [("host", "127.0.0.1"), ("content-type", "application/json")]
        headers.append(("transfer-encoding", "chunked") if chunked else ("content-length", str(MAX_BODY_BYTES + 1)))
        await client.send_raw(client.h11.send(h11.Request(method="POST", target=PATHS[dialect], headers=headers)))
        piece = b" " * 65536
        for _ in range(MAX_BODY_BYTES // len(piece) + 2):
            await client.send_raw(client.h11.send(h11.Data(data=piece)))

    await expect_refusal(load, f"oversized {'chunked' if chunked else 'declared'} {dialect}", send, 413)


async def websocket_turns(load: Load, rng: random.Random) -> None:
    """Three Responses turns on one socket chained by previous_response_id: a question, a forced
    call, the call's result. Sometimes a malformed message first, sometimes a drop mid-turn."""
    client = await ResponsesClient.open(load.port)  # its own open_timeout bounds the handshake
    try:
        if rng.random() < 0.3:
            await websocket_turn(load, client, {"input": 5}, expect_error=400)
        drop_in_last = rng.random() < 0.2
        tools = {"tools": tools_of("responses")}
        turns = [{"input": rng.choice(PROMPTS)}, {"input": "And the weather in Paris?", **tools, "tool_choice": "required"}]
        previous = None
        for index, turn in enumerate(turns):
            previous = await websocket_turn(load, client, {**turn, "previous_response_id": previous and previous["id"]},
                                            leave=drop_in_last and index == len(turns) - 1)
            if previous is None:
                return
        calls = [item for item in previous["output"] if item["type"] == "function_call"]
        if calls:
            result = [{"type": "function_call_output", "call_id": calls[0]["call_id"], "output": TOOL_RESULT}]
            await websocket_turn(load, client, {"input": result, **tools, "previous_response_id": previous["id"]})
    finally:
        if rng.random() < 0.5:
            await client.aclose()
        else:
            await trio.to_thread.run_sync(client.drop)  # gone without a Close frame, as Codex often is


async def websocket_turn(load: Load, client: ResponsesClient, fields: dict, *, expect_error: int | None = None,
                         leave: bool = False) -> dict | None:
    """One response.create; the finished response when it is ok."""
    body = {"type": "response.create", "model": MODEL, "max_output_tokens": load.profile.max_tokens,
            "store": False, **{key: value for key, value in fields.items() if value is not None}}
    load.generating += 1
    try:
        result = await _websocket_exchange(client, body, load.profile.hang_limit_s, leave)
    finally:
        load.generating -= 1
    if expect_error is not None:
        expected = result.final is not None and result.final.get("status") == expect_error
        load.record("4xx expected" if expected else "unexpected", f"websocket: expected error {expect_error}, "
                                                                 f"got {json.dumps(result.final)[:300]}")
        return None
    load.record(result.outcome, f"websocket {result.problem}", result.ttft_s)
    return result.final["response"] if result.outcome == "ok" else None


async def _websocket_exchange(client: ResponsesClient, body: dict, limit: float, leave: bool) -> Result:
    began = time.monotonic()
    await client.send(body)
    ttft_s = None
    while True:
        left = limit - (time.monotonic() - began)
        if left <= 0:
            return Result("hang", f"no final event within {limit:g}s")
        try:
            event = await client.receive(timeout=left)
        except TimeoutError:
            return Result("hang", f"no final event within {limit:g}s")
        if event["type"] == "error":
            return Result(status_outcome(event.get("status", 0)), f"error event {json.dumps(event)[:300]}",
                          final=event)
        if event["type"] == "response.failed":
            return Result("unexpected", f"response.failed {json.dumps(event)[:300]}", final=event)
        if ttft_s is None and stream_output("responses", None, event):
            ttft_s = time.monotonic() - began
            if leave:
                return Result("disconnected", ttft_s=ttft_s)
        if stream_end("responses", None, event):
            return Result("ok", ttft_s=ttft_s, final=event)


SCENARIOS = ((plain_turn, 3), (structured_turn, 2), (tool_turns, 2), (websocket_turns, 1),
             (disconnect_while_queued, 1), (disconnect_mid_stream, 1), (malformed, 1), (oversized, 1))


# ---- the client tasks --------------------------------------------------------------------------

async def generation_client(load: Load, rng: random.Random) -> None:
    scenarios, weights = zip(*SCENARIOS)
    while True:
        await run_scenario(load, rng.choices(scenarios, weights)[0], rng)


async def idle_holder(load: Load, rng: random.Random) -> None:
    while True:
        await run_scenario(load, hold_idle, rng)


async def run_scenario(load: Load, scenario, rng: random.Random) -> None:
    async with load.scenario():
        try:
            await scenario(load, rng)
        except Exception as exc:  # a refused connection, a broken reply: an outcome, not the end of the soak
            load.record("unexpected", f"{scenario.__name__}: {exc!r}")


async def hold_idle(load: Load, rng: random.Random) -> None:
    """A keep-alive connection left idle: reused before the server's idle timeout, and found
    closed by the server after it."""
    client = await RawClient.open(load.port)
    try:
        reply = await client.request("GET", "/health")
        load.record(status_outcome(reply.status), f"idle holder /health {reply.status}")
        outlive = rng.random() < 0.5
        idle_s = IDLE_TIMEOUT_S + rng.uniform(2, 4) if outlive else rng.uniform(1, IDLE_TIMEOUT_S - 2)
        if not await load.nap(idle_s):
            return
        if outlive:
            if not await client.is_closed_by_peer(timeout=3):
                load.record("unexpected", f"idle connection still open {idle_s:.1f}s after its last request")
            return
        reply = await client.request("GET", "/health")
        load.record(status_outcome(reply.status), f"idle holder reuse /health {reply.status}")
    finally:
        await client.aclose()


async def prober(load: Load) -> None:
    while True:
        await run_scenario(load, probe_health, None)
        await trio.sleep(PROBE_EVERY_S)


async def probe_health(load: Load, rng: None) -> None:
    """One /health on a fresh connection, as a load balancer's check: its latency, not an outcome."""
    busy = load.generating > 0
    began = time.monotonic()
    with trio.move_on_after(load.profile.hang_limit_s):
        reply = await request(load.port, "GET", "/health")
        latency = time.monotonic() - began
        load.tally.health_s.append(latency)
        if busy:
            load.tally.health_busy_s.append(latency)
        if reply.status != 200:
            load.record(status_outcome(reply.status), f"/health {reply.status}")
        return
    load.record("hang", f"/health unanswered after {load.profile.hang_limit_s:g}s")


# ---- quiet points and the run ------------------------------------------------------------------

def process_sample(pid: int) -> Sample:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return Sample(rss_bytes=int(status["VmRSS"].split()[0]) * 1024, fds=len(os.listdir(f"/proc/{pid}/fd")),
                  threads=int(status["Threads"]))


async def server_idle(port: int) -> bool:
    state = (await request(port, "GET", "/")).json()
    return state["state"] == "idle" and state["queue_depth"] == 0


async def quiet_sample(load: Load, pid: int) -> Sample:
    """Pause the clients, let running work finish and the server go idle, read the process once its
    descriptor count holds still (closed connections take a moment to be noticed), resume."""
    await load.pause()
    with trio.fail_after(load.profile.hang_limit_s):
        while not await server_idle(load.port):
            await trio.sleep(0.05)
    readings = [process_sample(pid)]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (len(readings) >= 5 and len({r.fds for r in readings[-5:]}) == 1):
        await trio.sleep(0.1)
        readings.append(process_sample(pid))
    sample = attrs.evolve(readings[-1], cache_bytes=await cache_bytes(load.port))
    load.resume()
    return sample


async def cache_bytes(port: int) -> int:
    """The bytes the server's caches hold (prefix, exact and disk tiers), as /metrics reports them."""
    reply = await request(port, "GET", "/metrics")
    families = text_string_to_metric_families(reply.body.decode())
    return int(sum(sample.value for family in families if family.name == "dflash_cache_bytes"
                   for sample in family.samples))


async def soak(server: LiveServer, profile: Profile, *, minutes: int, clients: int = 4, seed: int = 0,
               warmup_s: float = WARMUP_S, out=print) -> Report:
    """Run the mix for `minutes` against `server`, printing a row per minute; the report of the run
    (without the server's log and exit code, which `run_soak` adds)."""
    report = Report(profile, cpu_kind())
    load = Load(server.port, profile)
    rng = random.Random(seed)
    out(f"soak: {profile.engine} engine, CPU {report.cpu}, {clients} clients + /health prober + "
        f"{IDLE_HOLDERS} idle keep-alive connections, {minutes} min, seed {seed}")
    began = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(generation_client, load, random.Random(rng.random()))
        for _ in range(IDLE_HOLDERS):
            nursery.start_soon(idle_holder, load, random.Random(rng.random()))
        nursery.start_soon(prober, load)
        await trio.sleep_until(began + warmup_s)
        report.baseline = await quiet_sample(load, server.pid)
        report.warmup = load.take_tally()  # the warm-up's traffic is not the first minute's
        out(f"after {warmup_s:g}s warm-up: {mib(report.baseline.rss_bytes)} MiB, {report.baseline.fds} fds, "
            f"{report.baseline.threads} threads\n")
        out(TABLE_HEADER)
        measured_from = trio.current_time()  # the minutes count after the warm-up and its quiet point
        for index in range(1, minutes + 1):
            await trio.sleep_until(measured_from + 60 * index)
            sample = await quiet_sample(load, server.pid)
            report.minutes.append(Minute(index, load.take_tally(), sample))
            out(table_row(report.minutes[-1]))
        await load.pause()
        nursery.cancel_scope.cancel()
    return report


async def run_soak(profile: Profile, *, minutes: int, clients: int = 4, seed: int = 0, warmup_s: float = WARMUP_S,
                   cache_mib: int | None = None, out=print) -> tuple[Report, LiveServer]:
    """Start a server, soak it, stop it; the report and the server (whose log is still on disk).
    `cache_mib` bounds the memory caches, so that they fill during the warm-up and a leak shows as
    growth after it."""
    server = LiveServer(fake=profile.fake, fake_args=FAKE_ARGS if profile.fake else (), server={
        "max_body_bytes": MAX_BODY_BYTES, "idle_timeout_s": IDLE_TIMEOUT_S, "queue_max": 64, "keepalive_s": 1.0,
        "shutdown_grace_s": 5}, cache=None if cache_mib is None else {"memory_budget_mib": cache_mib})
    with server:
        report = await soak(server, profile, minutes=minutes, clients=clients, seed=seed, warmup_s=warmup_s, out=out)
        report.exit_code = server.stop()
    report.log_errors = [json.dumps(event)[:500] for event in server.events()
                         if event.get("event") in ERROR_EVENTS or event.get("level") in ("error", "critical")]
    return report, server


# ---- output ------------------------------------------------------------------------------------

COLUMNS = ("min", *OUTCOMES, "ttft p50 s", "ttft p99 s", "health p50 ms", "health p99 ms", "rss MiB", "fds",
           "threads", "cache bytes")
WIDTHS = [max(len(name), 6) for name in COLUMNS]
TABLE_HEADER = "  ".join(name.ljust(width) for name, width in zip(COLUMNS, WIDTHS)) + "\n" + \
               "  ".join("-" * width for width in WIDTHS)


def table_row(minute: Minute) -> str:
    tally, sample = minute.tally, minute.sample
    cells = [minute.index, *(tally.outcomes[outcome] for outcome in OUTCOMES),
             f"{percentile(tally.ttft_s, 0.5):.2f}", f"{percentile(tally.ttft_s, 0.99):.2f}",
             f"{percentile(tally.health_s, 0.5) * 1000:.1f}", f"{percentile(tally.health_s, 0.99) * 1000:.1f}",
             f"{mib(sample.rss_bytes)}", sample.fds, sample.threads, f"{mib(sample.cache_bytes)} MiB"]
    return "  ".join(str(cell).ljust(width) for cell, width in zip(cells, WIDTHS))


def print_summary(report: Report, out=print) -> None:
    totals = ", ".join(f"{outcome} {report.count(outcome)}" for outcome in OUTCOMES)
    out(f"\ntotal: {totals}")
    out(f"/health while busy: p50 {percentile(report.health_busy_s, 0.5) * 1000:.1f} ms, "
        f"p99 {percentile(report.health_busy_s, 0.99) * 1000:.1f} ms over {len(report.health_busy_s)} probes")
    out(f"memory {mib(report.baseline.rss_bytes)} -> {mib(report.minutes[-1].sample.rss_bytes)} MiB, "
        f"descriptors {report.baseline.fds} -> {report.minutes[-1].sample.fds} (quiet points: after warm-up, "
        f"at the end); server exit code {report.exit_code}")
    for line in [*report.problems[:20], *report.log_errors[:10]]:
        out(f"  {line}")


def mib(size: int) -> str:
    return f"{size / 2**20:.1f}"


async def main_async(args) -> int:
    report, server = await run_soak(FAKE if args.fake else REAL, minutes=args.minutes, clients=args.clients,
                                    seed=args.seed, warmup_s=args.warmup_s, cache_mib=args.cache_mib)
    print_summary(report)
    return report_verdict(server, report.failures())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=int, default=5)
    parser.add_argument("--fake", action="store_true", help="serve the unit tests' fake engine, not the model")
    parser.add_argument("--clients", type=int, default=4, help="concurrent generation clients")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-s", type=float, default=WARMUP_S,
                        help="seconds before the memory and descriptor baseline (the prefix caches fill meanwhile)")
    parser.add_argument("--cache-mib", type=int, default=None,
                        help="[cache] memory_budget_mib for the server (default: the config default)")
    args = parser.parse_args()
    if args.minutes < 1 or not 0 < args.warmup_s < 60 * args.minutes:
        parser.error("--minutes must be at least 1 and --warmup-s shorter than the run")
    return trio.run(main_async, args)


if __name__ == "__main__":
    sys.exit(main())
