"""Structured output on the embedded model through the real server: thirty JSON schemas rotated
through the three dialects (every complete reply parses and validates), forced tool calls with a
Claude Code tool set (a well-formed call with valid arguments every time), a Codex-style custom
tool with a grammar, and invalid or unsupported schemas as 400s in each dialect's shape."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.integration.conftest import running_server, server_config
from tests.integration.structured_schemas import SCHEMAS

FIXTURE = Path(__file__).parents[2] / "../shared/fixtures/clients/claude-code-2.1.197-messages-request.json"
# A few of Claude Code's tools with their schemas as sent; long descriptions cut so the prompt
# prefills in seconds on a CPU.
CLAUDE_TOOL_NAMES = ("Bash", "Read", "Edit", "Write", "WebFetch", "TaskCreate")
PROMPT = "Give one example, as JSON."
MAX_TOKENS = 64
DIALECTS = ("chat", "anthropic", "responses")
TIMEOUT_S = 300


def post(server, path: str, body: dict) -> httpx.Response:
    base_url, _ = server
    return httpx.post(f"{base_url}{path}", json=body, timeout=TIMEOUT_S)


# ---- one request per dialect: (reply text, complete?) ----------------------------------------

def ask_chat(server, schema: dict) -> tuple[str, bool]:
    reply = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
        "response_format": {"type": "json_schema", "json_schema": {"name": "example", "schema": schema,
                                                                  "strict": True}}})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return choice["message"]["content"], choice["finish_reason"] == "stop"


def ask_anthropic(server, schema: dict) -> tuple[str, bool]:
    reply = post(server, "/v1/messages", {
        "model": "m", "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": PROMPT}],
        "output_format": {"type": "json_schema", "schema": schema}})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return "".join(block["text"] for block in body["content"] if block["type"] == "text"), \
        body["stop_reason"] == "end_turn"


def ask_responses(server, schema: dict) -> tuple[str, bool]:
    reply = post(server, "/v1/responses", {
        "input": PROMPT, "max_output_tokens": MAX_TOKENS, "store": False,
        "text": {"format": {"type": "json_schema", "name": "example", "schema": schema, "strict": True}}})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    texts = [part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"]]
    return "".join(texts), body["status"] == "completed"


ASK = {"chat": ask_chat, "anthropic": ask_anthropic, "responses": ask_responses}


def test_thirty_schemas_through_all_three_dialects_validate(server):
    complete = 0
    for index, schema in enumerate(SCHEMAS):
        # Rotated, so each dialect goes first for some: the later ones reuse the cached prompt.
        replies = {dialect: ASK[dialect](server, schema) for dialect in DIALECTS[index % 3:] + DIALECTS[:index % 3]}
        # The same conversation renders to the same prompt in every dialect; greedy replies agree.
        assert len({text for text, _ in replies.values()}) == 1, (index, replies)
        for dialect, (text, finished) in replies.items():
            if not finished:
                continue  # cut by max_tokens: finish reason length, the client knows it is incomplete
            complete += 1
            try:
                jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
            except (ValueError, jsonschema.ValidationError) as exc:
                pytest.fail(f"schema {index} through {dialect}: {text!r} does not validate: {exc}")
    assert complete >= 3 * (len(SCHEMAS) - 3), f"only {complete} of {3 * len(SCHEMAS)} replies finished"


def test_a_cut_constrained_reply_says_length(server):
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    reply = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    assert reply.json()["choices"][0]["finish_reason"] == "length"


# ---- forced tool calls -------------------------------------------------------------------------

def claude_tools() -> list[dict[str, Any]]:
    tools = json.loads(FIXTURE.read_text())["body"]["tools"]
    return [{"name": tool["name"], "description": tool["description"][:80], "input_schema": tool["input_schema"]}
            for tool in tools if tool["name"] in CLAUDE_TOOL_NAMES]


def forced_call(server, dialect: str, tools: list[dict], name: str | None) -> tuple[str, dict]:
    """(tool name, arguments) of the one call the reply must be."""
    messages = [{"role": "user", "content": "Show me what is in the file /etc/hostname."}]
    if dialect == "chat":
        reply = post(server, "/v1/chat/completions", {
            "messages": messages, "max_tokens": 160,
            "tools": [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                        "parameters": t["input_schema"]}} for t in tools],
            "tool_choice": {"type": "function", "function": {"name": name}} if name else "required"})
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        return call["function"]["name"], json.loads(call["function"]["arguments"])
    if dialect == "anthropic":
        reply = post(server, "/v1/messages", {
            "model": "m", "max_tokens": 160, "messages": messages, "tools": tools,
            "tool_choice": {"type": "tool", "name": name} if name else {"type": "any"}})
        body = reply.json()
        assert body["stop_reason"] == "tool_use", body
        [call] = [block for block in body["content"] if block["type"] == "tool_use"]
        return call["name"], call["input"]
    reply = post(server, "/v1/responses", {
        "input": messages[0]["content"], "max_output_tokens": 160, "store": False,
        "tools": [{"type": "function", "name": t["name"], "description": t["description"],
                   "parameters": t["input_schema"]} for t in tools],
        "tool_choice": {"type": "function", "name": name} if name else "required"})
    body = reply.json()
    assert body["status"] == "completed", body
    [call] = [item for item in body["output"] if item["type"] == "function_call"]
    return call["name"], json.loads(call["arguments"])


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("named", [None, "Read"])
def test_forced_tool_calls_are_well_formed_with_valid_arguments(server, dialect, named):
    tools = claude_tools()
    name, arguments = forced_call(server, dialect, tools, named)
    schemas = {tool["name"]: tool["input_schema"] for tool in tools}
    assert name in schemas and (named is None or name == named)
    jsonschema.validate(arguments, schemas[name])


@pytest.mark.parametrize("syntax, definition, pattern", [
    ("regex", "[a-z]{2,8}( [a-z]{2,8}){0,2}", r"[a-z]{2,8}( [a-z]{2,8}){0,2}"),
    ("lark", 'start: "ls" | "pwd" | "cat " PATH\nPATH: /\\/[a-z]{1,8}/', r"ls|pwd|cat /[a-z]{1,8}"),
])
def test_a_forced_custom_tool_input_follows_its_grammar(server, syntax, definition, pattern):
    reply = post(server, "/v1/responses", {
        "input": "Run a shell command.", "max_output_tokens": 64, "store": False, "tool_choice": "required",
        "tools": [{"type": "custom", "name": "shell", "description": "Runs a command.",
                   "format": {"type": "grammar", "syntax": syntax, "definition": definition}}]})
    body = reply.json()
    [call] = [item for item in body["output"] if item["type"] == "custom_tool_call"]
    assert call["name"] == "shell" and re.fullmatch(pattern, call["input"]), call


# ---- speculation on and off ------------------------------------------------------------------

def constrained_replies(server) -> tuple[list[Any], int]:
    """Greedy constrained replies (two schemas, a forced Claude Code call) and the tokens drafted."""
    replies, drafted = [], 0
    for schema in SCHEMAS[:2]:
        body = post(server, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40,
            "response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": schema}}}).json()
        replies.append(body["choices"][0]["message"]["content"])
        drafted += body["usage"]["timings"]["draft_tokens"]
    body = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Show me what is in the file /etc/hostname."}], "max_tokens": 60,
        "tools": [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                    "parameters": t["input_schema"]}} for t in claude_tools()],
        "tool_choice": "required"}).json()
    replies.append(body["choices"][0]["message"]["tool_calls"][0]["function"])
    drafted += body["usage"]["timings"]["draft_tokens"]
    return replies, drafted


def test_constrained_replies_are_the_same_with_speculation_on_and_off(tmp_path):
    # On: n-gram and DFlash drafts at every step (no adaptive pauses); off: plain decoding.
    with running_server(tmp_path / "on", server_config({"drafter": "auto", "adaptive": False})) as started:
        on, drafted = constrained_replies((started["listening"], started["model"]))
    with running_server(tmp_path / "off", server_config({"drafter": "none"})) as started:
        off, none = constrained_replies((started["listening"], started["model"]))
    assert drafted > 0 and none == 0
    assert on == off


# ---- invalid schemas ---------------------------------------------------------------------------

INVALID = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
UNSUPPORTED = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}


@pytest.mark.parametrize("schema, problem", [(INVALID, "nonsense"), (UNSUPPORTED, "uniqueItems")])
def test_invalid_schemas_are_400s_in_each_dialect_shape(server, schema, problem):
    chat = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert chat.status_code == 400
    assert problem in chat.json()["error"]["message"] and chat.json()["error"]["type"] == "invalid_request_error"
    assert chat.json()["error"]["param"] == "response_format.json_schema.schema"
    message = post(server, "/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user",
                                                                                          "content": "x"}],
                                            "output_format": {"type": "json_schema", "schema": schema}})
    assert message.status_code == 400
    assert message.json()["type"] == "error" and problem in message.json()["error"]["message"]
    response = post(server, "/v1/responses", {"input": "x", "store": False,
                                              "text": {"format": {"type": "json_schema", "name": "x",
                                                                  "schema": schema}}})
    assert response.status_code == 400 and problem in response.json()["error"]["message"]
