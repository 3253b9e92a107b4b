"""chat/constraints.py: the reply's grammar from the canonical request, and the errors a
tool_choice or format that cannot be met gives. The grammars are checked by llguidance itself
(without a vocabulary); what they generate is tested on the embedded model (tests/integration)."""

from __future__ import annotations

import json

import llguidance
import pytest

from dflash.chat.constraints import Constraint, reply_constraint
from dflash.chat.parser import OutputParser
from dflash.protocols import anthropic, openai_chat, responses
from dflash.protocols.canonical import GenerationRequest, Message, OutputFormat, ToolChoice, ToolGrammar, ToolSpec
from dflash.protocols.errors import APIError

WEATHER = ToolSpec("get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}},
                                              "required": ["city"]})
CLOCK = ToolSpec("get_time", parameters={"type": "object", "properties": {}})
PATCH = ToolSpec("apply_patch", kind="custom", grammar=ToolGrammar("lark", 'start: "*** Begin Patch\\n" /[a-z]+/'))
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def request(**fields) -> GenerationRequest:
    return GenerationRequest(messages=(Message("user", "hi"),), **fields)


def valid(constraint: Constraint) -> bool:
    grammars = [{"lark_grammar": constraint.lark},
                *({"name": name, "lark_grammar": text} for name, text in constraint.subgrammars)]
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(json.dumps({"grammars": grammars}))
    assert not is_error, messages
    return True


def test_free_text_has_no_constraint():
    assert reply_constraint(request()) is None
    assert reply_constraint(request(tools=(WEATHER,))) is None
    assert reply_constraint(request(tools=(WEATHER,), tool_choice=ToolChoice("none"))) is None


@pytest.mark.parametrize("output_format", [OutputFormat("json_object"), OutputFormat("json_schema", SCHEMA)])
def test_output_formats_are_json_grammars(output_format):
    constraint = reply_constraint(request(output_format=output_format))
    assert valid(constraint)
    assert "%json" in constraint.lark and "<tool_call>" not in constraint.lark


def test_a_format_with_tools_on_auto_also_allows_a_call():
    constraint = reply_constraint(request(output_format=OutputFormat("json_object"), tools=(WEATHER,)))
    assert valid(constraint)
    assert "<tool_call>" in constraint.lark


def test_tool_choice_none_with_a_format_offers_no_call():
    constraint = reply_constraint(request(output_format=OutputFormat("json_object"), tools=(WEATHER,),
                                          tool_choice=ToolChoice("none")))
    assert "<tool_call>" not in constraint.lark


def test_required_forces_a_call_to_any_tool_and_named_to_that_one():
    forced = reply_constraint(request(tools=(WEATHER, CLOCK), tool_choice=ToolChoice("required")))
    assert valid(forced) and '\\"get_weather\\"' in forced.lark and '\\"get_time\\"' in forced.lark
    named = reply_constraint(request(tools=(WEATHER, CLOCK), tool_choice=ToolChoice("required", "get_time")))
    assert valid(named) and "get_weather" not in named.lark
    # The tool's schema is checked on its own, leniently (client tool schemas use keywords
    # llguidance does not implement).
    assert [part.where for part in named.parts] == ["the parameters of tool 'get_time'"]
    assert named.parts[0].source["x-guidance"]["lenient"] is True


def test_the_forced_call_text_is_what_the_parser_reads_as_a_call():
    # The grammar's fixed text around the arguments, filled with valid arguments.
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
    parser = OutputParser(tools=(WEATHER,))
    parser.feed(text)
    parser.finish()
    assert [(call.name, call.arguments) for call in parser.tool_calls] == [("get_weather", '{"city":"Paris"}')]


def test_a_custom_tool_with_a_grammar_is_forced_in_the_xml_form_with_its_grammar():
    constraint = reply_constraint(request(tools=(PATCH,), tool_choice=ToolChoice("required")))
    assert valid(constraint)
    assert constraint.subgrammars == (("input_0", PATCH.grammar.definition),)
    assert "@input_0" in constraint.lark
    text = '<tool_call>\n<function=apply_patch>\n<parameter=input>\n*** Begin Patch\n{"x": 1}\n</parameter>\n' \
           '</function>\n</tool_call>'
    parser = OutputParser(tools=(PATCH,))
    parser.feed(text)
    parser.finish()
    # Raw input kept exactly, even where it looks like JSON.
    assert [(call.kind, call.arguments) for call in parser.tool_calls] == [("custom", '*** Begin Patch\n{"x": 1}')]


def test_with_tool_choice_auto_a_custom_tool_grammar_applies_from_its_call_on():
    constraint = reply_constraint(request(tools=(WEATHER, PATCH)))
    assert valid(constraint)
    assert constraint.subgrammars == (("input_0", PATCH.grammar.definition),)
    assert constraint.lark.startswith("start: reply\nreply: text_and_calls\n")
    assert "before_call_0[lazy]: /(?s:.*)<function=apply_patch>\\n<parameter=input>\\n/" in constraint.lark


def test_the_tool_prompt_teaches_the_xml_form_for_custom_tools():
    from dflash.chat.template import builtin_call_text, builtin_tool_prompt
    from dflash.protocols.canonical import ToolCall

    call = ToolCall("c1", "apply_patch", "*** Begin Patch\nabc", kind="custom")
    assert builtin_call_text(call) == ("<tool_call>\n<function=apply_patch>\n<parameter=input>\n*** Begin Patch\nabc"
                                       "\n</parameter>\n</function>\n</tool_call>")
    assert "<function=apply_patch>" in builtin_tool_prompt((WEATHER, PATCH))
    assert "<function=" not in builtin_tool_prompt((WEATHER,))
    parser = OutputParser(tools=(PATCH,))
    parser.feed(builtin_call_text(call))
    parser.finish()
    assert [(c.name, c.kind, c.arguments) for c in parser.tool_calls] == [("apply_patch", "custom", call.arguments)]


def test_a_regex_custom_tool_grammar_becomes_a_lark_rule():
    tool = ToolSpec("path", kind="custom", grammar=ToolGrammar("regex", "[a-z]+/[a-z]+"))
    constraint = reply_constraint(request(tools=(tool,), tool_choice=ToolChoice("required")))
    assert valid(constraint)
    assert constraint.subgrammars == (("input_0", "start: /[a-z]+\\/[a-z]+/\n"),)


def test_a_reasoning_block_the_prompt_opened_comes_first():
    constraint = reply_constraint(request(output_format=OutputFormat("json_object")), starts_in_thinking=True)
    assert valid(constraint)
    assert constraint.lark.startswith("start: reasoning reply")


@pytest.mark.parametrize("fields, message", [
    ({"tool_choice": ToolChoice("required")}, "offers no tools"),
    ({"tools": (WEATHER,), "tool_choice": ToolChoice("required", "nope")}, "'nope', which is not among"),
    ({"output_format": OutputFormat("json_schema", None, field="text.format.schema")}, "'text.format.schema' is"),
])
def test_constraints_that_cannot_be_met_are_400s(fields, message):
    with pytest.raises(APIError) as caught:
        reply_constraint(request(**fields))
    assert caught.value.status == 400 and message in caught.value.message


def test_each_dialect_names_where_its_format_came_from():
    chat = openai_chat.parse_request(json.dumps({"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}}).encode())
    assert chat.output_format == OutputFormat("json_schema", SCHEMA, "n")
    assert chat.output_format.field == "response_format.json_schema.schema"
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    beta = anthropic.parse_request(json.dumps({**body, "output_format": {"type": "json_schema", "schema": SCHEMA}}
                                              ).encode())
    config = anthropic.parse_request(json.dumps({**body, "output_config": {
        "format": {"type": "json_schema", "schema": SCHEMA}}}).encode())
    assert beta.output_format.schema == config.output_format.schema == SCHEMA
    assert (beta.output_format.field, config.output_format.field) == ("output_format.schema",
                                                                      "output_config.format.schema")
    codex = responses.parse_request(json.dumps({"input": "x", "text": {"format": {
        "type": "json_schema", "name": "out", "schema": SCHEMA, "strict": True}}}).encode())
    assert codex.generation.output_format.field == "text.format.schema"


def test_custom_tool_grammars_are_parsed_in_both_openai_shapes():
    definition = 'start: "a"+'
    codex = responses.parse_request(json.dumps({"input": "x", "tools": [{
        "type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark",
                                                            "definition": definition}}]}).encode())
    assert codex.generation.tools[0].grammar == ToolGrammar("lark", definition)
    chat = openai_chat.parse_request(json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": [{
        "type": "custom", "custom": {"name": "digits", "format": {
            "type": "grammar", "grammar": {"syntax": "regex", "definition": "[0-9]+"}}}}]}).encode())
    assert chat.tools[0].grammar == ToolGrammar("regex", "[0-9]+")
    with pytest.raises(APIError, match="syntax"):
        responses.parse_request(json.dumps({"input": "x", "tools": [{
            "type": "custom", "name": "t", "format": {"type": "grammar", "syntax": "ebnf",
                                                      "definition": "x"}}]}).encode())
