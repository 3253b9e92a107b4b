"""Anthropic Messages: request JSON -> GenerationRequest; output events -> message and SSE events.

Pure: no I/O. What Claude Code sends is the yardstick: system as text blocks (the per-request
billing header block is dropped by the template), `role: "system"` messages inside `messages`,
tool_use / tool_result / thinking blocks in history, cache_control markers, adaptive thinking.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import attrs

from dflash.protocols import common, fields
from dflash.protocols.canonical import (Finished, GenerationRequest, Message, OutputEvent, OutputFormat,
                                        ReasoningDelta, SSEEvent, TextDelta, Thinking, ToolCall, ToolCallDelta, ToolCallEnd,
                                        ToolCallStart, ToolChoice, ToolSpec, Usage, timings)
from dflash.protocols.errors import APIError, anthropic_error_body
from dflash.protocols.fields import bad, path

ROLES = ("user", "assistant", "system")
STOP_REASONS = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens",
                "tool_calls": "tool_use"}
THINKING_TYPES = {"enabled": True, "disabled": False, "adaptive": None}
# Blocks a local model cannot use (images, documents, server-tool results): accepted, left out.
IGNORED_BLOCKS = ("image", "document", "redacted_thinking", "server_tool_use", "web_search_tool_result",
                  "web_fetch_tool_result", "code_execution_tool_result", "container_upload", "search_result",
                  "mcp_tool_use", "mcp_tool_result")


def new_tool_use_id() -> str:
    return f"toolu_{secrets.token_hex(12)}"


# ---- request ---------------------------------------------------------------------------------

def parse_request(body: bytes, *, counting: bool = False) -> GenerationRequest:
    """`counting`: a count_tokens body, which has no max_tokens and may omit messages."""
    payload = fields.json_object(body)
    messages = payload.get("messages")
    if counting and messages is None:
        messages = []
    system = _system(payload.get("system"))
    tool_choice = fields.obj(payload, "tool_choice") or {}
    choice_type = fields.string(tool_choice, "type", "tool_choice", default="auto")
    return GenerationRequest(
        messages=(*system, *_messages(messages, allow_empty=counting)),
        model=fields.string(payload, "model"),
        tools=_tools(payload),
        tool_choice=_tool_choice(choice_type, tool_choice),
        parallel_tool_calls=not fields.boolean(tool_choice, "disable_parallel_tool_use", "tool_choice", default=False),
        sampling=common.parse_sampling(payload),
        max_tokens=common.parse_max_tokens(payload, ("max_tokens",)),
        stop=fields.strings(payload, "stop_sequences", single_allowed=False),
        stream=bool(fields.boolean(payload, "stream")),
        output_format=_output_format(payload),
        thinking=_thinking(payload),
        template_kwargs=fields.obj(payload, "chat_template_kwargs") or {},
        metadata=fields.obj(payload, "metadata") or {},
    )


def _system(system: Any) -> tuple[Message, ...]:
    if system is None:
        return ()
    if isinstance(system, str):
        return (Message("system", system),) if system else ()
    if not isinstance(system, list):
        raise bad("system", "must be a string or an array of text blocks", system)
    texts = []
    for index, block in enumerate(system):
        where = path("system", index)
        if not isinstance(block, dict) or block.get("type") != "text":
            raise bad(where, "must be a text block", block)
        texts.append(fields.string(block, "text", where, default=""))
    # One system text, blocks joined as Anthropic's API joins them; Claude Code's first block is a
    # per-request billing header, which the template drops line by line.
    text = "\n".join(text for text in texts if text)
    return (Message("system", text),) if text else ()


def _messages(messages: Any, *, allow_empty: bool) -> list[Message]:
    if messages is None:
        raise APIError(400, "'messages' is required", param="messages")
    if not isinstance(messages, list) or (not messages and not allow_empty):
        raise bad("messages", "must be a non-empty array", messages)
    parsed: list[Message] = []
    for index, message in enumerate(messages):
        parsed += _message(path("messages", index), message)
    return parsed


def _message(where: str, message: Any) -> list[Message]:
    if not isinstance(message, dict):
        raise bad(where, "must be an object", message)
    role = message.get("role")
    if role not in ROLES:
        raise bad(path(where, "role"), f"must be one of {', '.join(ROLES)}", role)
    content = message.get("content")
    if isinstance(content, str):
        return [Message(role, content)]
    if not isinstance(content, list):
        raise bad(path(where, "content"), "must be a string or an array of content blocks", content)
    blocks = [_block(path(path(where, "content"), index), block) for index, block in enumerate(content)]
    if role == "assistant":
        return [_assistant(blocks)]
    return _user_or_system(role, blocks)


def _block(where: str, block: Any) -> dict:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad(where, "must be an object with a 'type'", block)
    kind = block["type"]
    if kind == "text":
        return {"type": "text", "text": fields.string(block, "text", where, default="")}
    if kind == "thinking":
        return {"type": "thinking", "text": fields.string(block, "thinking", where, default="")}
    if kind == "tool_use":
        tool_input = block.get("input", {})
        return {"type": "tool_use", "call": ToolCall(fields.string(block, "id", where, default=""),
                                                     fields.string(block, "name", where, default=""),
                                                     json.dumps(tool_input, ensure_ascii=False))}
    if kind == "tool_result":
        text = fields.parts_text(path(where, "content"), block.get("content"), ("text",), joiner="\n")
        if fields.boolean(block, "is_error", where):
            text = f"Error: {text}"
        return {"type": "tool_result", "id": fields.string(block, "tool_use_id", where, default=""), "text": text}
    return {"type": "ignored"}


def _assistant(blocks: list[dict]) -> Message:
    text = "".join(block["text"] for block in blocks if block["type"] == "text")
    reasoning = "".join(block["text"] for block in blocks if block["type"] == "thinking")
    calls = tuple(block["call"] for block in blocks if block["type"] == "tool_use")
    return Message("assistant", text, reasoning=reasoning or None, tool_calls=calls)


def _user_or_system(role: str, blocks: list[dict]) -> list[Message]:
    """Tool results become tool messages in order; the text around them stays the user's."""
    messages: list[Message] = []
    texts: list[str] = []
    for block in blocks:
        if block["type"] == "tool_result":
            if texts:
                messages.append(Message(role, "".join(texts)))
                texts = []
            messages.append(Message("tool", block["text"], tool_call_id=block["id"]))
        elif block["type"] == "text":
            texts.append(block["text"])
    if texts or not messages:
        messages.append(Message(role, "".join(texts)))
    return messages


def _tools(payload: dict) -> tuple[ToolSpec, ...]:
    tools = fields.array(payload, "tools") or []
    parsed = []
    for index, tool in enumerate(tools):
        where = path("tools", index)
        if not isinstance(tool, dict):
            raise bad(where, "must be an object", tool)
        if tool.get("type") not in (None, "custom"):
            continue  # Anthropic's server tools (web_search_…, bash_…): nothing here runs them
        parsed.append(common.function_tool(tool, where, schema_key="input_schema"))
    return tuple(parsed)


def _tool_choice(choice_type: str, choice: dict) -> ToolChoice:
    if choice_type == "auto":
        return ToolChoice()
    if choice_type == "none":
        return ToolChoice("none")
    if choice_type == "any":
        return ToolChoice("required")
    if choice_type == "tool":
        name = fields.string(choice, "name", "tool_choice")
        if not name:
            raise bad("tool_choice.name", "must name a tool", choice.get("name"))
        return ToolChoice("required", name)
    raise bad("tool_choice.type", "must be auto, any, tool or none", choice_type)


def _thinking(payload: dict) -> Thinking:
    thinking = fields.obj(payload, "thinking")
    output_config = fields.obj(payload, "output_config") or {}
    effort = fields.string(output_config, "effort", "output_config")
    enabled, budget = None, None
    if thinking is not None:
        kind = fields.string(thinking, "type", "thinking")
        if kind not in THINKING_TYPES:
            raise bad("thinking.type", "must be enabled, adaptive or disabled", kind)
        enabled = THINKING_TYPES[kind]
        budget = fields.integer(thinking, "budget_tokens", None, low=0, where="thinking")
    return common.thinking(payload, enabled=enabled, effort=effort, budget_tokens=budget)


def _output_format(payload: dict) -> OutputFormat:
    """`output_format` (the structured-outputs beta) or `output_config.format`, where newer
    clients send it."""
    value, where = fields.obj(payload, "output_format"), "output_format"
    if not value:
        output_config = fields.obj(payload, "output_config") or {}
        value, where = fields.obj(output_config, "format", "output_config"), "output_config.format"
    if not value:
        return OutputFormat()
    kind = fields.string(value, "type", where)
    if kind != "json_schema":
        raise bad(f"{where}.type", "must be json_schema", kind)
    return OutputFormat("json_schema", fields.obj(value, "schema", where), field=f"{where}.schema")


# ---- response ----------------------------------------------------------------------------------

@attrs.define
class _Block:
    kind: str  # "thinking", "text" or "tool_use"
    body: dict


class MessageRender:
    """One message as Anthropic SSE events and, from the same events, as a body."""

    def __init__(self, message_id: str, model: str, *, prompt_tokens: int, thinking: bool = False):
        self.message_id = message_id
        self.model = model
        self._prompt_tokens = prompt_tokens
        self._thinking = thinking  # the request asked for thinking: keep-alives go into a thinking block
        self._blocks: list[_Block] = []
        self._open: _Block | None = None
        self._started = False
        self._finished: Finished | None = None

    def opening(self, index: int = 0) -> list[SSEEvent]:
        self._started = True
        message = {**self._envelope(), "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self._prompt_tokens, "output_tokens": 0}}
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def events(self, event: OutputEvent, index: int = 0) -> list[SSEEvent]:
        if isinstance(event, ReasoningDelta):
            return self._delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                               "thinking", {"type": "thinking_delta", "thinking": event.text})
        if isinstance(event, TextDelta):
            return self._delta("text", {"type": "text", "text": ""}, "text", {"type": "text_delta", "text": event.text})
        if isinstance(event, ToolCallStart):
            out = self._close()
            return out + self._start("tool_use", {"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
        if isinstance(event, ToolCallDelta):
            return [self._block_delta({"type": "input_json_delta", "partial_json": event.arguments})]
        if isinstance(event, ToolCallEnd):
            if self._open is not None:
                self._open.body["input"] = _input_object(event.call)
            return self._close()
        if isinstance(event, Finished):
            self._finished = event
            out = self._close()
            delta = {"stop_reason": STOP_REASONS[event.reason], "stop_sequence": event.stop_sequence}
            return out + [("message_delta", {"type": "message_delta", "delta": delta,
                                             "usage": render_usage(event.usage)})]
        return []  # logprobs: not part of this dialect

    def closing(self) -> list[SSEEvent]:
        return [("message_stop", {"type": "message_stop"})]

    def keepalive(self) -> list[SSEEvent]:
        """`ping` while queued; once the message has started, an empty delta of the open text or
        thinking block (opening one if none is): Claude Code's stream watchdog counts content
        events only (its SDK drops pings), and aborts after 300 s without one, shorter than the
        prefill of its own first request on a CPU. After `message_delta` (finished) only a ping
        fits: no content block may open then."""
        in_tool_call = self._open is not None and self._open.kind == "tool_use"
        if not self._started or self._finished is not None or in_tool_call:
            return [("ping", {"type": "ping"})]
        if self._open is None:
            return self.events(ReasoningDelta("") if self._thinking else TextDelta(""))
        return self.events(ReasoningDelta("") if self._open.kind == "thinking" else TextDelta(""))

    def failure(self, error: APIError) -> list[SSEEvent]:
        return [("error", anthropic_error_body(error))]

    def body(self) -> dict:
        finished = self._finished or Finished("stop", Usage(prompt_tokens=self._prompt_tokens))
        return {**self._envelope(), "content": [block.body for block in self._blocks],
                "stop_reason": STOP_REASONS[finished.reason], "stop_sequence": finished.stop_sequence,
                "usage": render_usage(finished.usage)}

    def _envelope(self) -> dict:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model}

    def _delta(self, kind: str, start: dict, field: str, delta: dict) -> list[SSEEvent]:
        out: list[SSEEvent] = []
        if self._open is None or self._open.kind != kind:
            out += self._close() + self._start(kind, start)
        self._open.body[field] += delta[field]
        return out + [self._block_delta(delta)]

    def _start(self, kind: str, body: dict) -> list[SSEEvent]:
        self._open = _Block(kind, dict(body))
        self._blocks.append(self._open)
        return [("content_block_start", {"type": "content_block_start", "index": len(self._blocks) - 1,
                                         "content_block": body})]

    def _block_delta(self, delta: dict) -> SSEEvent:
        return "content_block_delta", {"type": "content_block_delta", "index": len(self._blocks) - 1, "delta": delta}

    def _close(self) -> list[SSEEvent]:
        if self._open is None:
            return []
        self._open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self._blocks) - 1})]


def _input_object(call: ToolCall) -> dict:
    try:
        value = json.loads(call.arguments)
    except json.JSONDecodeError:
        return {"input": call.arguments}
    return value if isinstance(value, dict) else {"input": value}


def render_usage(usage: Usage) -> dict:
    # Anthropic counts cache reads apart: input_tokens are the prompt tokens not read from cache.
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0,
            "timings": timings(usage)}
