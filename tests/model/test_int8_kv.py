"""The int8 KV cache (`[model] kv_cache = "int8"`: kv.Int8KVCache, causal_attention.cpp's "int8 keys
and values"): its codes are the quantization the header describes (checked against torch), its
attention is that of the dequantized cache with quantized query rows (checked against a float64
reference), each row is computed the same way whatever the other rows of its call, and a model on it
keeps every promise of the other caches: lossless speculation, prefill equal to decoding, the
native decode loop equal to the Python path, snapshots restored exactly, in memory and on disk."""

import math

import pytest
import torch

import dflash.engine.model as model_module
from dflash.engine.disk_cache import DiskCache
from dflash.engine.generate import Engine
from dflash.engine.kv import KEY_OFFSET, Int8KVCache
from dflash.engine.model import attention_description
from dflash.engine.native import extension
from dflash.engine.prefix_cache import PrefixCache
from dflash.engine.quant import quantize_linears
from dflash.engine.sampling import SamplingParams
from tests.model.test_weight_formats import (PROMPTS, assert_ngram_greedy_equals_plain_greedy,
                                              assert_verified_rows_equal_decode_rows)
from tests.model.tiny import ours_from_hf, tiny_hf_model

pytestmark = pytest.mark.skipif(extension() is None or not extension().int8_kv_available(),
                                reason="needs the native extension and AVX512-VNNI")

CHUNK = 256  # causal_attention.cpp's kChunk


def quantized_like_the_header(x):
    """codes, scales: scale = max|x| / 127 per row, codes round-half-even(x / scale), 0 for a zero row."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = amax / 127
    codes = torch.where(amax > 0, torch.round(x / scale), torch.zeros_like(x)).clamp(-127, 127)
    return codes, scale[..., 0]


def filled_cache(T, KV, D, length, seed=0):
    generator = torch.Generator().manual_seed(seed)
    k = (torch.randn(T, KV, D, generator=generator) * 2).to(torch.bfloat16)
    v = torch.randn(T, KV, D, generator=generator).to(torch.bfloat16)
    cache = Int8KVCache(1, KV, length, D, "cpu", extension())
    cache.write(0, 0, k, v)
    return cache, k, v


def attend(cache, q, start):
    return cache.attend(q, 0, start)


def test_codes_and_scales_are_the_headers_quantization():
    cache, k, v = filled_cache(40, 3, 64, 64)
    k[5] = 0  # a zero row: scale 0, codes 0
    cache.write(0, 5, k[5:6], v[5:6])
    codes, scales = quantized_like_the_header(k)
    assert torch.equal(cache.keys[0, :, :40].to(torch.int32) - KEY_OFFSET, codes.transpose(0, 1).to(torch.int32))
    assert torch.equal(cache.key_scales[0, :, :40], scales.transpose(0, 1))
    assert (cache.key_scales[0, :, 5] == 0).all() and (cache.keys[0, :, 5] == KEY_OFFSET).all()
    codes, scales = quantized_like_the_header(v)
    assert torch.equal(cache.values[0, :, :40].to(torch.int32), codes.transpose(0, 1).to(torch.int32))
    assert torch.equal(cache.value_scales[0, :, :40], scales.transpose(0, 1))


@pytest.mark.parametrize("D", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("start,T", [(0, 1), (0, 7), (250, 8), (255, 2), (0, 300), (513, 40), (1000, 1)])
def test_it_attends_over_the_dequantized_cache_with_quantized_query_rows(D, start, T):
    H, KV = 6, 2
    cache, _, _ = filled_cache(start + T + 5, KV, D, start + T + 5, seed=D)
    q = torch.randn(T, H, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = attend(cache, q, start)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    keys, values = cache.readable(0, start + T)
    codes, scales = quantized_like_the_header(q)
    query = codes * scales[..., None]
    length, G = start + T, H // KV
    visible = torch.arange(length)[None, :] <= (start + torch.arange(T))[:, None]
    reference = torch.empty(T, H, D, dtype=torch.float64)
    for h in range(H):
        logits = query[:, h].double() @ keys[h // G].double().T / math.sqrt(D)
        reference[:, h] = logits.masked_fill(~visible, float("-inf")).softmax(-1) @ values[h // G].double()
    # bf16 output rounding (values up to ~3) and the int16 value weights (header: at most f / 2 each)
    assert (out.double() - reference).abs().max() < 2e-2


@pytest.mark.parametrize("D", [16, 64, 128])
def test_a_row_is_the_same_alone_in_a_verification_block_or_in_a_prefill_chunk(D):
    H, KV, length = 9, 3, 600
    cache, _, _ = filled_cache(length, KV, D, length + 8, seed=3)
    q = torch.randn(length, H, D, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    whole = attend(cache, q, 0)  # many rows: per block of tokens, walking the chunks
    for cuts in (list(range(0, length + 1, 8)), list(range(length + 1)), [0, 5, 255, 256, 257, 300, 511, 513, 600]):
        pieces = [attend(cache, q[a:b], a) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(pieces), whole), cuts[:6]


def test_it_reads_only_the_keys_a_row_may_see():
    cache, _, _ = filled_cache(300, 2, 32, 300, seed=5)
    q = torch.randn(4, 4, 32).to(torch.bfloat16)
    clean = attend(cache, q, 250)
    cache.keys[0, :, 254:], cache.values[0, :, 254:] = 7, -100
    cache.key_scales[0, :, 254:], cache.value_scales[0, :, 254:] = float("nan"), float("inf")
    assert torch.equal(attend(cache, q, 250), clean)


@pytest.mark.parametrize("D", [32, 64, 128])
def test_rows_on_amx_tiles_get_the_bits_of_rows_on_vpdpbusd(D, monkeypatch):
    """An int8 cache's calls of many rows multiply on tiles where the CPU has AMX (int8_kv_tiles); the
    integer sums are exact, so a row gets the same bits as with vpdpbusd (DFLASH_ATTENTION_ISA=avx512-bf16
    keeps every call there), and, as there, reads nothing past the keys it may see."""
    if not extension().int8_kv_tiles(D):
        pytest.skip("no AMX tiles for an int8 cache on this CPU")
    H, KV = 6, 2
    cache, _, _ = filled_cache(700, KV, D, 704, seed=D + 1)
    q = torch.randn(300, H, D, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    on_tiles = [attend(cache, q, 0), attend(cache, q[:77], 400), attend(cache, q[:40], 250)]
    cache.keys[0, :, 290:], cache.values[0, :, 290:] = 7, -100  # past the last call's rows: never read
    cache.key_scales[0, :, 290:], cache.value_scales[0, :, 290:] = float("nan"), float("inf")
    assert torch.equal(attend(cache, q[:40], 250), on_tiles[2])
    monkeypatch.setenv("DFLASH_ATTENTION_ISA", "avx512-bf16")
    assert not extension().int8_kv_tiles(D)
    assert torch.equal(attend(cache, q[:40], 250), on_tiles[2])
    cache, _, _ = filled_cache(700, KV, D, 704, seed=D + 1)
    assert torch.equal(attend(cache, q, 0), on_tiles[0])
    assert torch.equal(attend(cache, q[:77], 400), on_tiles[1])


def test_bad_layers_are_errors_that_say_what():
    cache, _, _ = filled_cache(8, 2, 64, 16)
    q = torch.randn(2, 4, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="past 16 cached"):
        extension().causal_attention_int8(q, cache.keys[0], cache.values[0], cache.key_scales[0], cache.value_scales[0], 15)
    with pytest.raises(RuntimeError, match="uint8"):
        extension().causal_attention_int8(q, cache.values[0], cache.values[0], cache.key_scales[0], cache.value_scales[0], 0)
    with pytest.raises(RuntimeError, match="scales"):
        extension().quantize_kv(q[:, :2], q[:, :2], cache.keys[0], cache.values[0], cache.key_scales[0, :, :8],
                                cache.value_scales[0], 0)
    odd = Int8KVCache(1, 2, 16, 24, "cpu", extension())  # no kernel takes heads of 24 dimensions
    with pytest.raises(RuntimeError, match="head dim 24"):
        odd.write(0, 0, torch.randn(2, 2, 24), torch.randn(2, 2, 24))


@pytest.fixture(params=["int8", "int4"])
def model(request):
    model = ours_from_hf(tiny_hf_model("qwen3"), dtype=torch.bfloat16)
    quantize_linears(model, request.param)
    model.kv_cache = "int8"
    return model


def test_the_model_serves_an_int8_cache_named_as_such(model):
    assert isinstance(model.new_kv_cache(64), Int8KVCache) and model.kv_dtype == torch.int8
    assert attention_description(torch.int8) == f"ours-int8-vnni-r{extension().int8_kv_revision()}"


def test_verified_rows_get_the_logits_of_decode_steps_bit_for_bit(model):
    assert_verified_rows_equal_decode_rows(model, (0, 1, 31, 32, 63, 120, 190))


def test_prefill_rows_equal_decode_rows_whatever_the_chunking(model):
    tokens = torch.randint(0, 128, (100,), generator=torch.Generator().manual_seed(7))

    def run(chunks):
        kv = model.new_kv_cache(256)
        for start, end in zip(chunks, chunks[1:]):
            logits, _ = model(tokens[start:end], start, kv, logits_positions=None)
        return kv.keys[:, :, :100].clone(), kv.key_scales[:, :, :100].clone(), kv.values[:, :, :100].clone(), logits[-1]

    whole = run([0, 100])
    for chunks in ([0, 37, 100], [0, 20, 21, 64, 99, 100], list(range(101))):
        assert all(torch.equal(a, b) for a, b in zip(run(chunks), whole)), chunks


def test_the_native_decode_loop_equals_the_python_layers(model, monkeypatch):
    tokens = torch.randint(0, 128, (120,), generator=torch.Generator().manual_seed(6))
    for start, rows in ((100, 1), (95, 8)):
        results = []
        for native in (True, False):
            with monkeypatch.context() as patch:
                if not native:
                    patch.setattr(model_module, "native_extension", lambda: None)
                kv = model.new_kv_cache(256)
                model(tokens[:start], 0, kv)
                calls = extension().layers_without_aten_calls()
                logits, _ = model(tokens[start : start + rows], start, kv, logits_positions=None)
                # the native loop takes its path without ATen calls between the kernels here too
                assert extension().layers_without_aten_calls() == calls + int(native)
                results.append((logits, kv.keys[:, :, : start + rows].clone(), kv.value_scales[:, :, : start + rows].clone()))
        assert all(torch.equal(a, b) for a, b in zip(*results)), (start, rows)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ngram_greedy_equals_plain_greedy(model, prompt):
    assert_ngram_greedy_equals_plain_greedy(model, prompt)


def test_a_snapshot_restores_the_codes_and_scales_exactly(model):
    kv = model.new_kv_cache(128)
    model(torch.arange(40), 0, kv)
    snapshot = kv.snapshot(30)
    assert snapshot.keys.dtype == torch.uint8 and snapshot.key_scales.shape == (kv.keys.shape[0], kv.keys.shape[1], 30)
    assert snapshot.nbytes == 2 * snapshot.keys.numel() + 2 * 4 * snapshot.key_scales.numel()
    other = model.new_kv_cache(128)
    other.restore(snapshot)
    assert other.length == 30
    for name in ("keys", "values", "key_scales", "value_scales"):
        assert torch.equal(getattr(other, name)[:, :, :30], getattr(kv, name)[:, :, :30]), name
    with pytest.raises(ValueError, match="int8 snapshot"):
        model.new_kv_cache(128, dtype=torch.bfloat16).restore(snapshot)
    built_on = kv.snapshot(40, base=snapshot)  # positions 30..40 only, on the first 30
    assert built_on.base is snapshot and built_on.keys.shape[2] == built_on.key_scales.shape[2] == 10
    other = model.new_kv_cache(128)
    other.restore(built_on)
    for name in ("keys", "values", "key_scales", "value_scales"):
        assert torch.equal(getattr(other, name)[:, :, :40], getattr(kv, name)[:, :, :40]), name


def test_a_restart_restores_from_disk_with_the_same_output(model, tmp_path):
    identity = {"weights": "tiny-qwen3", "numerics": "int8-kv", "max_ctx": 128}
    conversation = [5, 9, 33, 2, 7, 100, 4, 61, 12, 90, 3, 5, 9, 33, 2, 8]

    def serve_once():
        disk = DiskCache(tmp_path, max_bytes=1 << 30, identity=identity)
        engine = Engine(model, max_ctx=128, prefix_cache=PrefixCache(4, 1 << 30), disk_cache=disk)
        generation = engine.start(conversation, SamplingParams(), max_tokens=6, snapshot_at=(12,))
        out = generation.run()
        disk.flush()
        disk.close()
        return out, generation.stats

    first, stats = serve_once()
    assert stats.cached_tokens == 0
    again, stats = serve_once()
    assert stats.cached_tokens == 12 and again == first
