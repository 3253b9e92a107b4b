"""K agent conversations at once against `dflash cluster`: 1 replica, then 2 with the affine
router, then 2 with Ray Serve's default power-of-two router. Per setup: turns per second, output
tokens per second, the median time to first token of follow-up turns, and how many follow-ups
hit the agent turn cache (the replica still held the conversation's last turn) and what share of
their prompt tokens came from a cache.

Each conversation is an agent loop (bench/agent_loop.py's): the Claude Code system prompt and
tools, the model made to call a tool every turn, the tool's result appended after a short pause.
Conversations carry Claude Code's session id in `metadata.user_id`, which the affine router keys
on. The CPU kind is printed: on a machine with C cores, replicas beyond C/threads only contend.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/cluster.py [--conversations 4] [--turns 4]
        [--system-tokens 800] [--cache-mib 0] [--setups 1:affine,2:affine,2:power_of_two]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.agent_loop import TOOL_RESULTS, conversation_start, stream_turn  # noqa: E402
from bench.live_server import LiveServer, print_table  # noqa: E402
from dflash.engine.cpu import cpu_kind  # noqa: E402

TOOL_PAUSE_S = 0.3  # the client runs its tool; the replica is free meanwhile


def converse(base_url: str, index: int, turns: int, system: str, tools: list[dict], rows: list) -> None:
    """One conversation: a row (turn, ttft_s, prompt tokens, cached tokens, turn-cache hit, output
    tokens, last turn resumed) per turn. The server's turn-cache hit says the restored prefix
    includes a generated turn, any one; the last turn is resumed when the cached prefix reaches
    past the previous turn's prompt, into the turn generated for it."""
    session = f"user_bench_account_bench_session_{index:04d}"
    with httpx.Client(base_url=base_url, timeout=600) as client:
        messages: list[dict] = [{"role": "user", "content": f"Task {index}: look at the request handlers in "
                                                            "src/ and tidy them up."}]
        previous_prompt = None
        for turn in range(1, turns + 1):
            ttft, reply, timings = stream_turn(client, system, tools, messages, metadata={"user_id": session})
            prompt, cached = timings.get("prompt_tokens", 0), timings.get("cached_prefix_tokens", 0)
            rows.append((turn, ttft, prompt, cached, bool(timings.get("agent_turn_cache_hit")),
                         timings.get("output_tokens", 0), previous_prompt is not None and cached > previous_prompt))
            previous_prompt = prompt
            call = next((block for block in reply["content"] if block.get("type") == "tool_use"), None)
            if call is None:
                break
            result = TOOL_RESULTS[(turn + index) % len(TOOL_RESULTS)]
            messages += [reply, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call["id"], "content": result}]}]
            time.sleep(TOOL_PAUSE_S)


def run_setup(replicas: int, router: str, args, system: str, tools: list[dict]) -> dict:
    cluster = {"replicas": replicas, "router": router, "ray_actor_options": {"num_cpus": 1}}
    model = {"max_ctx": 4096, "threads": args.threads}
    cache = {"agent_turn_cache": True, **({"memory_budget_mib": args.cache_mib} if args.cache_mib else {})}
    with LiveServer(fake=False, model=model, cache=cache, cluster=cluster) as server:
        base_url = f"http://127.0.0.1:{server.port}"
        # One warm-up turn per replica's worth of conversations, so no setup pays first-call costs.
        converse(base_url, 10_000, 1, system, tools, [])
        rows: list = []
        began = time.perf_counter()
        threads = [threading.Thread(target=converse, args=(base_url, index, args.turns, system, tools, rows))
                   for index in range(args.conversations)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - began
        exit_code = server.stop(timeout=120)
    follow_ups = [row for row in rows if row[0] > 1]
    return {
        "setup": f"{replicas} x {router}",
        "turns": len(rows),
        "seconds": elapsed,
        "turns_per_s": len(rows) / elapsed,
        "tokens_per_s": sum(row[5] for row in rows) / elapsed,
        "follow_up_ttft_s": statistics.median(row[1] for row in follow_ups) if follow_ups else float("nan"),
        "turn_cache_hits": sum(row[4] for row in follow_ups) / len(follow_ups) if follow_ups else float("nan"),
        "last_turn_resumed": sum(row[6] for row in follow_ups) / len(follow_ups) if follow_ups else float("nan"),
        "cached_share": (sum(row[3] for row in follow_ups) / max(1, sum(row[2] for row in follow_ups))),
        "exit": exit_code,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=800)
    parser.add_argument("--threads", type=int, default=1, help="engine threads per replica")
    parser.add_argument("--cache-mib", type=int, default=0,
                        help="[cache] memory_budget_mib per replica (0: the default, 2048)")
    parser.add_argument("--setups", default="1:affine,2:affine,2:power_of_two")
    args = parser.parse_args()
    system, tools = conversation_start(args.system_tokens)
    results = []
    for setup in args.setups.split(","):
        replicas, router = setup.split(":")
        results.append(run_setup(int(replicas), router, args, system, tools))
        print(results[-1], flush=True)
    print(f"\ncluster: {args.conversations} conversations x {args.turns} turns, system prompt "
          f"~{args.system_tokens} tokens, embedded model, {args.threads} thread(s) per replica, "
          f"cache memory {args.cache_mib or 2048} MiB per replica, CPU: {cpu_kind()}")
    print_table(["setup", "turns", "s", "turns/s", "output tok/s", "follow-up TTFT s (median)",
                 "follow-up turn-cache hits", "follow-ups resuming their last turn", "follow-up prompt tokens cached"],
                [[r["setup"], r["turns"], f"{r['seconds']:.1f}", f"{r['turns_per_s']:.2f}", f"{r['tokens_per_s']:.1f}",
                  f"{r['follow_up_ttft_s']:.2f}", f"{r['turn_cache_hits']:.0%}", f"{r['last_turn_resumed']:.0%}",
                  f"{r['cached_share']:.0%}"]
                 for r in results])


if __name__ == "__main__":
    main()
