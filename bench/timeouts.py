"""Slow and stalled clients next to normal ones, against a live server with short timeouts.

- slow headers (slowloris): a header byte every 0.25 s; expect 408 at header_timeout_s
- slow body: headers, then a body byte every 0.25 s; expect 408 at body_timeout_s
- stalled reader: a streaming request whose client never reads (tiny receive buffer); once the
  socket buffers are full the server's writes block, and idle_timeout_s later it drops the client
  and cancels the job (the time to fill the buffers comes first and depends on the token rate)
- normal clients: /health and short chat completions in a loop the whole time; all must succeed
  (the table shows their latencies where it shows the slow clients' cut-off times)

    python bench/timeouts.py [--fake] [--slow 5] [--stalled 2] [--normal 4] [--time-limit 300]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.live_server import LiveServer, percentile, print_table  # noqa: E402
from tests.unit.rawhttp import RawClient, request  # noqa: E402

CHAT = "/v1/chat/completions"
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 2.0
IDLE_TIMEOUT_S = 3.0
DRIP_S = 0.25
# A cut-off counts as on time within this much of the configured timeout.
TOLERANCE_S = 0.75


async def slow_headers(port: int) -> float:
    """Seconds from the first byte until the server answers (or closes)."""
    client = await RawClient.open(port)
    began = time.monotonic()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + b"x-drip: " + b"a" * 10_000
    return await _drip_until_cut(client, head, began)


async def slow_body(port: int) -> float:
    """Seconds from the end of the headers until the server answers (or closes)."""
    client = await RawClient.open(port)
    await client.send_raw(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: 10000\r\n\r\n")
    return await _drip_until_cut(client, b" " * 10_000, time.monotonic())


async def _drip_until_cut(client: RawClient, data: bytes, began: float) -> float:
    answered = trio.Event()
    status: list[int] = []

    async def read_answer() -> None:
        try:
            status.append((await client.read_head())[0])
        except Exception:
            pass
        answered.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_answer)
        for index in range(len(data)):
            try:
                await client.send_raw(data[index:index + 1])
            except trio.BrokenResourceError:
                break
            with trio.move_on_after(DRIP_S):
                await answered.wait()
            if answered.is_set():
                break
        await answered.wait()
    elapsed = time.monotonic() - began
    await client.aclose()
    if status and status[0] != 408:
        raise AssertionError(f"expected 408, got {status[0]}")
    return elapsed


async def stalled_reader(port: int, server: LiveServer, max_tokens: int) -> dict:
    client = await RawClient.open(port, receive_buffer=2048)
    await client.send_request("POST", CHAT, json_body={
        "messages": [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}],
        "max_tokens": max_tokens, "stream": True})
    status, headers = await client.read_head()
    stopped_reading_at = time.time()
    request_id = headers["x-request-id"]
    while True:  # never read again; wait for the server's verdict in its log
        lines = [event for event in server.events("request") if event.get("id") == request_id]
        if lines:
            break
        await trio.sleep(0.1)
    await client.aclose()
    line = lines[0]
    ended_at = datetime.datetime.fromisoformat(line["timestamp"]).timestamp()
    return {"after_s": ended_at - stopped_reading_at, "dropped": line["client_disconnected"],
            "finish_reason": line.get("finish_reason"), "completion_tokens": line.get("completion_tokens")}


async def normal_client(port: int, until: trio.Event, latencies: dict[str, list[float]], errors: list[str]) -> None:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    while not until.is_set():
        for method, path, kwargs in (("GET", "/health", {}), ("POST", CHAT, {"json_body": body})):
            began = time.monotonic()
            try:
                reply = await request(port, method, path, **kwargs)
                if reply.status != 200:
                    errors.append(f"{method} {path}: {reply.status}")
            except Exception as exc:
                errors.append(f"{method} {path}: {exc!r}")
            latencies[path].append(time.monotonic() - began)
        await trio.sleep(0.1)


async def main_async(args) -> int:
    server = LiveServer(fake=args.fake, server={
        "header_timeout_s": HEADER_TIMEOUT_S, "body_timeout_s": BODY_TIMEOUT_S, "idle_timeout_s": IDLE_TIMEOUT_S,
        "queue_max": 64}, model={} if args.fake else {"max_ctx": 2048},
        fake_args=("--decode-step-ms", "1", "--endless"))
    header_cuts: list[float] = []
    body_cuts: list[float] = []
    stalls: list[dict] = []
    latencies: dict[str, list[float]] = {"/health": [], CHAT: []}
    errors: list[str] = []
    with server:
        port = server.port
        done = trio.Event()
        with trio.fail_after(args.time_limit):
            async with trio.open_nursery() as nursery:
                for _ in range(args.normal):
                    nursery.start_soon(normal_client, port, done, latencies, errors)
                async with trio.open_nursery() as slow:
                    for _ in range(args.slow):
                        slow.start_soon(lambda: _append(header_cuts, slow_headers(port)))
                        slow.start_soon(lambda: _append(body_cuts, slow_body(port)))
                    for _ in range(args.stalled):
                        slow.start_soon(lambda: _append(stalls, stalled_reader(port, server, args.max_tokens)))
                done.set()
        exit_code = server.stop()

    stall_times = [stall["after_s"] for stall in stalls]
    rows = [
        ["slow headers", len(header_cuts), HEADER_TIMEOUT_S, percentile(header_cuts, 0.5), max(header_cuts),
         _verdict(header_cuts, HEADER_TIMEOUT_S)],
        ["slow body", len(body_cuts), BODY_TIMEOUT_S, percentile(body_cuts, 0.5), max(body_cuts),
         _verdict(body_cuts, BODY_TIMEOUT_S)],
        ["stalled reader", len(stalls), f">= {IDLE_TIMEOUT_S}", percentile(stall_times, 0.5), max(stall_times),
         "dropped, job cancelled" if all(s["dropped"] and s["finish_reason"] is None for s in stalls)
         else f"NOT DROPPED: {stalls}"],
        *[[f"normal {path}", len(times), "-", percentile(times, 0.5), max(times),
           "ok" if not any(error.split(":")[0].endswith(path) for error in errors) else "errors"]
          for path, times in latencies.items()],
    ]
    print(f"\ntimeouts: {'fake' if args.fake else 'real'} engine; header {HEADER_TIMEOUT_S}s, body "
          f"{BODY_TIMEOUT_S}s, idle {IDLE_TIMEOUT_S}s\n")
    print_table(["client", "count", "timeout s", "p50 s", "max s", "verdict"], rows)
    for stall in stalls:
        print(f"  stalled reader: dropped {stall['after_s']:.2f}s after it stopped reading, "
              f"{stall['completion_tokens']} tokens generated by then")
    print("  (chat requests queue behind a stalled reader's job until it is dropped: one job at a time)")
    failures = [row[0] for row in rows if row[-1] not in ("on time", "ok", "dropped, job cancelled")]
    failures += errors[:5]
    if exit_code != 0:
        failures.append(f"server exit code {exit_code}")
    print("PASS" if not failures else f"FAIL: {failures}; server log: {server.log_path}")
    if failures:
        return 1
    server.remove_files()
    return 0


async def _append(results: list, coroutine) -> None:
    results.append(await coroutine)


def _verdict(cuts: list[float], timeout: float) -> str:
    late = [cut for cut in cuts if not timeout - 0.05 <= cut <= timeout + TOLERANCE_S]
    return "on time" if not late else f"OFF: {late}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake", action="store_true", help="serve the unit tests' fake engine, not the model")
    parser.add_argument("--slow", type=int, default=5, help="slow-header clients, and as many slow-body ones")
    parser.add_argument("--stalled", type=int, default=2)
    parser.add_argument("--normal", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=1500, help="reply length asked by stalled readers")
    parser.add_argument("--time-limit", type=float, default=300)
    return trio.run(main_async, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
