"""Reading request JSON field by field: each reader checks one type and range and raises an
APIError that names the field (as a path like `messages[2].content`) and the value it got.

`null` means "the default" throughout, as in OpenAI's and Anthropic's APIs. Fields nobody reads
here are ignored: clients send many that do not concern a local server.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from dflash.protocols.errors import APIError

SEED_RANGE = (-(2**63), 2**64 - 1)
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def bad(param: str, problem: str, value: Any) -> APIError:
    shown = json.dumps(value, ensure_ascii=False, default=repr)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return APIError(400, f"'{param}' {problem}, got {shown}", param=param)


def path(where: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def parts_text(where: str, content: Any, part_types: tuple[str, ...], *, joiner: str = "",
               keys: tuple[str, ...] = ("text",)) -> str:
    """A string, or an array of content parts whose text parts (of `part_types`) are joined; other
    parts (images) are dropped. A part's text is its first non-empty field among `keys`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "must be a string or an array of content parts", content)
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad(path(where, index), "must be an object with a 'type'", part)
        if part["type"] in part_types:
            texts.append(next((text for key in keys if (text := string(part, key, path(where, index), default=""))), ""))
    return joiner.join(texts)


def json_object(body: bytes) -> dict:
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None
    if not isinstance(payload, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(payload).__name__}")
    if SURROGATE_ESCAPE.search(body):
        _check_surrogates(payload)
    return payload


def _check_surrogates(payload: dict) -> None:
    """JSON may escape half a UTF-16 pair; such text cannot be encoded, tokenized or echoed back."""
    try:
        json.dumps(payload, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "request body contains an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)") from None


def required(payload: dict, key: str, where: str = "") -> Any:
    value = payload.get(key)
    if value is None:
        name = path(where, key)
        raise APIError(400, f"'{name}' is required", param=name)
    return value


def string(payload: dict, key: str, where: str = "", *, default: str | None = None) -> str | None:
    value = payload.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad(path(where, key), "must be a string", value)
    return value


def boolean(payload: dict, key: str, where: str = "", *, default: bool | None = None) -> bool | None:
    value = payload.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(path(where, key), "must be true or false", value)
    return value


def number(payload: dict, key: str, default: float, *, low: float, high: float | None = None,
           low_open: bool = False, where: str = "") -> float:
    """A finite number in [low, high] (or (low, high] with `low_open`)."""
    value = payload.get(key)
    if value is None:
        return default
    too_low = type(value) in (int, float) and (value <= low if low_open else value < low)
    too_high = type(value) in (int, float) and high is not None and value > high
    if type(value) not in (int, float) or not math.isfinite(value) or too_low or too_high:
        if high is None:
            span = f"> {low:g}" if low_open else f">= {low:g}"
        else:
            span = f"in ({low:g}, {high:g}]" if low_open else f"from {low:g} to {high:g}"
        raise bad(path(where, key), f"must be a number {span}", value)
    return float(value)


def integer(payload: dict, key: str, default: int | None, *, low: int, high: int | None = None,
            where: str = "") -> int | None:
    value = payload.get(key)
    if value is None:
        return default
    if type(value) is not int or value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f">= {low}"
        raise bad(path(where, key), f"must be an integer {span}", value)
    return value


def seed(payload: dict, key: str = "seed") -> int | None:
    return integer(payload, key, None, low=SEED_RANGE[0], high=SEED_RANGE[1])


def obj(payload: dict, key: str, where: str = "") -> dict | None:
    value = payload.get(key)
    if value is not None and not isinstance(value, dict):
        raise bad(path(where, key), "must be an object", value)
    return value


def array(payload: dict, key: str, where: str = "") -> list | None:
    value = payload.get(key)
    if value is not None and not isinstance(value, list):
        raise bad(path(where, key), "must be an array", value)
    return value


def strings(payload: dict, key: str, where: str = "", *, single_allowed: bool = True) -> tuple[str, ...]:
    """A string or an array of strings (stop sequences); empty strings are dropped."""
    value = payload.get(key)
    if value is None:
        return ()
    if isinstance(value, str) and single_allowed:
        value = [value]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        expected = "a string or an array of strings" if single_allowed else "an array of strings"
        raise bad(path(where, key), f"must be {expected}", value)
    return tuple(item for item in value if item)


def logit_bias(payload: dict, key: str = "logit_bias") -> dict[int, float]:
    """OpenAI's {"token id": bias in [-100, 100]}."""
    value = obj(payload, key)
    if not value:
        return {}
    biases: dict[int, float] = {}
    for token, bias in value.items():
        if not token.lstrip("-").isdigit() or int(token) < 0:
            raise bad(f"{key}.{token}", "must be keyed by a token id", token)
        if type(bias) not in (int, float) or not -100 <= bias <= 100:
            raise bad(f"{key}.{token}", "must be a number from -100 to 100", bias)
        biases[int(token)] = float(bias)
    return biases
