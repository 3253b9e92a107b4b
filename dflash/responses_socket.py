"""OpenAI Responses over one WebSocket per client session (Codex's `supports_websockets`).

Each text message from the client is a Responses request with `"type": "response.create"`;
the server answers with text messages holding exactly the JSON events the SSE stream carries,
ending with `response.completed` (or `.incomplete` / `.failed`). One response runs at a time; a
request that arrives meanwhile waits its turn.

The socket keeps its own chain of responses (whatever `store` says): Codex sends
`previous_response_id` and only the new input items, and the conversation is rebuilt from that
chain. `generate: false` (Codex's warm-up) is answered without running the model and is
chainable like any other response. Errors before a response starts are
`{"type": "error", "status": ..., "error": {...}}` (Codex treats an error without `status` as no
failure at all); errors after it started are `response.failed`. A dropped connection cancels the
running job at its next step.
"""

from __future__ import annotations

import json
import math
from contextlib import aclosing

import trio

from dflash.chat.parser import new_call_id
from dflash.http.server import Request, RequestDone, RequestObserver
from dflash.http.websocket import WebSocket, WebSocketClosed
from dflash.logs import get_logger
from dflash.protocols import fields, responses
from dflash.protocols.conversation import conversation_key
from dflash.protocols.errors import APIError, openai_error_body
from dflash.protocols.response_store import ResponseStore
from dflash.reply import Replies
from dflash.reply_stream import ReplyStream
from dflash.responses_turn import begin_turn

log = get_logger("dflash.http")

CHAIN_KEPT = 32  # responses a socket can chain from; Codex continues the latest one
QUEUED_MAX = 4  # response.create messages waiting behind the running one


class ResponsesSocket:
    def __init__(self, replies: Replies, stored: ResponseStore, socket: WebSocket, upgrade: Request, *,
                 owner: str | None, keepalive_s: float, log_text: bool = False,
                 on_response: RequestObserver = lambda done: None):
        self._replies = replies
        self._stored = stored  # the server's store (`store: true` responses, GET /v1/responses/{id})
        self._socket = socket
        self._upgrade = upgrade
        self._owner = owner  # the handshake's API key digest: whose stored responses it may continue
        self._keepalive_s = keepalive_s
        self._log_text = log_text
        self._on_response = on_response  # told of each response as its log line is written
        self._chain = ResponseStore(CHAIN_KEPT)
        self.responses_served = 0

    async def serve(self) -> None:
        """Until the client closes or drops the connection (or the server cancels us)."""
        send_request, receive_request = trio.open_memory_channel[bytes](math.inf)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read, send_request, nursery.cancel_scope)
                async with receive_request:
                    async for body in receive_request:
                        await self._answer(body)
        except WebSocketClosed:
            pass

    async def _read(self, requests: trio.MemorySendChannel[bytes], session: trio.CancelScope) -> None:
        """Reads every message, so pings are answered and a drop is noticed while a response runs."""
        async with requests:
            try:
                while True:
                    message = await self._socket.receive_message()
                    if isinstance(message, bytes):
                        await self._socket.close(1003, "binary messages are not accepted; send JSON text")
                        break
                    try:
                        kind = _message_type(message)
                    except APIError as error:
                        await self._send_error(error)
                        continue
                    if kind == "response.create":
                        if requests.statistics().current_buffer_used >= QUEUED_MAX:
                            await self._send_error(APIError(429, f"{QUEUED_MAX} response.create messages are "
                                                                 "already waiting on this socket"))
                        else:
                            requests.send_nowait(message.encode())
                    elif kind != "response.processed":  # an acknowledgement; nothing to answer
                        await self._send_error(APIError(400, f"unsupported message type {kind!r}; expected "
                                                             "'response.create'", param="type"))
            except WebSocketClosed:
                pass
        session.cancel()  # the client is gone: the running job stops at its next step

    async def _answer(self, body: bytes) -> None:
        request = Request(method="WS", target=self._upgrade.target, headers=self._upgrade.headers)
        request.log["dialect"] = "responses_websocket"
        started = trio.current_time()
        status = 200
        try:
            await self._respond(request, body)
        except APIError as error:
            status = error.status
            await self._send_error(error)
        finally:
            self.responses_served += 1
            duration_s = trio.current_time() - started
            disconnected = self._socket.closed is not None
            log.info("request", id=request.id, method=request.method, path=request.path, status=status,
                     duration_ms=round(duration_s * 1000, 1), client_disconnected=disconnected, **request.log)
            self._on_response(RequestDone(request.id, request.method, request.path, status, duration_s, disconnected,
                                          request.log))

    async def _respond(self, request: Request, body: bytes) -> None:
        parsed = responses.parse_request(body)
        request.log["previous_response_id"] = parsed.previous_response_id
        turn = begin_turn((self._chain, self._stored), parsed, owner=self._owner, missing_status=400)
        render = turn.renderer(self._replies.model.model_id)
        if fields.boolean(fields.json_object(body), "generate", default=True) is False:
            await self._send(render.opening() + render.finish_without_output())
            self._chain.put(render.response_id, render.body(), turn.conversation(()), self._owner)
            return
        # The upgrade request's headers carry Codex's session_id for every response on this socket.
        conversation = conversation_key(session_header=request.header("session_id"),
                                        prompt_cache_key=parsed.prompt_cache_key)
        reply = self._replies.prepare(turn.request.generation, call_id=new_call_id, request_id=request.id,
                                      conversation=conversation)
        first_job = await self._replies.submit(reply)  # refusals come before anything is sent
        try:
            stream = ReplyStream(render, self._send, self._keepalive_s)
            async with aclosing(self._replies.streamed(reply, render, first_job)) as batches:
                await stream.run(batches)
        finally:
            first_job.cancel()
            request.log.update(reply.log_fields(with_text=self._log_text))
        self._chain.put(render.response_id, render.body(), turn.conversation(render.output_messages()), self._owner)
        turn.store(self._stored, render, self._owner)

    async def _send(self, events) -> None:
        for _, payload in events:
            await self._socket.send_text(_json(payload))

    async def _send_error(self, error: APIError) -> None:
        await self._socket.send_text(_json({"type": "error", "status": error.status, **openai_error_body(error)}))


def _json(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def _message_type(message: str) -> str:
    try:
        payload = json.loads(message)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"a WebSocket message must be a JSON object: {exc}") from None
    if not isinstance(payload, dict):
        raise APIError(400, f"a WebSocket message must be a JSON object, got {type(payload).__name__}")
    return payload.get("type")
