"""The C++ decode-layer loop gives bit-identical results to the Python path it replaces, on every
architecture flag (qkv bias, q/k norm, GQA) and weight format, for decode steps and verification
blocks, captured hidden states included. Skipped where it was not built (`make install` builds it)."""

import pytest
import torch

import dflash.engine.model as model_module
from dflash.engine.native import extension
from dflash.engine.quant import quantize_linears
from tests.model.tiny import ours_from_hf, tiny_hf_model

pytestmark = pytest.mark.skipif(extension() is None, reason="the native extension is not built")


def run(model, tokens, start, kv_state, rows):
    kv = model.new_kv_cache(256)
    kv.keys.copy_(kv_state[0])
    kv.values.copy_(kv_state[1])
    kv.length = start
    logits, hidden = model(tokens[start : start + rows], start, kv, capture_layers=(2, 0), logits_positions=None)
    return logits, hidden, kv.keys[:, :, : start + rows].clone()


@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_native_layers_equal_the_python_layers_bit_for_bit(architecture, weights, monkeypatch):
    model = ours_from_hf(tiny_hf_model(architecture), dtype=torch.float32 if weights == "fp32" else torch.bfloat16)
    quantize_linears(model, weights)
    torch.manual_seed(6)
    tokens = torch.randint(0, 128, (120,))
    kv = model.new_kv_cache(256)
    model(tokens[:100], 0, kv)
    state = (kv.keys.clone(), kv.values.clone())
    for start, rows in ((100, 1), (95, 8), (60, 5)):
        native = run(model, tokens, start, state, rows)
        with monkeypatch.context() as patch:
            patch.setattr(model_module, "native_extension", lambda: None)
            python = run(model, tokens, start, state, rows)
        assert torch.equal(native[0], python[0])
        assert all(torch.equal(a, b) for a, b in zip(native[1], python[1])) and len(native[1]) == 2
        assert torch.equal(native[2], python[2])
