"""What a reply must follow, as grammar text: the client's output format (a JSON object or a JSON
schema), a forced tool call (tool_choice required / any / a named tool) in the tool-call syntax
chat/parser.py reads back, and a custom tool's own input grammar wherever the model calls it.

This module only writes text in llguidance's Lark dialect (JSON schemas embedded as `%json`);
checked_grammar.py compiles and checks it with the engine, so an invalid schema is a 400 before
anything streams. Each piece the client wrote is also listed on its own (`parts`), so that check can name
the piece at fault rather than the grammar built around it.

The forced call is one `<tool_call>` block, Hermes style, the form the built-in tool prompt
teaches:  <tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>
with ARGS following the tool's parameter schema. The schema stays the root of its own `%json`
(not wrapped in an envelope schema) so its local `$ref`s still resolve. A custom tool with a
grammar is forced in the XML form instead, <function=NAME><parameter=input>RAW</parameter>…,
because there its raw input needs no JSON escaping and can follow the grammar as written.

With tool_choice auto the reply stays free text, but a custom tool with a grammar can only be
called in that XML form (the form the built-in tool prompt teaches for custom tools), and from its
opening on the input follows the tool's grammar: a lazy rule per such tool ends at the first
opening of its call, and the free text around calls may not contain an opening (nor the JSON form
`"name": "NAME"`, whose escaped input no grammar could check).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from dflash.chat.parser import (
    CUSTOM_CALL_CLOSING,
    FUNCTION_OPEN,
    THINK_CLOSE,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    custom_call_opening,
)
from dflash.protocols.canonical import GenerationRequest, OutputFormat, ToolSpec
from dflash.protocols.errors import APIError

ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Compact JSON: with free whitespace a small model can pad a reply with newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False}
# Tool schemas are the client's, written for the model to read, not for a validator (Claude Code's
# use `propertyNames`, which llguidance does not implement): keywords it cannot enforce are left
# out rather than refuse the request. A response format is the client's contract and stays strict.
TOOL_JSON_OPTIONS = {**JSON_OPTIONS, "lenient": True}
# Free text up to and including the first </think>: a reasoning block the prompt has opened.
REASONING_RULE = f"reasoning[lazy]: /(?s:.*){re.escape(THINK_CLOSE).replace('/', chr(92) + '/')}/"


@attrs.frozen
class GrammarPart:
    """One piece the client wrote, checked on its own so an error names it."""

    where: str  # the piece as the client knows it, e.g. "response_format.json_schema.schema"
    param: str  # the request field for the error body
    kind: Literal["json_schema", "lark", "regex"]
    source: Any  # a schema (dict) or grammar text


@attrs.frozen
class Constraint:
    lark: str  # the start grammar
    subgrammars: tuple[tuple[str, str], ...] = ()  # (name, Lark grammar), referred to as @name
    parts: tuple[GrammarPart, ...] = ()

    def grammar(self) -> str:
        """In llguidance's form: a list of grammars, the first the start, the others its @names."""
        return json.dumps({"grammars": [{"lark_grammar": self.lark},
                                        *({"name": name, "lark_grammar": text} for name, text in self.subgrammars)]})


def reply_constraint(request: GenerationRequest, *, starts_in_thinking: bool = False) -> Constraint | None:
    """The grammar of the whole reply, or None when the reply is free. Raises APIError (400) for
    a tool_choice that cannot be met or a json_schema format without a schema."""
    tools = request.offered_tools
    builder = _Builder()
    grammar_tools = [tool for tool in tools if tool.kind == "custom" and tool.grammar is not None]
    if request.tool_choice.mode == "required":
        reply = builder.tool_call(_forced_tools(request, tools))
    elif request.output_format.type != "text":
        reply = builder.json_reply(request.output_format)
        if tools:
            # tool_choice auto: the model may still call a tool instead of answering.
            reply = f"{reply} | {builder.tool_call(tools)}"
    elif grammar_tools:
        reply = builder.free_text_with_custom_calls(grammar_tools)
    else:
        return None
    rules = [f"start: {'reasoning ' if starts_in_thinking else ''}reply", f"reply: {reply}", *builder.rules]
    if starts_in_thinking:
        rules.append(REASONING_RULE)
    return Constraint("\n".join(rules) + "\n", tuple(builder.subgrammars), tuple(builder.parts))


def _forced_tools(request: GenerationRequest, tools: Sequence[ToolSpec]) -> Sequence[ToolSpec]:
    choice = request.tool_choice
    if not tools:
        raise APIError(400, "'tool_choice' requires a tool call, but the request offers no tools",
                       param="tool_choice")
    if choice.name is None:
        return tools
    named = [tool for tool in tools if tool.name == choice.name]
    if not named:
        raise APIError(400, f"'tool_choice' names the tool {choice.name!r}, which is not among the tools offered "
                            f"({', '.join(repr(tool.name) for tool in tools)})", param="tool_choice")
    return named


class _Builder:
    """Collects the named rules, subgrammars and client-written parts of one grammar."""

    def __init__(self):
        self.rules: list[str] = []
        self.subgrammars: list[tuple[str, str]] = []
        self.parts: list[GrammarPart] = []

    def json_reply(self, output_format: OutputFormat) -> str:
        schema = ANY_OBJECT if output_format.type == "json_object" else output_format.schema
        if schema is None:
            raise APIError(400, f"'{output_format.field}' is required for a json_schema format",
                           param=output_format.field)
        schema = _with_options(schema, JSON_OPTIONS)
        self.parts.append(GrammarPart(output_format.field, output_format.field, "json_schema", schema))
        return self._json_rule("answer", schema)

    def tool_call(self, tools: Sequence[ToolSpec]) -> str:
        calls = " | ".join(self._call(index, tool) for index, tool in enumerate(tools))
        self.rules.append(f"call: {calls}")
        return f"{_literal(TOOL_CALL_OPEN + chr(10))} call {_literal(chr(10) + TOOL_CALL_CLOSE)}"

    def _call(self, index: int, tool: ToolSpec) -> str:
        if tool.kind == "custom" and tool.grammar is not None:
            return self._custom_call(index, tool)
        schema = tool.parameters if tool.kind == "function" else \
            {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
             "additionalProperties": False}
        schema = _with_options(schema, TOOL_JSON_OPTIONS)
        if tool.kind == "function":
            self.parts.append(GrammarPart(f"the parameters of tool {tool.name!r}", "tools", "json_schema", schema))
        arguments = self._json_rule(f"arguments_{index}", schema)
        opening = f'{{"name": {json.dumps(tool.name, ensure_ascii=False)}, "arguments": '
        return f"{_literal(opening)} {arguments} {_literal('}')}"

    def _custom_call(self, index: int, tool: ToolSpec) -> str:
        name = self._input_grammar(index, tool)
        return f"{_literal(custom_call_opening(tool.name))} @{name} {_literal(CUSTOM_CALL_CLOSING)}"

    def free_text_with_custom_calls(self, tools: Sequence[ToolSpec]) -> str:
        # Regex pieces: each tool's XML opening tag and its JSON-form name.
        tags = [_regex_escape(f"{FUNCTION_OPEN}{tool.name}>") for tool in tools]
        json_names = [r'"name":\s*' + _regex_escape(json.dumps(tool.name, ensure_ascii=False)) for tool in tools]
        calls = []
        for index, tool in enumerate(tools):
            others = "|".join(json_names + tags[:index] + tags[index + 1:])
            self.rules.append(f"before_call_{index}[lazy]: /(?s:.*){_regex_escape(custom_call_opening(tool.name))}/"
                              f" & ~/(?s:.*)({others})(?s:.*)/")
            name = self._input_grammar(index, tool)
            calls.append(f"before_call_{index} @{name} {_literal(CUSTOM_CALL_CLOSING)} text_and_calls")
        self.rules.append(f"text_and_calls: FREE_TEXT | {' | '.join(calls)}")
        self.rules.append(f"FREE_TEXT: /(?s:.*)/ & ~/(?s:.*)({'|'.join(tags + json_names)})(?s:.*)/")
        return "text_and_calls"

    def _input_grammar(self, index: int, tool: ToolSpec) -> str:
        """Registers the custom tool's grammar as subgrammar input_INDEX; returns that name."""
        grammar = tool.grammar
        assert grammar is not None
        name = f"input_{index}"
        where = f"the {grammar.syntax} grammar of tool {tool.name!r}"
        self.parts.append(GrammarPart(where, "tools", grammar.syntax, grammar.definition))
        lark = grammar.definition if grammar.syntax == "lark" else regex_lark(grammar.definition)
        self.subgrammars.append((name, lark))
        return name

    def _json_rule(self, name: str, schema: dict[str, Any]) -> str:
        self.rules.append(f"{name}: %json {json.dumps(schema, ensure_ascii=False)}")
        return name


def _with_options(schema: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """The schema with llguidance's compile options (`x-guidance`); the client's own win."""
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**options, **(own if isinstance(own, dict) else {})}}


def regex_lark(regex: str) -> str:
    """A regular expression as a one-rule Lark grammar; '/' ends a Lark regex, so it is escaped."""
    return "start: /" + re.sub(r"(?<!\\)/", r"\\/", regex) + "/\n"


def _regex_escape(text: str) -> str:
    """`text` as a literal inside a Lark /regex/ (llguidance's regex syntax, '/' ends it)."""
    out = []
    for char in text:
        if char == "\n":
            out.append("\\n")
        elif char.isalnum() or char in " _<>=:,;'\"!%@`":
            out.append(char)
        else:
            out.append("\\" + char)
    return "".join(out)


def _literal(text: str) -> str:
    # Lark string literals take JSON's escapes.
    return json.dumps(text, ensure_ascii=False)
