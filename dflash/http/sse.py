"""Server-sent events: framing and the `: keep-alive` ticker.

Two framings: `data:` lines only (OpenAI Chat Completions) and `event:` + `data:` (Anthropic
Messages, OpenAI Responses). Both come from `frame`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

import trio

KEEPALIVE_COMMENT = b": keep-alive\n\n"
SSE_HEADERS = (
    ("content-type", "text/event-stream; charset=utf-8"),
    ("cache-control", "no-cache"),
    # nginx and friends buffer responses unless told not to; a buffered stream defeats keep-alive.
    ("x-accel-buffering", "no"),
)


class BodyWriter(Protocol):
    async def start(self, status: int, headers: Sequence[tuple[str, str]] = ()) -> None: ...
    async def write(self, data: bytes) -> None: ...
    async def end(self) -> None: ...


def frame(data: str, event: str | None = None) -> bytes:
    """One SSE record. Data with newlines becomes several `data:` lines, which the client rejoins."""
    lines = [f"event: {event}\n"] if event is not None else []
    lines += [f"data: {line}\n" for line in data.split("\n")]
    return ("".join(lines) + "\n").encode()


class SSEStream:
    """An event stream on a started response, with a keep-alive ticker beside it.

    The ticker writes `: keep-alive` whenever nothing has gone out for `keepalive_s`: while the job
    waits in the queue or sits inside a long prefill no events flow, and proxies and HTTP clients
    drop a silent connection. It runs on the clock, not on engine progress, because a single
    prefill chunk can outlast `keepalive_s` and progress callbacks would miss exactly that stall."""

    def __init__(self, writer: BodyWriter, keepalive_s: float, keepalive_frame: Callable[[], bytes] | None = None):
        self._writer = writer
        self._keepalive_s = keepalive_s
        # The dialect's own keep-alive event where it has one (a client's idle timer may count
        # only events, not comments); a comment otherwise.
        self._keepalive_frame = keepalive_frame or (lambda: KEEPALIVE_COMMENT)
        self._last_write = trio.current_time()

    async def send(self, data: str, event: str | None = None) -> None:
        await self._write(frame(data, event))

    async def _write(self, payload: bytes) -> None:
        await self._writer.write(payload)
        self._last_write = trio.current_time()

    async def keep_alive(self) -> None:
        while True:
            await trio.sleep_until(self._last_write + self._keepalive_s)
            if trio.current_time() >= self._last_write + self._keepalive_s:
                await self._write(self._keepalive_frame() or KEEPALIVE_COMMENT)


@asynccontextmanager
async def open_sse_stream(writer: BodyWriter, keepalive_s: float, headers: Sequence[tuple[str, str]] = (), *,
                          keepalive_frame: Callable[[], bytes] | None = None) -> AsyncIterator[SSEStream]:
    """Send the SSE headers now (before any token exists) and keep the stream alive until exit."""
    await writer.start(200, [*SSE_HEADERS, *headers])
    stream = SSEStream(writer, keepalive_s, keepalive_frame)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.keep_alive)
        yield stream
        nursery.cancel_scope.cancel()
    await writer.end()
