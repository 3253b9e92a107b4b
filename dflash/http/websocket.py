"""WebSocket on top of the HTTP server: the upgrade handshake and message framing, with wsproto.

Nothing here knows what a model or a response is. A handler that wants a WebSocket calls
`accept_websocket(request, writer, ...)`: the handshake is checked (a bad one raises
`HandshakeRefused` before anything is sent, so the handler can answer it as a plain HTTP error),
the 101 goes out through h11, and from then on the socket's bytes belong to a `WebSocket`.

`permessage-deflate` is accepted when the client offers it (Codex does). A message is bounded by
`max_message_bytes` after decompression; a larger one closes the connection with 1009.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import trio
import wsproto
from wsproto import ConnectionType
from wsproto.events import CloseConnection, Message, Ping, TextMessage
from wsproto.extensions import Extension, PerMessageDeflate
from wsproto.utilities import RemoteProtocolError, generate_accept_token

from dflash.http.server import ClientGone, Request

SUPPORTED_VERSION = "13"


class HandshakeRefused(Exception):
    """An upgrade request that is not a valid WebSocket handshake; answered with `status`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class WebSocketClosed(Exception):
    """The peer closed the WebSocket (with a Close frame or by dropping the connection)."""

    def __init__(self, code: int, reason: str = ""):
        super().__init__(f"WebSocket closed ({code}{': ' + reason if reason else ''})")
        self.code = code


class RawStream(Protocol):
    """The connection's socket after the protocol switch (see ResponseWriter.switch_protocols)."""

    async def send_raw(self, data: bytes) -> None: ...
    async def receive_raw(self) -> bytes: ...  # b"" once the peer has closed


class Upgradable(Protocol):
    async def switch_protocols(self, headers: Sequence[tuple[str, str]]) -> tuple[RawStream, bytes]: ...


def is_websocket_upgrade(request: Request) -> bool:
    return request.method == "GET" and (request.header("upgrade") or "").lower() == "websocket"


def _handshake_headers(request: Request, extensions: list[Extension]) -> list[tuple[str, str]]:
    """The 101's headers for a valid handshake (RFC 6455 section 4.2), and the extensions it accepts."""
    if not is_websocket_upgrade(request):
        raise HandshakeRefused(400, "expected a GET request with 'Upgrade: websocket'")
    connection_tokens = [token.lower() for token in _comma_list(request.header("connection"))]
    if "upgrade" not in connection_tokens:
        raise HandshakeRefused(400, f"the 'Connection' header must contain 'Upgrade', got "
                                    f"{request.header('connection')!r}")
    version = request.header("sec-websocket-version")
    if version != SUPPORTED_VERSION:
        raise HandshakeRefused(426, f"unsupported Sec-WebSocket-Version {version!r}; this server speaks "
                                    f"{SUPPORTED_VERSION}")
    key = request.header("sec-websocket-key")
    if not key:
        raise HandshakeRefused(400, "the 'Sec-WebSocket-Key' header is missing")
    headers = [("upgrade", "WebSocket"), ("connection", "Upgrade"),
               ("sec-websocket-accept", generate_accept_token(key.encode()).decode())]
    accepted = _accept_extensions(request.header("sec-websocket-extensions") or "", extensions)
    if accepted:
        headers.append(("sec-websocket-extensions", ", ".join(accepted)))
    return headers


def _accept_extensions(offered: str, extensions: list[Extension]) -> list[str]:
    accepted: list[str] = []
    for offer in _comma_list(offered):
        name = offer.split(";", 1)[0].strip()
        for extension in extensions:
            if extension.name != name or extension.enabled():
                continue
            parameters = extension.accept(offer)
            if parameters is True or parameters == "":
                accepted.append(name)
            elif parameters:
                accepted.append(f"{name}; {parameters}")
    return accepted


def _comma_list(value: str | None) -> list[str]:
    return [piece.strip() for piece in (value or "").split(",") if piece.strip()]


async def accept_websocket(request: Request, writer: Upgradable, *, max_message_bytes: int) -> WebSocket:
    """Answer the upgrade with 101 and return the WebSocket. Raises HandshakeRefused (nothing sent)."""
    deflate = PerMessageDeflate()
    headers = _handshake_headers(request, [deflate])
    stream, early_bytes = await writer.switch_protocols(headers)
    extensions: list[Extension] = [deflate] if deflate.enabled() else []
    return WebSocket(stream, wsproto.Connection(ConnectionType.SERVER, extensions, early_bytes),
                     max_message_bytes=max_message_bytes)


class WebSocket:
    """One server-side WebSocket: whole messages in, text messages out, pings answered.

    `receive_message` is meant for one reader task; `send_text` may be called from several tasks
    (sends are serialized). A peer that stops reading is treated as gone (the stream's sends are
    bounded by the server's idle timeout)."""

    def __init__(self, stream: RawStream, connection: wsproto.Connection, *, max_message_bytes: int):
        self._stream = stream
        self._ws = connection
        self._max_message_bytes = max_message_bytes
        self._send_lock = trio.Lock()
        self.closed: WebSocketClosed | None = None

    async def receive_message(self) -> str | bytes:
        """The next whole message. Raises WebSocketClosed once the connection is over."""
        parts: list[str | bytes] = []
        size = 0
        while True:
            for event in self._ws.events():
                if isinstance(event, Message):
                    parts.append(event.data)
                    size += len(event.data)
                    if size > self._max_message_bytes:
                        await self.close(1009, f"message over {self._max_message_bytes} bytes")
                        raise self.closed
                    if event.message_finished:
                        return ("" if isinstance(event, TextMessage) else b"").join(parts)
                elif isinstance(event, Ping):
                    await self._send(event.response())
                elif isinstance(event, CloseConnection):
                    await self._answer_close(event)
                    raise self.closed
            if self.closed is not None:
                raise self.closed
            data = await self._stream.receive_raw()
            if not data:
                self.closed = WebSocketClosed(1006, "connection dropped without a Close frame")
                raise self.closed
            try:
                self._ws.receive_data(data)
            except RemoteProtocolError as exc:
                await self.close(1002, str(exc))
                raise self.closed from None

    async def send_text(self, text: str) -> None:
        if self.closed is not None:
            raise self.closed
        await self._send(TextMessage(data=text))

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Send a Close frame (once); the connection is over for this side."""
        if self.closed is not None:
            return
        self.closed = WebSocketClosed(code, reason)
        if self._ws.state is wsproto.ConnectionState.OPEN:
            await self._send(CloseConnection(code=code, reason=reason[:120]))

    async def _answer_close(self, event: CloseConnection) -> None:
        self.closed = WebSocketClosed(event.code, event.reason or "")
        if self._ws.state is wsproto.ConnectionState.REMOTE_CLOSING:
            await self._send(event.response())

    async def _send(self, event) -> None:
        async with self._send_lock:
            data = self._ws.send(event)
            try:
                await self._stream.send_raw(data)
            except ClientGone as exc:  # the peer reset the connection or stopped reading
                self.closed = WebSocketClosed(1006, str(exc))
                raise self.closed from None

