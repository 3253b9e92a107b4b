"""HTTP/1.1 on trio streams with h11: one task per connection, persistent connections, limits.

Bytes in, `Request` out; a handler's writes in, bytes out. Nothing here knows what a model is.
It reads like h11's own trio example: a thin wrapper moves bytes between the socket and h11's
state machine, and every wait on the peer is bounded by a timeout from `Limits`.

A request the server refuses before any handler sees it (400 malformed, 408 too slow, 413 too
big, 431 headers too big) is answered with `Connection: close`, and the connection is closed
after a short lingering read so the client gets the answer rather than a reset.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable, Sequence
from http import HTTPStatus

import attrs
import h11
import trio

from dflash.logs import get_logger

RECEIVE_SIZE = 64 * 1024
# After refusing a request, how long (and how much) to keep reading the client's unread bytes so
# closing the socket does not turn into a TCP reset that destroys our answer in flight.
LINGER_S = 1.0
LINGER_BYTES = 4 * 1024 * 1024

log = get_logger("dflash.http")


@attrs.frozen
class Limits:
    max_header_bytes: int
    max_body_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    idle_timeout_s: float


class ClientGone(Exception):
    """The peer closed or reset the connection, or stopped reading for longer than the idle timeout."""


class _Refused(Exception):
    """A request the server answers itself, before any handler; the connection then closes."""

    def __init__(self, status: int, message: str, request: Request | None = None):
        super().__init__(f"{status} {message}")
        self.status = status
        self.message = message
        self.request = request  # None when the request line and headers never parsed


@attrs.define(eq=False)
class Request:
    method: str
    target: str
    headers: list[tuple[str, str]]  # names lower-case, as h11 gives them
    body: bytes = b""
    id: str = attrs.field(factory=lambda: secrets.token_hex(8))
    # Fields a handler adds to this request's log line (token counts, timings, dialect).
    log: dict = attrs.field(factory=dict)

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]

    @property
    def query(self) -> str:
        return self.target.partition("?")[2]

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((value for key, value in self.headers if key == name), None)


@attrs.frozen
class Response:
    status: int
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json(cls, status: int, payload, headers: Sequence[tuple[str, str]] = ()) -> Response:
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        return cls(status, body, (("content-type", "application/json"), *headers))


@attrs.frozen
class RequestDone:
    """A finished request as its log line tells it, for whoever watches requests (metrics)."""

    id: str | None
    method: str | None
    path: str | None  # None when the request line never parsed
    status: int | None  # None when nothing was sent
    duration_s: float
    client_disconnected: bool
    fields: dict  # what the handler added to the log line (dialect, token counts, timings)


class _Connection:
    """One socket and its h11 state machine. Sends are serialized: a handler and its SSE ticker
    may write concurrently, and h11's state must advance in the order the bytes go out."""

    def __init__(self, stream: trio.SocketStream, limits: Limits):
        self.stream = stream
        self.limits = limits
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self._send_lock = trio.Lock()

    async def send(self, event) -> None:
        # Uncontended, take the lock without a checkpoint: an event that produces no bytes (the end
        # of a Content-Length body) then completes even if the peer has just closed after reading
        # everything, and the request is not mistaken for a disconnect.
        try:
            self._send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self._send_lock.acquire()
        try:
            data = self.h11.send(event)
            if data:
                await self._send_bytes(data)
        finally:
            self._send_lock.release()

    async def _send_bytes(self, data: bytes) -> None:
        with trio.move_on_after(self.limits.idle_timeout_s) as stalled:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ClientGone("peer closed the connection") from exc
        if stalled.cancelled_caught:
            raise ClientGone(f"peer stopped reading for {self.limits.idle_timeout_s:g}s")

    async def receive(self) -> bool:
        """Feed the next bytes from the socket to h11; False once the peer has closed."""
        try:
            data = await self.stream.receive_some(RECEIVE_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        self.h11.receive_data(data)
        return bool(data)

    async def receive_while_responding(self) -> bool:
        """Like `receive`, for the peer-close watcher. Bytes that arrive now belong to a pipelined
        next request and wait in h11's buffer; past one header's worth we stop reading, so a client
        cannot grow that buffer without bound (its stalls are still caught by the idle timeout)."""
        if len(self.h11.trailing_data[0]) > self.limits.max_header_bytes:
            await trio.sleep_forever()
        return await self.receive()

    async def send_raw(self, data: bytes) -> None:
        """Bytes of the protocol the connection switched to (WebSocket frames)."""
        async with self._send_lock:
            await self._send_bytes(data)

    async def receive_raw(self) -> bytes:
        try:
            return await self.stream.receive_some(RECEIVE_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    def has_buffered_bytes(self) -> bool:
        data, closed = self.h11.trailing_data
        return bool(data) or closed

    async def next_event(self):
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise _Refused(exc.error_status_hint, str(exc)) from None
            if event is not h11.NEED_DATA:
                return event
            await self.receive()

    async def linger_and_close(self) -> None:
        with trio.move_on_after(LINGER_S):
            try:
                await self.stream.send_eof()
                drained = 0
                while drained < LINGER_BYTES and (data := await self.stream.receive_some(RECEIVE_SIZE)):
                    drained += len(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        await trio.aclose_forcefully(self.stream)


class PeerCloseWatcher:
    """Reads the socket while a request is being answered and cancels the request's scope when the
    peer closes. Without it a closed client is only noticed on the next write, which never comes
    for a queued job, a long prefill, or a non-streaming request."""

    def __init__(self, receive_more: Callable[[], Awaitable[bool]], scope: trio.CancelScope):
        self._receive_more = receive_more
        self._scope = scope
        self.peer_closed = False

    async def run(self) -> None:
        while await self._receive_more():
            pass
        self.peer_closed = True
        self._scope.cancel()


class ResponseWriter:
    """Writes the response to one request: status and headers, body pieces, end.

    The common headers (CORS, request id) go on every response; a HEAD request gets the headers
    of its GET and no body. Each write gives up with ClientGone after `idle_timeout_s` of a peer
    that does not read."""

    def __init__(self, connection: _Connection, request: Request, common_headers: Sequence[tuple[str, str]],
                 closing: bool):
        self._connection = connection
        self._is_head = request.method == "HEAD"
        self._headers = [*common_headers, ("x-request-id", request.id)]
        if closing:
            self._headers.append(("connection", "close"))
        self.status: int | None = None
        self.finished = False

    @property
    def started(self) -> bool:
        return self.status is not None

    async def start(self, status: int, headers: Sequence[tuple[str, str]] = ()) -> None:
        self.status = status
        await self._connection.send(h11.Response(status_code=status, headers=[*headers, *self._headers],
                                                 reason=_reason(status)))

    async def write(self, data: bytes) -> None:
        if data and not self._is_head:
            await self._connection.send(h11.Data(data=data))

    async def end(self) -> None:
        await self._connection.send(h11.EndOfMessage())
        self.finished = True

    async def send(self, response: Response) -> None:
        await self.start(response.status, [*response.headers, ("content-length", str(len(response.body)))])
        await self.write(response.body)
        await self.end()

    async def switch_protocols(self, headers: Sequence[tuple[str, str]]) -> tuple[_Connection, bytes]:
        """Answer an upgrade request with 101; the connection's bytes then belong to the caller.
        Returns the connection (its `send_raw`/`receive_raw`) and the bytes the peer sent early."""
        self.status = 101
        await self._connection.send(h11.InformationalResponse(status_code=101, headers=[*headers, *self._headers],
                                                              reason=_reason(101)))
        self.finished = True
        early_bytes, _ = self._connection.h11.trailing_data
        return self._connection, bytes(early_bytes)


Handler = Callable[[Request, ResponseWriter], Awaitable[Response | None]]
# (path or None when the request line never parsed, status, message) -> the refusal's response.
ErrorResponder = Callable[[str | None, int, str], Response]
CommonHeaders = Callable[[Request | None], Sequence[tuple[str, str]]]
RequestObserver = Callable[[RequestDone], None]


def plain_error(path: str | None, status: int, message: str) -> Response:
    return Response.json(status, {"error": {"message": message, "status": status}})


class HTTPServer:
    def __init__(self, handler: Handler, limits: Limits, *, common_headers: CommonHeaders = lambda request: (),
                 error_response: ErrorResponder = plain_error, on_request: RequestObserver = lambda done: None):
        self._handler = handler
        self._on_request = on_request
        self.limits = limits
        self._common_headers = common_headers
        self._error_response = error_response
        self._accepting = trio.CancelScope()
        self.closing = False
        self.active_requests = 0
        self._requests_done = trio.Event()

    async def serve(self, listeners: list[trio.SocketListener], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Accept until `stop_accepting`, then wait for the open connections to end."""
        async with trio.open_nursery() as connections:
            with self._accepting:
                await trio.serve_listeners(self._serve_connection, listeners, handler_nursery=connections,
                                           task_status=task_status)

    def stop_accepting(self) -> None:
        """Close the listeners; responses from now on carry `Connection: close`."""
        self.closing = True
        self._accepting.cancel()

    async def wait_no_requests(self) -> None:
        while self.active_requests:
            await self._requests_done.wait()

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        connection = _Connection(stream, self.limits)
        try:
            reused = False
            while (request := await self._receive_request(connection, reused)) is not None:
                if not await self._respond(connection, request):
                    return
                connection.h11.start_next_cycle()
                reused = True
        except _Refused as refusal:
            await self._refuse(connection, refusal)
        except ClientGone:
            pass
        except Exception:
            log.exception("connection_failed")

    async def _receive_request(self, connection: _Connection, reused: bool) -> Request | None:
        # Until the first byte nobody waits for an answer: an idle connection closes quietly, after
        # the idle timeout between keep-alive requests or the header timeout on a fresh one.
        quiet_s = self.limits.idle_timeout_s if reused else self.limits.header_timeout_s
        with trio.move_on_after(quiet_s) as quiet:
            if not connection.has_buffered_bytes() and not await connection.receive():
                return None
        if quiet.cancelled_caught:
            return None
        with trio.move_on_after(self.limits.header_timeout_s) as slow:
            event = await connection.next_event()
        if slow.cancelled_caught:
            raise _Refused(408, f"request headers not received within {self.limits.header_timeout_s:g}s")
        if isinstance(event, h11.ConnectionClosed):
            return None
        # h11 bounds only headers that are still arriving; a head that came in one read is measured here.
        head_bytes = len(event.target) + sum(len(name) + len(value) + 4 for name, value in event.headers)
        if head_bytes > self.limits.max_header_bytes:
            raise _Refused(431, f"request headers of {head_bytes} bytes are over the limit of "
                                f"{self.limits.max_header_bytes} bytes")
        request = Request(
            method=event.method.decode("ascii"),
            target=event.target.decode("latin-1"),
            headers=[(name.decode("latin-1"), value.decode("latin-1")) for name, value in event.headers],
        )
        request.body = await self._receive_body(connection, request)
        return request

    async def _receive_body(self, connection: _Connection, request: Request) -> bytes:
        limit = self.limits.max_body_bytes
        declared = request.header("content-length")  # h11 has checked it is a number
        if declared is not None and int(declared) > limit:
            raise _Refused(413, f"request body of {int(declared)} bytes is over the limit of {limit} bytes",
                           request)
        if connection.h11.they_are_waiting_for_100_continue:
            await connection.send(h11.InformationalResponse(status_code=100, headers=[]))
        body = bytearray()
        with trio.move_on_after(self.limits.body_timeout_s):
            while True:
                event = await connection.next_event()
                if isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > limit:  # chunked bodies declare no length: stop at the crossing
                        raise _Refused(413, f"request body is over the limit of {limit} bytes", request)
                elif isinstance(event, h11.EndOfMessage):
                    return bytes(body)
                elif isinstance(event, h11.ConnectionClosed):
                    raise ClientGone("peer closed the connection while sending the body")
        raise _Refused(408, f"request body not received within {self.limits.body_timeout_s:g}s", request)

    async def _respond(self, connection: _Connection, request: Request) -> bool:
        """Run the handler with a peer-close watcher beside it; True if the connection can be reused."""
        writer = ResponseWriter(connection, request, self._common_headers(request), self.closing)
        started = trio.current_time()
        client_disconnected = False
        self.active_requests += 1
        try:
            if _asks_for_upgrade(request):
                # The handler may take the socket over (WebSocket): nothing else may read it.
                await self._run_handler(request, writer)
            else:
                async with trio.open_nursery() as nursery:
                    watcher = PeerCloseWatcher(connection.receive_while_responding, nursery.cancel_scope)
                    nursery.start_soon(watcher.run)
                    await self._run_handler(request, writer)
                    nursery.cancel_scope.cancel()
                client_disconnected = watcher.peer_closed and not writer.finished
        except* ClientGone:
            client_disconnected = True
        finally:
            self.active_requests -= 1
            if not self.active_requests:
                self._requests_done.set()
                self._requests_done = trio.Event()
            duration_s = trio.current_time() - started
            log.info("request", id=request.id, method=request.method, path=request.path, status=writer.status,
                     duration_ms=round(duration_s * 1000, 1), client_disconnected=client_disconnected, **request.log)
            self.observe(RequestDone(request.id, request.method, request.path, writer.status, duration_s,
                                     client_disconnected, request.log))
        return writer.finished and connection.h11.our_state is h11.DONE and connection.h11.their_state is h11.DONE

    def observe(self, done: RequestDone) -> None:
        """Tell the request observer; its failure is logged, never the request's."""
        try:
            self._on_request(done)
        except Exception:
            log.exception("request_observer_failed", path=done.path)

    async def _run_handler(self, request: Request, writer: ResponseWriter) -> None:
        """The one place a handler's unexpected error is caught: answered with a 500 in the path's
        error shape while nothing has been sent; after that the response stays incomplete and the
        connection closes, which is all a client can still be told."""
        try:
            response = await self._handler(request, writer)
            if response is not None:
                await writer.send(response)
        except* ClientGone:
            raise
        except* Exception:
            log.exception("handler_failed", id=request.id, path=request.path)
            if not writer.started:
                await writer.send(self._error_response(request.path, 500, "internal server error"))

    async def _refuse(self, connection: _Connection, refusal: _Refused) -> None:
        request = refusal.request
        if connection.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            response = self._error_response(request.path if request else None, refusal.status, refusal.message)
            headers = [*response.headers, ("content-length", str(len(response.body))),
                       *self._common_headers(request), ("connection", "close")]
            try:
                await connection.send(h11.Response(status_code=refusal.status, headers=headers,
                                                   reason=_reason(refusal.status)))
                await connection.send(h11.Data(data=response.body))
                await connection.send(h11.EndOfMessage())
            except ClientGone:
                pass
        log.info("request", id=request.id if request else None, method=request.method if request else None,
                 path=request.path if request else None, status=refusal.status, refused=refusal.message,
                 client_disconnected=False)
        self.observe(RequestDone(request.id if request else None, request.method if request else None,
                                 request.path if request else None, refusal.status, 0.0, False, {}))
        await connection.linger_and_close()


def _asks_for_upgrade(request: Request) -> bool:
    return request.header("upgrade") is not None


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""
