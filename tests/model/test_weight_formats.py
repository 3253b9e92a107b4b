"""Weight-only int8 and int4: the kernels give each row the same result whatever the number of rows
(so verification sees decode's logits), the values round-trip, and greedy speculation on a quantized
model reproduces plain greedy decoding of the same format token for token. Every test runs on the
kernel sets we ship (quant.kernels): ours (int8 dot products: VNNI for up to 4 rows, AMX tiles for
more where the CPU has them, so the row-count test also proves the two agree bit for bit), ours
with the AVX2 kernels forced (what AVX2-only CPUs run; test_quantized_kernels.py compares them
with the others bit for bit), and torch's; each with the attention kernels we ship."""

import pytest
import torch

from dflash.engine.generate import Engine
from dflash.engine.model import half_linear_rows_invariant, has_bf16_hardware, torch_attention_rows_invariant
from dflash.engine.native import extension
from dflash.engine.quant import Int4Linear, Int8Linear, auto_weights, kernels, quantize_linears
from dflash.engine.sampling import SamplingParams
from dflash.engine.speculative import SpeculationConfig
from tests.model.tiny import ours_from_hf, tiny_hf_model

KINDS = {"int8": Int8Linear, "int4": Int4Linear}


@pytest.fixture(autouse=True, params=["ours", "torch"])
def attention_kernel_set(request, monkeypatch):
    """The attention kernels we ship (model.attention_kernels): torch's flash kernel only where it
    is row-invariant (AMX; elsewhere it is never chosen), ours everywhere."""
    if request.param == "torch" and not torch_attention_rows_invariant():
        pytest.skip("torch's attention is not row-invariant on this CPU: ours runs there")
    if request.param == "ours" and (extension() is None or not extension().causal_attention_available()):
        pytest.skip("our attention needs the native extension and AVX2")
    monkeypatch.setenv("DFLASH_ATTENTION", request.param)
    return request.param


@pytest.fixture(autouse=True, params=["int8-dot", "int8-dot-avx2", "torch"])
def kernel_set(request, monkeypatch):
    """"int8-dot-avx2": ours with the AVX2 kernels forced (what AVX2-only CPUs run)."""
    name = request.param.removesuffix("-avx2")
    if name == "int8-dot" and (extension() is None or not extension().int8dot_available()):
        pytest.skip("our kernels need the native extension and AVX2")
    if request.param.endswith("-avx2"):
        monkeypatch.setenv("DFLASH_INT8DOT_ISA", "avx2")
        assert extension().int8dot_isa(1) == extension().int8dot_isa(16) == "avx2"
    monkeypatch.setenv("DFLASH_KERNELS", name)
    assert kernels() == name
    return name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(128, 64), (192, 96), (960, 576), (576, 1536)])
def test_each_row_is_computed_the_same_whatever_the_row_count(kind, shape):
    torch.manual_seed(1)
    linear = KINDS[kind](torch.randn(shape) * 0.05, torch.randn(shape[0]) * 0.1)
    assert linear.kernels == kernels()
    x = torch.randn(64, shape[1]).bfloat16()
    together = linear(x)
    for rows in (1, 2, 5, 8, 16, 32):
        for start in range(0, x.shape[0] - rows + 1, rows):
            assert torch.equal(linear(x[start : start + rows]), together[start : start + rows])


def test_int4_keeps_values_that_are_already_4_bit_groups_of_32():
    torch.manual_seed(2)
    N, K = 64, 96
    scale = torch.rand(N, K // 32, 1) * 0.01 + 0.001
    offset = torch.randn(N, K // 32, 1) * 0.05
    codes = torch.randint(0, 16, (N, K // 32, 32)).float()
    codes[..., 0], codes[..., 1] = 0, 15  # each group spans the full range, as a Q4_1 block
    weight = (codes * scale + offset).view(N, K)
    # exact up to the bf16 rounding of each group's scale and zero, and of the dequantized value
    restored = Int4Linear(weight, None).dequantized(torch.float32)
    assert (restored - weight).abs().max() <= 2 ** -6 * (15 * scale.max() + offset.abs().max())


def test_int8_round_trip_error_is_half_a_step():
    torch.manual_seed(3)
    weight = torch.randn(96, 64)
    layer = Int8Linear(weight, None)
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((layer.dequantized(torch.float32) - weight).abs() <= step * 0.51).all()


@pytest.fixture(params=["int8", "int4"])
def quantized(request, kernel_set):
    model = ours_from_hf(tiny_hf_model("qwen2"), dtype=torch.bfloat16)  # qwen2: qkv biases too
    quantize_linears(model, request.param)
    assert isinstance(model.layers[0].feed_forward.w13, KINDS[request.param])
    assert isinstance(model.lm_head, Int8Linear)  # int4 too: see quantize_linears
    return model


PROMPTS = [[5, 9, 33, 2, 7, 100, 4, 61, 12, 90, 3, 5, 9, 33, 2], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]]


def assert_ngram_greedy_equals_plain_greedy(model, prompt):
    """Greedy n-gram speculation on `model` gives plain greedy decoding's tokens, and did verify."""
    def run(speculation):
        engine = Engine(model, max_ctx=128, prefill_chunk=8, speculation=speculation)
        generation = engine.start(prompt, SamplingParams(), max_tokens=32)
        return generation.run(), generation.stats

    plain, _ = run(SpeculationConfig(drafter="none"))
    speculative, stats = run(SpeculationConfig(drafter="ngram", max_draft_tokens=7, ngram_min=1, ngram_max=3, adaptive=False))
    assert speculative == plain
    assert stats.verification_steps > 0


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ngram_greedy_equals_plain_greedy_on_quantized_weights(quantized, prompt):
    assert_ngram_greedy_equals_plain_greedy(quantized, prompt)


# Not fp32: MKL's fp32 GEMM computes a row differently with 1, 4 or 16 rows (README, Lossless).
@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
def test_verified_rows_get_the_logits_of_decode_steps_bit_for_bit(weights):
    """At starts on both sides of the attention's key buckets (model.KEY_BUCKET), a forward over 8
    rows gives each row exactly the logits a 1-row decode step at that position gives."""
    if weights == "bf16" and not half_linear_rows_invariant():
        pytest.skip("torch's bf16 matmuls are not row-invariant on this CPU (AVX512-BF16 without AMX): "
                    "a server there does not speculate on bf16 weights (test_loading.py)")
    model = ours_from_hf(tiny_hf_model("qwen3"), dtype=torch.bfloat16)
    quantize_linears(model, weights)
    assert_verified_rows_equal_decode_rows(model, (0, 1, 25, 28, 31, 32, 57, 63, 64, 120, 127, 190))


def assert_verified_rows_equal_decode_rows(model, starts):
    """At each start, a forward over 8 rows gives each row exactly a 1-row decode step's logits."""
    tokens = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(5))
    kv = model.new_kv_cache(256)
    for start in starts:
        kv.length = 0
        if start:
            model(tokens[:start], 0, kv)
        verified, _ = model(tokens[start : start + 8], start, kv, logits_positions=None)
        for i in range(8):
            kv.length = start + i
            decoded, _ = model(tokens[start + i : start + i + 1], start + i, kv)
            assert torch.equal(decoded[0], verified[i]), (start, i)


@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
def test_prefill_rows_equal_decode_rows_whatever_the_chunking(weights):
    """Keys, values and logits of a prompt are the same prefilled in one chunk, in other chunks, or
    decoded a token at a time: a prefix-cache hit continues exactly as a recomputation would."""
    if weights == "bf16" and not has_bf16_hardware():
        pytest.skip("without bf16 hardware bf16 linears prefill in fp32 (model.Linear: 5x faster than "
                    "bf16 there), so prefilled rows are close to decoded ones, not equal; int8/int4 are exact")
    if weights == "bf16" and not half_linear_rows_invariant():
        pytest.skip("torch's bf16 matmuls are not row-invariant on this CPU (AVX512-BF16 without AMX): "
                    "prefilled rows are close to decoded ones, not equal; int8/int4 are exact")
    model = ours_from_hf(tiny_hf_model("qwen3"), dtype=torch.bfloat16)
    quantize_linears(model, weights)
    torch.manual_seed(7)
    tokens = torch.randint(0, 128, (100,))

    def run(chunks):
        kv = model.new_kv_cache(256)
        for start, end in zip(chunks, chunks[1:]):
            logits, _ = model(tokens[start:end], start, kv, logits_positions=None)
        return kv.keys[:, :, :100].clone(), kv.values[:, :, :100].clone(), logits[-1]

    whole = run([0, 100])
    for chunks in ([0, 37, 100], [0, 20, 21, 64, 99, 100], list(range(101))):
        assert all(torch.equal(a, b) for a, b in zip(run(chunks), whole)), chunks


def test_auto_serves_a_4_bit_source_as_int4_and_others_as_int8():
    assert auto_weights("bfloat16", 4) == "int4"
    assert auto_weights("bfloat16", 8) == "int8"
    assert auto_weights("bfloat16", None) == "int8"
    assert auto_weights("float32", 4) == "fp32"


def test_layers_called_without_row_groups_compute_them_alike():
    """A caller that runs decoder layers itself (no row groups passed) gets what forward gets."""
    model = ours_from_hf(tiny_hf_model("llama"), dtype=torch.bfloat16)
    tokens = torch.randint(0, 128, (40,))
    kv = model.new_kv_cache(128)
    _, (expected,) = model(tokens, 0, kv, capture_layers=(2,))
    cos, sin = (table[:40] for table in model._rope_tables(128))
    x = model.embed(tokens)
    other = model.new_kv_cache(128)
    with torch.inference_mode():
        for index, layer in enumerate(model.layers):
            x = layer(x, cos, sin, other, index, 0, None)
    assert torch.equal(x, expected)
