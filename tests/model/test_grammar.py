"""Grammar-constrained decoding on the embedded model: replies follow the schema, speculation
does not change them, bad schemas are clear errors, and a cut reply ends with 'length'."""

import json

import jsonschema
import pytest

from dflash.chat.constraints import reply_constraint
from dflash.chat.template import render_prompt
from dflash.engine.grammar import GrammarError, json_schema_grammar, lark_grammar
from dflash.engine.loading import load_model
from dflash.engine.sampling import SamplingParams
from dflash.engine.speculative import SpeculationConfig
from dflash.protocols.canonical import GenerationRequest, Message, ToolGrammar, ToolSpec

SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
     "required": ["city", "country"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                  "minItems": 1, "maxItems": 3}},
     "required": ["colors"], "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"}},
     "required": ["age", "name"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def loaded():
    return load_model(dtype="bfloat16", max_ctx=1024)


def constrained(loaded, prompt, grammar, max_tokens=48, speculation=SpeculationConfig()):
    engine = loaded.engine
    engine.speculation = speculation
    engine.rollback(0)
    try:
        ids = render_prompt(loaded.tokenizer, [{"role": "user", "content": prompt}])
        generation = engine.start(ids, SamplingParams(), max_tokens, grammar=grammar)
        out = generation.run()
        return loaded.tokenizer.decode(out), generation
    finally:
        engine.speculation = SpeculationConfig()


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "enum-array", "bounds-pattern"])
def test_constrained_reply_validates_and_speculation_does_not_change_it(loaded, schema):
    prompt = "Describe Paris as JSON."
    text, generation = constrained(loaded, prompt, json_schema_grammar(schema))
    assert generation.finished == "stop"
    jsonschema.validate(json.loads(text), schema)
    ngram = SpeculationConfig(drafter="ngram", adaptive=False, ngram_min=1)
    again, _ = constrained(loaded, prompt, json_schema_grammar(schema), speculation=ngram)
    assert again == text


def test_lark_grammar_is_followed(loaded):
    text, _ = constrained(loaded, "Say yes or no.", lark_grammar('start: "yes" | "no"'))
    assert text in ("yes", "no")


def test_a_cut_constrained_reply_finishes_with_length(loaded):
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    _, generation = constrained(loaded, "Tell a long story as JSON.", json_schema_grammar(schema), max_tokens=5)
    assert generation.finished == "length"


def test_invalid_schemas_are_clear_errors(loaded):
    grammar_tokenizer = loaded.engine.grammar_tokenizer()
    with pytest.raises(GrammarError):
        grammar_tokenizer.validate(json_schema_grammar({"type": "object", "properties": {"a": {"type": "nonsense"}}}))
    with pytest.raises(GrammarError):
        grammar_tokenizer.validate(lark_grammar("start: ("))


PATCH_GRAMMAR = 'start: "*** Begin Patch\\n" /[a-z ]+/ "\\n*** End Patch"\n'


@pytest.mark.parametrize("text, accepted", [
    ("I will edit it.\n<tool_call>\n<function=apply_patch>\n<parameter=input>\n*** Begin Patch\nabc def\n"
     "*** End Patch\n</parameter>\n</function>\n</tool_call>\nDone.", True),
    ('Reading first.\n<tool_call>\n{"name": "read", "arguments": {"path": "a.py"}}\n</tool_call>', True),
    ("Plain words, no call at all.", True),
    ("<tool_call>\n<function=apply_patch>\n<parameter=input>\nrm -rf /", False),  # input off the grammar
    ('<tool_call>\n{"name": "apply_patch", "arguments": {"input": "x"}}', False),  # JSON form cannot be checked
])
def test_with_tool_choice_auto_a_custom_tool_input_follows_its_grammar(loaded, text, accepted):
    tools = (ToolSpec("read", parameters={"type": "object", "properties": {"path": {"type": "string"}}}),
             ToolSpec("apply_patch", kind="custom", grammar=ToolGrammar("lark", PATCH_GRAMMAR)))
    constraint = reply_constraint(GenerationRequest(messages=(Message("user", "edit"),), tools=tools))
    matcher = loaded.engine.grammar_tokenizer().matcher(constraint.grammar())
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    assert (matcher.valid_prefix(ids) == len(ids)) is accepted
