"""The transformers fallback backend (an architecture outside the built-in family: Gemma 3)."""

import torch
import transformers

from dflash.engine.generate import Engine
from dflash.engine.hf_backend import HFModel
from dflash.engine.sampling import SamplingParams


def tiny_gemma3():
    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8,
    )
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(config).eval()


def test_greedy_equals_transformers_generate_and_rollback_works():
    hf = tiny_gemma3()
    prompt = [5, 9, 33, 2, 7, 100, 4, 61, 12, 90, 3]
    with torch.no_grad():
        reference = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
    engine = Engine(HFModel(hf), max_ctx=64, prefill_chunk=4)
    assert engine.start(prompt, SamplingParams(), 12).run() == reference
    # A second request sharing the prompt reuses the live state after a crop back into it.
    again = engine.start(prompt, SamplingParams(), 12)
    assert again.run() == reference
    assert again.stats.cached_tokens in (0, len(prompt) - 1)  # 0 when the sliding window lost the states


def test_snapshot_and_restore_round_trip():
    model = HFModel(tiny_gemma3())
    kv = model.new_kv_cache(64)
    model(torch.tensor([1, 2, 3, 4]), 0, kv)
    snap = kv.snapshot()
    expected, _ = model(torch.tensor([5]), 4, kv)
    model(torch.tensor([6, 7]), 5, kv)
    kv.restore(snap)
    again, _ = model(torch.tensor([5]), 4, kv)
    assert torch.equal(expected, again)
