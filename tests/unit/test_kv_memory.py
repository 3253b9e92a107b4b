"""The KV cache's memory is resident only as positions are written: an idle server does not hold
its whole context (README, bench/memory.py), and an unwritten position reads as zero."""

import torch

from dflash.engine.kv import KVCache, lazily_zeroed


def resident_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20


def test_a_fresh_cache_is_zero_and_not_resident_until_written():
    # Whatever the heap holds by now: inside the full suite a calloc'd cache came back resident
    # (freed heap reused and zeroed), so the cache is an anonymous mapping of its own.
    before = resident_mib()
    kv = KVCache(layers=30, kv_heads=3, max_ctx=32768, head_dim=64, dtype=torch.bfloat16, device="cpu")  # 720 MiB
    assert kv.keys.dtype == torch.bfloat16 and kv.keys.shape == (30, 3, 32768, 64)
    assert resident_mib() - before < 50
    kv.write(0, 0, torch.ones(100, 3, 64), torch.ones(100, 3, 64))
    assert kv.keys[0, :, :100].eq(1).all() and not kv.keys[0, :, 100:200].any() and not kv.values[29].any()
    assert resident_mib() - before < 100  # reading zeros maps the shared zero page, not new memory


def test_every_dtype_the_engine_uses():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.uint8):
        t = lazily_zeroed((4, 5), dtype, "cpu")
        assert t.dtype == dtype and t.shape == (4, 5) and not t.any()
