"""One handler per endpoint: the routes, and for each the dialect's parse and render.

The way of a reply from a canonical request to a dialect's events is in reply.py, shared with
the other transports; a handler parses the body into a GenerationRequest (a 400 in the dialect's
shape before anything is sent), hands it to the replies, and sends the renderer's events as SSE
or its body as one JSON response.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import secrets
import time
from contextlib import aclosing
from collections.abc import Iterator
from typing import Any

import attrs

from dflash import __version__
from dflash.chat.parser import new_call_id
from dflash.config import Config, ServerConfig
from dflash.engine.cpu import cpu_kind
from dflash.http.routing import CORSPolicy, HostPolicy, Router, is_loopback_host, offered_key
from dflash.http.server import Handler, Request, Response, ResponseWriter
from dflash.http.sse import frame, open_sse_stream
from dflash.http.websocket import HandshakeRefused, accept_websocket
from dflash.metrics import Metrics
from dflash.protocols import anthropic, openai_chat, responses
from dflash.protocols.canonical import SSEEvent
from dflash.protocols.conversation import conversation_key
from dflash.protocols.errors import APIError, anthropic_error_body, openai_error_body
from dflash.protocols.openai_chat import CompletionHeader
from dflash.protocols.response_store import ResponseStore
from dflash.reply import ModelText, Renderer, Replies, Reply
from dflash.reply_stream import ReplyStream
from dflash.responses_socket import ResponsesSocket
from dflash.responses_turn import begin_turn
from dflash.scheduler import Job, Scheduler

RESPONSES_PATH = "/v1/responses"
# The page served at / to browsers, and the files it loads (dflash/web/, shipped in the package).
PAGE = "index.html"
WEB_FILES = {"/web/app.js": ("app.js", "text/javascript; charset=utf-8"),
             "/web/style.css": ("style.css", "text/css; charset=utf-8")}
NO_AUTH_MARK = b'<meta name="dflash-auth" content="none">'
KEY_AUTH_MARK = b'<meta name="dflash-auth" content="api-key">'
# Nothing from elsewhere: scripts, styles and requests stay on this server.
PAGE_POLICY = ("default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
               "frame-ancestors 'none'; form-action 'none'")
ROUTED_PATHS = ("/health", "/", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/messages",
                "/v1/messages/count_tokens", RESPONSES_PATH, *WEB_FILES)


def build_info(config: Config, model: ModelText) -> dict[str, str]:
    """What /metrics (dflash_build_info) and the status page say the server runs."""
    return {"version": __version__, "model": model.model_id, "dtype": config.model.dtype,
            "weights_format": model.weights or model.weights_format, "source_format": model.weights_format,
            "cpu": cpu_kind()}


def wants_html(request: Request) -> bool:
    """A browser's navigation (its Accept names text/html); API clients ask for JSON or anything."""
    return "text/html" in (request.header("accept") or "").lower()


def _web_file(name: str) -> bytes:
    return importlib.resources.files("dflash").joinpath("web", name).read_bytes()


def settings_of(config: Config) -> dict[str, Any]:
    """The configuration as the status page shows it: everything but the API keys themselves."""
    server = {**attrs.asdict(config.server), "api_keys": len(config.server.api_keys)}
    return {"server": server, "model": attrs.asdict(config.model), "speculative": attrs.asdict(config.speculative),
            "cache": attrs.asdict(config.cache)}


def exposure_warnings(server: ServerConfig) -> Iterator[str]:
    """What an operator must hear about at start-up and on `/`."""
    if not is_loopback_host(server.host) and not server.api_keys:
        yield (f"listening on {server.host}, reachable from other machines, without api_keys: anyone who "
               "can connect can use the model")


def dialect_of(path: str | None) -> str:
    return "anthropic" if path is not None and path.startswith("/v1/messages") else "openai"


def api_error_response(path: str | None, error: APIError) -> Response:
    body = anthropic_error_body(error) if dialect_of(path) == "anthropic" else openai_error_body(error)
    return Response.json(error.status, body, error.headers)


def error_response(path: str | None, status: int, message: str) -> Response:
    """For errors answered outside a handler (HTTP limits, routing, auth, a handler's unexpected
    failure), in the path's dialect."""
    return api_error_response(path, APIError(status, message))


class _Routes(Router):
    """The fixed routes, and GET /v1/responses/{id}: the one path with a parameter. A request a
    handler refuses (APIError) is answered in its dialect's shape here; any other error is the
    HTTP server's to answer."""

    def __init__(self, routes, *, get_response: Handler, **settings):
        super().__init__(routes, **settings)
        self._get_response = get_response

    async def __call__(self, request: Request, writer: ResponseWriter) -> Response | None:
        try:
            return await super().__call__(request, writer)
        except APIError as error:
            if writer.started:
                raise
            return api_error_response(request.path, error)

    def _find(self, request: Request) -> Handler | None:
        handler = super()._find(request)
        if handler is None and request.method in ("GET", "HEAD") and request.path.startswith(RESPONSES_PATH + "/"):
            return self._get_response
        return handler


class API:
    def __init__(self, model: ModelText, scheduler: Scheduler, config: Config, metrics: Metrics):
        self._model = model
        self._scheduler = scheduler
        self._metrics = metrics
        self._build = build_info(config, model)
        self._page = _web_file(PAGE)
        if config.server.api_keys:  # the page asks for a key before its first request
            self._page = self._page.replace(NO_AUTH_MARK, KEY_AUTH_MARK)
        self._web_files = {path: (_web_file(name), content_type) for path, (name, content_type) in WEB_FILES.items()}
        self._keepalive_s = config.server.keepalive_s
        self._log_text = config.logging.log_text
        self._config = config
        self._started_monotonic = time.monotonic()
        self._created = int(time.time())
        self.replies = Replies(model, scheduler)
        self.responses = ResponseStore()

    def router(self) -> Router:
        routes = {
            ("GET", "/health"): self.health,
            ("GET", "/"): self.root,
            ("GET", "/metrics"): self.metrics,
            **{("GET", path): self.web_file for path in WEB_FILES},
            ("GET", "/v1/models"): self.models,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("POST", "/v1/messages"): self.messages,
            ("POST", "/v1/messages/count_tokens"): self.count_tokens,
            ("POST", RESPONSES_PATH): self.create_response,
            ("GET", RESPONSES_PATH): self.responses_websocket,
        }
        server = self._config.server
        return _Routes(routes, get_response=self.get_response, error_response=error_response,
                       api_keys=server.api_keys, cors=CORSPolicy(server.cors_origins), is_open=self._is_open,
                       hosts=HostPolicy(enforced=is_loopback_host(server.host), allowed_hosts=server.allowed_hosts))

    def _owner(self, request: Request) -> str | None:
        """Whose stored responses a request may read and continue: those made with the same API
        key (a digest, not the key). Without api_keys every request is the same owner."""
        if not self._config.server.api_keys:
            return None
        return hashlib.sha256((offered_key(request) or "").encode()).hexdigest()[:32]

    # ---- plain endpoints -------------------------------------------------------------------

    async def health(self, request: Request, writer: ResponseWriter) -> Response:
        return Response.json(200, {"status": "ok"})

    def _is_open(self, request: Request) -> bool:
        """Requests answered without an API key besides /health: the page and its files (static,
        no data: the page asks for the key and sends it with its own requests), and /metrics
        when `metrics_auth` is off."""
        if request.path in WEB_FILES or (request.path == "/" and wants_html(request)):
            return True
        return request.path == "/metrics" and not self._config.server.metrics_auth

    async def root(self, request: Request, writer: ResponseWriter) -> Response:
        if wants_html(request):
            return Response(200, self._page, (("content-type", "text/html; charset=utf-8"), ("vary", "Accept"),
                                              ("cache-control", "no-cache"),
                                              ("content-security-policy", PAGE_POLICY)))
        return Response.json(200, self.status_body(), headers=[("vary", "Accept")])

    def status_body(self) -> dict[str, Any]:
        """What `GET /` answers an API client (a cluster adds its replicas)."""
        return {
            "status": "ok",
            "model": self._model.model_id,
            "weights": self._model.weights,
            "kv_cache": self._model.kv_cache,
            "cpu": self._model.cpu,
            "state": self._scheduler.state,
            "queue_depth": self._scheduler.queue_depth,
            "running": self._scheduler.running_jobs(),
            "uptime_s": round(time.monotonic() - self._started_monotonic, 3),
            "version": __version__,
            "warnings": list(exposure_warnings(self._config.server)),
            "build": self._build,
            "settings": settings_of(self._config),
            "recent_requests": list(self._metrics.recent),
        }

    async def metrics(self, request: Request, writer: ResponseWriter) -> Response:
        body, content_type = self._metrics.exposition(request.header("accept"))
        return Response(200, body, (("content-type", content_type),))

    async def web_file(self, request: Request, writer: ResponseWriter) -> Response:
        body, content_type = self._web_files[request.path]
        return Response(200, body, (("content-type", content_type), ("cache-control", "no-cache")))

    async def models(self, request: Request, writer: ResponseWriter) -> Response:
        ids = [self._model.model_id, *self._model.aliases]
        body: dict[str, Any] = {"object": "list", "data": [
            {"id": model_id, "object": "model", "created": self._created, "owned_by": "dflash",
             "context_length": self._model.max_ctx, "max_context_length": self._model.max_ctx}
            for model_id in ids
        ]}
        if "client_version" in request.query:
            # Codex asks for its model catalog this way; the OpenAI list stays beside it.
            body["models"] = [responses.codex_model_entry(model_id, self._model.max_ctx, priority)
                              for priority, model_id in enumerate(ids, start=1)]
        return Response.json(200, body)

    async def responses_websocket(self, request: Request, writer: ResponseWriter) -> None:
        request.log["dialect"] = "responses_websocket"
        try:
            socket = await accept_websocket(request, writer, max_message_bytes=self._config.server.max_body_bytes)
        except HandshakeRefused as refused:
            raise APIError(refused.status, str(refused)) from None
        session = ResponsesSocket(self.replies, self.responses, socket, request, owner=self._owner(request),
                                  keepalive_s=self._keepalive_s, log_text=self._log_text,
                                  on_response=self._metrics.request_done)
        await session.serve()
        request.log["responses"] = session.responses_served

    async def get_response(self, request: Request, writer: ResponseWriter) -> Response:
        response_id = request.path[len(RESPONSES_PATH) + 1:]
        stored = self.responses.get(response_id, owner=self._owner(request))
        if stored is None:
            raise APIError(404, f"no response with id {response_id!r} is stored", param="response_id")
        return Response.json(200, stored.body)

    async def count_tokens(self, request: Request, writer: ResponseWriter) -> Response:
        request.log["dialect"] = "anthropic_count_tokens"
        parsed = anthropic.parse_request(request.body, counting=True)
        prompt = self.replies.render_prompt(parsed)
        return Response.json(200, {"input_tokens": len(prompt.token_ids)})

    # ---- generation endpoints --------------------------------------------------------------

    async def chat_completions(self, request: Request, writer: ResponseWriter) -> Response | None:
        request.log["dialect"] = "openai_chat"
        chat = openai_chat.parse_request(request.body)
        reply = self.replies.prepare(chat, call_id=new_call_id, request_id=request.id,
                                     conversation=conversation_key(session_header=request.header("session_id")))
        header = CompletionHeader(id=f"chatcmpl-{secrets.token_hex(12)}", created=int(time.time()),
                                  model=chat.model or self._model.model_id)
        return await self._answer(request, writer, reply, openai_chat.ChatCompletionRender(header, chat))

    async def messages(self, request: Request, writer: ResponseWriter) -> Response | None:
        request.log["dialect"] = "anthropic"
        message = anthropic.parse_request(request.body)
        reply = self.replies.prepare(message, call_id=anthropic.new_tool_use_id, request_id=request.id,
                                     conversation=conversation_key(session_header=request.header("session_id"),
                                                                   metadata=message.metadata))
        render = anthropic.MessageRender(f"msg_{secrets.token_hex(12)}", message.model or self._model.model_id,
                                         prompt_tokens=len(reply.prompt.token_ids),
                                         thinking=message.thinking.enabled is True)
        return await self._answer(request, writer, reply, render)

    async def create_response(self, request: Request, writer: ResponseWriter) -> Response | None:
        request.log["dialect"] = "responses"
        owner = self._owner(request)
        parsed = responses.parse_request(request.body)
        # Operators (and the real-client tests) see which turns continued a stored one.
        request.log["previous_response_id"] = parsed.previous_response_id
        turn = begin_turn(self.responses, parsed, owner=owner)
        conversation = conversation_key(session_header=request.header("session_id"),
                                        prompt_cache_key=parsed.prompt_cache_key)
        reply = self.replies.prepare(turn.request.generation, call_id=new_call_id, request_id=request.id,
                                     conversation=conversation)
        render = turn.renderer(self._model.model_id)
        answer = await self._answer(request, writer, reply, render)
        turn.store(self.responses, render, owner=owner)
        return answer

    async def _answer(self, request: Request, writer: ResponseWriter, reply: Reply,
                      render: Renderer) -> Response | None:
        if self._log_text:
            request.log["prompt_text"] = reply.prompt.text
        first_job = await self.replies.submit(reply)  # refusals are answered before anything is sent
        try:
            if reply.request.stream:
                await self._stream(writer, reply, render, first_job)
                return None
            async with aclosing(self.replies.events(reply, render, first_job)) as batches:
                async for _ in batches:
                    pass  # a non-streaming reply sends nothing until the renderer's body is complete
            return Response.json(200, render.body())
        finally:
            first_job.cancel()
            request.log.update(reply.log_fields(with_text=self._log_text))

    async def _stream(self, writer: ResponseWriter, reply: Reply, render: Renderer, first_job: Job) -> None:
        # The headers go out now, before the job runs: the keep-alive covers the queue wait and
        # the prefill, and the opening events tell the client its job has started.
        async with open_sse_stream(writer) as sse:
            async def send(batch: list[SSEEvent]) -> None:
                await sse.write(b"".join(frame(_sse_data(payload), name) for name, payload in batch))

            stream = ReplyStream(render, send, self._keepalive_s, send_idle=sse.comment)
            async with aclosing(self.replies.streamed(reply, render, first_job)) as batches:
                await stream.run(batches)


def _sse_data(payload: str | dict) -> str:
    return payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
