"""Cancellation under load: N concurrent streaming clients on loopback against a live server.

A random third disconnect while their job is queued, a third once it runs (half during prefill,
half during decode), the rest read to the end. Reports completed and cancelled counts and the
time from each disconnect to the engine being ready again (client close -> the server's
`job_cancelled` log line, whose time is taken after the generation is closed). Then asserts the
server answers /health and a normal request, is idle with an empty queue, and that its memory is
back to the level measured after a warm-up request.

    python bench/stress_cancel.py [--clients 50] [--fake] [--seed 0] [--time-limit 600]
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.live_server import LiveServer, percentile, print_table, report_verdict  # noqa: E402
from tests.unit.rawhttp import RawClient, request  # noqa: E402

CHAT = "/v1/chat/completions"
# Memory may settle a little above the warm level (allocator caches, logging buffers).
RSS_SLACK_BYTES = 32 * 1024 * 1024
RSS_SLACK_FRACTION = 0.10


def prompt(index: int) -> list[dict]:
    # Each client's own text first, so the engine's prefix cache cannot skip the prefill.
    filler = " ".join(f"item {n} is a line of the inventory list." for n in range(24))
    return [{"role": "user", "content": f"Client {index}. {filler} Summarise the list."}]


class Outcome:
    def __init__(self, index: int, plan: str):
        self.index = index
        self.plan = plan  # "queued", "prefill", "decode" or "complete"
        self.result = "pending"  # what actually happened
        self.request_id: str | None = None
        self.disconnected_at: float | None = None  # time.time(), comparable with log timestamps


async def run_client(port: int, outcome: Outcome, max_tokens: int, rng: random.Random) -> None:
    client = await RawClient.open(port)
    await client.send_request("POST", CHAT, json_body={"messages": prompt(outcome.index), "stream": True,
                                                       "max_tokens": max_tokens, "temperature": 0})
    status, headers = await client.read_head()
    outcome.request_id = headers.get("x-request-id")
    if status != 200:
        outcome.result = f"http {status}"
        await client.aclose()
        return
    records = client.read_sse_records()
    started = await _wait_for_start(records, rng.uniform(0.05, 1.5) if outcome.plan == "queued" else None)
    if outcome.plan == "queued" and not started:
        return await _disconnect(client, outcome, "cancelled while queued")
    if outcome.plan in ("queued", "prefill"):
        return await _disconnect(client, outcome, "cancelled during prefill")
    content_chunks = 0
    async for record in records:
        if '"content":"' in record and '"content":""' not in record:
            content_chunks += 1
            if outcome.plan == "decode" and content_chunks == 2:
                return await _disconnect(client, outcome, "cancelled during decode")
        if record == "data: [DONE]":
            outcome.result = "completed"
    if outcome.result != "completed":
        outcome.result = "completed early" if outcome.plan == "decode" else "stream ended without [DONE]"
    await client.aclose()


async def _wait_for_start(records, patience: float | None) -> bool:
    """True once the role chunk (sent when the engine takes the job) arrives; False after `patience`."""
    with trio.move_on_after(patience if patience is not None else float("inf")):
        async for record in records:
            if '"role":"assistant"' in record:
                return True
    return False


async def _disconnect(client: RawClient, outcome: Outcome, result: str) -> None:
    outcome.disconnected_at = time.time()
    await client.aclose()
    outcome.result = result


async def storm(port: int, clients: int, max_tokens: int, seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    plans = ["queued", "prefill", "decode", "complete"]
    thirds = [clients // 3, clients // 6, clients // 3 - clients // 6]
    chosen = sum(([plan] * count for plan, count in zip(plans, thirds)), [])
    chosen += ["complete"] * (clients - len(chosen))
    rng.shuffle(chosen)
    outcomes = [Outcome(index, plan) for index, plan in enumerate(chosen)]
    async with trio.open_nursery() as nursery:
        for outcome in outcomes:
            nursery.start_soon(run_client, port, outcome, max_tokens, random.Random(rng.random()))
            await trio.sleep(0.002)  # arrival order is queue order; keep it close to the plan order
    return outcomes


async def wait_idle(port: int, timeout: float) -> dict:
    with trio.fail_after(timeout):
        while True:
            state = (await request(port, "GET", "/")).json()
            if state["state"] == "idle" and state["queue_depth"] == 0:
                return state
            await trio.sleep(0.05)


async def normal_request(port: int) -> None:
    reply = await request(port, "POST", CHAT, json_body={"messages": prompt(-1), "max_tokens": 4})
    assert reply.status == 200, reply
    assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


def stop_latencies_ms(server: LiveServer, outcomes: list[Outcome]) -> dict[str, list[float]]:
    """Client disconnect -> engine ready, per kind, from the server's job_cancelled lines."""
    cancelled_at = {}
    for event in server.events("job_cancelled"):
        cancelled_at[event["request_id"]] = datetime.datetime.fromisoformat(event["timestamp"]).timestamp()
    latencies: dict[str, list[float]] = {}
    for outcome in outcomes:
        if outcome.disconnected_at is None or outcome.request_id not in cancelled_at:
            continue
        latency = (cancelled_at[outcome.request_id] - outcome.disconnected_at) * 1000
        latencies.setdefault(outcome.result, []).append(latency)
    return latencies


async def main_async(args) -> int:
    fake_args = ("--prefill-step-ms", "20", "--decode-step-ms", "5", "--prefill-chunk", "32")
    model = {} if args.fake else {"prefill_chunk": 64, "max_ctx": 2048}
    server = LiveServer(fake=args.fake, server={"queue_max": args.clients + 8, "keepalive_s": 1.0},
                        model=model, fake_args=fake_args)
    with server:
        port = server.port
        await normal_request(port)  # warm-up: first-use allocations happen before the baseline
        rss_before = server.rss_bytes()
        began = time.monotonic()
        with trio.fail_after(args.time_limit):
            outcomes = await storm(port, args.clients, args.max_tokens, args.seed)
            await wait_idle(port, timeout=120)
        storm_s = time.monotonic() - began
        health = await request(port, "GET", "/health")
        await normal_request(port)
        await wait_idle(port, timeout=30)
        rss_after = server.rss_bytes()
        latencies = stop_latencies_ms(server, outcomes)
        exit_code = server.stop()

    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome.result] = counts.get(outcome.result, 0) + 1
    print(f"\nstress_cancel: {args.clients} clients, {'fake' if args.fake else 'real'} engine, "
          f"seed {args.seed}, {storm_s:.1f}s\n")
    print_table(["outcome", "clients", "stop p50 ms", "stop p99 ms", "stop max ms"], [
        [result, count, percentile(latencies.get(result, []), 0.5), percentile(latencies.get(result, []), 0.99),
         max(latencies.get(result, []), default=float("nan"))]
        for result, count in sorted(counts.items())
    ])
    every_stop = [value for values in latencies.values() for value in values]
    print(f"\nall cancellations: p50 {percentile(every_stop, 0.5):.1f} ms, p99 {percentile(every_stop, 0.99):.1f} ms "
          f"(client close -> generation closed)")
    print(f"memory: {rss_before / 2**20:.1f} MiB after warm-up, {rss_after / 2**20:.1f} MiB after the storm")
    print(f"after: /health {health.status}, normal request ok, exit code {exit_code}")

    failures = []
    if health.status != 200:
        failures.append(f"/health answered {health.status}")
    unexpected = {result: n for result, n in counts.items() if not result.startswith(("completed", "cancelled"))}
    if unexpected:
        failures.append(f"unexpected outcomes: {unexpected}")
    cancelled = sum(n for result, n in counts.items() if result.startswith("cancelled"))
    if len(every_stop) != cancelled:
        failures.append(f"{cancelled} clients disconnected but the server logged {len(every_stop)} cancellations")
    if rss_after > rss_before * (1 + RSS_SLACK_FRACTION) + RSS_SLACK_BYTES:
        failures.append(f"memory did not come back: {rss_before} -> {rss_after} bytes")
    if exit_code != 0:
        failures.append(f"server exited with {exit_code} on SIGTERM")
    return report_verdict(server, failures)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--fake", action="store_true", help="serve the unit tests' fake engine, not the model")
    parser.add_argument("--max-tokens", type=int, default=16, help="reply length for the clients that complete")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=600, help="seconds for the whole storm")
    return trio.run(main_async, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
