"""Helpers for dialect tests on the fake engine: requests, SSE events, and the scripted replies."""

from __future__ import annotations

import json

from tests.unit.rawhttp import RawClient, Reply, request

WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                "days": {"type": "integer"}},
                               "required": ["city"]}}

# What the fake "model" writes for each golden case.
PLAIN = "Hello there."
REASONING = "<think>The user greets me.</think>Hello there."
ONE_CALL = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": "2"}}\n</tool_call>'
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>')
STOPPED = "Hello there. STOP and more"


async def post(port: int, path: str, body: dict, headers=()) -> Reply:
    return await request(port, "POST", path, json_body=body, headers=list(headers))


async def post_stream(port: int, path: str, body: dict, headers=()) -> list[tuple[str | None, object]]:
    """(event name, parsed data) of every record of a streamed reply; `[DONE]` stays a string."""
    client = await RawClient.open(port)
    try:
        await client.send_request("POST", path, json_body={**body, "stream": True}, headers=list(headers))
        status, response_headers = await client.read_head()
        assert status == 200, status
        assert response_headers["content-type"].startswith("text/event-stream")
        records = [record async for record in client.read_sse_records()]
    finally:
        await client.aclose()
    return [sse_event(record) for record in records if not record.startswith(":")]


def sse_event(record: str) -> tuple[str | None, object]:
    """(event name, parsed data) of one SSE record; `[DONE]` stays a string, a comment's data is None."""
    name, data = None, []
    for line in record.split("\n"):
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data.append(line.removeprefix("data: "))
    if not data:
        return name, None
    text = "\n".join(data)
    return name, text if text == "[DONE]" else json.loads(text)


def merged(signatures: list[str]) -> list[str]:
    """Consecutive text pieces of one kind joined: the fake model writes one byte per token."""
    out: list[str] = []
    for signature in signatures:
        kind, _, text = signature.partition(":")
        if out and kind in ("content", "reasoning", "text", "thinking", "args", "input")\
                and out[-1].startswith(kind + ":"):
            out[-1] += text
        else:
            out.append(signature)
    return out
