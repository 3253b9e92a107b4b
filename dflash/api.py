"""One handler per endpoint: dialect parse -> chat render -> scheduler job -> dialect render.

This is where HTTP, the dialects, the text side of the model and the scheduler meet; each stays
in its own module and this one only joins them.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import attrs

from dflash import __version__
from dflash.config import Config
from dflash.engine.sampling import SamplingParams
from dflash.http.routing import CORSPolicy, Router
from dflash.http.server import Handler, Request, Response, ResponseWriter
from dflash.http.sse import open_sse_stream
from dflash.protocols import openai_chat
from dflash.protocols.canonical import Sampling, Usage
from dflash.protocols.errors import APIError, anthropic_error_body, context_length_error, openai_error_body
from dflash.protocols.openai_chat import CompletionHeader
from dflash.scheduler import EngineFailed, Job, JobStep, QueueFull, Scheduler, ShuttingDown
from dflash.stop_strings import StopStrings

RETRY_AFTER_S = 1


class Detokenizer(Protocol):
    def push(self, token_ids: list[int]) -> str: ...
    def flush(self) -> str: ...


@attrs.frozen
class ModelText:
    """The loaded model as handlers see it: its name, context size and text side, as plain
    callables so a server can run on a fake model (tests, bench --fake) without a tokenizer."""

    model_id: str
    max_ctx: int
    render_prompt: Callable[[list[dict]], list[int]]
    new_detokenizer: Callable[[], Detokenizer]
    aliases: tuple[str, ...] = ()


def dialect_of(path: str | None) -> str:
    return "anthropic" if path is not None and path.startswith("/v1/messages") else "openai"


def api_error_response(path: str | None, error: APIError) -> Response:
    body = anthropic_error_body(error) if dialect_of(path) == "anthropic" else openai_error_body(error)
    return Response.json(error.status, body, error.headers)


def error_response(path: str | None, status: int, message: str) -> Response:
    """For errors found outside a handler (HTTP limits, routing, auth), in the path's dialect."""
    return api_error_response(path, APIError(status, message))


def _answering_errors(handler: Handler) -> Handler:
    async def answer(request: Request, writer: ResponseWriter) -> Response | None:
        try:
            return await handler(request, writer)
        except APIError as error:
            return api_error_response(request.path, error)

    return answer


class API:
    def __init__(self, model: ModelText, scheduler: Scheduler, config: Config):
        self._model = model
        self._scheduler = scheduler
        self._keepalive_s = config.server.keepalive_s
        self._log_text = config.logging.log_text
        self._config = config
        self._started_monotonic = time.monotonic()
        self._created = int(time.time())

    def router(self) -> Router:
        routes = {
            ("GET", "/health"): self.health,
            ("GET", "/"): self.root,
            ("GET", "/v1/models"): self.models,
            ("POST", "/v1/chat/completions"): _answering_errors(self.chat_completions),
        }
        return Router(routes, error_response=error_response, api_keys=self._config.server.api_keys,
                      cors=CORSPolicy(self._config.server.cors_origins))

    async def health(self, request: Request, writer: ResponseWriter) -> Response:
        return Response.json(200, {"status": "ok"})

    async def root(self, request: Request, writer: ResponseWriter) -> Response:
        return Response.json(200, {
            "status": "ok",
            "model": self._model.model_id,
            "state": self._scheduler.state,
            "queue_depth": self._scheduler.queue_depth,
            "uptime_s": round(time.monotonic() - self._started_monotonic, 3),
            "version": __version__,
        })

    async def models(self, request: Request, writer: ResponseWriter) -> Response:
        # Codex adds ?client_version=…; it gets the same OpenAI list.
        ids = [self._model.model_id, *self._model.aliases]
        return Response.json(200, {"object": "list", "data": [
            {"id": model_id, "object": "model", "created": self._created, "owned_by": "dflash",
             "context_length": self._model.max_ctx}
            for model_id in ids
        ]})

    async def chat_completions(self, request: Request, writer: ResponseWriter) -> Response | None:
        request.log["dialect"] = "openai_chat"
        chat = openai_chat.parse_request(request.body)
        prompt_ids = self._render(chat.messages)
        if self._log_text:
            request.log["prompt_text"] = chat.messages
        max_tokens = self._fit_max_tokens(len(prompt_ids), chat.max_tokens)
        job = self._submit(request, prompt_ids, chat.sampling, max_tokens)
        reply = _Reply(self._model.new_detokenizer(), chat.stop, prompt_tokens=len(prompt_ids))
        header = CompletionHeader(id=f"chatcmpl-{secrets.token_hex(12)}", created=int(time.time()),
                                  model=chat.model or self._model.model_id)
        with job:
            try:
                if chat.stream:
                    await self._stream_chat(writer, job, reply, header, include_usage=chat.include_usage)
                    return None
                text = await _collect(job, reply)
                return Response.json(200, openai_chat.render_completion(
                    header, text=text, finish_reason=reply.finish_reason, usage=reply.usage()))
            finally:
                self._record(request, job, reply)

    async def _stream_chat(self, writer: ResponseWriter, job: Job, reply: _Reply, header: CompletionHeader, *,
                           include_usage: bool) -> None:
        # The headers go out now, before the job runs: the keep-alive ticker covers the queue
        # wait and the prefill, and the role chunk tells the client its job has started.
        async with open_sse_stream(writer, self._keepalive_s) as sse:
            async def send_json(payload: dict) -> None:
                await sse.send(json.dumps(payload, ensure_ascii=False, separators=(",", ":")))

            try:
                await job.wait_started()
                await send_json(openai_chat.render_chunk(header, delta={"role": "assistant", "content": ""}))
                await _generate(job, reply,
                                lambda text: send_json(openai_chat.render_chunk(header, delta={"content": text})))
            except (ShuttingDown, EngineFailed) as exc:
                await send_json(openai_chat.render_stream_error(_as_api_error(exc)))
            else:
                usage = reply.usage()
                await send_json(openai_chat.render_chunk(header, delta={}, finish_reason=reply.finish_reason,
                                                         usage=None if include_usage else usage))
                if include_usage:
                    await send_json(openai_chat.render_usage_chunk(header, usage))
            await sse.send("[DONE]")

    def _render(self, messages: list[dict]) -> list[int]:
        # On the event loop, not in a thread: the tokenizer is shared with the detokenizers of
        # running streams, and HF fast tokenizers are not safe to use from two threads at once.
        # Rendering takes milliseconds at the context sizes served here.
        try:
            return self._model.render_prompt(messages)
        except Exception as exc:
            raise APIError(400, f"the conversation cannot be rendered with the model's chat template: {exc}",
                           param="messages") from None

    def _fit_max_tokens(self, prompt_tokens: int, max_tokens: int) -> int:
        """Clamp to the room left in the context (the reply then ends with finish_reason "length");
        refuse only a prompt that leaves no room at all."""
        room = self._model.max_ctx - prompt_tokens
        if room < 1:
            raise context_length_error(self._model.max_ctx, prompt_tokens, max_tokens)
        return min(max_tokens, room)

    def _submit(self, request: Request, prompt_ids: list[int], sampling: Sampling, max_tokens: int) -> Job:
        params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed)
        try:
            return self._scheduler.submit(prompt_ids, params, max_tokens, request_id=request.id)
        except QueueFull as exc:
            raise APIError(429, str(exc), headers=[("retry-after", str(RETRY_AFTER_S))]) from None
        except ShuttingDown as exc:
            raise _as_api_error(exc) from None

    def _record(self, request: Request, job: Job, reply: _Reply) -> None:
        usage = reply.usage()
        request.log.update(
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            prefilled_tokens=usage.prefilled_tokens,
            completion_tokens=usage.completion_tokens,
            finish_reason=reply.finish_reason,
            queue_ms=round(job.queue_ms, 1),
            prefill_ms=round(usage.prefill_ms, 1),
            decode_ms=round(usage.decode_ms, 1),
        )
        if self._log_text:
            request.log["completion_text"] = reply.text


class _Reply:
    """The text side of one generation: detokenized, cut before any stop string, with its numbers."""

    def __init__(self, detokenizer: Detokenizer, stop_strings: tuple[str, ...], *, prompt_tokens: int):
        self._detokenizer = detokenizer
        self._stops = StopStrings(stop_strings)
        self._prompt_tokens = prompt_tokens
        self._parts: list[str] = []
        self._stats = None
        self.finish_reason: str | None = None

    @property
    def stopped_by_string(self) -> bool:
        return self._stops.hit

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def feed(self, step: JobStep) -> str:
        self._stats = step.stats
        if step.finished:
            self.finish_reason = step.finished
        text = self._stops.push(self._detokenizer.push(step.tokens))
        if self._stops.hit:
            self.finish_reason = "stop"
        self._parts.append(text)
        return text

    def finish(self) -> str:
        text = self._stops.push(self._detokenizer.flush()) + self._stops.flush()
        self._parts.append(text)
        if self.finish_reason is None:
            self.finish_reason = "stop"
        return text

    def usage(self) -> Usage:
        stats = self._stats
        if stats is None:
            return Usage(prompt_tokens=self._prompt_tokens)
        return Usage(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.generated_tokens,
                     cached_tokens=stats.cached_tokens, prefilled_tokens=stats.prefilled_tokens,
                     prefill_ms=stats.prefill_ms, decode_ms=stats.decode_ms)


async def _generate(job: Job, reply: _Reply, emit: Callable[[str], Awaitable[None]]) -> None:
    while (step := await job.next_step()) is not None:
        text = reply.feed(step)
        if text:
            await emit(text)
        if reply.stopped_by_string:
            job.cancel()  # nothing after a stop string is wanted: free the engine at the next step
            return
    tail = reply.finish()
    if tail:
        await emit(tail)


async def _collect(job: Job, reply: _Reply) -> str:
    parts: list[str] = []

    async def keep(text: str) -> None:
        parts.append(text)

    try:
        await _generate(job, reply, keep)
    except (ShuttingDown, EngineFailed) as exc:
        raise _as_api_error(exc) from None
    return "".join(parts)


def _as_api_error(exc: Exception) -> APIError:
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc), headers=[("retry-after", str(RETRY_AFTER_S))])
    return APIError(500, str(exc))
