"""One reply, whatever carries it: a canonical request in, a dialect's events out.

The chat template renders the request, its constraint is compiled and checked, the scheduler runs
the job (`n` of them for Chat Completions), the output parser turns tokens into canonical events
and the dialect's renderer turns those into its own events. The HTTP handlers (api.py) send the
events as SSE or wait for the renderer's body; a WebSocket loop sends them as messages. Both send
through a ReplyStream (reply_stream.py), which puts the dialect's keep-alive between them.

Every refusal that can come before anything is sent (a bad request, an invalid schema, a full
queue) is an APIError from `prepare` or `submit`; after that, `streamed` ends with the dialect's
failure events instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, Protocol

import attrs
import trio

from dflash.chat.checked_grammar import CheckedGrammars
from dflash.chat.constraints import Constraint, reply_constraint
from dflash.chat.parser import OutputParser
from dflash.chat.template import RenderedPrompt
from dflash.chat.tool_memory import ToolMemory
from dflash.protocols.canonical import (Finished, GenerationRequest, Logprobs, Message, OutputEvent, SSEEvent,
                                        TokenLogprob, ToolCall, Usage)
from dflash.protocols.errors import APIError, context_length_error
from dflash.scheduler import EngineFailed, Job, JobStep, QueueFull, Scheduler, ShuttingDown

RETRY_AFTER_S = 1


class Detokenizer(Protocol):
    def push(self, token_ids: list[int]) -> str: ...
    def flush(self) -> str: ...


class PromptRenderer(Protocol):
    def render(self, request: GenerationRequest, memory: ToolMemory | None = None) -> RenderedPrompt: ...


@attrs.frozen
class ModelText:
    """The loaded model as replies see it: its name, context size and text side, as plain
    objects so a server can run on a fake model (tests, bench --fake) without a tokenizer."""

    model_id: str
    max_ctx: int
    template: PromptRenderer
    new_detokenizer: Callable[[], Detokenizer]
    token_bytes: Callable[[int], bytes]  # one token's text, for logprobs
    vocab_size: int
    aliases: tuple[str, ...] = ()
    # Speculative prefill is on: a prompt longer than the context is compressed to fit, not refused.
    compresses_to_fit: bool = False
    weights_format: str = "unknown"  # what the weights were read from: gguf, safetensors (for operators)
    weights: str = ""  # the weight format served (bf16, fp32, int8, int4); "" on a fake model
    kv_cache: str = ""  # the KV cache's dtype (bfloat16, float32, int8); "" on a fake model
    cpu: str = ""  # the CPU kind the kernels were chosen for (engine/cpu.py)


class Renderer(Protocol):
    """A dialect's view of one reply (see openai_chat.ChatCompletionRender)."""

    def opening(self, index: int = 0) -> list[SSEEvent]: ...
    def events(self, event: OutputEvent, index: int = 0) -> list[SSEEvent]: ...
    def closing(self) -> list[SSEEvent]: ...
    # The dialect's harmless event while nothing else is sent ([] where it has none, or none fits
    # now: queued, or finished). Called only once every event rendered before it has been sent.
    def keepalive(self) -> list[SSEEvent]: ...
    def failure(self, error: APIError) -> list[SSEEvent]: ...
    def body(self) -> dict: ...


@attrs.define
class Reply:
    """A generation request on its way: the prompt, the budget and what the jobs reported."""

    request: GenerationRequest
    prompt: RenderedPrompt
    max_tokens: int
    call_id: Callable[[], str]
    request_id: str = ""  # for the scheduler's log lines
    conversation: str | None = None  # the client's session id (protocols/conversation.py); a cluster routes by it
    constraint: Constraint | None = None  # what the reply must follow (output format, forced tool call)
    grammar: str | None = None  # the constraint compiled and checked, once submitted
    usage: Usage = Usage()
    finish_reasons: list[str] = attrs.field(factory=list)
    texts: list[str] = attrs.field(factory=list)
    queue_ms: float = 0.0
    received_at: float = attrs.field(factory=trio.current_time)
    first_output_ms: float | None = None  # from receipt to the first generated output (time to first token)

    def log_fields(self, *, with_text: bool) -> dict[str, Any]:
        """The reply's numbers for the request's log line (and its text, when operators asked)."""
        usage = self.usage
        fields: dict[str, Any] = dict(
            prompt_tokens=usage.prompt_tokens or len(self.prompt.token_ids),
            cached_tokens=usage.cached_tokens,
            prefilled_tokens=usage.prefilled_tokens,
            completion_tokens=usage.completion_tokens,
            finish_reason=",".join(self.finish_reasons) or None,
            queue_ms=round(self.queue_ms, 1),
            ttft_ms=round(self.first_output_ms, 1) if self.first_output_ms is not None else None,
            prefill_ms=round(usage.prefill_ms, 1),
            decode_ms=round(usage.decode_ms, 1),
            draft_tokens=usage.draft_tokens,
            accepted_tokens=usage.accepted_tokens,
            acceptance_length=round(usage.acceptance_length, 3),
        )
        if usage.compressed_from_tokens:
            fields.update(compressed_from_tokens=usage.compressed_from_tokens, scoring_ms=round(usage.scoring_ms, 1))
        if with_text:
            fields["completion_text"] = self.texts[0] if len(self.texts) == 1 else self.texts
        return fields


class Replies:
    """The way of every reply: one per server, shared by the transports, because the tool memory
    and the checked grammars serve whichever transport the next turn of a conversation takes."""

    def __init__(self, model: ModelText, scheduler: Scheduler):
        self.model = model
        self._scheduler = scheduler
        self.tool_memory = ToolMemory()
        self._grammars = CheckedGrammars(scheduler.check_grammar)

    def render_prompt(self, request: GenerationRequest) -> RenderedPrompt:
        # On the event loop, not in a thread: the tokenizer is shared with the detokenizers of
        # running streams, and HF fast tokenizers are not safe to use from two threads at once.
        # Rendering takes milliseconds at the context sizes served here.
        try:
            return self.model.template.render(request, self.tool_memory)
        except Exception as exc:
            raise APIError(400, f"the conversation cannot be rendered with the model's chat template: {exc}",
                           param="messages") from None

    def prepare(self, request: GenerationRequest, *, call_id: Callable[[], str], request_id: str = "",
                conversation: str | None = None) -> Reply:
        """Render and check what can be checked without the engine; APIError (400) if refused."""
        prompt = self.render_prompt(request)
        self._check_logit_bias(request)
        max_tokens = self._fit_max_tokens(prompt, request.max_tokens)
        constraint = reply_constraint(request, starts_in_thinking=prompt.starts_in_thinking)
        return Reply(request, prompt, max_tokens, call_id, request_id, conversation, constraint)

    async def submit(self, reply: Reply) -> Job:
        """Check the reply's grammar with the engine (an invalid schema is a 400) and queue its
        first job (a full queue is a 429, shutdown a 503); the caller cancels the job when done."""
        reply.grammar = await self._grammars.compiled(reply.constraint)
        return self._submit(reply)

    async def streamed(self, reply: Reply, render: Renderer, first_job: Job) -> AsyncIterator[list[SSEEvent]]:
        """The dialect's events in batches, its closing ones included; a failure once the reply
        has begun ends them with the dialect's failure events rather than an exception. A batch
        is what one renderer call made (numbered as a whole where the dialect numbers events):
        send it whole before asking for the next (ReplyStream does)."""
        try:
            async with aclosing(self.events(reply, render, first_job)) as batches:
                async for batch in batches:
                    yield batch
        except APIError as error:
            yield render.failure(error)
        else:
            if closing := render.closing():
                yield closing

    async def events(self, reply: Reply, render: Renderer, first_job: Job) -> AsyncIterator[list[SSEEvent]]:
        """The request's generations, one after another, as batches of the dialect's events
        (without the closing ones); a failure is an APIError. The renderer sees every event either way."""
        try:
            for index in range(reply.request.n):
                job = first_job if index == 0 else self._submit(reply)
                with job:
                    await job.wait_started()
                    if opening := render.opening(index):
                        yield opening
                    async with aclosing(self._generate(job, reply)) as outputs:
                        async for output in outputs:
                            if reply.first_output_ms is None and not isinstance(output, Finished):
                                reply.first_output_ms = (trio.current_time() - reply.received_at) * 1000
                            if batch := render.events(output, index):
                                yield batch
                    reply.queue_ms += job.queue_ms
        except (ShuttingDown, EngineFailed) as exc:
            raise _as_api_error(exc) from None

    async def _generate(self, job: Job, reply: Reply) -> AsyncIterator[OutputEvent]:
        request, prompt = reply.request, reply.prompt
        parser = OutputParser(tools=request.offered_tools, stop=request.stop,
                              starts_in_thinking=prompt.starts_in_thinking,
                              parallel_tool_calls=request.parallel_tool_calls, call_id=reply.call_id,
                              # a forced call is well-formed by grammar: announce it at its name
                              announce_calls_early=request.tool_choice.mode == "required")
        detokenizer = self.model.new_detokenizer()
        last: JobStep | None = None
        while (step := await job.next_step()) is not None:
            last = step
            if step.logprobs and request.logprobs:
                yield self._logprobs(step)
            for event in parser.feed(detokenizer.push(step.tokens)):
                yield event
            if parser.done:
                job.cancel("stop")  # nothing after a stop string (or the one allowed call) is wanted
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
        reply.usage = reply.usage + usage
        reply.finish_reasons.append(reason)
        reply.texts.append(parser.raw_text)
        yield Finished(reason, usage, parser.stop_sequence)

    def _rendered_turn(self, request: GenerationRequest, calls: list[ToolCall]) -> tuple[int, ...]:
        """The prompt plus this reply's turn, closing tokens included, tokenized as the next
        request will render it (tool memory supplies the turn's exact text)."""
        turn = Message("assistant", tool_calls=tuple(calls))
        probe = attrs.evolve(request, messages=(*request.messages, turn, Message("user", "next")))
        try:
            rendered = self.model.template.render(probe, self.tool_memory)
        except Exception:
            return ()
        if len(rendered.snapshot_at) < 2:
            return ()
        return tuple(rendered.token_ids[: rendered.snapshot_at[-2]])  # through the turn's closing tokens

    def _logprobs(self, step: JobStep) -> Logprobs:
        def entry(token_id: int, logprob: float) -> tuple[str, float, tuple[int, ...]]:
            raw = self.model.token_bytes(token_id)
            return raw.decode("utf-8", errors="replace"), logprob, tuple(raw)

        tokens = []
        for choice in step.logprobs or ():
            text, logprob, raw = entry(choice.token_id, choice.logprob)
            tokens.append(TokenLogprob(text, logprob, raw, tuple(entry(*alternative) for alternative in choice.top)))
        return Logprobs(tuple(tokens))

    def _check_logit_bias(self, request: GenerationRequest) -> None:
        for token_id in request.sampling.logit_bias:
            if token_id >= self.model.vocab_size:
                raise APIError(400, f"'logit_bias' names token {token_id}, but the vocabulary has "
                                    f"{self.model.vocab_size} tokens", param="logit_bias")

    def _fit_max_tokens(self, prompt: RenderedPrompt, max_tokens: int) -> int:
        """Clamp to the room left in the context (the reply then ends with finish reason "length");
        refuse only a prompt that leaves no room at all — unless compression will make it fit (the
        engine then clamps to the room the compressed prompt leaves), which needs room for what
        it must keep."""
        prompt_tokens = len(prompt.token_ids)
        room = self.model.max_ctx - prompt_tokens
        if room >= 1:
            return min(max_tokens, room)
        kept = sum(end - start for start, end in prompt.protected)
        if not self.model.compresses_to_fit or kept >= self.model.max_ctx:
            raise context_length_error(self.model.max_ctx, prompt_tokens, max_tokens)
        return max_tokens

    def _submit(self, reply: Reply) -> Job:
        request = reply.request
        try:
            return self._scheduler.submit(reply.prompt.token_ids, request.sampling, reply.max_tokens,
                                          request_id=reply.request_id, snapshot_at=reply.prompt.snapshot_at,
                                          top_logprobs=request.top_logprobs if request.logprobs else None,
                                          grammar=reply.grammar, conversation=reply.conversation,
                                          protected=reply.prompt.protected)
        except QueueFull as exc:
            raise APIError(429, str(exc), headers=[("retry-after", str(RETRY_AFTER_S))]) from None
        except ShuttingDown as exc:
            raise _as_api_error(exc) from None


def _usage(step: JobStep | None, prompt_tokens: int) -> Usage:
    stats = step.stats if step is not None else None
    if stats is None:
        return Usage(prompt_tokens=prompt_tokens)
    return Usage(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.generated_tokens,
                 cached_tokens=stats.cached_tokens, prefilled_tokens=stats.prefilled_tokens,
                 prefill_ms=stats.prefill_ms, decode_ms=stats.decode_ms,
                 draft_tokens=stats.draft_tokens, accepted_tokens=stats.accepted_tokens,
                 verification_steps=stats.verification_steps,
                 agent_turn_cache_hit=int(stats.agent_turn_cache_hit),
                 compressed_from_tokens=stats.compressed_from_tokens, scoring_ms=stats.scoring_ms)


def _as_api_error(exc: ShuttingDown | EngineFailed) -> APIError:
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc), headers=[("retry-after", str(RETRY_AFTER_S))])
    return APIError(500, str(exc))
