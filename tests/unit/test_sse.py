"""SSE framing and headers (no engine, no sockets); the keep-alive is test_reply_stream.py's."""

from __future__ import annotations

import trio

from dflash.http.sse import frame, open_sse_stream


class RecordingWriter:
    def __init__(self):
        self.writes: list[tuple[float, bytes]] = []
        self.status = None
        self.ended = False

    async def start(self, status, headers=()):
        self.status = status
        self.headers = dict(headers)

    async def write(self, data: bytes) -> None:
        self.writes.append((trio.current_time(), data))

    async def end(self) -> None:
        self.ended = True


def test_frames():
    assert frame('{"a":1}') == b'data: {"a":1}\n\n'
    assert frame("x", event="message_start") == b"event: message_start\ndata: x\n\n"
    assert frame("two\nlines") == b"data: two\ndata: lines\n\n"


async def test_headers_go_out_before_any_event(autojump_clock):
    writer = RecordingWriter()
    async with open_sse_stream(writer):
        assert writer.status == 200
        assert writer.headers["content-type"].startswith("text/event-stream")
        assert writer.headers["cache-control"] == "no-cache"
        assert writer.writes == []
    assert writer.ended
