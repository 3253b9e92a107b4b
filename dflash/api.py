"""One handler per endpoint: dialect parse -> chat render -> scheduler job -> dialect render.

This is where HTTP, the dialects, the text side of the model and the scheduler meet; each stays
in its own module and this one only joins them. Every generation endpoint runs the same way:
the dialect parses the body into a GenerationRequest (a 400 in the dialect's shape before
anything is sent), the chat template renders it, the scheduler runs it, the output parser turns
tokens into canonical events, and the dialect's renderer turns those into SSE events or a body.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, Protocol

import attrs

from dflash import __version__
from dflash.chat.constraints import Constraint, GrammarPart, reply_constraint
from dflash.chat.parser import OutputParser, new_call_id
from dflash.chat.template import RenderedPrompt
from dflash.chat.tool_memory import ToolMemory
from dflash.config import Config
from dflash.engine.grammar import GrammarError, json_schema_grammar, lark_grammar, regex_grammar
from dflash.engine.sampling import SamplingParams
from dflash.http.routing import CORSPolicy, Router
from dflash.http.server import Handler, Request, Response, ResponseWriter
from dflash.http.sse import open_sse_stream
from dflash.protocols import anthropic, openai_chat, responses
from dflash.protocols.canonical import (Finished, GenerationRequest, Logprobs, Message, OutputEvent, SSEEvent,
                                        TokenLogprob, ToolCall,
                                        Usage)
from dflash.protocols.errors import APIError, anthropic_error_body, context_length_error, openai_error_body
from dflash.protocols.openai_chat import CompletionHeader
from dflash.protocols.response_store import ResponseStore
from dflash.scheduler import EngineFailed, Job, JobStep, QueueFull, Scheduler, ShuttingDown

RETRY_AFTER_S = 1
CHECKED_GRAMMARS_KEPT = 256  # grammars known valid; an agent sends the same tools and schema every turn
RESPONSES_PATH = "/v1/responses"


class Detokenizer(Protocol):
    def push(self, token_ids: list[int]) -> str: ...
    def flush(self) -> str: ...


class PromptRenderer(Protocol):
    def render(self, request: GenerationRequest, memory: ToolMemory | None = None) -> RenderedPrompt: ...


@attrs.frozen
class ModelText:
    """The loaded model as handlers see it: its name, context size and text side, as plain
    objects so a server can run on a fake model (tests, bench --fake) without a tokenizer."""

    model_id: str
    max_ctx: int
    template: PromptRenderer
    new_detokenizer: Callable[[], Detokenizer]
    token_bytes: Callable[[int], bytes]  # one token's text, for logprobs
    vocab_size: int
    aliases: tuple[str, ...] = ()


class Renderer(Protocol):
    """A dialect's view of one reply (see openai_chat.ChatCompletionRender)."""

    def opening(self, index: int = 0) -> list[SSEEvent]: ...
    def events(self, event: OutputEvent, index: int = 0) -> list[SSEEvent]: ...
    def closing(self) -> list[SSEEvent]: ...
    def failure(self, error: APIError) -> list[SSEEvent]: ...
    def body(self) -> dict: ...


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


class _Routes(Router):
    """The fixed routes, and GET /v1/responses/{id}: the one path with a parameter."""

    def __init__(self, routes, *, get_response: Handler, **settings):
        super().__init__(routes, **settings)
        self._get_response = get_response

    def _find(self, request: Request) -> Handler | None:
        handler = super()._find(request)
        if handler is None and request.method in ("GET", "HEAD") and request.path.startswith(RESPONSES_PATH + "/"):
            return self._get_response
        return handler


@attrs.define
class _Served:
    """A generation request on its way: the prompt, the budget and what the jobs reported."""

    request: GenerationRequest
    prompt: RenderedPrompt
    max_tokens: int
    call_id: Callable[[], str]
    constraint: Constraint | None = None  # what the reply must follow (output format, forced tool call)
    usage: Usage = Usage()
    finish_reasons: list[str] = attrs.field(factory=list)
    texts: list[str] = attrs.field(factory=list)
    queue_ms: float = 0.0


class API:
    def __init__(self, model: ModelText, scheduler: Scheduler, config: Config):
        self._model = model
        self._scheduler = scheduler
        self._keepalive_s = config.server.keepalive_s
        self._log_text = config.logging.log_text
        self._config = config
        self._started_monotonic = time.monotonic()
        self._created = int(time.time())
        self.tool_memory = ToolMemory()
        self.responses = ResponseStore()
        self._checked_grammars: OrderedDict[str, None] = OrderedDict()

    def router(self) -> Router:
        routes = {
            ("GET", "/health"): self.health,
            ("GET", "/"): self.root,
            ("GET", "/v1/models"): self.models,
            ("POST", "/v1/chat/completions"): _answering_errors(self.chat_completions),
            ("POST", "/v1/messages"): _answering_errors(self.messages),
            ("POST", "/v1/messages/count_tokens"): _answering_errors(self.count_tokens),
            ("POST", RESPONSES_PATH): _answering_errors(self.create_response),
            ("GET", RESPONSES_PATH): _answering_errors(self.responses_websocket),
        }
        return _Routes(routes, get_response=_answering_errors(self.get_response), error_response=error_response,
                       api_keys=self._config.server.api_keys, cors=CORSPolicy(self._config.server.cors_origins))

    # ---- plain endpoints -------------------------------------------------------------------

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

    async def responses_websocket(self, request: Request, writer: ResponseWriter) -> Response:
        # Codex tries the Responses WebSocket transport first when configured to; 426 sends it
        # straight to HTTP POST, where other statuses make it retry the WebSocket five times.
        raise APIError(426, "the Responses WebSocket transport is not served here; use POST /v1/responses",
                       headers=[("upgrade", "websocket")])

    async def get_response(self, request: Request, writer: ResponseWriter) -> Response:
        response_id = request.path[len(RESPONSES_PATH) + 1:]
        stored = self.responses.get(response_id)
        if stored is None:
            raise APIError(404, f"no response with id {response_id!r} is stored", param="response_id")
        return Response.json(200, stored.body)

    async def count_tokens(self, request: Request, writer: ResponseWriter) -> Response:
        request.log["dialect"] = "anthropic_count_tokens"
        parsed = anthropic.parse_request(request.body, counting=True)
        prompt = self._render(parsed)
        return Response.json(200, {"input_tokens": len(prompt.token_ids)})

    # ---- generation endpoints --------------------------------------------------------------

    async def chat_completions(self, request: Request, writer: ResponseWriter) -> Response | None:
        request.log["dialect"] = "openai_chat"
        chat = openai_chat.parse_request(request.body)
        served = self._prepare(chat, call_id=new_call_id)
        header = CompletionHeader(id=f"chatcmpl-{secrets.token_hex(12)}", created=int(time.time()),
                                  model=chat.model or self._model.model_id)
        render = openai_chat.ChatCompletionRender(header, chat)
        return await self._answer(request, writer, served, render)

    async def messages(self, request: Request, writer: ResponseWriter) -> Response | None:
        request.log["dialect"] = "anthropic"
        message = anthropic.parse_request(request.body)
        served = self._prepare(message, call_id=anthropic.new_tool_use_id)
        render = anthropic.MessageRender(f"msg_{secrets.token_hex(12)}", message.model or self._model.model_id,
                                         prompt_tokens=len(served.prompt.token_ids))
        return await self._answer(request, writer, served, render)

    async def create_response(self, request: Request, writer: ResponseWriter) -> Response | None:
        request.log["dialect"] = "responses"
        parsed = responses.parse_request(request.body)
        earlier: tuple = ()
        if parsed.previous_response_id is not None:
            # Operators (and the real-client tests) see which turns continued a stored one.
            request.log["previous_response_id"] = parsed.previous_response_id
            previous = self.responses.get(parsed.previous_response_id)
            if previous is None:
                raise APIError(404, f"previous response {parsed.previous_response_id!r} is not stored (it was "
                                    "created with store=false, or the server restarted or forgot it)",
                               param="previous_response_id")
            earlier = previous.conversation
            parsed = responses.continuing(parsed, earlier)
        served = self._prepare(parsed.generation, call_id=new_call_id)
        render = responses.ResponseRender(parsed, model=parsed.generation.model or self._model.model_id,
                                          created_at=int(time.time()))
        reply = await self._answer(request, writer, served, render)
        if parsed.store:
            self.responses.put(render.response_id, render.body(),
                               responses.conversation(parsed, earlier, render.output_messages()))
        return reply

    # ---- the shared way of a generation ----------------------------------------------------

    def _prepare(self, request: GenerationRequest, *, call_id: Callable[[], str]) -> _Served:
        prompt = self._render(request)
        self._check_logit_bias(request)
        max_tokens = self._fit_max_tokens(len(prompt.token_ids), request.max_tokens)
        constraint = reply_constraint(request, starts_in_thinking=prompt.starts_in_thinking)
        return _Served(request, prompt, max_tokens, call_id, constraint)

    async def _answer(self, request: Request, writer: ResponseWriter, served: _Served,
                      render: Renderer) -> Response | None:
        if self._log_text:
            request.log["prompt_text"] = served.prompt.text
        grammar = await self._checked_grammar(served.constraint)  # a bad schema is a 400 before anything is sent
        first_job = self._submit(request, served, grammar)  # a full queue is a 429 before anything is sent
        try:
            if served.request.stream:
                await self._stream(writer, served, render, first_job, request)
                return None
            try:
                await self._run_all(served, render, first_job, request, send=_discard)
            except (ShuttingDown, EngineFailed) as exc:
                raise _as_api_error(exc) from None
            return Response.json(200, render.body())
        finally:
            first_job.cancel()
            self._record(request, served)

    async def _stream(self, writer: ResponseWriter, served: _Served, render: Renderer, first_job: Job,
                      request: Request) -> None:
        # The headers go out now, before the job runs: the keep-alive ticker covers the queue
        # wait and the prefill, and the opening events tell the client its job has started.
        async with open_sse_stream(writer, self._keepalive_s) as sse:
            async def send(events: list[SSEEvent]) -> None:
                for name, payload in events:
                    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                                                separators=(",", ":"))
                    await sse.send(data, name)

            try:
                await self._run_all(served, render, first_job, request, send=send)
            except (ShuttingDown, EngineFailed, APIError) as exc:
                await send(render.failure(exc if isinstance(exc, APIError) else _as_api_error(exc)))
            else:
                await send(render.closing())

    async def _run_all(self, served: _Served, render: Renderer, first_job: Job, request: Request, *,
                       send: Callable[[list[SSEEvent]], Awaitable[None]]) -> None:
        """The request's generations, one after another (`n` of them for Chat Completions). The
        renderer sees every event either way; `send` streams what it makes of them."""
        for index in range(served.request.n):
            job = first_job if index == 0 else self._submit(request, served, first_job.grammar)
            with job:
                await job.wait_started()
                await send(render.opening(index))
                async with aclosing(self._generate(job, served)) as events:
                    async for event in events:
                        await send(render.events(event, index))
                served.queue_ms += job.queue_ms

    async def _generate(self, job: Job, served: _Served) -> AsyncIterator[OutputEvent]:
        request, prompt = served.request, served.prompt
        parser = OutputParser(tools=request.offered_tools, stop=request.stop,
                              starts_in_thinking=prompt.starts_in_thinking,
                              parallel_tool_calls=request.parallel_tool_calls, call_id=served.call_id,
                              # a forced call is well-formed by grammar: announce it at its name
                              announce_calls_early=request.tool_choice.mode == "required")
        detokenizer = self._model.new_detokenizer()
        last: JobStep | None = None
        while (step := await job.next_step()) is not None:
            last = step
            if step.logprobs and request.logprobs:
                yield self._logprobs(step)
            for event in parser.feed(detokenizer.push(step.tokens)):
                yield event
            if parser.done:
                job.cancel()  # nothing after a stop string (or the one allowed call) is wanted
                break
        else:
            for event in parser.feed(detokenizer.flush()) + parser.finish():
                yield event
        if parser.tool_calls:
            self.tool_memory.remember([call.id for call in parser.tool_calls], prompt.thinking_prefix + parser.raw_text)
            # Agent turn cache: while the client runs the tool, have the engine hold the turn as
            # the follow-up will render it and keep a snapshot: the follow-up prefills only the
            # tool result.
            self._scheduler.checkpoint_turn(job, self._rendered_turn(request, parser.tool_calls))
        usage = _usage(last, len(prompt.token_ids))
        reason = ("tool_calls" if parser.tool_calls else "stop_sequence" if parser.stop_sequence is not None
                  else "length" if last is not None and last.finished == "length" else "stop")
        served.usage = served.usage + usage
        served.finish_reasons.append(reason)
        served.texts.append(parser.raw_text)
        yield Finished(reason, usage, parser.stop_sequence)

    def _rendered_turn(self, request: GenerationRequest, calls: list[ToolCall]) -> tuple[int, ...]:
        """The prompt plus this reply's turn, closing tokens included, tokenized as the next
        request will render it (tool memory supplies the turn's exact text)."""
        turn = Message("assistant", tool_calls=tuple(calls))
        probe = attrs.evolve(request, messages=(*request.messages, turn, Message("user", "next")))
        try:
            rendered = self._model.template.render(probe, self.tool_memory)
        except Exception:
            return ()
        if len(rendered.snapshot_at) < 2:
            return ()
        return tuple(rendered.token_ids[: rendered.snapshot_at[-2]])  # through the turn's closing tokens

    def _logprobs(self, step: JobStep) -> Logprobs:
        def entry(token_id: int, logprob: float) -> tuple[str, float, tuple[int, ...]]:
            raw = self._model.token_bytes(token_id)
            return raw.decode("utf-8", errors="replace"), logprob, tuple(raw)

        tokens = []
        for choice in step.logprobs or ():
            text, logprob, raw = entry(choice.token_id, choice.logprob)
            tokens.append(TokenLogprob(text, logprob, raw, tuple(entry(*alternative) for alternative in choice.top)))
        return Logprobs(tuple(tokens))

    def _render(self, request: GenerationRequest) -> RenderedPrompt:
        # On the event loop, not in a thread: the tokenizer is shared with the detokenizers of
        # running streams, and HF fast tokenizers are not safe to use from two threads at once.
        # Rendering takes milliseconds at the context sizes served here.
        try:
            return self._model.template.render(request, self.tool_memory)
        except Exception as exc:
            raise APIError(400, f"the conversation cannot be rendered with the model's chat template: {exc}",
                           param="messages") from None

    def _check_logit_bias(self, request: GenerationRequest) -> None:
        for token_id in request.sampling.logit_bias:
            if token_id >= self._model.vocab_size:
                raise APIError(400, f"'logit_bias' names token {token_id}, but the vocabulary has "
                                    f"{self._model.vocab_size} tokens", param="logit_bias")

    def _fit_max_tokens(self, prompt_tokens: int, max_tokens: int) -> int:
        """Clamp to the room left in the context (the reply then ends with finish reason "length");
        refuse only a prompt that leaves no room at all."""
        room = self._model.max_ctx - prompt_tokens
        if room < 1:
            raise context_length_error(self._model.max_ctx, prompt_tokens, max_tokens)
        return min(max_tokens, room)

    async def _checked_grammar(self, constraint: Constraint | None) -> str | None:
        """The constraint compiled for the engine, and checked: each piece the client wrote on its
        own first, so that a 400 names the schema or grammar at fault."""
        if constraint is None:
            return None
        grammar = constraint.grammar()
        if grammar in self._checked_grammars:
            self._checked_grammars.move_to_end(grammar)
            return grammar
        for part in constraint.parts:
            try:
                await self._scheduler.check_grammar(_part_grammar(part))
            except GrammarError as exc:
                raise APIError(400, f"{part.where} is invalid or unsupported for constrained decoding: {exc}",
                               param=part.param) from None
        try:
            await self._scheduler.check_grammar(grammar)
        except GrammarError as exc:
            raise APIError(400, f"the request's output constraints cannot be combined: {exc}") from None
        self._checked_grammars[grammar] = None
        if len(self._checked_grammars) > CHECKED_GRAMMARS_KEPT:
            self._checked_grammars.popitem(last=False)
        return grammar

    def _submit(self, request: Request, served: _Served, grammar: str | None) -> Job:
        sampling = served.request.sampling
        params = SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            repetition_penalty=sampling.repetition_penalty, frequency_penalty=sampling.frequency_penalty,
            presence_penalty=sampling.presence_penalty, rep_window=sampling.rep_window,
            logit_bias=dict(sampling.logit_bias), seed=sampling.seed)
        top_logprobs = served.request.top_logprobs if served.request.logprobs else None
        try:
            return self._scheduler.submit(served.prompt.token_ids, params, served.max_tokens, request_id=request.id,
                                          snapshot_at=served.prompt.snapshot_at, top_logprobs=top_logprobs,
                                          grammar=grammar)
        except QueueFull as exc:
            raise APIError(429, str(exc), headers=[("retry-after", str(RETRY_AFTER_S))]) from None
        except ShuttingDown as exc:
            raise _as_api_error(exc) from None

    def _record(self, request: Request, served: _Served) -> None:
        usage = served.usage
        request.log.update(
            prompt_tokens=usage.prompt_tokens or len(served.prompt.token_ids),
            cached_tokens=usage.cached_tokens,
            prefilled_tokens=usage.prefilled_tokens,
            completion_tokens=usage.completion_tokens,
            finish_reason=",".join(served.finish_reasons) or None,
            queue_ms=round(served.queue_ms, 1),
            prefill_ms=round(usage.prefill_ms, 1),
            decode_ms=round(usage.decode_ms, 1),
            draft_tokens=usage.draft_tokens,
            accepted_tokens=usage.accepted_tokens,
            acceptance_length=round(usage.acceptance_length, 3),
        )
        if self._log_text:
            request.log["completion_text"] = served.texts[0] if len(served.texts) == 1 else served.texts


def _part_grammar(part: GrammarPart) -> str:
    try:
        if part.kind == "json_schema":
            return json_schema_grammar(part.source)
        return lark_grammar(part.source) if part.kind == "lark" else regex_grammar(part.source)
    except ValueError as exc:  # llguidance refuses some schemas while converting them
        raise APIError(400, f"{part.where} is invalid or unsupported for constrained decoding: {exc}",
                       param=part.param) from None


async def _discard(events: list[SSEEvent]) -> None:
    """A non-streaming reply sends nothing until the renderer's body is complete."""


def _usage(step: JobStep | None, prompt_tokens: int) -> Usage:
    stats = step.stats if step is not None else None
    if stats is None:
        return Usage(prompt_tokens=prompt_tokens)
    return Usage(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.generated_tokens,
                 cached_tokens=stats.cached_tokens, prefilled_tokens=stats.prefilled_tokens,
                 prefill_ms=stats.prefill_ms, decode_ms=stats.decode_ms,
                 draft_tokens=stats.draft_tokens, accepted_tokens=stats.accepted_tokens,
                 verification_steps=stats.verification_steps,
                 agent_turn_cache_hit=int(getattr(stats, "agent_turn_cache_hit", False)))


def _as_api_error(exc: Exception) -> APIError:
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc), headers=[("retry-after", str(RETRY_AFTER_S))])
    return APIError(500, str(exc))
