"""What the dialects read alike: sampling, the token budget, the reasoning switch's
`chat_template_kwargs`, OpenAI's output formats, tools and tool choice.

Chat Completions and Responses are both OpenAI's and share most of their shapes; Anthropic's
Messages shares sampling, the budget and function tools. Each dialect module keeps what is its
own and takes the rest from here, so a fix to a shared field reaches all of them.
"""

from __future__ import annotations

from typing import Any

from dflash.protocols import fields
from dflash.protocols.canonical import (DEFAULT_MAX_TOKENS, OutputFormat, Sampling, Thinking, ToolChoice, ToolGrammar,
                                        ToolSpec)
from dflash.protocols.fields import bad, path

TEMPLATE_KWARGS = "chat_template_kwargs"


def parse_sampling(payload: dict) -> Sampling:
    """The sampling fields all three dialects share (the reference API's "Sampling Chain",
    shared/spec/API.md beside the repository)."""
    repetition_penalty = "repetition_penalty" if payload.get("repetition_penalty") is not None else "rep_pen"
    return Sampling(
        temperature=fields.number(payload, "temperature", 0.0, low=0.0, high=2.0),
        top_p=fields.number(payload, "top_p", 1.0, low=0.0, high=1.0, low_open=True),
        top_k=fields.integer(payload, "top_k", 0, low=0),
        repetition_penalty=fields.number(payload, repetition_penalty, 1.0, low=0.0, high=10.0, low_open=True),
        frequency_penalty=fields.number(payload, "frequency_penalty", 0.0, low=-2.0, high=2.0),
        presence_penalty=fields.number(payload, "presence_penalty", 0.0, low=-2.0, high=2.0),
        rep_window=fields.integer(payload, "rep_window", 256, low=1),
        logit_bias=fields.logit_bias(payload),
        seed=fields.seed(payload),
    )


def parse_max_tokens(payload: dict, names: tuple[str, ...]) -> int:
    """The first of the alias fields that is set; the default when none is (never an error)."""
    for name in names:
        value = fields.integer(payload, name, None, low=1)
        if value is not None:
            return value
    return DEFAULT_MAX_TOKENS


def thinking(payload: dict, *, enabled: bool | None, effort: str | None,
             budget_tokens: int | None = None) -> Thinking:
    """The reasoning switch as the dialect's own fields set it (`enabled`, `effort`), unless
    chat_template_kwargs.enable_thinking, the most direct, says otherwise."""
    kwargs = fields.obj(payload, TEMPLATE_KWARGS) or {}
    explicit = fields.boolean(kwargs, "enable_thinking", TEMPLATE_KWARGS)
    return Thinking(enabled=enabled if explicit is None else explicit, effort=effort, budget_tokens=budget_tokens,
                    preserve=fields.boolean(kwargs, "preserve_thinking", TEMPLATE_KWARGS))


def effort_enables(effort: str | None) -> bool | None:
    """OpenAI's reasoning effort as the switch: "none" turns reasoning off, any other on."""
    return None if effort is None else effort != "none"


def output_format(value: dict | None, where: str, *, schema_in: str | None = None) -> OutputFormat:
    """OpenAI's text, json_object or json_schema format. `schema_in`: the key of the object that
    holds the schema and its name (Chat Completions' "json_schema"); None when they sit beside
    the type (Responses)."""
    if not value:
        return OutputFormat()
    kind = fields.string(value, "type", where, default="text")
    if kind == "json_schema":
        holder, at = (value, where) if schema_in is None else (fields.obj(value, schema_in, where) or {},
                                                               path(where, schema_in))
        return OutputFormat("json_schema", fields.obj(holder, "schema", at), fields.string(holder, "name", at),
                            field=path(at, "schema"))
    if kind not in ("text", "json_object"):
        raise bad(path(where, "type"), "must be text, json_object or json_schema", kind)
    return OutputFormat(kind, field=where)


def tool_name(tool: dict, where: str) -> str:
    name = fields.string(tool, "name", where)
    if not name:
        raise bad(path(where, "name"), "must be a non-empty string", tool.get("name"))
    return name


def function_tool(function: dict, where: str, *, schema_key: str = "parameters") -> ToolSpec:
    parameters = fields.obj(function, schema_key, where)
    return ToolSpec(name=tool_name(function, where),
                    description=fields.string(function, "description", where, default=""),
                    parameters=parameters if parameters is not None else {"type": "object", "properties": {}})


def tool_grammar(tool_format: dict | None, where: str) -> ToolGrammar | None:
    """A custom tool's `format`: {"type": "grammar", "syntax": "lark" | "regex", "definition"};
    {"type": "text"} or none leaves the input free."""
    if not tool_format or tool_format.get("type") in (None, "text"):
        return None
    if tool_format.get("type") != "grammar":
        raise bad(path(where, "type"), "must be text or grammar", tool_format.get("type"))
    syntax = fields.string(tool_format, "syntax", where, default="lark")
    if syntax not in ("lark", "regex"):
        raise bad(path(where, "syntax"), "must be lark or regex", syntax)
    definition = fields.string(tool_format, "definition", where)
    if not definition:
        raise bad(path(where, "definition"), "must be a non-empty grammar", tool_format.get("definition"))
    return ToolGrammar(syntax, definition)


def parse_tool_choice(choice: Any, where: str = "tool_choice") -> ToolChoice:
    """OpenAI's tool_choice: auto, none, required, or a named tool (either API's shape)."""
    if choice is None:
        return ToolChoice()
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad(where, "must be auto, none, required or a named tool", choice)
        return ToolChoice(choice)
    if not isinstance(choice, dict):
        raise bad(where, "must be a string or an object", choice)
    named = choice.get("function") if isinstance(choice.get("function"), dict) else choice
    name = named.get("name")
    if isinstance(name, str) and name:
        return ToolChoice("required", name)
    return ToolChoice()  # allowed_tools and other shapes: the model chooses
