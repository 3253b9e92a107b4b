"""Our causal attention kernel (native/causal_attention.cpp): it computes attention (checked against
a float64 reference), and computes each row the same way whatever the other rows of the call, the
position the call starts at, and whether the call runs chunk by chunk (few rows) or row block by
row block (many rows): what lossless speculation and exact prefix-cache restores rest on. The model
runs it wherever model.attention_kernels() says "ours" (every CPU with AVX2 and the native build).
Over a bf16 cache it multiplies on AMX tiles where the CPU has them (DFLASH_ATTENTION_ISA=amx-bf16),
with bf16 dot products where it has AVX512-BF16 (=avx512-bf16), else with fp32 fmas (=avx2): each
is tested where the CPU runs it."""

import math

import pytest
import torch

from dflash.engine.model import attention_description, attention_kernels, attention_rows_invariant, kv_dtype_for
from dflash.engine.native import extension
from tests.model.tiny import ours_from_hf, tiny_hf_model

pytestmark = pytest.mark.skipif(
    extension() is None or not extension().causal_attention_available(), reason="needs the native extension and AVX2"
)

AVAILABLE_ISAS = [] if extension() is None else extension().causal_attention_isas()
ISAS = ["avx2"] + [pytest.param(isa, marks=pytest.mark.skipif(isa not in AVAILABLE_ISAS, reason=f"needs {isa}"))
                   for isa in ("avx512-bf16", "amx-bf16")]

CHUNK = 256  # causal_attention.cpp's kChunk: the row sets below straddle it
FEW_ROWS = 64  # its kFewRows: up to this many query rows per KV head the call splits over chunks


def reference(q, keys, values, start):
    T, H, D = q.shape
    G = H // keys.shape[0]
    length = start + T
    visible = torch.arange(length)[None, :] <= (start + torch.arange(T))[:, None]
    out = torch.empty(T, H, D, dtype=torch.float64)
    for h in range(H):
        scores = q[:, h].double() @ keys[h // G, :length].double().T / math.sqrt(D)
        out[:, h] = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values[h // G, :length].double()
    return out


def random_cache(T, H, KV, D, length, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=generator).to(dtype)
    keys = torch.randn(KV, length, D, generator=generator).to(dtype)
    values = torch.randn(KV, length, D, generator=generator).to(dtype)
    return q, keys, values


@pytest.fixture
def threads(request):
    """torch's thread count for the test (conftest sets 1), from the test's parameter."""
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


def use(isa, monkeypatch):
    monkeypatch.setenv("DFLASH_ATTENTION_ISA", isa)
    assert extension().causal_attention_isa() == isa


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("start,T", [(0, 1), (0, 7), (10, 1), (250, 8), (255, 2), (0, 300), (513, 40), (1000, 1)])
def test_matches_a_float64_reference(isa, dtype, D, start, T, monkeypatch):
    use(isa, monkeypatch)
    q, keys, values = random_cache(T, 6, 2, D, start + T + 5, dtype)
    out = extension().causal_attention(q, keys, values, start)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    assert (out.double() - reference(q.float(), keys.float(), values.float(), start)).abs().max() < tolerance


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [16, 64, 128])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_a_row_is_the_same_alone_in_a_verification_block_or_in_a_prefill_chunk(isa, dtype, D, threads, monkeypatch):
    """Positions 0..599 computed as one call (prefill: many rows), in blocks of 8 (verification: few
    rows, split over chunks, and on 2 threads over parts of the rows too), one at a time (decode),
    and in uneven pieces across the chunk boundaries: every row bit for bit the same."""
    use(isa, monkeypatch)
    H, KV, length = 9, 3, 600
    q, keys, values = random_cache(length, H, KV, D, length + 8, dtype, seed=1)
    whole = extension().causal_attention(q, keys, values, 0)
    assert length * H // KV > FEW_ROWS  # the whole call takes the many-rows path
    for cuts in (list(range(0, length + 1, 8)), list(range(length + 1)), [0, 5, 255, 256, 257, 300, 511, 513, 600]):
        pieces = [extension().causal_attention(q[a:b], keys, values, a) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(pieces), whole), cuts[:6]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 4, 40])
def test_it_reads_only_the_keys_a_row_may_see(isa, dtype, T, monkeypatch):
    """Positions past the call's last row hold anything (a cache's stale or unwritten tail, even NaN):
    the result does not change."""
    use(isa, monkeypatch)
    q, keys, values = random_cache(T, 4, 2, 32, 300, dtype, seed=2)
    clean = extension().causal_attention(q, keys, values, 250)
    keys[:, 250 + T:], values[:, 250 + T:] = float("nan"), float("inf")
    assert torch.equal(extension().causal_attention(q, keys, values, 250), clean)


@pytest.mark.skipif("avx512-bf16" not in AVAILABLE_ISAS, reason="needs AVX512-BF16")
def test_bf16_dot_products_are_a_sequence_of_their_own(monkeypatch):
    """Over a bf16 cache the ISAs round differently (so a disk snapshot names which: test_loading),
    over an fp32 cache they are one."""
    q, keys, values = random_cache(8, 9, 3, 64, 700, torch.bfloat16, seed=4)
    by_isa = {}
    for isa in AVAILABLE_ISAS:
        use(isa, monkeypatch)
        by_isa[isa] = (extension().causal_attention(q, keys, values, 692),
                       extension().causal_attention(q.float(), keys.float(), values.float(), 692))
    for isa in AVAILABLE_ISAS[1:]:
        assert not torch.equal(by_isa["avx2"][0], by_isa[isa][0]), isa
        assert torch.equal(by_isa["avx2"][1], by_isa[isa][1]), isa


SOFTMAX_ISAS = ["avx2", pytest.param("avx512", marks=pytest.mark.skipif(
    extension() is None or "avx512" not in extension().chunk_softmax_isas(), reason="needs AVX512F/DQ"))]


def softmax_cases():
    """Rows of scores over every visible count 1..256 (whole vectors of 8 and 16, and each tail), with
    the values past a row's keys left as garbage that must not count."""
    generator = torch.Generator().manual_seed(5)
    scores = torch.randn(2 * CHUNK, CHUNK, generator=generator) * 6
    seen = torch.cat([torch.arange(1, CHUNK + 1), torch.arange(1, CHUNK + 1).flip(0)])
    return scores, seen


@pytest.mark.parametrize("isa", SOFTMAX_ISAS)
def test_the_chunk_softmax_is_a_softmax_over_the_keys_a_row_sees(isa):
    scores, seen = softmax_cases()
    e, m, l = extension().softmax_rows(scores, seen, isa)
    for r, n in enumerate(seen.tolist()):
        assert m[r] == scores[r, :n].max()
        expected = (scores[r, :n].double() - m[r].double()).exp()
        # exp's argument in base 2 is rounded to fp32 first (causal_attention.cpp, exp_nonpositive):
        # ~1e-7 of relative error near 0, up to ~5e-6 for the tiniest terms (x near -87, ~1e-38)
        torch.testing.assert_close(e[r, :n].double(), expected, rtol=1e-5, atol=1e-30)
        big = expected >= 1e-6
        torch.testing.assert_close(e[r, :n][big].double(), expected[big], rtol=2e-6, atol=0)
        assert torch.all(e[r, n : (n + 7) // 8 * 8] == 0)
        torch.testing.assert_close(l[r].double(), expected.sum(), rtol=1e-5, atol=0)


@pytest.mark.skipif(extension() is None or "avx512" not in extension().chunk_softmax_isas(), reason="needs AVX512F/DQ")
def test_the_wide_chunk_softmax_gives_the_same_bits_as_the_avx2_one():
    """Attention chooses the AVX512 softmax where the CPU has it; a disk snapshot made on an AVX2-only
    CPU of the same kernel revision must still hold the bits this one computes, so both are one
    sequence: the max in any order, exp lane by lane, l summed on 8 lanes in key order."""
    scores, seen = softmax_cases()
    narrow, wide = extension().softmax_rows(scores, seen, "avx2"), extension().softmax_rows(scores, seen, "avx512")
    for r, n in enumerate(seen.tolist()):
        padded = (n + 7) // 8 * 8
        assert torch.equal(narrow[0][r, :padded], wide[0][r, :padded]), n
    assert torch.equal(narrow[1], wide[1]) and torch.equal(narrow[2], wide[2])


def test_a_bad_softmax_call_says_what_is_wrong():
    scores, seen = softmax_cases()
    with pytest.raises(RuntimeError, match="isa sse"):
        extension().softmax_rows(scores, seen, "sse")
    with pytest.raises(RuntimeError, match=r"seen\[0\] = 0"):
        extension().softmax_rows(scores[:1], torch.zeros(1, dtype=torch.long), "avx2")


@pytest.mark.parametrize("bad", ["head_dim", "past_the_cache", "dtype"])
def test_bad_shapes_are_errors_that_say_what(bad):
    q, keys, values = random_cache(2, 4, 2, 64, 16, torch.float32)
    if bad == "head_dim":
        q, keys, values = q[..., :24].contiguous(), keys[..., :24].contiguous(), values[..., :24].contiguous()
        match = "head dim 24"
    elif bad == "past_the_cache":
        match = "past 16 cached"
    else:
        q = q.double()
        match = "fp32 or bf16"
    with pytest.raises(RuntimeError, match=match):
        extension().causal_attention(q, keys, values, 15 if bad == "past_the_cache" else 0)


def test_the_model_runs_ours_where_it_is_chosen(monkeypatch):
    """DFLASH_ATTENTION=ours: the model's logits are those of torch's attention up to rounding, its
    cache is bf16 for a bf16 model on any CPU, and its rows are invariant."""
    model = ours_from_hf(tiny_hf_model("qwen3"), dtype=torch.bfloat16)
    tokens = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(3))

    def logits(kernels):
        monkeypatch.setenv("DFLASH_ATTENTION", kernels)
        assert attention_kernels() == kernels
        kv = model.new_kv_cache(64, dtype=torch.float32)
        return model(tokens, 0, kv, logits_positions=None)[0]

    assert (logits("ours") - logits("torch")).abs().max() < 0.05
    monkeypatch.setenv("DFLASH_ATTENTION", "ours")
    assert kv_dtype_for(torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    assert attention_rows_invariant(torch.bfloat16) and attention_rows_invariant(torch.float32)


@pytest.mark.skipif("avx512-bf16" not in AVAILABLE_ISAS, reason="needs AVX512-BF16")
def test_a_disk_snapshot_names_the_revision_of_the_bf16_sequence(monkeypatch):
    """The scores became bf16 dot products in revision 2 and exp another sequence in revision 3 (every
    path, the fp32 ones too): a snapshot written before must not be served to this kernel, so the name
    carries the revision."""
    monkeypatch.setenv("DFLASH_ATTENTION", "ours")
    if "amx-bf16" in AVAILABLE_ISAS:
        assert attention_description(torch.bfloat16) == f"ours-amx-bf16-r{extension().causal_attention_revision()}"
        monkeypatch.setenv("DFLASH_ATTENTION_ISA", "avx512-bf16")
    assert attention_description(torch.bfloat16) == f"ours-avx512-bf16-r{extension().causal_attention_revision()}"
    assert extension().causal_attention_revision() >= 3  # 3: another exp, on every path
    monkeypatch.setenv("DFLASH_ATTENTION_ISA", "avx2")
    assert attention_description(torch.bfloat16) == f"ours-avx2-r{extension().causal_attention_revision()}"
    assert attention_description(torch.float32) == f"ours-r{extension().causal_attention_revision()}"
