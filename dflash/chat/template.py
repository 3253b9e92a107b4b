"""Conversation -> prompt text and tokens, through the model's own chat template.

The template is rendered with jinja2 the way transformers does (same environment, filters and
globals), with tools, `enable_thinking`, `preserve_thinking` and the client's other
`chat_template_kwargs`. A template that cannot render tools (no mention of them, like the
embedded SmolLM2's) gets the built-in Hermes/Qwen-style tool prompt in its system turn, calls as
`<tool_call>` JSON and results as `<tool_response>`: the forms chat/parser.py reads back.

Earlier tool-call turns are replayed from tool memory when it has them, so the prompt holds the
exact text the model generated. The rendered prompt also says where its messages end (in
tokens), so the engine can keep prefix-cache snapshots at those boundaries, and which tokens
prompt compression must keep: all but the contents of the user, assistant and tool messages
before the last user turn (the system prompt and its tool definitions, the template's own text,
the last user turn and the generation prompt are never dropped).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import attrs
import jinja2
import jinja2.ext
import jinja2.sandbox

from dflash.chat.parser import CUSTOM_CALL_CLOSING, custom_call_opening
from dflash.chat.tool_memory import ToolMemory
from dflash.protocols.canonical import GenerationRequest, Message, ToolCall, ToolSpec

BILLING_HEADER = "x-anthropic-billing-header:"
# For a model whose tokenizer has no template of its own.
CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Keys of the render context that the client's chat_template_kwargs may not replace.
RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


@attrs.frozen
class Tokenized:
    ids: list[int]
    starts: list[int] | None  # the text offset where each token begins; None if the tokenizer cannot say


@attrs.frozen
class RenderedPrompt:
    text: str
    token_ids: list[int]
    snapshot_at: tuple[int, ...]  # token positions just after each message that the prompt closes
    starts_in_thinking: bool  # the generation prompt opened a <think> block
    thinking_prefix: str  # that opening, which a replayed turn must start with to match
    protected: tuple[tuple[int, int], ...] = ()  # token spans [start, end) prompt compression keeps


class ChatTemplate:
    def __init__(self, source: str | dict[str, str], *, tokenize: Callable[[str], Tokenized],
                 bos_token: str = "", eos_token: str = ""):
        sources = source if isinstance(source, dict) else {"default": source}
        environment = _environment()
        self._templates = {name: environment.from_string(text) for name, text in sources.items()}
        self._native_tools = {name: "tools" in text for name, text in sources.items()}
        self._tokenize = tokenize
        self._specials = {"bos_token": bos_token, "eos_token": eos_token}
        self.turn_end = self._find_turn_end()

    def render(self, request: GenerationRequest, memory: ToolMemory | None = None) -> RenderedPrompt:
        tools = request.offered_tools
        name = "tool_use" if tools and "tool_use" in self._templates else "default"
        native = bool(tools) and self._native_tools[name]
        messages = _template_messages(request.messages, tools, native=native, memory=memory,
                                      preserve_thinking=bool(request.thinking.preserve))
        context: dict[str, Any] = {key: value for key, value in request.template_kwargs.items()
                                   if key not in RESERVED_KWARGS}
        if request.thinking.enabled is not None:
            context.setdefault("enable_thinking", request.thinking.enabled)
        if request.thinking.preserve is not None:
            context.setdefault("preserve_thinking", request.thinking.preserve)
        if request.thinking.effort is not None:
            context.setdefault("reasoning_effort", request.thinking.effort)
        text = self._templates[name].render(
            messages=messages, tools=[_native_tool(tool) for tool in tools] if native else None,
            add_generation_prompt=True, **self._specials, **context)
        tokens = self._tokenize(text)
        tail = text.rstrip()
        opened = tail.endswith("<think>")
        return RenderedPrompt(text=text, token_ids=tokens.ids, snapshot_at=self._boundaries(text, tokens),
                              starts_in_thinking=opened,
                              thinking_prefix=text[tail.rfind("<think>"):] if opened else "",
                              protected=_protected_spans(text, tokens, messages))

    def _find_turn_end(self) -> str:
        """What the template writes after a message's content, learned from a probe render
        (`<|im_end|>\\n` for ChatML). Empty when the template will not say."""
        probe = [{"role": "system", "content": "\x01s"}, {"role": "user", "content": "\x01u"},
                 {"role": "assistant", "content": "\x01a"}]
        try:
            text = self._templates["default"].render(messages=probe, add_generation_prompt=False, **self._specials)
        except Exception:
            return ""
        after = text[text.rfind("\x01a") + 2:] if "\x01a" in text else ""
        return after if after.strip() else ""

    def _boundaries(self, text: str, tokens: Tokenized) -> tuple[int, ...]:
        if not self.turn_end or tokens.starts is None:
            return ()
        positions = []
        offset = text.find(self.turn_end)
        while offset >= 0:
            end = offset + len(self.turn_end)
            index = bisect.bisect_left(tokens.starts, end)
            if index < len(tokens.starts) and tokens.starts[index] == end:
                positions.append(index)  # only where a token begins: a snapshot holds whole tokens
            offset = text.find(self.turn_end, end)
        return tuple(positions)


def chat_template_for(tokenizer) -> ChatTemplate:
    """The ChatTemplate of a transformers tokenizer; ChatML when it brings none."""

    def tokenize(text: str) -> Tokenized:
        # The template already wrote any BOS it wants; adding special tokens again would double it.
        try:
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:  # slow tokenizers have no offsets: no boundaries then
            return Tokenized(tokenizer.encode(text, add_special_tokens=False), None)
        return Tokenized(list(encoded["input_ids"]), [start for start, _ in encoded["offset_mapping"]])

    return ChatTemplate(tokenizer.chat_template or CHATML, tokenize=tokenize,
                        bos_token=_token_text(tokenizer.bos_token), eos_token=_token_text(tokenizer.eos_token))


def render_text(tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
    """Plain role/content messages through transformers (the CLI and benchmarks)."""
    if not tokenizer.chat_template:
        raise ValueError("the model's tokenizer has no chat template")
    normalized = [{**m, "content": m.get("content") or ""} for m in messages]
    return tokenizer.apply_chat_template(normalized, tokenize=False, add_generation_prompt=add_generation_prompt)


def render_prompt(tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
    text = render_text(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def _protected_spans(text: str, tokens: Tokenized, messages: Sequence[dict[str, Any]]) -> tuple[tuple[int, int], ...]:
    """The complement of the droppable tokens: those wholly inside the content of a user,
    assistant or tool message before the last user message, found in the text in order (a
    content the template changed is not found, and stays)."""
    count = len(tokens.ids)
    if tokens.starts is None:
        return ((0, count),) if count else ()
    users = [i for i, message in enumerate(messages) if message.get("role") == "user"]
    earlier = messages[: users[-1]] if users else []
    droppable: list[tuple[int, int]] = []
    cursor = 0
    for message in earlier:
        content = message.get("content")
        if not isinstance(content, str) or not content:
            continue
        found = text.find(content, cursor)
        if found < 0:
            continue
        cursor = found + len(content)  # past a system prompt too, which stays whole
        if message.get("role") not in ("user", "assistant", "tool"):
            continue
        first = bisect.bisect_left(tokens.starts, found)
        after = bisect.bisect_left(tokens.starts, cursor)
        # the token that crosses the content's end (into the template's text) stays
        end = after if after < count and tokens.starts[after] == cursor else after - 1
        if end > first:
            droppable.append((first, end))
    spans: list[tuple[int, int]] = []
    position = 0
    for start, end in droppable:
        if start > position:
            spans.append((position, start))
        position = end
    if position < count:
        spans.append((position, count))
    return tuple(spans)


# ---- the conversation as the template sees it ---------------------------------------------

def _template_messages(messages: Sequence[Message], tools: Sequence[ToolSpec], *, native: bool,
                       memory: ToolMemory | None, preserve_thinking: bool) -> list[dict[str, Any]]:
    messages = _merged_leading_system(_context_before_questions(messages))
    if tools and not native:
        prompt = builtin_tool_prompt(tools)
        if messages and messages[0].role == "system":
            messages[0] = attrs.evolve(messages[0], content=f"{messages[0].content}\n\n{prompt}".lstrip())
        else:
            messages.insert(0, Message("system", prompt))
    rendered: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "assistant":
            rendered.append(_assistant(message, native=native, memory=memory, preserve_thinking=preserve_thinking))
        elif message.role == "tool" and not native:
            result = f"<tool_response>\n{message.content}\n</tool_response>"
            if rendered and rendered[-1].get("tool_results"):
                rendered[-1]["content"] += "\n" + result  # parallel results: one user turn
            else:
                rendered.append({"role": "user", "content": result, "tool_results": True})
        elif message.role == "tool":
            rendered.append({"role": "tool", "content": message.content, "tool_call_id": message.tool_call_id,
                             "name": message.name})
        else:
            rendered.append({"role": message.role, "content": message.content})
    for entry in rendered:
        entry.pop("tool_results", None)
    return rendered


def _context_before_questions(messages: Sequence[Message]) -> list[Message]:
    """System messages that follow a user message go before it, so the question is what the model
    reads last. Claude Code appends its lists of agents and skills (~1.5K tokens) as a system
    message after the user's question; read last, the embedded model continued the list (150
    tokens, no answer) where with the list first it answered and stopped. Applied to every turn
    alike, so a conversation renders the same way in each request and stays cached."""
    ordered: list[Message] = []
    question_at: int | None = None  # where the user message that the system messages follow sits
    for message in messages:
        if message.role == "system" and question_at is not None:
            ordered.insert(question_at, message)
            question_at += 1
            continue
        question_at = len(ordered) if message.role == "user" else None
        ordered.append(message)
    return ordered


def _merged_leading_system(messages: Sequence[Message]) -> list[Message]:
    """One system turn at the top (templates want at most one there); Claude Code's per-request
    billing header lines are dropped from it, or no two of its prompts would share a prefix."""
    messages = [attrs.evolve(m, content=_without_billing_header(m.content)) if m.role == "system" else m
                for m in messages]
    leading = 0
    while leading < len(messages) and messages[leading].role == "system":
        leading += 1
    if leading <= 1:
        return messages
    merged = "\n\n".join(m.content for m in messages[:leading] if m.content)
    return [Message("system", merged), *messages[leading:]]


def _without_billing_header(text: str) -> str:
    if BILLING_HEADER not in text:
        return text
    return "\n".join(line for line in text.split("\n") if not line.startswith(BILLING_HEADER)).strip("\n")


def _assistant(message: Message, *, native: bool, memory: ToolMemory | None,
               preserve_thinking: bool) -> dict[str, Any]:
    if message.tool_calls and memory is not None:
        original = memory.recall([call.id for call in message.tool_calls])
        if original is not None:
            return {"role": "assistant", "content": original}
    if native:
        entry: dict[str, Any] = {"role": "assistant", "content": message.content}
        if message.reasoning:
            entry["reasoning_content"] = message.reasoning
        if message.tool_calls:
            entry["tool_calls"] = [_native_call(call) for call in message.tool_calls]
        return entry
    parts = []
    if preserve_thinking and message.reasoning:
        parts.append(f"<think>\n{message.reasoning}\n</think>\n\n")
    parts.append(message.content)
    if message.tool_calls:
        calls = "\n".join(builtin_call_text(call) for call in message.tool_calls)
        parts.append(f"\n{calls}" if message.content else calls)
    return {"role": "assistant", "content": "".join(parts)}


def _native_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": _arguments(call)}}


def _native_tool(tool: ToolSpec) -> dict[str, Any]:
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": _parameters(tool)}}


def _parameters(tool: ToolSpec) -> dict[str, Any]:
    if tool.kind == "custom":
        return {"type": "object", "properties": {"input": {"type": "string", "description": "the raw input"}},
                "required": ["input"]}
    return tool.parameters


def _arguments(call: ToolCall) -> dict[str, Any]:
    if call.kind == "custom":
        return {"input": call.arguments}
    try:
        arguments = json.loads(call.arguments) if call.arguments else {}
    except json.JSONDecodeError:
        return {"input": call.arguments}
    return arguments if isinstance(arguments, dict) else {"input": arguments}


# ---- the built-in tool prompt ----------------------------------------------------------------

def builtin_tool_prompt(tools: Sequence[ToolSpec]) -> str:
    signatures = "\n".join(json.dumps(_native_tool(tool), ensure_ascii=False) for tool in tools)
    example = ToolCall(id="", name=tools[0].name, arguments=json.dumps(_example_arguments(tools[0])))
    return (
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
        f"For example:\n{builtin_call_text(example)}"
        + _custom_tool_note(tools)
    )


def _custom_tool_note(tools: Sequence[ToolSpec]) -> str:
    custom = next((tool for tool in tools if tool.kind == "custom"), None)
    if custom is None:
        return ""
    example = ToolCall(id="", name=custom.name, arguments="...", kind="custom")
    return ("\n\nA function whose only parameter is `input` (raw text) is called with that text as it is, "
            f"not in JSON:\n{builtin_call_text(example)}")


def builtin_call_text(call: ToolCall) -> str:
    if call.kind == "custom":
        return f"<tool_call>\n{custom_call_opening(call.name)}{call.arguments}{CUSTOM_CALL_CLOSING}\n</tool_call>"
    payload = {"name": call.name, "arguments": _arguments(call)}
    return f"<tool_call>\n{json.dumps(payload, ensure_ascii=False)}\n</tool_call>"


def _example_arguments(tool: ToolSpec) -> dict[str, Any]:
    """One plausible value per required parameter (or the first parameter): small models copy the
    shape of an example far more reliably than they follow a description of it."""
    properties = _parameters(tool).get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = _parameters(tool).get("required")
    required = [name for name in required if isinstance(name, str) and name in properties] \
        if isinstance(required, list) else []
    names = required or list(properties)[:1]
    return {name: _example_value(properties[name]) for name in names}


def _example_value(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return "..."
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    return {"integer": 1, "number": 1, "boolean": True, "array": [], "object": {}}.get(kind, "...")


# ---- jinja2 as transformers sets it up ------------------------------------------------------

def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                               extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment


def _token_text(token: Any) -> str:
    return token if isinstance(token, str) else str(getattr(token, "content", "") or "")
