"""The streaming parser of generated text: stop strings, <think> reasoning, tool calls.

Text arrives in pieces that split anywhere (a tag, a stop string or a UTF-8 character can span
tokens), so each stage holds back the shortest tail that could still turn into something it
must recognise, and releases it when the next piece decides. What comes out is canonical events:
reasoning and text deltas, and tool calls with their arguments typed by the tool's schema.

Tool calls are recognised only when tools were offered, in the forms models write:
  <tool_call>{"name": …, "arguments": {…}}</tool_call>          (Hermes, Qwen2.5, the built-in prompt)
  <tool_call><function=NAME><parameter=P>V</parameter></function></tool_call>   (Qwen3-Coder)
  <function=NAME>…</function>                                    (the same without the wrapper)
  {"name": …, "arguments": {…}} as the whole start of the reply  (bare JSON)
A block that looks like a call but does not parse, or names a tool that was not offered, is
returned as text: dropping it would hide what the model said.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from dflash.protocols.canonical import (OutputEvent, ReasoningDelta, TextDelta, ToolCall, ToolCallDelta,
                                        ToolCallEnd, ToolCallStart, ToolSpec)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
# A custom tool's call in the XML form: its raw input needs no JSON escaping.
CUSTOM_CALL_CLOSING = "\n</parameter>\n" + FUNCTION_CLOSE


def custom_call_opening(name: str) -> str:
    return f"{FUNCTION_OPEN}{name}>\n<parameter=input>\n"

# The start of a call block up to its tool's name: a Hermes JSON call ({"name": "X", ...) or the
# XML form (<function=X>), after <tool_call>; or the rest of a bare <function=X>.
CALL_NAME_RE = {
    TOOL_CALL_OPEN: re.compile(r'\s*(?:\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,|<function=([^>\s]+)>)'),
    FUNCTION_OPEN: re.compile(r"()([^>\s]+)>"),
}
FUNCTION_RE = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|\Z)", re.S)
PARAMETER_RE = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class StopStrings:
    """Cuts text before the first stop string; the stop string itself is never emitted.

    The longest tail of the pending text that could still begin a stop string is held back
    until the next piece decides it; everything before it is safe to send."""

    def __init__(self, stop_strings: Sequence[str]):
        self._stop_strings = [stop for stop in stop_strings if stop]
        self._pending = ""
        self.hit: str | None = None  # the stop string that matched

    def push(self, text: str) -> str:
        """The part of `text` (with what was held back) that can go out now."""
        if self.hit is not None:
            return ""
        pending = self._pending + text
        found = [(index, stop) for stop in self._stop_strings if (index := pending.find(stop)) >= 0]
        if found:
            cut, self.hit = min(found)
            self._pending = ""
            return pending[:cut]
        held = max((_partial_suffix(pending, stop) for stop in self._stop_strings), default=0)
        self._pending = pending[len(pending) - held:]
        return pending[:len(pending) - held]

    def flush(self) -> str:
        """At the end of generation the held tail can no longer become a stop string."""
        text, self._pending = self._pending, ""
        return "" if self.hit is not None else text


class OutputParser:
    """Generated text in, canonical events out. `feed` each detokenized piece, then `finish`."""

    def __init__(self, *, tools: Sequence[ToolSpec] = (), stop: Sequence[str] = (), starts_in_thinking: bool = False,
                 parallel_tool_calls: bool = True, call_id: Callable[[], str] = new_call_id,
                 announce_calls_early: bool = False):
        self._stops = StopStrings(stop)
        self._tools = {tool.name: tool for tool in tools}
        self._parallel = parallel_tool_calls
        self._call_id = call_id
        self._mode = "reasoning" if starts_in_thinking else "content"
        self._pending = ""  # text read but not yet classified; always a suffix of raw_text
        self._tool_opener = ""
        # Announce a call when its tool's name is read rather than when the call is complete. Only
        # where a grammar makes every call well-formed: an unparsable block can then no longer
        # fall back to text (a call cut by max_tokens ends with empty arguments).
        self._announce_early = announce_calls_early
        self._opened: tuple[str, ToolSpec] | None = None  # (id, tool) of a call announced before its end
        self._json_scan = _ObjectScan()
        self._reasoning_started = False
        self._content_started = False  # leading whitespace of a reply is dropped
        self.raw_text = ""  # what the model generated, up to a stop string: tool memory keeps it
        self.tool_calls: list[ToolCall] = []
        self.done = False  # nothing more is wanted: a stop string, or the one tool call allowed

    @property
    def stop_sequence(self) -> str | None:
        return self._stops.hit

    def feed(self, text: str) -> list[OutputEvent]:
        if self.done:
            return []
        passed = self._stops.push(text)
        self.raw_text += passed
        events = self._scan(passed, final=False)
        if self._stops.hit is not None and not self.done:
            events += self._scan("", final=True)
            self.done = True
        return _merged(events)

    def finish(self) -> list[OutputEvent]:
        """The end of generation: whatever was held back is decided now."""
        if self.done:
            return []
        passed = self._stops.flush()
        self.raw_text += passed
        events = self._scan(passed, final=True)
        self.done = True
        return _merged(events)

    # ---- the state machine ---------------------------------------------------------------

    def _scan(self, text: str, *, final: bool) -> list[OutputEvent]:
        self._pending += text
        events: list[OutputEvent] = []
        step = {"reasoning": self._reasoning, "content": self._content, "tool": self._tool, "json": self._json}
        while not self.done and step[self._mode](events, final):
            pass
        return events

    def _reasoning(self, events: list[OutputEvent], final: bool) -> bool:
        if not self._reasoning_started:
            stripped = self._pending.lstrip()
            if not final and THINK_OPEN.startswith(stripped):
                return False  # blank so far, or a <think> the model repeats is still arriving
            self._pending = stripped.removeprefix(THINK_OPEN).lstrip()
            self._reasoning_started = True
        index = self._pending.find(THINK_CLOSE)
        if index >= 0:
            self._emit(events, ReasoningDelta, self._pending[:index].rstrip())
            self._pending = self._pending[index + len(THINK_CLOSE):]
            self._mode, self._content_started = "content", False
            return True
        held = 0 if final else _held(self._pending, (THINK_CLOSE,))
        self._emit(events, ReasoningDelta, self._pending[:len(self._pending) - held])
        self._pending = self._pending[len(self._pending) - held:]
        return False

    def _content(self, events: list[OutputEvent], final: bool) -> bool:
        if not self._content_started:
            self._pending = self._pending.lstrip()
            if self._tools and self._pending.startswith("{"):
                self._mode, self._json_scan = "json", _ObjectScan()
                return True
        markers = (THINK_OPEN, THINK_CLOSE) + ((TOOL_CALL_OPEN, FUNCTION_OPEN) if self._tools else ())
        found = [(index, marker) for marker in markers if (index := self._pending.find(marker)) >= 0]
        if found:
            index, marker = min(found)
            self._emit_text(events, self._pending[:index].rstrip())
            self._pending = self._pending[index + len(marker):]
            if marker == THINK_OPEN:
                self._mode, self._reasoning_started = "reasoning", False
            elif marker in (TOOL_CALL_OPEN, FUNCTION_OPEN):
                self._mode, self._tool_opener = "tool", marker
            return True
        held = 0 if final else _held(self._pending, markers)
        self._emit_text(events, self._pending[:len(self._pending) - held])
        self._pending = self._pending[len(self._pending) - held:]
        return False

    def _tool(self, events: list[OutputEvent], final: bool) -> bool:
        closer = TOOL_CALL_CLOSE if self._tool_opener == TOOL_CALL_OPEN else FUNCTION_CLOSE
        index = self._pending.find(closer)
        if index < 0 and not final:
            self._open_call_early(events)
            return False
        inner = self._pending if index < 0 else self._pending[:index]
        rest = "" if index < 0 else self._pending[index + len(closer):]
        if closer == FUNCTION_CLOSE and index >= 0:
            # A bare <function=…> may still be followed by the </tool_call> of a wrapper.
            stripped = rest.lstrip()
            if not final and TOOL_CALL_CLOSE.startswith(stripped):
                return False
            if stripped.startswith(TOOL_CALL_CLOSE):
                rest = stripped[len(TOOL_CALL_CLOSE):]
        written = self._tool_opener + self._pending[:len(self._pending) - len(rest)]
        block = inner if closer == TOOL_CALL_CLOSE else FUNCTION_OPEN + inner + FUNCTION_CLOSE
        self._pending, self._mode = rest, "content"
        calls = self._parse_block(block)
        if calls or self._opened is not None:
            self._emit_calls(events, calls)
        else:
            self._emit_text(events, written)
        return True

    def _json(self, events: list[OutputEvent], final: bool) -> bool:
        end = self._json_scan.end_of_object(self._pending)
        if end is None and not final:
            return False
        end = len(self._pending) if end is None else end
        candidate, self._pending = self._pending[:end], self._pending[end:]
        self._mode, self._json_scan = "content", _ObjectScan()
        calls = self._parse_json_calls(candidate)
        if calls:
            self._emit_calls(events, calls)
        else:
            self._emit_text(events, candidate)
        return True

    # ---- emitting ------------------------------------------------------------------------

    def _emit(self, events: list[OutputEvent], kind: type, text: str) -> None:
        if text:
            events.append(kind(text))

    def _emit_text(self, events: list[OutputEvent], text: str) -> None:
        if not self._content_started:
            text = text.lstrip()
        if text:
            self._content_started = True
            events.append(TextDelta(text))

    def _open_call_early(self, events: list[OutputEvent]) -> None:
        """Announce the call as soon as its tool's name is read, so a client sees it begin (a
        tool_use block, a call chunk) while its arguments are still being generated."""
        if not self._announce_early or self._opened is not None:
            return
        match = CALL_NAME_RE[self._tool_opener].match(self._pending)
        if match is None:
            return
        name = match.group(1) or match.group(2)
        if match.group(1):
            try:
                name = json.loads(f'"{name}"')
            except json.JSONDecodeError:
                return
        tool = self._tools.get(name)
        if tool is None:
            return
        self._opened = (self._call_id(), tool)
        events.append(ToolCallStart(len(self.tool_calls), self._opened[0], tool.name, tool.kind, tool.namespace))

    def _emit_calls(self, events: list[OutputEvent], calls: list[tuple[ToolSpec, Any]]) -> None:
        opened, self._opened = self._opened, None
        if opened is not None and (not calls or calls[0][0] is not opened[1]):
            # The block that began as a call to this tool did not parse as one (cut by max_tokens,
            # or broken): the announced call still has to end, with empty arguments.
            calls = [(opened[1], {} if opened[1].kind == "function" else ""), *calls]
        for position, (tool, arguments) in enumerate(calls):
            index = len(self.tool_calls)
            call = _tool_call(opened[0] if opened is not None and position == 0 else self._call_id(), tool, arguments)
            self.tool_calls.append(call)
            if opened is None or position > 0:
                events.append(ToolCallStart(index, call.id, call.name, call.kind, tool.namespace))
            events += [ToolCallDelta(index, call.arguments), ToolCallEnd(index, call)]
            if not self._parallel:
                # One call is all the client allows: the turn ends with it. What came after it
                # (the unread `_pending`) is not part of the turn, for tool memory either.
                self.raw_text = self.raw_text[:len(self.raw_text) - len(self._pending)]
                self._pending = ""
                self.done = True
                return

    # ---- parsing tool calls --------------------------------------------------------------

    def _parse_block(self, block: str) -> list[tuple[ToolSpec, Any]]:
        if FUNCTION_OPEN in block:
            return self._parse_xml_calls(block)
        return self._parse_json_calls(block.strip())

    def _parse_xml_calls(self, block: str) -> list[tuple[ToolSpec, Any]]:
        calls = []
        for name, body in FUNCTION_RE.findall(block):
            tool = self._tools.get(name)
            if tool is None:
                return []
            properties = _properties(tool.parameters)
            # A custom tool's input is raw text, kept as written (a forced call with a grammar
            # writes it this way, and it may well look like JSON).
            arguments = {key: _trim_newline(value) if tool.kind == "custom" else
                         _typed(_trim_newline(value), properties.get(key))
                         for key, value in PARAMETER_RE.findall(body)}
            calls.append((tool, arguments))
        return calls

    def _parse_json_calls(self, text: str) -> list[tuple[ToolSpec, Any]]:
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            return []
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            if not isinstance(item, dict):
                return []
            if isinstance(item.get("function"), dict):
                item = item["function"]
            tool = self._tools.get(item.get("name")) if isinstance(item.get("name"), str) else None
            arguments = item.get("arguments", item.get("parameters", {}))
            if isinstance(arguments, str) and tool is not None and tool.kind == "function":
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    return []
            if tool is None or (tool.kind == "function" and not isinstance(arguments, dict)):
                return []
            if tool.kind == "function":
                properties = _properties(tool.parameters)
                arguments = {key: _coerced(value, properties.get(key)) for key, value in arguments.items()}
            calls.append((tool, arguments))
        return calls


def _tool_call(call_id: str, tool: ToolSpec, arguments: Any) -> ToolCall:
    if tool.kind == "custom":
        # A freeform tool takes raw text; the model was shown it as one string parameter `input`.
        if isinstance(arguments, dict) and isinstance(arguments.get("input"), str):
            raw = arguments["input"]
        elif isinstance(arguments, str):
            raw = arguments
        else:
            raw = json.dumps(arguments, ensure_ascii=False)
        return ToolCall(call_id, tool.name, raw, "custom")
    return ToolCall(call_id, tool.name, json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))


def _properties(schema: Any) -> dict[str, Any]:
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return properties if isinstance(properties, dict) else {}


def _schema_types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    if "enum" in schema:
        return ["string"]
    types: list[str] = []
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            types += _schema_types(option)
    return types


def _typed(text: str, schema: Any) -> Any:
    """An XML parameter's text as the schema's type. Undeclared parameters try JSON, else stay text;
    a value that does not convert to its declared type stays text for the client to judge."""
    types = _schema_types(schema)
    stripped = text.strip()
    for kind in types:
        if kind != "string" and (converted := _convert(stripped, kind)) is not _UNCONVERTED:
            return converted
    if types:
        return text
    try:
        return json.loads(stripped)
    except (json.JSONDecodeError, RecursionError):
        return text


def _coerced(value: Any, schema: Any) -> Any:
    """A JSON argument is typed already; only a number or flag the model quoted is converted."""
    types = _schema_types(schema)
    if isinstance(value, str) and types and "string" not in types:
        return _typed(value, schema)
    return value


_UNCONVERTED = object()


def _convert(text: str, kind: str) -> Any:
    if kind == "integer":
        try:
            return int(text)
        except ValueError:
            return _UNCONVERTED
    if kind == "number":
        try:
            number = float(text)
        except ValueError:
            return _UNCONVERTED
        return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _UNCONVERTED)
    if kind == "null":
        return None if text.lower() in ("null", "none", "") else _UNCONVERTED
    if kind in ("object", "array"):
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            return _UNCONVERTED
        return value if isinstance(value, dict if kind == "object" else list) else _UNCONVERTED
    return _UNCONVERTED


def _trim_newline(value: str) -> str:
    """Qwen3-Coder writes values on their own lines; one newline each side is the format, not the value."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class _ObjectScan:
    """Finds the end of the JSON object that opens a growing text, reading each character once
    (a bare JSON call can carry a whole file, one token at a time)."""

    def __init__(self):
        self._read = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def end_of_object(self, text: str) -> int | None:
        """The index just past the object, or None while it is still open."""
        for index in range(self._read, len(text)):
            char = text[index]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return index + 1
        self._read = len(text)
        return None


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def _held(text: str, markers: Sequence[str]) -> int:
    """What to hold back: a tail that may begin a marker, or trailing whitespace (it is trimmed
    before a tag, so it cannot go out until the next text shows whether a tag follows)."""
    partial = max((_partial_suffix(text, marker) for marker in markers), default=0)
    body = text[:len(text) - partial]
    return partial + (len(body) - len(body.rstrip()))


def _merged(events: list[OutputEvent]) -> list[OutputEvent]:
    merged: list[OutputEvent] = []
    for event in events:
        previous = merged[-1] if merged else None
        if isinstance(event, (TextDelta, ReasoningDelta)) and type(previous) is type(event):
            merged[-1] = type(event)(previous.text + event.text)
        else:
            merged.append(event)
    return merged
