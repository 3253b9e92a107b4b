"""The C++ decode-layer loop gives bit-identical results to the Python path it replaces, on every
architecture flag (qkv bias, q/k norm, GQA) and weight format, for decode steps and verification
blocks (and prefill chunks, on our int8/int4 kernels), captured hidden states included. Skipped
where it was not built (`make install` builds it)."""

import numpy as np
import pytest
import torch

import dflash.engine.model as model_module
from dflash.engine.native import extension
from dflash.engine.quant import quantize_linears
from tests.model.tiny import ours_from_hf, tiny_hf_model

pytestmark = pytest.mark.skipif(extension() is None, reason="the native extension is not built")


def run(model, tokens, start, kv_state, rows, capture_into=None):
    kv = model.new_kv_cache(256)
    kv.keys.copy_(kv_state[0])
    kv.values.copy_(kv_state[1])
    kv.length = start
    logits, hidden = model(tokens[start : start + rows], start, kv, capture_layers=(2, 0), logits_positions=None,
                           capture_into=capture_into)
    return logits, hidden, kv.keys[:, :, : start + rows].clone()


def prefilled(architecture, weights):
    """A tiny model in `weights`, 120 random tokens and the KV state of the first 100."""
    model = ours_from_hf(tiny_hf_model(architecture), dtype=torch.float32 if weights == "fp32" else torch.bfloat16)
    quantize_linears(model, weights)
    torch.manual_seed(6)
    tokens = torch.randint(0, 128, (120,))
    kv = model.new_kv_cache(256)
    model(tokens[:100], 0, kv)
    return model, tokens, (kv.keys.clone(), kv.values.clone())


@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_native_layers_equal_the_python_layers_bit_for_bit(architecture, weights, monkeypatch):
    model, tokens, state = prefilled(architecture, weights)
    # 40 rows: more than FEW_ROWS (a prefill chunk), which only our int8/int4 kernels take natively
    for start, rows in ((100, 1), (95, 8), (60, 5), (80, 40)):
        calls = extension().layers_without_aten_calls()
        native = run(model, tokens, start, state, rows)
        # int8/int4 on our kernels and attention (bf16 cache) take the loop without ATen calls
        fast = weights in ("int8", "int4") and model_module.attention_kernels() == "ours" and extension().int8dot_available()
        assert extension().layers_without_aten_calls() == calls + int(fast)
        with monkeypatch.context() as patch:
            patch.setattr(model_module, "native_extension", lambda: None)
            python = run(model, tokens, start, state, rows)
        assert torch.equal(native[0], python[0])
        assert all(torch.equal(a, b) for a, b in zip(native[1], python[1])) and len(native[1]) == 2
        assert torch.equal(native[2], python[2])


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_captured_states_written_into_the_drafter_rows_equal_those_returned(weights, native, monkeypatch):
    """capture_into (the DFlash drafter's rows, which the forward fills in place of returning the
    states: ~100 us a step less) holds exactly the returned states, in capture_layers order."""
    model, tokens, state = prefilled("llama", weights)
    C = model.args.hidden_size
    if not native:
        monkeypatch.setattr(model_module, "native_extension", lambda: None)
    for start, rows in ((100, 1), (95, 8)):
        _, hidden, _ = run(model, tokens, start, state, rows)
        # a strided block of a wider buffer, NaN around it: only its own columns are written
        buffer = torch.full((rows + 2, 2 * C + 5), float("nan"), dtype=torch.bfloat16)
        into = buffer[1 : rows + 1, 3 : 3 + 2 * C]
        _, returned, _ = run(model, tokens, start, state, rows, capture_into=into)
        assert returned == [] and torch.equal(into, torch.cat(hidden, dim=-1))
        assert buffer[0].isnan().all() and buffer[:, :3].isnan().all() and buffer[:, 3 + 2 * C :].isnan().all()


@pytest.mark.parametrize("width", [576, 100, 64])
def test_native_rms_norm_takes_its_fixed_sequence(width):
    """rms_norm's bf16 rows (8 lanes where the CPU has AVX2) are the documented sequence, bit for bit:
    sums of squares in 8 fp32 lanes (c mod 8) in order, one tree, 1/sqrt(mean + eps), then
    bf16(weight * bf16(x * inverse)). The Python path calls the same function, so the comparison of
    the two loops above cannot see a change here."""
    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(5, width, generator=generator) * 3).bfloat16()
    weight = torch.randn(width, generator=generator).bfloat16()
    eps = 1e-5
    expected = []
    for row in x.float():
        padded = torch.cat([row, torch.zeros(-width % 8)]).view(-1, 8)
        lanes = torch.zeros(8)
        for block in padded:
            lanes = lanes + block * block
        p = lanes.tolist()
        f = np.float32
        total = (f(p[0]) + f(p[1]) + (f(p[2]) + f(p[3]))) + ((f(p[4]) + f(p[5])) + (f(p[6]) + f(p[7])))
        inverse = f(1.0) / np.sqrt(f(total) / f(width) + f(eps))
        normed = (row * torch.tensor(inverse, dtype=torch.float32)).bfloat16().float()
        expected.append((weight.float() * normed).bfloat16())
    assert torch.equal(extension().rms_norm(x, weight, eps), torch.stack(expected))


@pytest.mark.parametrize("width", [1536, 13, 70])
def test_native_silu_product_is_silu_times_up_rounded_as_torch_rounds(width, monkeypatch):
    """silu_product(gate_up) = bf16(bf16(silu(gate)) * up) with its own exp (model.FeedForward calls it
    for bf16 rows, as the decode loops do, so their rows agree; the loops above check that): within
    one bf16 rounding of the float64 value, its products rounded like torch's bf16 mul, a tail
    (width not a multiple of 8) the same bits as the same values in a full block, 16 lanes the same
    bits as 8, and any shape."""
    generator = torch.Generator().manual_seed(width)
    gate = torch.cat([torch.randn(4, width, generator=generator) * 4, torch.tensor([[-100.0, 100.0, 0.0] * width])[:, :width]])
    gate_up = torch.cat([gate, torch.randn(5, width, generator=generator)], dim=1).bfloat16()
    out = extension().silu_product(gate_up)
    g, up = gate_up[:, :width].double(), gate_up[:, width:]
    silu = g / (1 + torch.exp(-g))
    assert ((out.double() - silu * up.double()).abs() <= (silu * up.double()).abs() * 2 ** -7 + 1e-30).all()
    ours_silu = extension().silu_product(torch.cat([gate_up[:, :width], torch.ones_like(up)], dim=1))
    assert torch.equal(out, (ours_silu.float() * up.float()).bfloat16())  # bf16(silu) times up, one rounding
    pad = -width % 64  # zeros before: the tail's values then sit in full blocks of 64 (and of 16, 8)
    padded = torch.cat([torch.zeros(5, pad), gate_up[:, :width], torch.zeros(5, pad), gate_up[:, width:]], dim=1).bfloat16()
    assert torch.equal(extension().silu_product(padded)[:, pad:], out)
    assert torch.equal(extension().silu_product(gate_up.view(5, 1, 2 * width))[:, 0], out)
    monkeypatch.setenv("DFLASH_SILU_LANES", "8")  # where the CPU has AVX512: its 8-lane code, the same bits
    assert torch.equal(extension().silu_product(gate_up), out)
    with pytest.raises(RuntimeError, match="silu_product: expected bf16"):
        extension().silu_product(gate_up.float())


@pytest.mark.parametrize("cache", ["auto", "int8"])
@pytest.mark.parametrize("weights", ["fp32", "bf16", "int4"])
@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_a_draft_tree_in_one_attention_call_equals_the_python_chain_by_chain_bit_for_bit(architecture, weights, cache,
                                                                                        monkeypatch):
    """decode_layers attends a tree's chains in one call (attend_tree: the chunks of 256 keys wholly
    below the tree shared by its rows); model.py attends them one causal call each."""
    from dflash.engine.model import TreeRows

    if cache == "int8" and not extension().int8_kv_available():
        pytest.skip("an int8 cache needs AVX512-VNNI")
    model = ours_from_hf(tiny_hf_model(architecture), dtype=torch.float32 if weights == "fp32" else torch.bfloat16)
    quantize_linears(model, weights)
    model.kv_cache = cache
    torch.manual_seed(8)
    tokens = torch.randint(0, 128, (560,))
    kv = model.new_kv_cache(600)
    model(tokens[:540], 0, kv)
    names = ("keys", "values") + (("key_scales", "value_scales") if cache == "int8" else ())
    state = {name: getattr(kv, name).clone() for name in names}
    parents = (-1, 0, 1, 2, 0, 4, 1, 6, 6, 0, 9, 10, 11)  # chains of 4, 2, 1, 2, 4 rows
    for start in (100, 250, 256, 530):  # none, across the first chunk's end, one and two shared chunks

        def verify():
            for name in names:
                getattr(kv, name).copy_(state[name])
            kv.length = start
            rows = TreeRows.of(parents, model.args, model.dtype, model.device)
            logits, _ = model(tokens[start : start + len(parents)], start, kv, logits_positions=None, tree=rows)
            return [logits, rows.keys.clone()] + [getattr(kv, name)[:, :, : start + len(parents)].clone() for name in names]

        native = verify()
        with monkeypatch.context() as patch:
            patch.setattr(model_module, "native_extension", lambda: None)
            python = verify()
        assert all(torch.equal(a, b) for a, b in zip(native, python)), start
