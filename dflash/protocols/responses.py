"""OpenAI Responses: request JSON -> GenerationRequest; output events -> response object and SSE events.

Pure: no I/O. What Codex sends is the yardstick: `developer` messages, function_call /
function_call_output / custom_tool_call / reasoning items in `input`, tools of type function,
custom (freeform, e.g. apply_patch), namespace (flattened) and built-ins (web_search, local_shell:
accepted, not offered to the model). A custom tool's call comes back as a `custom_tool_call`
item with raw `input`, never as a function_call.

Output order (the reference API's "Tool-call output and replay", shared/spec/API.md beside the
repository): reasoning (if any), then one assistant
message (its text may be empty when the reply is only calls), then one item per call. Every event
has a `sequence_number`; item ids in the stream are those of the final response.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import attrs

from dflash.protocols import common, fields
from dflash.protocols.canonical import (Finished, GenerationRequest, Logprobs, Message, OutputEvent, ReasoningDelta,
                                        SSEEvent, TextDelta, Thinking, ToolCall, ToolCallDelta, ToolCallEnd,
                                        ToolCallStart, ToolSpec, Usage, timings)
from dflash.protocols.errors import APIError, response_error
from dflash.protocols.fields import bad, path

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PART_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")
MAX_TOKENS_FIELDS = ("max_output_tokens", "max_tokens")


@attrs.frozen
class ResponsesRequest:
    generation: GenerationRequest  # its messages: instructions, earlier turns (previous_response_id), input
    input_messages: tuple[Message, ...] = ()  # this request's own input
    store: bool = True
    previous_response_id: str | None = None
    instructions: str | None = None
    reasoning: dict[str, Any] = attrs.field(factory=dict)  # echoed; `summary` decides how reasoning shows
    text: dict[str, Any] = attrs.field(factory=dict)
    tools: list[Any] = attrs.field(factory=list)  # echoed as sent
    tool_choice: Any = "auto"
    include: tuple[str, ...] = ()
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    user: str | None = None


# ---- request ---------------------------------------------------------------------------------

def parse_request(body: bytes) -> ResponsesRequest:
    payload = fields.json_object(body)
    instructions = fields.string(payload, "instructions")
    reasoning = fields.obj(payload, "reasoning") or {}
    text = fields.obj(payload, "text") or {}
    tools_sent = fields.array(payload, "tools") or []
    tool_choice = payload.get("tool_choice")
    messages = _input(payload.get("input"))
    include = fields.array(payload, "include") or []
    if not all(isinstance(item, str) for item in include):
        raise bad("include", "must be an array of strings", include)
    generation = GenerationRequest(
        messages=_with_instructions(instructions, messages),
        model=fields.string(payload, "model"),
        tools=_tools(tools_sent),
        tool_choice=common.parse_tool_choice(tool_choice),
        parallel_tool_calls=fields.boolean(payload, "parallel_tool_calls", default=True),
        sampling=common.parse_sampling(payload),
        max_tokens=common.parse_max_tokens(payload, MAX_TOKENS_FIELDS),
        stop=fields.strings(payload, "stop"),
        stream=bool(fields.boolean(payload, "stream")),
        output_format=common.output_format(fields.obj(text, "format", "text"), "text.format"),
        thinking=_thinking(reasoning, payload),
        template_kwargs=fields.obj(payload, "chat_template_kwargs") or {},
        metadata=fields.obj(payload, "metadata") or {},
    )
    return ResponsesRequest(
        generation=generation,
        input_messages=messages,
        store=fields.boolean(payload, "store", default=True),
        previous_response_id=fields.string(payload, "previous_response_id"),
        instructions=instructions,
        reasoning=reasoning,
        text=text,
        tools=tools_sent,
        tool_choice=tool_choice if tool_choice is not None else "auto",
        include=tuple(include),
        service_tier=fields.string(payload, "service_tier"),
        prompt_cache_key=fields.string(payload, "prompt_cache_key"),
        user=fields.string(payload, "user"),
    )


def continuing(request: ResponsesRequest, earlier: tuple[Message, ...]) -> ResponsesRequest:
    """The request after the conversation of its previous response. The earlier instructions
    do not carry over (as in OpenAI's API): only this request's stand at the top."""
    messages = _with_instructions(request.instructions, earlier + request.input_messages)
    return attrs.evolve(request, generation=attrs.evolve(request.generation, messages=messages))


def conversation(request: ResponsesRequest, earlier: tuple[Message, ...], output: tuple[Message, ...]):
    """What a later `previous_response_id` continues: earlier turns, this input, this output."""
    return earlier + request.input_messages + output


def _with_instructions(instructions: str | None, messages: tuple[Message, ...]) -> tuple[Message, ...]:
    return (Message("system", instructions), *messages) if instructions else messages


def _thinking(reasoning: dict, payload: dict) -> Thinking:
    effort = fields.string(reasoning, "effort", "reasoning")
    fields.string(reasoning, "summary", "reasoning")
    return common.thinking(payload, enabled=common.effort_enables(effort), effort=effort)


def _tools(tools: list) -> tuple[ToolSpec, ...]:
    parsed: list[ToolSpec] = []
    for index, tool in enumerate(tools):
        where = path("tools", index)
        if not isinstance(tool, dict):
            raise bad(where, "must be an object", tool)
        parsed += _tool(where, tool, namespace=None)
    return tuple(parsed)


def _tool(where: str, tool: dict, *, namespace: str | None) -> list[ToolSpec]:
    kind = tool.get("type")
    if kind == "function":
        return [attrs.evolve(common.function_tool(tool, where), namespace=namespace)]
    if kind == "custom":
        return [ToolSpec(name=common.tool_name(tool, where), description=_custom_description(tool, where),
                         kind="custom", namespace=namespace,
                         grammar=common.tool_grammar(fields.obj(tool, "format", where), path(where, "format")))]
    if kind == "namespace":
        inner = fields.array(tool, "tools", where) or []
        name = fields.string(tool, "name", where)
        flattened = []
        for index, item in enumerate(inner):
            if not isinstance(item, dict):
                raise bad(path(path(where, "tools"), index), "must be an object", item)
            flattened += _tool(path(path(where, "tools"), index), item, namespace=name)
        return flattened
    return []  # web_search, local_shell, file_search, mcp, …: the server runs none of them


def _custom_description(tool: dict, where: str) -> str:
    description = fields.string(tool, "description", where, default="")
    tool_format = fields.obj(tool, "format", where) or {}
    if tool_format.get("type") == "grammar" and isinstance(tool_format.get("definition"), str):
        # The grammar is the contract for the raw input; show it rather than lose it.
        description += f"\nThe input follows this {tool_format.get('syntax', 'lark')} grammar:\n" \
                       f"{tool_format['definition']}"
    return description


def _input(value: Any) -> tuple[Message, ...]:
    if value is None:
        raise APIError(400, "'input' is required", param="input")
    if isinstance(value, str):
        return (Message("user", value),)
    if not isinstance(value, list):
        raise bad("input", "must be a string or an array of items", value)
    return tuple(_Conversation().read(value))


class _Conversation:
    """Input items -> messages. An assistant message and the calls right after it are one turn;
    reasoning items attach to the assistant turn that follows them."""

    def __init__(self):
        self.messages: list[Message] = []
        self._reasoning: list[str] = []

    def read(self, items: list) -> list[Message]:
        for index, item in enumerate(items):
            where = path("input", index)
            if not isinstance(item, dict):
                raise bad(where, "must be an object", item)
            kind = item.get("type", "message")
            reader = self._readers().get(kind) if isinstance(kind, str) else None
            if reader is not None:
                reader(where, item)
        return self.messages

    def _readers(self):
        return {"message": self._message, "function_call": self._function_call,
                "custom_tool_call": self._custom_tool_call, "local_shell_call": self._local_shell_call,
                "function_call_output": self._output, "custom_tool_call_output": self._output,
                "local_shell_call_output": self._output, "reasoning": self._reasoning_item}

    def _message(self, where: str, item: dict) -> None:
        role = item.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad(path(where, "role"), f"must be one of {', '.join(ROLES)}", role)
        text = _content_text(path(where, "content"), item.get("content"))
        if ROLES[role] == "assistant":
            self._assistant(text=text)
        else:
            self.messages.append(Message(ROLES[role], text))

    def _function_call(self, where: str, item: dict) -> None:
        arguments = item.get("arguments")
        if arguments is not None and not isinstance(arguments, str):
            raise bad(path(where, "arguments"), "must be a string of JSON", arguments)
        self._assistant(call=ToolCall(_call_id(where, item), fields.string(item, "name", where, default=""),
                                      arguments or "{}"))

    def _custom_tool_call(self, where: str, item: dict) -> None:
        self._assistant(call=ToolCall(_call_id(where, item), fields.string(item, "name", where, default=""),
                                      fields.string(item, "input", where, default=""), "custom"))

    def _local_shell_call(self, where: str, item: dict) -> None:
        action = fields.obj(item, "action", where) or {}
        self._assistant(call=ToolCall(_call_id(where, item), "local_shell", json.dumps(action, ensure_ascii=False)))

    def _output(self, where: str, item: dict) -> None:
        output = item.get("output")
        if isinstance(output, list):
            text = _content_text(path(where, "output"), output)
        elif isinstance(output, str):
            text = output
        else:
            text = json.dumps(output, ensure_ascii=False) if output is not None else ""
        self.messages.append(Message("tool", text, tool_call_id=_call_id(where, item)))

    def _reasoning_item(self, where: str, item: dict) -> None:
        for key in ("summary", "content"):
            parts = fields.array(item, key, where) or []
            text = _content_text(path(where, key), parts)
            if text:
                self._reasoning.append(text)
                return

    def _assistant(self, *, text: str = "", call: ToolCall | None = None) -> None:
        reasoning = "\n".join(self._reasoning) or None
        self._reasoning = []
        previous = self.messages[-1] if self.messages else None
        if call is not None and previous is not None and previous.role == "assistant":
            self.messages[-1] = attrs.evolve(previous, tool_calls=(*previous.tool_calls, call),
                                             reasoning=previous.reasoning or reasoning)
            return
        self.messages.append(Message("assistant", text, reasoning=reasoning, tool_calls=(call,) if call else ()))


def _call_id(where: str, item: dict) -> str:
    return fields.string(item, "call_id", where) or fields.string(item, "id", where) or ""


def _content_text(where: str, content: Any) -> str:
    return fields.parts_text(where, content, TEXT_PART_TYPES, keys=("text", "refusal"))


# ---- response ----------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponseRender:
    """One response as Responses SSE events and, from the same events, as the response object."""

    def __init__(self, request: ResponsesRequest, *, model: str, created_at: int):
        self.response_id = new_id("resp")
        self._request = request
        self._model = model
        self._created_at = created_at
        self._summary = request.reasoning.get("summary") is not None
        self._sequence = 0
        self._output: list[dict] = []
        self._open: dict | None = None  # the item being written
        self._message_written = False
        self._status = "in_progress"
        self._usage: Usage | None = None
        self._incomplete: dict | None = None
        self._error: dict | None = None
        self._calls: list[ToolCall] = []
        self._text = ""
        self._reasoning = ""

    # -- events

    def opening(self, index: int = 0) -> list[SSEEvent]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def events(self, event: OutputEvent, index: int = 0) -> list[SSEEvent]:
        if isinstance(event, ReasoningDelta):
            self._reasoning += event.text
            return self._reasoning_delta(event.text)
        if isinstance(event, TextDelta):
            self._text += event.text
            out = self._open_message() if not self._is_open("message") else []
            self._open["content"][0]["text"] += event.text
            return out + [self._event("response.output_text.delta", **self._where(), content_index=0,
                                      delta=event.text, logprobs=[])]
        if isinstance(event, ToolCallStart):
            out = self._close()
            if not self._message_written:
                out += self._open_message() + self._close()
            return out + self._open_call(event)
        if isinstance(event, ToolCallDelta):
            kind = "custom_tool_call_input" if self._open["type"] == "custom_tool_call" else "function_call_arguments"
            self._open["input" if kind == "custom_tool_call_input" else "arguments"] += event.arguments
            return [self._event(f"response.{kind}.delta", **self._where(), delta=event.arguments)]
        if isinstance(event, ToolCallEnd):
            self._calls.append(event.call)
            return self._close()
        if isinstance(event, Finished):
            return self._finish(event)
        if isinstance(event, Logprobs):
            return []
        raise TypeError(f"not an output event: {event!r}")

    def closing(self) -> list[SSEEvent]:
        return []

    def in_progress(self) -> list[SSEEvent]:
        """The response as it stands, again: a harmless event while nothing else happens."""
        return [self._event("response.in_progress", response=self._snapshot())]

    def keepalive(self) -> list[SSEEvent]:
        # Before `response.created` has gone out (a queued job) only a comment fits, and once the
        # response is completed (or failed) an `in_progress` would contradict it.
        return self.in_progress() if self._sequence and self._status == "in_progress" else []

    def finish_without_output(self) -> list[SSEEvent]:
        """`generate: false` (a warm-up): completed with no output and no model run."""
        self._status = "completed"
        self._usage = Usage()
        return [self._event("response.completed", response=self._snapshot())]

    def failure(self, error: APIError) -> list[SSEEvent]:
        out = self._close()
        self._status = "failed"
        self._error = response_error(error)
        return out + [self._event("response.failed", response=self._snapshot())]

    def body(self) -> dict:
        return self._snapshot()

    def output_messages(self) -> tuple[Message, ...]:
        """The reply as conversation, for a later `previous_response_id`."""
        return (Message("assistant", self._text, reasoning=self._reasoning or None, tool_calls=tuple(self._calls)),)

    # -- items

    def _reasoning_delta(self, text: str) -> list[SSEEvent]:
        out: list[SSEEvent] = []
        kind = "summary" if self._summary else "content"
        part_event = "response.reasoning_summary_part" if self._summary else "response.content_part"
        text_event = "response.reasoning_summary_text" if self._summary else "response.reasoning_text"
        index_key = "summary_index" if self._summary else "content_index"
        if not self._is_open("reasoning"):
            out += self._close()
            out += self._add({"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []})
            part = {"type": "summary_text" if self._summary else "reasoning_text", "text": ""}
            self._open[kind].append(part)
            out.append(self._event(f"{part_event}.added", **self._where(), **{index_key: 0}, part=dict(part)))
        self._open[kind][0]["text"] += text
        return out + [self._event(f"{text_event}.delta", **self._where(), **{index_key: 0}, delta=text)]

    def _open_message(self) -> list[SSEEvent]:
        out = self._close()
        self._message_written = True
        out += self._add({"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                          "content": []})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._open["content"].append(part)
        return out + [self._event("response.content_part.added", **self._where(), content_index=0, part=dict(part))]

    def _open_call(self, event: ToolCallStart) -> list[SSEEvent]:
        if event.kind == "custom":
            item = {"type": "custom_tool_call", "id": new_id("ctc"), "status": "in_progress", "call_id": event.id,
                    "name": event.name, "input": ""}
        else:
            item = {"type": "function_call", "id": new_id("fc"), "status": "in_progress", "call_id": event.id,
                    "name": event.name, "arguments": ""}
        if event.namespace is not None:
            item["namespace"] = event.namespace
        return self._add(item)

    def _add(self, item: dict) -> list[SSEEvent]:
        self._output.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self._output) - 1, item=_copy(item))]

    def _close(self) -> list[SSEEvent]:
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self._output) - 1}
        out: list[SSEEvent] = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [self._event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", **where, content_index=0, part=dict(part))]
        elif item["type"] == "reasoning":
            out += self._close_reasoning(item, where)
        elif item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                   arguments=item["arguments"]))
        elif item["type"] == "custom_tool_call":
            out.append(self._event("response.custom_tool_call_input.done", **where, input=item["input"]))
        if "status" in item:
            item["status"] = "completed"
        return out + [self._event("response.output_item.done", output_index=where["output_index"], item=_copy(item))]

    def _close_reasoning(self, item: dict, where: dict) -> list[SSEEvent]:
        if self._summary:
            part = item["summary"][0]
            return [self._event("response.reasoning_summary_text.done", **where, summary_index=0, text=part["text"]),
                    self._event("response.reasoning_summary_part.done", **where, summary_index=0, part=dict(part))]
        part = item["content"][0]
        return [self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"]),
                self._event("response.content_part.done", **where, content_index=0, part=dict(part))]

    def _finish(self, finished: Finished) -> list[SSEEvent]:
        out = self._close()
        if not self._message_written and not self._calls:
            out += self._open_message() + self._close()  # an empty reply is still one (empty) message
        self._usage = finished.usage
        if finished.reason == "length":
            self._status = "incomplete"
            self._incomplete = {"reason": "max_output_tokens"}
            return out + [self._event("response.incomplete", response=self._snapshot())]
        self._status = "completed"
        return out + [self._event("response.completed", response=self._snapshot())]

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self._output) - 1}

    def _event(self, kind: str, **payload) -> SSEEvent:
        event = {"type": kind, "sequence_number": self._sequence, **payload}
        self._sequence += 1
        return kind, event

    def _snapshot(self) -> dict:
        request = self._request
        generation = request.generation
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self._created_at,
            "status": self._status,
            "error": self._error,
            "incomplete_details": self._incomplete,
            "instructions": request.instructions,
            "max_output_tokens": generation.max_tokens,
            "model": self._model,
            "output": [_copy(item) for item in self._output],
            "parallel_tool_calls": generation.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "prompt_cache_key": request.prompt_cache_key,
            "reasoning": {"effort": request.reasoning.get("effort"), "summary": request.reasoning.get("summary")},
            "service_tier": request.service_tier or "default",
            "store": request.store,
            "temperature": generation.sampling.temperature,
            "text": {"format": {"type": "text"}, **request.text},
            "tool_choice": request.tool_choice,
            "tools": request.tools,
            "top_p": generation.sampling.top_p,
            "truncation": "disabled",
            "usage": render_usage(self._usage) if self._usage is not None else None,
            "user": request.user,
            "metadata": generation.metadata,
        }


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


def render_usage(usage: Usage) -> dict:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens, "timings": timings(usage)}


# Codex's own instructions for its hosted models run to ~4K tokens; a local model pays for every
# one of them in prefill on each new conversation, and a small model follows a short text better.
CODEX_BASE_INSTRUCTIONS = """You are a coding agent in the user's terminal (Codex CLI), served by a local model.
Work in the current folder. To look around or run anything, call the shell tool; to change files, call apply_patch
with a patch that starts with "*** Begin Patch" and ends with "*** End Patch". Read a file before you change it.
Make the smallest change that does the task, then check it (run the tests or the program when you can).
Keep answers short: say what you did and anything the user must know. Ask only when the task is ambiguous."""


def codex_model_entry(model_id: str, max_ctx: int, priority: int) -> dict:
    """A model in the catalog Codex reads (its provider's `model_catalog_url`, or a file named by
    `model_catalog_json`). Codex 0.171 rejects an entry missing any of these fields and falls back
    to default metadata: its ~4K-token instructions and no apply_patch tool."""
    return {
        "slug": model_id, "display_name": model_id, "description": "Local dflash server",
        "default_reasoning_level": "medium",
        "supported_reasoning_levels": [{"effort": effort, "description": f"{effort} reasoning"}
                                       for effort in ("low", "medium", "high")],
        "shell_type": "shell_command", "visibility": "list", "supported_in_api": True, "priority": priority,
        "context_window": max_ctx, "supports_reasoning_summaries": False, "supports_parallel_tool_calls": True,
        "base_instructions": CODEX_BASE_INSTRUCTIONS, "support_verbosity": False,
        "apply_patch_tool_type": "freeform", "truncation_policy": {"mode": "bytes", "limit": 10000},
        "experimental_supported_tools": [],
    }
