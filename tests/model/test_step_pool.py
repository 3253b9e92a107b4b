"""The native kernels' threads (step_pool.cpp): a decode step or a verification block computes the
same bits on 1, 2 or 3 threads, on the spinning workers or off them, and a forked child (which
has none of its parent's threads) computes them too. Skipped where the extension is not built."""

import multiprocessing

import pytest
import torch

from dflash.engine.native import extension
from dflash.engine.quant import quantize_linears
from tests.model.tiny import ours_from_hf, tiny_hf_model

pytestmark = pytest.mark.skipif(
    extension() is None or not extension().int8dot_available() or not extension().causal_attention_available(),
    reason="the native extension is not built, or this CPU lacks AVX2",
)

CONTEXT = 600  # three chunks of causal_attention.cpp's 256 keys: several attention tasks per head


def wide_model(weights: str):
    """Layers wide enough (256 -> 32 blocks of 16 channels) that every matmul splits over threads."""
    hf = tiny_hf_model("llama", hidden_size=256, intermediate_size=512, max_position_embeddings=1024)
    model = ours_from_hf(hf, dtype=torch.bfloat16)
    quantize_linears(model, weights)
    return model


def forwards(model, tokens, filled) -> list[torch.Tensor]:
    """A decode row and a 1 + 7 verification block after a prefill of CONTEXT tokens: logits and the
    keys they wrote."""
    results = []
    for rows in (1, 8):
        kv = model.new_kv_cache(1024)
        kv.keys.copy_(filled[0])
        kv.values.copy_(filled[1])
        kv.length = CONTEXT
        logits, _ = model(tokens[CONTEXT : CONTEXT + rows], CONTEXT, kv, logits_positions=None)
        results += [logits, kv.keys[:, :, : CONTEXT + rows].clone()]
    return results


def prepared(weights: str):
    model = wide_model(weights)
    tokens = torch.randint(0, 128, (CONTEXT + 8,), generator=torch.Generator().manual_seed(3))
    kv = model.new_kv_cache(1024)
    model(tokens[:CONTEXT], 0, kv)
    return model, tokens, (kv.keys.clone(), kv.values.clone())


@pytest.fixture(autouse=True)
def our_kernels(monkeypatch):
    monkeypatch.setenv("DFLASH_ATTENTION", "ours")  # the pool runs only where every loop is ours
    monkeypatch.setenv("DFLASH_KERNELS", "int8-dot")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_same_bits_on_any_number_of_threads(weights):
    model, tokens, filled = prepared(weights)
    by_threads = {}
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        loops = extension().step_pool_loops()
        by_threads[threads] = forwards(model, tokens, filled)
        ran_on_workers = extension().step_pool_loops() > loops
        assert ran_on_workers == (threads > 1), f"{threads} threads: pool used = {ran_on_workers}"
    for threads in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(by_threads[1], by_threads[threads])), f"{threads} threads differ"


def test_the_pool_stays_out_where_torch_runs_a_loop_of_the_step(monkeypatch):
    """With torch's attention in the step, OpenMP's threads would queue behind spinning workers."""
    model, tokens, filled = prepared("int4")
    torch.set_num_threads(2)
    monkeypatch.setenv("DFLASH_ATTENTION", "torch")
    loops = extension().step_pool_loops()
    forwards(model, tokens, filled)
    assert extension().step_pool_loops() == loops


def verify_block(model, tokens, kv) -> torch.Tensor:
    kv.length = CONTEXT
    logits, _ = model(tokens[CONTEXT : CONTEXT + 8], CONTEXT, kv, logits_positions=None)
    return logits


def child_verifies(model, tokens, kv, queue):
    # No large torch op here: libgomp cannot start threads in a child forked after its parent ran
    # an OpenMP region (torch ops hang there on 2 threads); ours must not care.
    torch.set_num_threads(2)
    loops = extension().step_pool_loops()
    logits = verify_block(model, tokens, kv)
    queue.put((logits.float().tolist(), extension().step_pool_loops() > loops))  # plain lists: no shared storage


def test_a_forked_child_makes_its_own_threads():
    model, tokens, filled = prepared("int4")
    torch.set_num_threads(2)
    kv = model.new_kv_cache(1024)
    kv.keys.copy_(filled[0])
    kv.values.copy_(filled[1])
    expected = verify_block(model, tokens, kv)  # the parent's pool now has a worker; the child has none
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=child_verifies, args=(model, tokens, kv, queue))
    child.start()
    try:
        logits, pool_ran = queue.get(timeout=120)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0 and pool_ran
    assert torch.equal(expected.float(), torch.tensor(logits))
