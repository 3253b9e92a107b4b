"""A context longer than the trained one: RoPE scaling equal to transformers', and the KV dtype
(fp32 on CPU for a bf16 model) followed, with speculation still lossless."""

import math

import attrs
import pytest
import torch
import transformers

from dflash.engine.cpu import kind_from_flags
from dflash.engine.generate import Engine
import dflash.engine.model as model_module
from dflash.engine.model import ModelArgs, build_transformer, kv_dtype_for, with_rope_scaling
from dflash.engine.native import extension as native_extension
from dflash.engine.sampling import SamplingParams
from dflash.engine.speculative import SpeculationConfig
from tests.model.tiny import ours_from_hf, tiny_hf_model

TRAINED = 256  # tiny.py's max_position_embeddings
MAX_CTX = 4 * TRAINED
ATOL = 1e-4


def hf_with_rope(hf_model, rope_parameters):
    """The same weights in transformers, with the given RoPE scaling over MAX_CTX positions."""
    config = transformers.LlamaConfig(**{**hf_model.config.to_dict(), "max_position_embeddings": MAX_CTX,
                                         "rope_parameters": {"rope_theta": 10000.0, **rope_parameters}})
    scaled = transformers.LlamaForCausalLM(config).eval()
    scaled.load_state_dict(hf_model.state_dict())
    return scaled


@pytest.mark.parametrize("mode, attention_factor, rope_parameters", [
    ("yarn", 0.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAINED}),
    ("yarn", 1.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAINED, "attention_factor": 1.0}),
    ("linear", 0.0, {"rope_type": "linear", "factor": 4.0}),
])
def test_scaled_rope_matches_transformers_past_the_trained_context(mode, attention_factor, rope_parameters):
    hf = tiny_hf_model("llama")
    args = with_rope_scaling(ModelArgs.from_hf_config(hf.config.to_dict()), MAX_CTX, mode, attention_factor=attention_factor,
                             static=True)  # at every position, as transformers applies it (test_rope_switch.py: switched)
    assert args.rope_scaling == rope_parameters
    ours = build_transformer(args, hf.state_dict(), torch.float32)
    ids = torch.randint(0, 128, (3 * TRAINED,), generator=torch.Generator().manual_seed(1))
    kv = ours.new_kv_cache(MAX_CTX)
    ours(ids[:-16], 0, kv)
    logits, _ = ours(ids[-16:], len(ids) - 16, kv, logits_positions=None)  # positions ~2.9x the trained context
    with torch.no_grad():
        reference = hf_with_rope(hf, rope_parameters)(ids[None]).logits[0, -16:]
    torch.testing.assert_close(logits, reference, atol=ATOL, rtol=0)


def test_auto_scaling_is_yarn_past_the_trained_context_and_keeps_a_declared_scaling():
    plain = ModelArgs.from_hf_config(tiny_hf_model("llama").config.to_dict())
    assert with_rope_scaling(plain, TRAINED, "auto") == plain
    assert with_rope_scaling(plain, MAX_CTX, "auto").rope_scaling == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAINED, "plain_within": TRAINED}
    assert with_rope_scaling(plain, MAX_CTX, "linear", factor=2.0, static=True).rope_scaling == {"rope_type": "linear", "factor": 2.0}
    declared = ModelArgs.from_hf_config(tiny_hf_model("llama3-rope").config.to_dict())
    assert with_rope_scaling(declared, MAX_CTX, "auto") == declared
    assert with_rope_scaling(declared, MAX_CTX, "none").rope_scaling is None
    with pytest.raises(ValueError, match="unknown rope_scaling 'ntk'"):
        with_rope_scaling(plain, MAX_CTX, "ntk")


def test_the_attention_factor_replaces_yarns_temperature_and_only_yarns():
    plain = ModelArgs.from_hf_config(tiny_hf_model("llama").config.to_dict())
    own = build_transformer(with_rope_scaling(plain, MAX_CTX, "auto"), tiny_hf_model("llama").state_dict(), torch.float32)
    assert own.rope_attention_scale == pytest.approx(0.1 * math.log(4) + 1)
    cooled = with_rope_scaling(plain, MAX_CTX, "auto", attention_factor=1.0)
    assert build_transformer(cooled, tiny_hf_model("llama").state_dict(), torch.float32).rope_attention_scale == 1.0
    assert with_rope_scaling(plain, TRAINED, "auto", attention_factor=1.0) == plain  # no YaRN served: nothing to replace
    declared = attrs.evolve(plain, rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128})
    assert with_rope_scaling(declared, MAX_CTX, "auto", attention_factor=1.0).rope_scaling == {
        **declared.rope_scaling, "attention_factor": 1.0}  # a declared YaRN's temperature is replaced too
    with pytest.raises(ValueError, match="applies to YaRN only, not to rope_scaling 'linear'"):
        with_rope_scaling(plain, MAX_CTX, "linear", attention_factor=1.0)
    with pytest.raises(ValueError, match="0 .YaRN's own. or positive, got -1"):
        with_rope_scaling(plain, MAX_CTX, "yarn", attention_factor=-1)


@pytest.mark.parametrize("flags, kind", [
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "AMX"),
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX512-BF16"),
    ({"avx2", "avx512f"}, "AVX512"),
    ({"avx2", "fma"}, "AVX2"),
])
def test_cpu_kind_from_flags(flags, kind):
    assert kind_from_flags(frozenset(flags)) == kind


@pytest.mark.parametrize("dtype, device, bf16_hardware, attention, expected", [
    (torch.bfloat16, "cpu", False, "torch", torch.float32),
    (torch.float16, "cpu", False, "torch", torch.float32),
    (torch.bfloat16, "cpu", False, "ours", torch.bfloat16),  # ours reads a bf16 cache fast on AVX2
    (torch.bfloat16, "cpu", True, "torch", torch.bfloat16),
    (torch.float32, "cpu", True, "torch", torch.float32),
    (torch.float32, "cpu", False, "ours", torch.float32),
    (torch.bfloat16, "cuda", False, "torch", torch.bfloat16),
])
def test_kv_dtype_policy(dtype, device, bf16_hardware, attention, expected, monkeypatch):
    monkeypatch.setattr(model_module, "has_bf16_hardware", lambda: bf16_hardware)
    monkeypatch.setattr(model_module, "attention_kernels", lambda: attention)
    assert kv_dtype_for(dtype, torch.device(device)) == expected


# Where the attention is row-invariant (see test_loading: elsewhere the server does not speculate).
@pytest.mark.parametrize("bf16_hardware, attention", [(False, "ours"), (True, "torch"), (True, "ours")])
def test_a_bf16_model_keeps_its_kv_dtype_and_speculation_stays_lossless(bf16_hardware, attention, monkeypatch):
    if attention == "ours" and (native_extension() is None or not native_extension().causal_attention_available()):
        pytest.skip("our attention needs the native extension and AVX2")
    if attention == "torch" and not model_module.torch_attention_rows_invariant():
        pytest.skip("torch's attention is row-invariant only on AMX CPUs")
    if not model_module.half_linear_rows_invariant():
        pytest.skip("torch's bf16 matmuls are not row-invariant on this CPU (AVX512-BF16 without AMX): "
                    "a server there does not speculate on bf16 weights (test_loading.py)")
    monkeypatch.setenv("DFLASH_ATTENTION", attention)
    monkeypatch.setattr(model_module, "has_bf16_hardware", lambda: bf16_hardware)
    expected = torch.bfloat16
    target = ours_from_hf(tiny_hf_model("llama"), torch.bfloat16)
    ngram = SpeculationConfig(drafter="ngram", max_draft_tokens=4, ngram_min=1, ngram_max=3, adaptive=False)
    prompt = [5, 9, 33, 2, 7, 100, 4, 61, 12, 90, 3, 5, 9, 33, 2]
    outputs = []
    for speculation in (SpeculationConfig(), ngram):
        engine = Engine(target, max_ctx=128, prefill_chunk=8, speculation=speculation)
        assert engine.kv.keys.dtype == target.kv_dtype == expected
        generation = engine.start(prompt, SamplingParams(), max_tokens=24)
        outputs.append(generation.run())
    assert outputs[0] == outputs[1]
    assert generation.stats.verification_steps > 0


def test_the_engine_keeps_what_generations_learned_of_drafters_per_configuration():
    target = ours_from_hf(tiny_hf_model("llama"), torch.bfloat16)
    ngram = SpeculationConfig(drafter="ngram", max_draft_tokens=4, ngram_min=1, ngram_max=3)
    engine = Engine(target, max_ctx=128, prefill_chunk=8, speculation=ngram)
    prompt = [5, 9, 33, 2, 7, 100, 4, 61, 12, 90, 3, 5, 9, 33, 2]
    engine.start(prompt, SamplingParams(), max_tokens=16).run()
    memory = engine.speculation_memory()
    assert "ngram" in memory.drafters  # the first generation's verdict on the n-gram drafter
    engine.rollback(0)
    generation = engine.start(prompt, SamplingParams(), max_tokens=4)
    assert generation.speculation.memory is memory
    engine.speculation = SpeculationConfig(drafter="ngram", max_draft_tokens=2)
    assert engine.speculation_memory() is not memory and not engine.speculation_memory().drafters
    engine.speculation = ngram  # back: what was learned under it is there again
    assert engine.speculation_memory() is memory
    for block in range(3, 3 + Engine.REMEMBERED_CONFIGURATIONS):  # a bounded number of configurations is kept
        engine.speculation = SpeculationConfig(drafter="ngram", max_draft_tokens=block)
        engine.speculation_memory()
    engine.speculation = ngram
    assert engine.speculation_memory() is not memory
