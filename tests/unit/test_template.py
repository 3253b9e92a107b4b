"""chat/template.py and chat/tool_memory.py: native and built-in tool rendering, thinking, system
merging, the billing header, message boundaries and replay of generated turns."""

from __future__ import annotations

from dflash.chat.template import ChatTemplate
from dflash.chat.tool_memory import ToolMemory
from dflash.protocols.canonical import GenerationRequest, Message, Thinking, ToolCall, ToolChoice, ToolSpec
from tests.unit.fakes import FAKE_TEMPLATE, byte_tokenize

# A Qwen3-like template: tools natively, tool_calls structured, a thinking switch.
NATIVE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if not (tools and m.role == 'system') %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking %}"
    "<think>\n{% endif %}{{ greeting | default('') }}{% endif %}"
)
TOOL = ToolSpec("get_weather", "Weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                           "required": ["city"]})
CALL = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
HISTORY = (Message("user", "weather?"), Message("assistant", "", tool_calls=(CALL,)),
           Message("tool", "sunny", tool_call_id="call_1"))


def native() -> ChatTemplate:
    return ChatTemplate(NATIVE, tokenize=byte_tokenize)


def test_native_template_gets_tools_and_structured_calls():
    text = native().render(GenerationRequest(HISTORY, tools=(TOOL,))).text
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\nsunny<|im_end|>" in text


def test_builtin_tool_prompt_for_a_template_without_tools():
    text = FAKE_TEMPLATE.render(GenerationRequest((Message("system", "Be brief."), *HISTORY), tools=(TOOL,))).text
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert 'For example:\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "..."}}\n</tool_call>' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text


def test_tool_choice_none_renders_no_tools():
    text = FAKE_TEMPLATE.render(GenerationRequest(HISTORY, tools=(TOOL,), tool_choice=ToolChoice("none"))).text
    assert "# Tools" not in text


def test_thinking_switch_and_template_kwargs():
    template = native()
    thinking = template.render(GenerationRequest((Message("user", "hi"),), thinking=Thinking(enabled=True)))
    assert thinking.text.endswith("<|im_start|>assistant\n<think>\n")
    assert thinking.starts_in_thinking and thinking.thinking_prefix == "<think>\n"
    plain = template.render(GenerationRequest((Message("user", "hi"),), template_kwargs={"greeting": "Yo",
                                                                                         "messages": []}))
    assert plain.text.endswith("assistant\nYo") and not plain.starts_in_thinking


def test_leading_system_messages_merge_and_the_billing_header_goes():
    request = GenerationRequest((
        Message("system", "x-anthropic-billing-header: cc_version=1; cch=abc;\nYou are Claude Code."),
        Message("system", "Be careful."), Message("user", "hi")))
    text = FAKE_TEMPLATE.render(request).text
    assert text.startswith("<|im_start|>system\nYou are Claude Code.\n\nBe careful.<|im_end|>\n")
    assert "billing" not in text


def test_system_messages_after_a_question_are_read_before_it():
    """Claude Code sends its agent and skill lists as a system message after the user's question:
    the question must stay the last thing before the answer, the same way in every later turn."""
    first = (Message("system", "You are Claude Code."), Message("user", "Say hello."),
             Message("system", "Available agents: Explore, Plan."))
    text = FAKE_TEMPLATE.render(GenerationRequest(first)).text
    assert text.startswith("<|im_start|>system\nYou are Claude Code.\n\nAvailable agents: Explore, Plan.<|im_end|>\n"
                           "<|im_start|>user\nSay hello.<|im_end|>\n")
    later = FAKE_TEMPLATE.render(GenerationRequest(
        (*first, Message("assistant", "Hello."), Message("user", "Again."), Message("system", "A reminder.")))).text
    assert later.startswith(text.removesuffix("<|im_start|>assistant\n"))  # turn 1 is a prefix: cached
    assert later.index("A reminder.") < later.index("Again.")


def test_boundaries_are_token_positions_after_each_turn_end():
    rendered = FAKE_TEMPLATE.render(GenerationRequest((Message("user", "héllo"), Message("assistant", "ok"),
                                                       Message("user", "more"))))
    prompt = bytes(rendered.token_ids).decode()
    assert FAKE_TEMPLATE.turn_end == "<|im_end|>\n"
    assert [bytes(rendered.token_ids[:position]).decode()[-11:] for position in rendered.snapshot_at] == \
        ["<|im_end|>\n"] * 4
    assert rendered.snapshot_at[-1] == len(prompt.encode()) - len("<|im_start|>assistant\n")


def test_tool_memory_replays_a_turn_only_for_its_exact_ids():
    memory = ToolMemory()
    memory.remember(["call_1"], "I will check.\n<tool_call>{...}</tool_call>")
    text = FAKE_TEMPLATE.render(GenerationRequest(HISTORY, tools=(TOOL,)), memory).text
    assert "<|im_start|>assistant\nI will check.\n<tool_call>{...}</tool_call><|im_end|>" in text
    assert memory.recall(["call_1", "call_2"]) is None
    assert memory.recall(["call_2"]) is None


def test_tool_memory_is_a_bounded_lru():
    memory = ToolMemory(max_turns=2, max_chars=10)
    memory.remember(["a"], "1234")
    memory.remember(["b", "c"], "5678")
    assert memory.recall(["c", "b"]) == "5678"
    memory.remember(["d"], "90")
    assert memory.recall(["a"]) is None and memory.recall(["d"]) == "90" and len(memory) == 2
    memory.remember(["e"], "123456789")
    assert len(memory) == 1 and memory.recall(["e"]) == "123456789"
