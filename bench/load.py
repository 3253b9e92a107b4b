"""Model load time: the first load of a GGUF (dequantize + write the cache copy) and a later load.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/load.py [--model SOURCE]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from dflash.engine.loading import EMBEDDED_DEFAULT, load_model  # noqa: E402


def timed_load(source: str, cache_dir: str) -> float:
    started = time.perf_counter()
    load_model(source, cache_dir=cache_dir, max_ctx=4096)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_DEFAULT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache_dir:
        first = timed_load(args.model, cache_dir)
        later = timed_load(args.model, cache_dir)
    print(f"| model | first load (conversion) | later load |\n|---|---|---|\n| {args.model} | {first:.1f} s | {later:.1f} s |")


if __name__ == "__main__":
    main()
