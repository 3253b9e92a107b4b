"""The official `openai` and `anthropic` SDKs against the real server on the embedded model: every
reply and stream must parse, tool calls included. Replies are kept short.

SmolLM2-135M does not follow a tool prompt from instructions alone, but it does continue a
conversation in which it already called the tool, so the tool tests send such a history."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
QUESTION = "Name a colour."


@pytest.fixture(scope="module")
def oai(server):
    base_url, _ = server
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    base_url, _ = server
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


# ---- Chat Completions ------------------------------------------------------------------------

def chat_tool_history() -> list[dict]:
    earlier = {"id": "call_earlier", "type": "function",
               "function": {"name": "get_weather", "arguments": json.dumps({"city": "Rome"})}}
    return [{"role": "user", "content": "What is the weather in Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [earlier]},
            {"role": "user", "content": "And in Paris?"}]


def test_chat_tool_call_non_streaming(oai):
    completion = oai.chat.completions.create(model="my-agent", messages=chat_tool_history(), max_tokens=40,
                                             tools=[{"type": "function", "function": WEATHER}],
                                             tool_choice="required", temperature=0)
    choice = completion.choices[0]
    assert completion.model == "my-agent"
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_chat_tool_call_streaming_accumulates(oai):
    with oai.chat.completions.stream(model="my-agent", messages=chat_tool_history(), max_tokens=40,
                                     tools=[{"type": "function", "function": WEATHER}], temperature=0) as stream:
        for _ in stream:
            pass
        completion = stream.get_final_completion()
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.function.parsed_arguments in (None, {"city": "Paris"})
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_chat_logprobs_n_and_usage(oai):
    completion = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}],
                                             max_tokens=4, n=2, logprobs=True, top_logprobs=2, temperature=0)
    assert [choice.index for choice in completion.choices] == [0, 1]
    first, second = completion.choices
    assert first.message.content == second.message.content  # greedy twice
    tokens = first.logprobs.content
    assert tokens and all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in tokens)
    assert tokens[0].top_logprobs[0].token == tokens[0].token  # greedy picks the likeliest
    assert completion.usage.completion_tokens >= 2 * len(tokens)


def test_chat_bad_request_is_the_sdks_bad_request_error(oai):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}], temperature=5)
    assert caught.value.body["param"] == "temperature"


# ---- Responses -----------------------------------------------------------------------------

def test_responses_text_non_streaming_and_streaming(oai):
    response = oai.responses.create(model="codex-model", input=QUESTION, max_output_tokens=6,
                                    instructions="Answer briefly.")
    assert response.model == "codex-model" and response.output_text
    assert response.status in ("completed", "incomplete")
    assert response.usage.input_tokens > 0 and response.usage.input_tokens_details.cached_tokens >= 0
    with oai.responses.stream(model="codex-model", input=QUESTION, max_output_tokens=6,
                              instructions="Answer briefly.") as stream:
        events = list(stream)
    # (The SDK's get_final_response() knows only response.completed; a reply cut by
    # max_output_tokens ends in response.incomplete, as OpenAI's own does.)
    assert [event.type for event in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == response.output_text  # greedy


def test_responses_tool_call_and_follow_up(oai):
    history = [{"role": "user", "content": "What is the weather in Rome?"},
               {"type": "function_call", "call_id": "call_earlier", "name": "get_weather",
                "arguments": json.dumps({"city": "Rome"})},
               {"role": "user", "content": "And in Paris?"}]
    tools = [{"type": "function", **WEATHER}, {"type": "web_search"}]
    with oai.responses.stream(model="codex-model", input=history, tools=tools, max_output_tokens=40,
                              temperature=0) as stream:
        for _ in stream:
            pass
        response = stream.get_final_response()
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [("get_weather", {"city": "Paris"})]
    follow_up = oai.responses.create(
        model="codex-model", tools=tools, max_output_tokens=8,
        input=[*history, *[item.model_dump(exclude_none=True) for item in response.output],
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 24 C"}])
    assert follow_up.status in ("completed", "incomplete")


def test_responses_store_and_previous_response_id(oai):
    first = oai.responses.create(model="m", input=QUESTION, max_output_tokens=4)
    assert oai.responses.retrieve(first.id).id == first.id
    second = oai.responses.create(model="m", input="Another one.", previous_response_id=first.id, max_output_tokens=4)
    assert second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve("resp_unknown")


# ---- Anthropic Messages --------------------------------------------------------------------

def test_anthropic_text_non_streaming_streaming_and_count(claude):
    message = claude.messages.create(model="claude-opus-4-8", max_tokens=6, system="Answer briefly.",
                                     messages=[{"role": "user", "content": QUESTION}])
    assert message.model == "claude-opus-4-8" and message.content[0].type == "text"
    assert message.stop_reason in ("end_turn", "max_tokens")
    with claude.messages.stream(model="claude-opus-4-8", max_tokens=6, system="Answer briefly.",
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == message.content[0].text  # greedy (temperature defaults to 0)
    counted = claude.messages.count_tokens(model="claude-opus-4-8", system="Answer briefly.",
                                           messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_anthropic_tool_use_streaming_and_tool_result(claude):
    tools = [{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}]
    history = [{"role": "user", "content": "What is the weather in Rome?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_earlier", "name": "get_weather",
                                                  "input": {"city": "Rome"}}]},
               {"role": "user", "content": "And in Paris?"}]
    with claude.messages.stream(model="claude-opus-4-8", max_tokens=40, tools=tools, tool_choice={"type": "any"},
                                messages=history) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (tool_use,) = [block for block in final.content if block.type == "tool_use"]
    assert (tool_use.name, tool_use.input) == ("get_weather", {"city": "Paris"})
    answer = claude.messages.create(
        model="claude-opus-4-8", max_tokens=8, tools=tools,
        messages=[*history, {"role": "assistant", "content": [block.model_dump() for block in final.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                                "content": "sunny"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_anthropic_bad_request_is_the_sdks_bad_request_error(claude):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="m", max_tokens=5, messages=[{"role": "robot", "content": "x"}])
    assert caught.value.body["type"] == "error"


def test_message_boundaries_keep_a_conversation_cached_across_other_requests(oai):
    system = {"role": "system", "content": "You are a terse assistant. " * 20}
    first_turn = [system, {"role": "user", "content": QUESTION}]
    first = oai.chat.completions.create(model="m", messages=first_turn, max_tokens=4)
    oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Unrelated."}], max_tokens=2)
    second = oai.chat.completions.create(model="m", max_tokens=2, messages=[
        *first_turn, {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Another."}])
    # The unrelated request replaced the live state; the first turn comes back from a snapshot
    # the engine kept (at a message boundary, or of the exact earlier prompt).
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 5
