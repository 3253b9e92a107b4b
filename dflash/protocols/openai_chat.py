"""OpenAI Chat Completions: request JSON -> GenerationRequest, results -> response JSON and chunks.

Pure functions. `null` means "the default", as in OpenAI's API. Fields this server does not
implement yet (tools, logprobs, n, ...) are ignored rather than refused: real clients send them
on every request.
"""

from __future__ import annotations

import json
import math
from typing import Any

import attrs

from dflash.protocols.canonical import DEFAULT_MAX_TOKENS, GenerationRequest, Sampling, Usage
from dflash.protocols.errors import APIError

ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PART_TYPES = ("text", "input_text", "output_text")
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
SEED_RANGE = (-(2**63), 2**64 - 1)


@attrs.frozen
class CompletionHeader:
    """The fields that the response, and every chunk, of one completion repeat."""

    id: str
    created: int
    model: str


def parse_request(body: bytes) -> GenerationRequest:
    payload = _json_object(body)
    stream_options = payload.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise _bad("stream_options", "must be an object", stream_options)
    return GenerationRequest(
        messages=_messages(payload.get("messages")),
        model=_optional(payload, "model", str, "a string"),
        sampling=Sampling(
            temperature=_number(payload, "temperature", 0.0, low=0.0, high=2.0),
            top_p=_number(payload, "top_p", 1.0, low=0.0, high=1.0),
            seed=_seed(payload.get("seed")),
        ),
        max_tokens=_max_tokens(payload),
        stop=_stop(payload.get("stop")),
        stream=bool(_optional(payload, "stream", bool, "true or false")),
        include_usage=bool(_optional(stream_options or {}, "include_usage", bool, "true or false")),
    )


def render_completion(header: CompletionHeader, *, text: str, finish_reason: str, usage: Usage) -> dict:
    return {
        "id": header.id,
        "object": "chat.completion",
        "created": header.created,
        "model": header.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }],
        "usage": render_usage(usage),
    }


def render_chunk(header: CompletionHeader, *, delta: dict[str, Any], finish_reason: str | None = None,
                 usage: Usage | None = None) -> dict:
    """A stream chunk. Usage rides on the last chunk unless the client asked for a usage chunk."""
    chunk = {
        "id": header.id,
        "object": "chat.completion.chunk",
        "created": header.created,
        "model": header.model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if usage is not None:
        chunk["usage"] = render_usage(usage)
    return chunk


def render_usage_chunk(header: CompletionHeader, usage: Usage) -> dict:
    """The `stream_options.include_usage` chunk: no choices, only usage."""
    return {"id": header.id, "object": "chat.completion.chunk", "created": header.created, "model": header.model,
            "choices": [], "usage": render_usage(usage)}


def render_usage(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "timings": {
            "prompt_tokens": usage.prompt_tokens,
            "prefilled_tokens": usage.prefilled_tokens,
            "cached_tokens": usage.cached_tokens,
            "prefill_ms": round(usage.prefill_ms, 3),
            "decode_ms": round(usage.decode_ms, 3),
        },
    }


def render_stream_error(error: APIError) -> dict:
    """An error after the SSE headers went out: the status line is spent, so it rides in the stream."""
    return {"error": {"message": error.message, "type": "server_error" if error.status >= 500 else
                      "invalid_request_error", "param": error.param, "code": error.code or error.status}}


def _json_object(body: bytes) -> dict:
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(payload).__name__}")
    return payload


def _messages(messages: Any) -> list[dict]:
    if messages is None:
        raise APIError(400, "'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty array", messages)
    return [_message(index, message) for index, message in enumerate(messages)]


def _message(index: int, message: Any) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _bad(where, "must be an object", message)
    role = message.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role", f"must be one of {', '.join(ROLES)}", role)
    return {"role": role, "content": _content(f"{where}.content", message.get("content"))}


def _content(where: str, content: Any) -> str:
    """A string, or an array of parts whose text parts are joined; other parts (images) are dropped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or an array of content parts", content)
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _bad(f"{where}[{index}]", "must be an object with a 'type'", part)
        if part["type"] in TEXT_PART_TYPES:
            if not isinstance(part.get("text"), str):
                raise _bad(f"{where}[{index}].text", "must be a string", part.get("text"))
            texts.append(part["text"])
    return "".join(texts)


def _max_tokens(payload: dict) -> int:
    for field in MAX_TOKENS_FIELDS:
        value = payload.get(field)
        if value is None:
            continue
        if type(value) is not int or value < 1:
            raise _bad(field, "must be a positive integer", value)
        return value
    return DEFAULT_MAX_TOKENS


def _number(payload: dict, field: str, default: float, *, low: float, high: float) -> float:
    value = payload.get(field)
    if value is None:
        return default
    if type(value) not in (int, float) or not math.isfinite(value) or not low <= value <= high:
        raise _bad(field, f"must be a number from {low:g} to {high:g}", value)
    return float(value)


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is not int or not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise _bad("seed", "must be an integer", value)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _bad("stop", "must be a string or an array of strings", value)
    return tuple(item for item in value if item)


def _optional(payload: dict, field: str, expected_type: type, expected: str):
    value = payload.get(field)
    if value is not None and type(value) is not expected_type:
        raise _bad(field, f"must be {expected}", value)
    return value


def _bad(param: str, problem: str, value: Any) -> APIError:
    shown = json.dumps(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return APIError(400, f"'{param}' {problem}, got {shown}", param=param)
