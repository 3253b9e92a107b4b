"""The native calls that compute let go of the GIL while they run: the engine calls them on its own
thread, and the HTTP server's event loop in the same process must keep answering meanwhile (a
prefill chunk deep in a prompt is one decode_layers call of up to a second)."""

import threading
import time

import pytest
import torch

from dflash.engine.native import extension

pytestmark = pytest.mark.skipif(extension() is None or not extension().causal_attention_available(),
                                reason="the native extension is not built here")


def longest_stall_during(call) -> tuple[float, float]:
    """(seconds `call` took, the longest another Python thread went without running meanwhile)."""
    done, stalls = threading.Event(), [0.0]

    def watch():
        last = time.perf_counter()
        while not done.is_set():
            now = time.perf_counter()
            stalls[0] = max(stalls[0], now - last)
            last = now

    watcher = threading.Thread(target=watch)
    watcher.start()
    time.sleep(0.05)
    stalls[0] = 0.0
    started = time.perf_counter()
    call()
    took = time.perf_counter() - started
    done.set()
    watcher.join()
    return took, stalls[0]


def test_attention_over_a_long_context_lets_other_threads_run():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        q = torch.randn(1024, 9, 64, generator=generator).bfloat16()
        keys = torch.randn(3, 16384 + 1024, 64, generator=generator).bfloat16()
        values = torch.randn(3, 16384 + 1024, 64, generator=generator).bfloat16()
        took, stall = longest_stall_during(lambda: extension().causal_attention(q, keys, values, 16384))
    finally:
        torch.set_num_threads(threads)
    assert took > 0.04, f"the call took {took:.3f} s: too short to tell"
    assert stall < took / 2, f"the other thread stalled {stall:.3f} s of the call's {took:.3f} s"
