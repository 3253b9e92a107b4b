"""What the disk tier costs the engine thread: DiskCache.store of a prefix snapshot the size of a
20K-token prompt of the embedded model (keys and values 30 x 3 x 20347 x 64 bf16, the DFlash
drafter's context rows 20347 x 2304 bf16: ~560 MB), and how long the writer thread then takes.

    .venv/bin/python bench/snapshot_store.py [--tokens 20347] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dflash.engine.cpu import cpu_kind  # noqa: E402
from dflash.engine.disk_cache import DiskCache  # noqa: E402
from dflash.engine.kv import KVSnapshot  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20347)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = args.tokens
    snapshot = KVSnapshot(torch.randn(30, 3, n, 64).bfloat16(), torch.randn(30, 3, n, 64).bfloat16(), n)
    rows = torch.randn(n, 4 * 576).bfloat16()
    print(f"cpu={cpu_kind()}  tokens={n}")
    print("| cpu | store() on the engine thread | the writer thread after it |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        disk = DiskCache(folder, max_bytes=8 << 30, identity={"bench": 1})
        for repeat in range(args.repeats):
            started = time.perf_counter()
            disk.store(list(range(repeat, n + repeat)), snapshot, rows)
            stored = time.perf_counter() - started
            started = time.perf_counter()
            disk.flush(300)
            print(f"| {cpu_kind()} | {stored * 1000:.0f} ms | {(time.perf_counter() - started) * 1000:.0f} ms |")
        disk.close()


if __name__ == "__main__":
    main()
