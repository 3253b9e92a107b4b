"""How long the server takes to answer while it prefills a long prompt: `/health` polled every 20 ms
from a second connection during one long chat completion (the event loop shares the process with
the engine's thread, so a native call that held the GIL would hold every answer up).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/busy_health.py [--items 4000]   # ~28K tokens
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from bench.live_server import LiveServer  # noqa: E402
from dflash.engine.cpu import cpu_kind  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=4000, help="list items in the prompt (4000: ~28K tokens)")
    args = parser.parse_args()
    prompt = " ".join(f"item{i} value{i * 7 % 13}" for i in range(args.items))
    with LiveServer(fake=False) as server:
        base = f"http://127.0.0.1:{server.port}"
        waits: list[float] = []
        done = threading.Event()

        def poll() -> None:
            with httpx.Client(base_url=base, timeout=600) as http:
                while not done.is_set():
                    started = time.perf_counter()
                    http.get("/health")
                    waits.append(time.perf_counter() - started)
                    time.sleep(0.02)

        with httpx.Client(base_url=base, timeout=3600) as http:
            http.get("/health")
            poller = threading.Thread(target=poll)
            poller.start()
            started = time.perf_counter()
            reply = http.post("/v1/chat/completions", json={
                "model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": prompt}]})
            elapsed = time.perf_counter() - started
            done.set()
            poller.join()
    reply.raise_for_status()
    waits.sort()
    tokens = reply.json()["usage"]["prompt_tokens"]
    print(f"cpu={cpu_kind()}  a {tokens}-token prompt answered in {elapsed:.1f} s; /health during it, "
          f"{len(waits)} polls: median {waits[len(waits) // 2] * 1000:.0f} ms, "
          f"p99 {waits[int(len(waits) * 0.99)] * 1000:.0f} ms, max {waits[-1] * 1000:.0f} ms")


if __name__ == "__main__":
    main()
