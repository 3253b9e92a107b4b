"""A small HTTP/1.1 test client on one raw trio socket: send exact bytes or h11 requests, read
responses with h11, split SSE bodies into records. Raw so tests can misbehave on purpose."""

from __future__ import annotations

import json
import socket

import attrs
import h11
import trio


@attrs.frozen
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


class RawClient:
    def __init__(self, stream: trio.SocketStream):
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, port: int, *, receive_buffer: int | None = None) -> RawClient:
        if receive_buffer is None:
            return cls(await trio.open_tcp_stream("127.0.0.1", port))
        # Set before connect so the TCP window is small from the start.
        sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        await sock.connect(("127.0.0.1", port))
        return cls(trio.SocketStream(sock))

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def send_request(self, method: str, target: str, *, body: bytes | None = None, json_body=None,
                           headers: list[tuple[str, str]] = ()) -> None:
        if json_body is not None:
            body = json.dumps(json_body).encode()
            headers = [("content-type", "application/json"), *headers]
        given_host = any(name.lower() == "host" for name, _ in headers)
        all_headers = [*([] if given_host else [("host", "127.0.0.1")]), *headers]
        if body is not None:
            all_headers.append(("content-length", str(len(body))))
        data = self.h11.send(h11.Request(method=method, target=target, headers=all_headers))
        if body:
            data += self.h11.send(h11.Data(data=body))
        data += self.h11.send(h11.EndOfMessage())
        await self.stream.send_all(data)

    async def next_event(self):
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.h11.receive_data(await self.stream.receive_some(65536))

    async def read_head(self) -> tuple[int, dict[str, str]]:
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Response):
                return event.status_code, {k.decode(): v.decode() for k, v in event.headers}
            if isinstance(event, h11.ConnectionClosed):  # else the next read returns it again, for ever
                raise ConnectionError("the server closed the connection before answering")

    async def read_body_pieces(self):
        """Yield body bytes as they arrive, until the end of the message."""
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return

    async def read_reply(self) -> Reply:
        status, headers = await self.read_head()
        body = b"".join([piece async for piece in self.read_body_pieces()])
        return Reply(status, headers, body)

    async def request(self, method: str, target: str, **kwargs) -> Reply:
        if self.h11.our_state is h11.DONE:
            self.h11.start_next_cycle()
        await self.send_request(method, target, **kwargs)
        return await self.read_reply()

    async def read_sse_records(self):
        """Yield SSE records (the text between blank lines), comments included."""
        buffer = b""
        async for piece in self.read_body_pieces():
            buffer += piece
            while b"\n\n" in buffer:
                record, buffer = buffer.split(b"\n\n", 1)
                yield record.decode()

    async def is_closed_by_peer(self, timeout: float = 3.0) -> bool:
        """Read what is left; True once the server has closed the connection, False if it has not
        within `timeout`."""
        with trio.move_on_after(timeout):
            try:
                while await self.stream.receive_some(65536):
                    pass
            except trio.BrokenResourceError:
                pass
            return True
        return False

    async def aclose(self) -> None:
        await self.stream.aclose()


async def request(port: int, method: str, target: str, **kwargs) -> Reply:
    client = await RawClient.open(port)
    try:
        return await client.request(method, target, **kwargs)
    finally:
        await client.aclose()


def sse_data(records: list[str]) -> list[str]:
    """The data of each non-comment record."""
    return [record.removeprefix("data: ") for record in records if not record.startswith(":")]
