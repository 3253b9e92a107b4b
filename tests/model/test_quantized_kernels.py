"""Our int8-dot kernels (native/quantized_linear.cpp) compute the same int32 group sums with
AVX512-VNNI, AMX tiles or AVX2 and run the same float epilogue, so their outputs agree bit for
bit: checked here on this CPU by forcing each (DFLASH_INT8DOT_ISA, read on every call) over the
embedded model's shapes and every row count up to 20. Where the CPU lacks AVX512-VNNI there is
nothing to compare the AVX2 kernels with, and these tests are skipped (test_weight_formats.py still
runs them)."""

import pytest
import torch

from dflash.engine.native import extension
from dflash.engine.quant import kernels, kernels_description, pack_int4, pack_int8, per_group

pytestmark = pytest.mark.skipif(
    extension() is None or not extension().vnni_available(),
    reason="comparing the AVX2 kernels with the VNNI ones needs the native extension and AVX512-VNNI",
)

# The embedded model's linears: wqkv, wo, w13, w2 and the (int8) LM head, and a one-block one.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (16, 32)]
ROW_COUNTS = list(range(1, 21)) + [32, 64]


def weights(kind: str, N: int, K: int):
    """Random codes over the whole range (int8 -127..127, int4 0..15) in quant.py's layouts."""
    if kind == "int4":
        codes = pack_int4(torch.randint(0, 16, (N, K), dtype=torch.uint8))
        return codes, per_group(torch.rand(N, K // 32) * 0.01 + 1e-4, torch.randn(N, K // 32) * 0.05)
    return pack_int8(torch.randint(-127, 128, (N, K), dtype=torch.int8)), torch.rand(N) * 0.01 + 1e-4


def activations(M: int, K: int) -> torch.Tensor:
    """Normal rows, with a few groups that stress the quantization: all zeros, one spike, huge and
    tiny magnitudes, values exactly halfway between two codes."""
    x = torch.randn(M, K)
    x[0, :32] = 0
    if K >= 128:
        x[-1, 32:64] = 0
        x[-1, 40] = -3.0
        x[-1, 64:96] *= 1e4
        x[-1, 96:128] *= 1e-4
    if M > 2:
        x[1, :32] = torch.arange(32) - 15.5  # amax 15.5: k * 127 / 15.5 hits .5 for some k
    return x.bfloat16()


def run(monkeypatch, isa: str, matmul, *arguments) -> torch.Tensor:
    monkeypatch.setenv("DFLASH_INT8DOT_ISA", isa)
    return matmul(*arguments)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: f"{shape[0]}x{shape[1]}")
def test_avx2_vnni_and_amx_give_the_same_bits(kind, shape, monkeypatch):
    torch.manual_seed(shape[0] + shape[1])
    N, K = shape
    codes, scales = weights(kind, N, K)
    matmul = extension().int4_matmul if kind == "int4" else extension().int8_matmul
    for M in ROW_COUNTS:
        x = activations(M, K)
        avx2 = run(monkeypatch, "avx2", matmul, x, codes, scales)
        vnni = run(monkeypatch, "vnni", matmul, x, codes, scales)
        default = run(monkeypatch, "", matmul, x, codes, scales)  # AMX from 5 or 64 rows where present
        amx = run(monkeypatch, "amx", matmul, x, codes, scales)  # tiles for every row count (VNNI without AMX)
        assert torch.equal(avx2, vnni), (M, (avx2.float() - vnni.float()).abs().max())
        assert torch.equal(avx2, default), (M, (avx2.float() - default.float()).abs().max())
        assert torch.equal(avx2, amx), (M, (avx2.float() - amx.float()).abs().max())
        assert avx2.isfinite().all()


def test_the_forced_instruction_set_is_the_one_that_runs(monkeypatch):
    native = extension()
    monkeypatch.setenv("DFLASH_INT8DOT_ISA", "avx2")
    assert native.int8dot_isa(1) == native.int8dot_isa(16) == "avx2"
    assert kernels() == "int8-dot"
    monkeypatch.setenv("DFLASH_INT8DOT_ISA", "vnni")
    assert native.int8dot_isa(1) == native.int8dot_isa(16) == "avx512-vnni"
    monkeypatch.setenv("DFLASH_INT8DOT_ISA", "amx")
    tiles = "amx" if native.amx_available() else "avx512-vnni"
    assert native.int8dot_isa(1) == native.int8dot_isa(1, int4=True) == tiles
    monkeypatch.delenv("DFLASH_INT8DOT_ISA")
    assert native.int8dot_isa(4) == native.int8dot_isa(31, int4=True) == "avx512-vnni"
    assert native.int8dot_isa(5) == native.int8dot_isa(32, int4=True) == tiles
    assert kernels_description() == ("int8-dot (VNNI; AMX from 5 rows of int8; AMX from 32 rows of int4)"
                                     if native.amx_available() else "int8-dot (VNNI)")


def test_avx2_results_are_the_float_matmul_up_to_quantization(monkeypatch):
    """Not only equal to the others: close to x . W in floats (int8 activations: ~1% per group)."""
    torch.manual_seed(11)
    N, K = 96, 128
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    scales = torch.rand(N) * 0.01 + 1e-3
    x = torch.randn(7, K).bfloat16()
    got = run(monkeypatch, "avx2", extension().int8_matmul, x, pack_int8(q), scales).float()
    expected = x.float() @ (q.float() * scales[:, None]).t()
    assert ((got - expected).abs() <= 0.02 * expected.abs().max()).all()
