"""Resident memory stays within the snapshot caches' budget: 200 distinct long prompts through an
engine whose caches, without eviction, would grow to gigabytes."""

import os
import random

import torch
import transformers

from dflash.engine.generate import Engine
from dflash.engine.prefix_cache import PrefixCache
from dflash.engine.sampling import SamplingParams
from tests.model.tiny import ours_from_hf

MIB = 1 << 20
PROMPT_TOKENS = 512


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def wide_tiny_model():
    """Few weights but a wide KV state (4 KiB per token in bf16 snapshots), so snapshots are big."""
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    return ours_from_hf(transformers.LlamaForCausalLM(config).eval())


def warm_up(model, rng: random.Random) -> None:
    """The kernels' own one-time memory (oneDNN primitive caches, AMX tile buffers: tens of MiB on
    some CPUs) is taken by an engine without caches, before the measurement starts."""
    engine = Engine(model, max_ctx=PROMPT_TOKENS + 8, prefill_chunk=256)
    for _ in range(3):
        engine.start([rng.randrange(1, 512) for _ in range(PROMPT_TOKENS)], SamplingParams(), max_tokens=2).run()


def test_200_distinct_long_prompts_keep_resident_memory_within_the_budget():
    budget = 12 * MIB  # split as the server splits it: by slot share
    model = wide_tiny_model()
    rng = random.Random(0)
    warm_up(model, rng)
    engine = Engine(model, max_ctx=PROMPT_TOKENS + 8, prefill_chunk=256,
                    prefix_cache=PrefixCache(16, budget * 16 // 20), prompt_cache=PrefixCache(4, budget * 4 // 20))
    per_token = engine.kv.snapshot(1).nbytes
    stored = 0
    before = resident_bytes()
    peak = before
    for _ in range(200):
        prompt = [rng.randrange(1, 512) for _ in range(PROMPT_TOKENS)]
        generation = engine.start(prompt, SamplingParams(), max_tokens=2, snapshot_at=[128, 256, 500])
        generation.run()
        stored += (128 + 256 + 500 + PROMPT_TOKENS) * per_token
        peak = max(peak, resident_bytes())
    held = engine.prefix_cache.nbytes + engine.prompt_cache.nbytes
    assert stored > 50 * budget  # what the caches were offered: far beyond the budget
    assert held <= budget
    # Allocator slack: freed snapshots are not always handed back to the OS at once.
    print(f"resident memory grew {(peak - before) / MIB:.1f} MiB; caches hold {held / MIB:.1f} MiB")
    assert peak - before <= budget + 24 * MIB, f"resident memory grew {(peak - before) / MIB:.0f} MiB"
