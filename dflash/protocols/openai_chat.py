"""OpenAI Chat Completions: request JSON -> GenerationRequest; output events -> response and chunks.

Pure: no I/O. `ChatCompletionRender` turns the canonical event stream into SSE chunks and, from the
same events, the non-streaming body, so the two cannot disagree.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from dflash.protocols import common, fields
from dflash.protocols.canonical import (Finished, GenerationRequest, Logprobs, Message, OutputEvent, ReasoningDelta,
                                        SSEEvent, TextDelta, Thinking, TokenLogprob, ToolCall, ToolCallDelta,
                                        ToolCallEnd, ToolCallStart, ToolSpec, Usage, timings)
from dflash.protocols.errors import APIError, openai_error_body
from dflash.protocols.fields import bad, path

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
         "function": "tool"}
TEXT_PART_TYPES = ("text", "input_text", "output_text")
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20
FINISH_REASONS = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls"}


@attrs.frozen
class CompletionHeader:
    """The fields that the response, and every chunk, of one completion repeat."""

    id: str
    created: int
    model: str


# ---- request ---------------------------------------------------------------------------------

def parse_request(body: bytes) -> GenerationRequest:
    payload = fields.json_object(body)
    stream_options = fields.obj(payload, "stream_options") or {}
    logprobs = bool(fields.boolean(payload, "logprobs"))
    top_logprobs = fields.integer(payload, "top_logprobs", 0, low=0, high=MAX_TOP_LOGPROBS)
    return GenerationRequest(
        messages=_messages(payload.get("messages")),
        model=fields.string(payload, "model"),
        tools=_tools(payload),
        tool_choice=common.parse_tool_choice(payload.get("tool_choice")),
        parallel_tool_calls=fields.boolean(payload, "parallel_tool_calls", default=True),
        sampling=common.parse_sampling(payload),
        max_tokens=common.parse_max_tokens(payload, MAX_TOKENS_FIELDS),
        stop=fields.strings(payload, "stop"),
        stream=bool(fields.boolean(payload, "stream")),
        output_format=common.output_format(fields.obj(payload, "response_format"), "response_format",
                                           schema_in="json_schema"),
        thinking=_thinking(payload),
        template_kwargs=fields.obj(payload, "chat_template_kwargs") or {},
        n=fields.integer(payload, "n", 1, low=1, high=MAX_CHOICES),
        logprobs=logprobs or bool(top_logprobs),
        top_logprobs=top_logprobs,
        include_usage=bool(fields.boolean(stream_options, "include_usage", "stream_options")),
        metadata=_tracing(payload),
    )


def _thinking(payload: dict) -> Thinking:
    """reasoning.effort, then reasoning_effort, then chat_template_kwargs (the most direct) decide."""
    reasoning = fields.obj(payload, "reasoning") or {}
    effort = fields.string(reasoning, "effort", "reasoning") or fields.string(payload, "reasoning_effort")
    return common.thinking(payload, enabled=common.effort_enables(effort), effort=effort)


def _tools(payload: dict) -> tuple[ToolSpec, ...]:
    tools = fields.array(payload, "tools") or []
    parsed = []
    for index, tool in enumerate(tools):
        where = path("tools", index)
        if not isinstance(tool, dict):
            raise bad(where, "must be an object", tool)
        kind = fields.string(tool, "type", where, default="function")
        if kind == "function":
            function = fields.required(tool, "function", where)
            if not isinstance(function, dict):
                raise bad(path(where, "function"), "must be an object", function)
            parsed.append(common.function_tool(function, path(where, "function")))
        elif kind == "custom":
            custom = fields.obj(tool, "custom", where) or {}
            tool_format = fields.obj(custom, "format", path(where, "custom"))
            if tool_format is not None and isinstance(tool_format.get("grammar"), dict):
                # Chat Completions nests the grammar one level down: {type, grammar: {syntax, definition}}.
                tool_format = {"type": tool_format.get("type"), **tool_format["grammar"]}
            parsed.append(ToolSpec(name=common.tool_name(custom, path(where, "custom")),
                                   description=fields.string(custom, "description", where, default=""),
                                   kind="custom", grammar=common.tool_grammar(tool_format, path(where, "custom.format"))))
    return tuple(parsed)


def _tracing(payload: dict) -> dict[str, Any]:
    user = fields.string(payload, "user")
    metadata = fields.obj(payload, "metadata") or {}
    return {**metadata, **({"user": user} if user else {})}


def _messages(messages: Any) -> tuple[Message, ...]:
    if messages is None:
        raise APIError(400, "'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty array", messages)
    return tuple(_message(index, message) for index, message in enumerate(messages))


def _message(index: int, message: Any) -> Message:
    where = path("messages", index)
    if not isinstance(message, dict):
        raise bad(where, "must be an object", message)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad(path(where, "role"), f"must be one of {', '.join(ROLES)}", role)
    content = content_text(path(where, "content"), message.get("content"))
    if ROLES[role] == "assistant":
        reasoning = fields.string(message, "reasoning_content", where) or fields.string(message, "reasoning", where)
        return Message("assistant", content, reasoning=reasoning, tool_calls=_tool_calls(message, where))
    if ROLES[role] == "tool":
        return Message("tool", content, tool_call_id=fields.string(message, "tool_call_id", where),
                       name=fields.string(message, "name", where))
    return Message(ROLES[role], content)


def content_text(where: str, content: Any) -> str:
    """A string, or an array of parts whose text parts are joined; other parts (images) are dropped."""
    return fields.parts_text(where, content, TEXT_PART_TYPES)


def _tool_calls(message: dict, where: str) -> tuple[ToolCall, ...]:
    calls = fields.array(message, "tool_calls", where) or []
    parsed = []
    for index, call in enumerate(calls):
        at = path(path(where, "tool_calls"), index)
        if not isinstance(call, dict):
            raise bad(at, "must be an object", call)
        call_id = fields.string(call, "id", at, default="")
        if call.get("type") == "custom":
            custom = fields.obj(call, "custom", at) or {}
            parsed.append(ToolCall(call_id, fields.string(custom, "name", at, default=""),
                                   fields.string(custom, "input", at, default=""), "custom"))
            continue
        function = fields.obj(call, "function", at) or {}
        arguments = function.get("arguments")
        if arguments is not None and not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)  # lenient: an object instead of its JSON text
        parsed.append(ToolCall(call_id, fields.string(function, "name", path(at, "function"), default=""),
                               arguments or "{}"))
    return tuple(parsed)


# ---- response ----------------------------------------------------------------------------------

@attrs.define
class _Choice:
    reasoning: str = ""
    text: str = ""
    tool_calls: list[dict] = attrs.field(factory=list)
    call_kinds: dict[int, str] = attrs.field(factory=dict)  # call index -> "function" or "custom"
    logprobs: list[dict] = attrs.field(factory=list)
    pending_logprobs: list[dict] = attrs.field(factory=list)  # to ride on the next chunk
    finish_reason: str | None = None
    usage: Usage | None = None


class ChatCompletionRender:
    """One completion (with `n` choices) as chunks and as a body."""

    def __init__(self, header: CompletionHeader, request: GenerationRequest):
        self.header = header
        self._include_usage = request.include_usage
        self._logprobs = request.logprobs
        self._choices: dict[int, _Choice] = {}

    def opening(self, index: int = 0) -> list[SSEEvent]:
        self._choices[index] = _Choice()
        return [self._chunk(index, {"role": "assistant", "content": ""})]

    def events(self, event: OutputEvent, index: int = 0) -> list[SSEEvent]:
        choice = self._choices[index]
        if isinstance(event, TextDelta):
            choice.text += event.text
            return [self._chunk(index, {"content": event.text})]
        if isinstance(event, ReasoningDelta):
            choice.reasoning += event.text
            return [self._chunk(index, {"reasoning_content": event.text})]
        if isinstance(event, ToolCallStart):
            choice.call_kinds[event.index] = event.kind
            started = ToolCall(event.id, event.name, "", event.kind)
            return [self._chunk(index, {"tool_calls": [{"index": event.index, **render_tool_call(started)}]})]
        if isinstance(event, ToolCallDelta):
            kind = choice.call_kinds.get(event.index, "function")
            key = "input" if kind == "custom" else "arguments"
            return [self._chunk(index, {"tool_calls": [{"index": event.index, kind: {key: event.arguments}}]})]
        if isinstance(event, ToolCallEnd):
            choice.tool_calls.append(render_tool_call(event.call))
            return []
        if isinstance(event, Logprobs):
            rendered = [render_logprob(token) for token in event.tokens]
            if self._logprobs:
                choice.logprobs += rendered
                choice.pending_logprobs += rendered
            return []
        if isinstance(event, Finished):
            choice.finish_reason = FINISH_REASONS[event.reason]
            choice.usage = event.usage
            return [self._chunk(index, {}, finish_reason=choice.finish_reason,
                                usage=None if self._include_usage else event.usage)]
        raise TypeError(f"not an output event: {event!r}")

    def closing(self) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        if self._include_usage:
            events.append((None, {**self._base("chat.completion.chunk"), "choices": [],
                                  "usage": render_usage(self.usage)}))
        return [*events, (None, "[DONE]")]

    def keepalive(self) -> list[SSEEvent]:
        return []  # Chat Completions has no such event: the stream sends a comment

    def failure(self, error: APIError) -> list[SSEEvent]:
        """After the SSE headers went out the status line is spent: the error rides in the stream."""
        return [(None, openai_error_body(error)), (None, "[DONE]")]

    @property
    def usage(self) -> Usage:
        total = Usage()
        for choice in self._choices.values():
            total = total + (choice.usage or Usage())
        return total

    def body(self) -> dict:
        return {**self._base("chat.completion"),
                "choices": [self._choice_body(index, choice) for index, choice in sorted(self._choices.items())],
                "usage": render_usage(self.usage)}

    def _choice_body(self, index: int, choice: _Choice) -> dict:
        message: dict[str, Any] = {"role": "assistant",
                                   "content": choice.text if choice.text or not choice.tool_calls else None}
        if choice.reasoning:
            message["reasoning_content"] = choice.reasoning
        if choice.tool_calls:
            message["tool_calls"] = choice.tool_calls
        return {"index": index, "message": message,
                "logprobs": {"content": choice.logprobs, "refusal": None} if self._logprobs else None,
                "finish_reason": choice.finish_reason}

    def _chunk(self, index: int, delta: dict, *, finish_reason: str | None = None,
               usage: Usage | None = None) -> SSEEvent:
        choice = self._choices[index]
        logprobs = None
        if self._logprobs:
            logprobs, choice.pending_logprobs = {"content": choice.pending_logprobs, "refusal": None}, []
        chunk = {**self._base("chat.completion.chunk"),
                 "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
        if usage is not None:
            chunk["usage"] = render_usage(usage)
        return None, chunk

    def _base(self, kind: str) -> dict:
        return {"id": self.header.id, "object": kind, "created": self.header.created, "model": self.header.model}


def render_tool_call(call: ToolCall) -> dict:
    if call.kind == "custom":
        return {"id": call.id, "type": "custom", "custom": {"name": call.name, "input": call.arguments}}
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def render_logprob(token: TokenLogprob) -> dict:
    return {"token": token.token, "logprob": token.logprob, "bytes": list(token.token_bytes),
            "top_logprobs": [{"token": text, "logprob": logprob, "bytes": list(raw)}
                             for text, logprob, raw in token.top]}


def render_usage(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "timings": timings(usage),
    }
