"""A server lifetime that does nothing but fill a disk cache, for the kill -9 test: serves one
distinct prompt after another on the tiny model with snapshots at several boundaries, and
prints the index of each prompt once it is served. Run: python -m tests.model.disk_cache_writer DIR BUDGET"""

from __future__ import annotations

import sys

from dflash.engine.disk_cache import DiskCache
from dflash.engine.generate import Engine
from dflash.engine.prefix_cache import PrefixCache
from dflash.engine.sampling import SamplingParams
from tests.model.tiny import ours_from_hf, tiny_hf_model

IDENTITY = {"weights": "tiny-llama-crash", "dtype": "float32", "max_ctx": 256, "template": "t"}
BOUNDARIES = (60, 120, 180)
MAX_TOKENS = 4


def prompt(index: int) -> list[int]:
    """Distinct from the first token on, so no two prompts share a snapshot."""
    return [1 + index % 120, *((index * 7 + position * 13) % 127 + 1 for position in range(199))]


def engine_over(folder, budget: int, model=None) -> tuple[Engine, DiskCache]:
    model = model or ours_from_hf(tiny_hf_model("llama"))
    disk = DiskCache(folder, max_bytes=budget, identity=IDENTITY)
    return Engine(model, max_ctx=256, prefix_cache=PrefixCache(2, 1 << 20), disk_cache=disk), disk


def main(folder: str, budget: str) -> None:
    engine, _ = engine_over(folder, int(budget))
    index = 0
    while True:
        engine.start(prompt(index), SamplingParams(), MAX_TOKENS, snapshot_at=BOUNDARIES).run()
        print(index, flush=True)
        index += 1


if __name__ == "__main__":
    main(*sys.argv[1:])
