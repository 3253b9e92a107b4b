"""A multi-turn tool-using agent conversation replayed against the live server, with caches off,
with the memory prefix cache, and with the memory cache plus the agent turn cache: per turn, the
time to first token and the prompt tokens the server had to compute.

The conversation starts from the captured Claude Code request (its system prompt, trimmed to
`--system-tokens`, and a few of its tools); each turn the model is made to call a tool, and the
tool's result is appended, as an agent does. The results cycle through the sizes a coding agent's
tools typically return: a directory listing (~90 tokens), a file read (~500), a grep (~170), a
test run (~260).

"caches off" turns off both snapshot caches and the reuse of the engine's live state: every turn
computes its whole prompt. The last column is caches-off TTFT over agent-turn-cache TTFT.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/agent_loop.py [--turns 5] [--system-tokens 3000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.live_server import LiveServer  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "clients" / "claude-code-2.1.197-messages-request.json"
TOOL_RESULTS = [
    "src/\nsrc/app.py\nsrc/handlers.py\nsrc/util.py\ntests/\ntests/test_app.py\ntests/test_handlers.py\n"
    "README.md\npyproject.toml\n.gitignore",  # ls
    "\n".join(f"def handler_{i}(request):\n    return respond(request, status={200 + i % 5})\n"
              for i in range(24)),  # a file read
    "\n".join(f"src/handlers.py:{3 * i + 1}:def handler_{i}(request):" for i in range(12)),  # grep
    "\n".join(f"tests/test_handlers.py::test_handler_{i} PASSED" for i in range(14))
    + "\n=========== 14 passed in 0.42s ===========",  # a test run
]


def conversation_start(system_tokens: int) -> tuple[str, list[dict]]:
    request = json.loads(FIXTURE.read_text())
    body = request.get("body", request)
    system = "\n".join(block.get("text", "") for block in body["system"] if isinstance(block, dict))
    system = system[: system_tokens * 4]  # ~4 characters per token
    tools = [t for t in body["tools"] if t["name"] in ("Read", "Bash", "Grep")]
    for tool in tools:
        tool["description"] = tool["description"][:200]
    return system, tools


def stream_turn(client: httpx.Client, system: str, tools: list[dict], messages: list[dict],
                metadata: dict | None = None) -> tuple[float, dict, dict]:
    """One streamed Anthropic turn: (seconds to the first content event, final message, usage timings)."""
    started = time.perf_counter()
    first_token_s = None
    content: list[dict] = []
    timings: dict = {}
    with client.stream("POST", "/v1/messages", json={
        "model": "claude-opus-4-8", "max_tokens": 64, "system": system, "tools": tools,
        "tool_choice": {"type": "any"}, "messages": messages, "stream": True,
        **({"metadata": metadata} if metadata else {}),
    }) as response:
        event = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if event == "content_block_start":
                    content.append(data["content_block"])
                    if first_token_s is None:
                        first_token_s = time.perf_counter() - started
                elif event == "content_block_delta" and data["delta"]["type"] == "input_json_delta":
                    block = content[data["index"]]
                    block["_json"] = block.get("_json", "") + data["delta"]["partial_json"]
                elif event == "message_delta":
                    usage = data.get("usage", {})
                    timings = {**usage.get("timings", {}), "output_tokens": usage.get("output_tokens", 0)}
    for block in content:
        if "_json" in block:
            block["input"] = json.loads(block.pop("_json") or "{}")
    return first_token_s or float("nan"), {"role": "assistant", "content": content}, timings


def run(mode: str, cache: dict, turns: int, system: str, tools: list[dict]) -> list[tuple[int, float, int, int, bool]]:
    rows = []
    with LiveServer(fake=False, model={"max_ctx": 8192}, cache=cache) as server, \
            httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=600) as client:
        messages: list[dict] = [{"role": "user", "content": "Look at the request handlers in src/ and tidy them up."}]
        for turn in range(1, turns + 1):
            ttft, reply, timings = stream_turn(client, system, tools, messages)
            rows.append((turn, ttft, timings.get("prompt_tokens", 0), timings.get("prefilled_tokens", 0),
                         bool(timings.get("agent_turn_cache_hit"))))
            call = next((b for b in reply["content"] if b.get("type") == "tool_use"), None)
            if call is None:
                break
            result = TOOL_RESULTS[(turn - 1) % len(TOOL_RESULTS)]
            messages += [reply, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call["id"], "content": result}]}]
            time.sleep(0.5)  # the client runs its tool; the server is idle meanwhile
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-tokens", type=int, default=3000)
    args = parser.parse_args()
    system, tools = conversation_start(args.system_tokens)
    modes = {
        "caches off": {"prefix_cache_slots": 0, "prefill_cache_slots": 0, "reuse_live_state": False},
        "memory": {},
        "memory + agent turn cache": {"agent_turn_cache": True},
    }
    results = {mode: run(mode, cache, args.turns, system, tools) for mode, cache in modes.items()}
    print(f"\nagent loop: {args.turns} turns, system prompt ~{args.system_tokens} tokens")
    print("| turn | prompt tokens | " + " | ".join(f"{m}: TTFT s / prefilled" for m in modes) + " | off / turn cache |")
    print("|---|---|" + "---|" * len(modes) + "---|")
    for index in range(args.turns):
        cells, ttfts = [], {}
        prompt = "-"
        for mode in modes:
            rows = results[mode]
            if index < len(rows):
                turn, ttft, prompt_tokens, prefilled, hit = rows[index]
                prompt, ttfts[mode] = str(prompt_tokens), ttft
                cells.append(f"{ttft:.2f} / {prefilled}{' (turn hit)' if hit else ''}")
            else:
                cells.append("-")
        first, last = list(modes)[0], list(modes)[-1]
        ratio = f"{ttfts[first] / ttfts[last]:.1f}x" if first in ttfts and last in ttfts else "-"
        print(f"| {index + 1} | {prompt} | " + " | ".join(cells) + f" | {ratio} |")


if __name__ == "__main__":
    main()
