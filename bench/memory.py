"""Resident memory of an idle `dflash run` on the default configuration, against what it must hold.

The bound (issue 13): weights + KV state + 300 MiB. Weights and KV state are counted from the
engine that the server's own loader builds (in this process: the target's parameters and buffers,
its keys/values, and the DFlash drafter's weights, keys/values and captured context rows); the
resident memory is then read from /proc of a real `dflash run` on a loopback port, idle, a few
seconds after start-up.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/memory.py [--settle-s 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.live_server import LiveServer  # noqa: E402
from bench.soak import process_sample  # noqa: E402
from dflash.app import load_served_model  # noqa: E402
from dflash.config import Config  # noqa: E402
from dflash.engine.cpu import cpu_kind  # noqa: E402

MIB = 1 << 20
ALLOWANCE_MIB = 300


def tensor_mib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / MIB


def engine_parts() -> dict[str, float]:
    """MiB of each part of the engine the default configuration serves."""
    engine, _ = load_served_model(Config())
    model = engine.model
    kv = engine.kv
    scales = [kv.key_scales, kv.value_scales] if kv.quantized else []  # an int8 cache's (kv_cache = "auto" on AMX)
    parts = {"weights: target": tensor_mib([*model.parameters(), *model.buffers()]),
             "KV state: target keys/values": tensor_mib([kv.keys, kv.values, *scales])}
    drafter = engine.dflash_drafter
    if drafter is not None:
        parts["weights: drafter"] = tensor_mib([*drafter.draft.parameters(), *drafter.draft.buffers()])
        parts["KV state: drafter keys/values"] = tensor_mib([drafter.kv.keys, drafter.kv.values])
        parts["KV state: drafter context rows"] = tensor_mib([drafter.rows])
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settle-s", type=float, default=5.0, help="idle time before reading /proc")
    args = parser.parse_args()
    parts = engine_parts()
    gc.collect()
    with LiveServer(fake=False) as server:
        time.sleep(args.settle_s)
        rss = process_sample(server.pid).rss_bytes / MIB
    bound = sum(parts.values()) + ALLOWANCE_MIB
    print(f"\ncpu={cpu_kind()}  default configuration (examples/default.toml's values)  load {os.getloadavg()[0]:.2f}")
    print("| part | MiB |\n|---|---|")
    for name, mib in parts.items():
        print(f"| {name} | {mib:.0f} |")
    print(f"| bound: the above + {ALLOWANCE_MIB} | {bound:.0f} |")
    print(f"| resident memory of the idle server | {rss:.0f} ({'within' if rss <= bound else 'over'} the bound "
          f"by {abs(bound - rss):.0f}) |")


if __name__ == "__main__":
    main()
