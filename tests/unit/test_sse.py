"""SSE framing and the keep-alive ticker, on trio's autojump clock (no engine, no sockets)."""

from __future__ import annotations

import trio

from dflash.http.sse import KEEPALIVE_COMMENT, frame, open_sse_stream


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
    async with open_sse_stream(writer, keepalive_s=15):
        assert writer.status == 200
        assert writer.headers["content-type"].startswith("text/event-stream")
        assert writer.headers["cache-control"] == "no-cache"
        assert writer.writes == []
    assert writer.ended


async def test_keep_alive_only_while_nothing_is_written(autojump_clock):
    writer = RecordingWriter()
    start = trio.current_time()
    async with open_sse_stream(writer, keepalive_s=15) as sse:
        await trio.sleep(40)  # silent (queued, or one long prefill chunk): comments at 15 and 30
        await sse.send("token")  # at 40
        for _ in range(5):  # events every 10 s: no comment needed
            await trio.sleep(10)
            await sse.send("token")
        await trio.sleep(20)  # silent again: one comment, 15 s after the last event
    comments = [round(at - start) for at, data in writer.writes if data == KEEPALIVE_COMMENT]
    assert comments == [15, 30, 105]
