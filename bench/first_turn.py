"""The long first turn of a real agent, and the turns after it, on the embedded model.

Sends the captured first request of Claude Code (~20K tokens: system prompt and 24 tools) or
Codex (~9K) to a live server with the default context and a disk cache, then:
  turn 2   the same conversation, one reply and one user message longer (memory prefix cache);
  restart  the server stopped (SIGTERM: it writes its queued snapshots first), a new one on the
           same disk_dir, and a new session's first request that shares the system prompt and
           tools but asks something else (disk tier).
Prints time to first token (the first event with generated content: not the empty deltas sent
as keep-alives during prefill), prompt and prefilled tokens of each, and what the snapshot tiers
hold after turn 2 (`/metrics`).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/first_turn.py [--client claude|codex] [--max-tokens 16] [--kv-cache auto]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.engine.cpu import cpu_kind  # noqa: E402
from dflash.engine.loading import KV_CACHES  # noqa: E402
from bench.live_server import LiveServer  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "clients"
CLIENTS = {
    "claude": ("claude-code-2.1.197-messages-request.json", "/v1/messages"),
    "codex": ("codex-exec-0.171-responses-request.json", "/v1/responses"),
}


def first_request(client: str, max_tokens: int) -> tuple[str, dict]:
    name, path = CLIENTS[client]
    body = json.loads((FIXTURES / name).read_text())["body"]
    body["stream"] = True
    body["max_tokens" if client == "claude" else "max_output_tokens"] = max_tokens
    return path, body


def with_user_text(client: str, body: dict, text: str) -> dict:
    """The request with its last user message's text replaced (a new session's first question)."""
    body = json.loads(json.dumps(body))
    messages = body["messages"] if client == "claude" else body["input"]
    last = next(message for message in reversed(messages) if message.get("role") == "user")
    last["content"] = [{"type": "text" if client == "claude" else "input_text", "text": text}]
    return body


def next_turn(client: str, body: dict, reply: str, text: str) -> dict:
    body = json.loads(json.dumps(body))
    if client == "claude":
        body["messages"] += [{"role": "assistant", "content": [{"type": "text", "text": reply or "OK."}]},
                             {"role": "user", "content": [{"type": "text", "text": text}]}]
    else:
        body["input"] += [{"type": "message", "role": "assistant",
                           "content": [{"type": "output_text", "text": reply or "OK."}]},
                          {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]
    return body


def generated(kind: str, data: dict) -> bool:
    """Whether the event carries generated content: not the empty deltas the server sends as
    keep-alives while it prefills (Claude Code's watchdog counts only content events)."""
    if kind == "content_block_start":
        return data["content_block"].get("type") == "tool_use"
    if kind == "response.output_item.added":
        return data["item"].get("type") == "function_call"
    delta = data.get("delta")
    if isinstance(delta, dict):
        return any(value for key, value in delta.items() if key != "type" and isinstance(value, str))
    return kind.startswith("response.") and kind.endswith(".delta") and bool(delta)


def stream(http: httpx.Client, path: str, body: dict) -> tuple[float, str, dict]:
    """(seconds to the first content event, reply text, usage timings) of one streamed request."""
    started = time.perf_counter()
    first_s = None
    text, timings = "", {}
    with http.stream("POST", path, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = json.loads(line[6:])
            kind = data.get("type", "")
            if first_s is None and generated(kind, data):
                first_s = time.perf_counter() - started
            delta = data.get("delta")
            if kind == "content_block_delta" and delta.get("type") == "text_delta":
                text += delta["text"]
            elif kind == "response.output_text.delta":
                text += delta
            usage = (data.get("usage") or (data.get("response") or {}).get("usage") or {})
            timings = usage.get("timings") or timings
    return first_s or float("nan"), text, timings


def cache_bytes(http: httpx.Client) -> dict[str, float]:
    """What the server's snapshot tiers hold (`/metrics`, dflash_cache_bytes), by tier."""
    held = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("dflash_cache_bytes{"):
            labels, value = line.rsplit(" ", 1)
            held[labels.split('tier="', 1)[1].split('"', 1)[0]] = float(value)
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client", choices=sorted(CLIENTS), default="claude")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-cache", default="auto", choices=KV_CACHES, help="[model] kv_cache")
    args = parser.parse_args()
    path, body = first_request(args.client, args.max_tokens)
    disk_dir = Path(tempfile.mkdtemp(prefix="dflash-first-turn-"))
    rows = []
    try:
        for phase in ("first", "restart"):
            with LiveServer(fake=False, cache={"disk_dir": str(disk_dir)}, model={"kv_cache": args.kv_cache}) as server, \
                    httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=3600) as http:
                if phase == "first":
                    ttft, reply, timings = stream(http, path, body)
                    rows.append(("turn 1", ttft, timings))
                    ttft, _, timings = stream(http, path, next_turn(args.client, body, reply,
                                                                    "Now list the files in src/."))
                    rows.append(("turn 2", ttft, timings))
                    held = cache_bytes(http)
                    # An operator's restart: SIGTERM, and the server writes its queued snapshots first.
                    stopping = time.perf_counter()
                    server.stop(timeout=300)
                    stop_s = time.perf_counter() - stopping
                else:
                    ttft, _, timings = stream(http, path, with_user_text(args.client, body,
                                                                         "What does this project do?"))
                    rows.append(("new session after restart", ttft, timings))
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    print(f"\n{args.client} first turn, embedded model, kv_cache {args.kv_cache}, CPU: {cpu_kind()}; graceful stop after turn 2: {stop_s:.1f} s; "
          "snapshots held after turn 2: " + ", ".join(f"{tier} {size / 2**20:.0f} MiB" for tier, size in held.items()))
    print("| request | prompt tokens | prefilled | TTFT s | prefill ms |")
    print("|---|---|---|---|---|")
    for name, ttft, timings in rows:
        print(f"| {name} | {timings.get('prompt_tokens', '-')} | {timings.get('prefilled_tokens', '-')} | "
              f"{ttft:.1f} | {timings.get('prefill_ms', float('nan')):.0f} |")


if __name__ == "__main__":
    main()
