"""Model sources and their errors: HF folder, GGUF cache, and clear messages for bad input."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from dflash.engine.loading import ModelLoadError, auto_kv_cache, load_model, numerics, resolve_source
from dflash.engine.model import attention_description, silu_description
from dflash.engine.native import extension
from dflash.engine.quant import kernels
from dflash.engine.sampling import SamplingParams
from dflash.engine.speculative import SpeculationConfig
from tests.model.tiny import ours_from_hf, tiny_hf_model


def write_hf_folder(folder, name="llama", **sizes):
    model = tiny_hf_model(name, **sizes)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight" or not model.config.tie_word_embeddings},
              str(folder / "model.safetensors"))
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(128)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="t2").save_pretrained(folder)
    return model


def test_hf_folder_loads_and_generates_like_transformers(tmp_path):
    hf = write_hf_folder(tmp_path / "tiny")
    loaded = load_model(str(tmp_path / "tiny"), dtype="float32", max_ctx=64)
    assert loaded.model_id == "tiny" and loaded.backend == "native"
    prompt = [5, 9, 33, 7]
    with torch.no_grad():
        reference = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, 4:].tolist()
    loaded.engine.eos_token_ids = frozenset()
    assert loaded.engine.start(prompt, SamplingParams(), 6).run() == reference


def test_the_rope_attention_factor_reaches_the_served_yarn_and_a_misuse_is_named(tmp_path):
    write_hf_folder(tmp_path / "tiny")  # trained context 256
    own = load_model(str(tmp_path / "tiny"), dtype="float32", max_ctx=1024, rope_scaling_static=True)
    cooled = load_model(str(tmp_path / "tiny"), dtype="float32", max_ctx=1024, rope_attention_factor=1.0,
                        rope_scaling_static=True)
    assert own.engine.model.rope_attention_scale > 1.0 and cooled.engine.model.rope_attention_scale == 1.0
    assert cooled.engine.model.args.rope_scaling["attention_factor"] == 1.0  # part of the disk cache's identity
    prompt = [5, 9, 33, 7]
    assert not torch.equal(own.engine.forward(prompt), cooled.engine.forward(prompt))
    # By default the scaling switches in past the trained context: a short prompt runs unscaled.
    switched = load_model(str(tmp_path / "tiny"), dtype="float32", max_ctx=1024)
    plain = load_model(str(tmp_path / "tiny"), dtype="float32", max_ctx=256)
    assert switched.engine.model.rope_switch == 256 and own.engine.model.rope_switch is None
    assert switched.engine.model.args.rope_scaling["plain_within"] == 256  # part of the disk cache's identity
    assert torch.equal(switched.engine.forward(prompt), plain.engine.forward(prompt))
    with pytest.raises(ModelLoadError, match="applies to YaRN only, not to rope_scaling 'none'"):
        load_model(str(tmp_path / "tiny"), dtype="float32", max_ctx=1024, rope_scaling="none", rope_attention_factor=1.0)


@pytest.mark.parametrize("attention, cpu, weights, speculates", [
    ("ours", "AVX2", "bf16", True), ("torch", "AMX", "bf16", True), ("torch", "AVX2", "bf16", False),
    ("torch", "AVX512-BF16", "bf16", False), ("ours", "AVX512-BF16", "bf16", False),
    ("ours", "AVX512-BF16", "float16", False), ("ours", "AVX512-BF16", "float32", True),
    ("ours", "AVX512-BF16", "int8", True), ("ours", "AVX512-BF16", "int4", True)])
def test_speculation_runs_only_where_verified_rows_equal_decoded_ones(tmp_path, monkeypatch, attention, cpu,
                                                                      weights, speculates):
    """Where torch's attention (AVX2, AVX512-BF16 without AMX) or torch's bf16 matmuls (AVX512-BF16
    without AMX) compute a verified row unlike a decoded one, a server decodes plainly instead of
    speculating: left without our attention kernel (no compiler), or serving bf16 weights on Zen 4."""
    import dflash.engine.model as model_module

    write_hf_folder(tmp_path / "tiny")
    monkeypatch.setattr(model_module, "cpu_kind", lambda: cpu)
    monkeypatch.setattr(model_module, "attention_kernels", lambda: attention)
    # float16 and float32 by `dtype` (no weight format names fp16); the rest by `weights`.
    how = {"dtype": weights} if weights.startswith("float") else {"weights": weights}
    loaded = load_model(str(tmp_path / "tiny"), max_ctx=64, speculation=SpeculationConfig(drafter="ngram"), **how)
    assert (loaded.engine.speculation.drafter == "ngram") == speculates


def test_an_int8_kv_cache_is_served_where_the_cpu_can_and_refused_clearly_elsewhere(tmp_path, monkeypatch):
    write_hf_folder(tmp_path / "tiny")
    with pytest.raises(ModelLoadError, match="unsupported kv_cache 'int4'"):
        load_model(str(tmp_path / "tiny"), kv_cache="int4", max_ctx=64)
    if extension() is not None and extension().int8_kv_available():
        loaded = load_model(str(tmp_path / "tiny"), kv_cache="int8", weights="int8", max_ctx=64)
        assert loaded.kv_cache == "int8" and loaded.engine.kv.quantized
        assert loaded.engine.start([5, 9, 33], SamplingParams(), max_tokens=4).run()
        write_hf_folder(tmp_path / "wide", hidden_size=96)  # heads of 24 dimensions: no kernel takes them
        with pytest.raises(ModelLoadError, match="this model's have 24"):
            load_model(str(tmp_path / "wide"), kv_cache="int8", weights="int8", max_ctx=64)
    monkeypatch.setattr("dflash.engine.loading.native_extension", lambda: None)  # no native kernels, or no VNNI
    with pytest.raises(ModelLoadError, match="AVX512-VNNI"):
        load_model(str(tmp_path / "tiny"), kv_cache="int8", max_ctx=64)


def test_auto_serves_an_int8_cache_with_quantized_weights_where_tiles_multiply_it(tmp_path, monkeypatch):
    write_hf_folder(tmp_path / "tiny", "qwen3")  # head dim 32
    tiles = extension() is not None and extension().int8_kv_available() and extension().int8_kv_tiles(32)
    quantized = load_model(str(tmp_path / "tiny"), weights="int8", max_ctx=64)  # kv_cache = "auto"
    assert quantized.kv_cache == ("int8" if tiles else "bfloat16") and quantized.engine.kv.quantized == tiles
    assert quantized.engine.start([5, 9, 33], SamplingParams(), max_tokens=4).run()
    assert load_model(str(tmp_path / "tiny"), weights="bf16", max_ctx=64).kv_cache == "bfloat16"
    assert load_model(str(tmp_path / "tiny"), weights="int8", kv_cache="float", max_ctx=64).kv_cache == "bfloat16"

    class Kernels:  # a CPU with VNNI, with or without the tiles
        def __init__(self, tiles):
            self.tiles = tiles

        def int8_kv_available(self):
            return True

        def int8_kv_tiles(self, head_dim):
            return self.tiles and head_dim in (32, 64, 128)

    for kernels, weights, head_dim, expected in [(Kernels(True), "int4", 64, "int8"), (Kernels(True), "int8", 128, "int8"),
                                                 (Kernels(False), "int4", 64, "float"), (Kernels(True), "bf16", 64, "float"),
                                                 (Kernels(True), "fp32", 64, "float"), (Kernels(True), "int4", 256, "float"),
                                                 (None, "int4", 64, "float")]:
        monkeypatch.setattr("dflash.engine.loading.native_extension", lambda: kernels)
        assert auto_kv_cache(weights, head_dim) == expected, (kernels and kernels.tiles, weights, head_dim)


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_source(str(tmp_path / "nope"), tmp_path)


def test_unsupported_architecture_is_named(tmp_path):
    folder = tmp_path / "weird"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["NotARealForCausalLM"], "model_type": "nope"}))
    with pytest.raises(ModelLoadError, match="NotARealForCausalLM"):
        load_model(str(folder), dtype="float32")


def test_corrupt_weights_are_a_clear_error(tmp_path):
    write_hf_folder(tmp_path / "tiny")
    (tmp_path / "tiny" / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelLoadError, match="corrupt weights file"):
        load_model(str(tmp_path / "tiny"), dtype="float32")


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        resolve_source(str(bad), tmp_path / "cache")


def test_dflash_chat_streams_the_embedded_models_greedy_reply():
    # "What is the capital of France?" alone is a near-tie for the first token ("The" 25.33 vs "L"
    # 25.24 in fp32), so each weight format answered it differently, and "... Answer with one word."
    # flipped with int4 on our int8-dot kernels; this wording is answered "The capital city of
    # France is Paris." in fp32, bf16, int8 and int4, on both kernel sets.
    result = subprocess.run([sys.executable, "-m", "dflash.cli", "chat", "Name the capital city of France.",
                             "--max-tokens", "24"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_disk_snapshots_are_keyed_by_what_decides_their_bits(monkeypatch):
    """A disk snapshot computed with other kernels (matmul or attention) or another KV dtype would
    not equal what this server computes, so the cache identity names all three."""
    model = ours_from_hf(tiny_hf_model("llama"), dtype=torch.bfloat16)
    ours = numerics("bfloat16", "int4", model)
    assert ours.endswith(f"/{kernels()}/attention-{attention_description(model.kv_dtype)}/kv-{str(model.kv_dtype).removeprefix('torch.')}"
                         f"/silu-{silu_description(model.dtype)}")
    if extension() is not None:  # our SiLU product for bf16 rows: another exp than torch's
        assert ours.endswith(f"/silu-ours-{extension().silu_product_kind()}")
    for attention in ("ours", "torch"):
        monkeypatch.setenv("DFLASH_ATTENTION", attention)
        assert f"/attention-{attention_description(model.kv_dtype)}/" in numerics("bfloat16", "int4", model)
    if extension() is not None and extension().causal_attention_available():
        monkeypatch.setenv("DFLASH_ATTENTION", "ours")
        seen = set()
        for isa in ("avx2", "avx512-bf16"):  # the ISA the values are multiplied with, over a bf16 cache
            monkeypatch.setenv("DFLASH_ATTENTION_ISA", isa)
            seen.add(numerics("bfloat16", "int4", model))
        assert len(seen) == (2 if extension().causal_attention_isa() == "avx512-bf16" else 1)
        assert model.kv_dtype != torch.bfloat16 or all("/attention-ours-avx" in name for name in seen)
        monkeypatch.delenv("DFLASH_ATTENTION_ISA")
    monkeypatch.delenv("DFLASH_ATTENTION")
    monkeypatch.setenv("DFLASH_KERNELS", "torch")
    forced = numerics("bfloat16", "int4", model)
    assert forced.split("/")[2] == "torch" and (forced != ours or ours.split("/")[2] == "torch")
    assert numerics("bfloat16", "bf16", model).split("/")[2] == "torch"  # no quantized kernels in bf16
