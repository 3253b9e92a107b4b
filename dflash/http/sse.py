"""Server-sent events: framing, the headers, the `: keep-alive` comment.

Two framings: `data:` lines only (OpenAI Chat Completions) and `event:` + `data:` (Anthropic
Messages, OpenAI Responses). Both come from `frame`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

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
    """An event stream on a started response. What it sends and when it keeps the connection
    alive is the reply's business (reply_stream.ReplyStream); this only frames and writes."""

    def __init__(self, writer: BodyWriter):
        self._writer = writer

    async def write(self, framed: bytes) -> None:
        """Records framed by `frame` (several at once go out in one write)."""
        await self._writer.write(framed)

    async def comment(self) -> None:
        """`: keep-alive`, for a dialect that has no keep-alive event of its own."""
        await self._writer.write(KEEPALIVE_COMMENT)


@asynccontextmanager
async def open_sse_stream(writer: BodyWriter, headers: Sequence[tuple[str, str]] = ()) -> AsyncIterator[SSEStream]:
    """Send the SSE headers now (before any token exists) and end the body on exit."""
    await writer.start(200, [*SSE_HEADERS, *headers])
    yield SSEStream(writer)
    await writer.end()
