"""Weight formats: weight-only int8 (one scale per output channel) and int4 (asymmetric, groups of 32
along the input), quantized at load time for every linear of our decoder and its LM head.

Decoding reads every weight once per token, so on these CPUs a decode step is bound by weight bytes
(README, Numbers): bf16 reads 270 MB per token of the embedded model, int8 about half, int4 (its
LM head stays int8) about a third.
Two kernel sets, chosen at load by what the CPU has (`kernels()`, in the start-up log):
- "int8-dot": ours (native/quantized_linear.cpp), where the native extension is built and the CPU
  has AVX2 (and FMA). Activations are quantized to int8 per row and group of 32 (as llama.cpp
  does), each group's dot product is an exact int32 sum (AVX512-VNNI for up to 4 rows and AMX
  tiles for more where the CPU has them, else AVX2), and the scales are applied in one fixed order
  per row, so every instruction set gives the same bits. The weights are kept in its layout
  (`pack_int4`, `pack_int8`).
- "torch": torch's own (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), everywhere else
  (no compiler, no AVX2); bf16 activations (they run scalar loops on fp32 ones), row by row.
Both compute each output row the same way whatever the number of rows
(tests/model/test_weight_formats.py runs both). Every row — decode, verification and prefill — goes
through the same kernel set, so a verified row gets exactly the logits a decoded row gets (greedy
speculation stays lossless) and a prompt's keys do not depend on how it was chunked (a prefix-cache
hit equals a recomputation). Quality of each (bench/quality.py): README, Numbers.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from dflash.engine.native import extension as native_extension

WEIGHT_FORMATS = ("auto", "bf16", "fp32", "int8", "int4")
INT4_GROUP = 32  # the block of GGUF's Q4_0/Q4_1/Q8_0: a 4-bit GGUF's values are kept exactly
INT4_ROWS_MULTIPLE = 16  # the int4 kernel packs output channels in blocks


def dtype_for_weights(weights: str) -> torch.dtype:
    """The activation dtype a weight format runs with (the quantized kernels are fast on bf16 only)."""
    return torch.float32 if weights == "fp32" else torch.bfloat16


def auto_weights(dtype: str, source_bits: int | None) -> str:
    """The format "auto" serves: the fewest weight bytes that hold the quality bar (int8 within 1%
    of bf16 perplexity, int4 within 5%; bench/quality.py). int4 groups of 32 reproduce a 4-bit GGUF's
    values almost exactly, so a model that came as 4 bits is served as int4; other models get int8,
    which holds the 1% bar on the models measured. A float32 `dtype` asks for full precision."""
    if dtype == "float32":
        return "fp32"
    return "int4" if source_bits is not None and source_bits <= 4 else "int8"


def kernels() -> str:
    """The quantized kernels this process uses (the start-up log says which): ours where the
    native extension is built and the CPU has AVX2, else torch's. `DFLASH_KERNELS=torch` forces
    torch's, `DFLASH_INT8DOT_ISA=avx2` ours on AVX2 only (the tests run all three)."""
    native = native_extension()
    if os.environ.get("DFLASH_KERNELS") == "torch" or native is None or not native.int8dot_available():
        return "torch"
    return "int8-dot"


def kernels_description() -> str:
    """For the start-up log: which kernels, and which instructions ours use for few and many rows
    of int8 weights (the LM head in both formats) and of int4 ones, e.g.
    "int8-dot (VNNI; AMX from 5 rows of int8; AMX from 32 rows of int4)"."""
    name = kernels()
    if name == "torch":
        return name
    native = native_extension()
    names = {"avx512-vnni": "VNNI", "amx": "AMX", "avx2": "AVX2"}
    few = native.int8dot_isa(1)
    pieces = []  # where each format's many-row instructions take over
    for int4, label in ((False, "int8"), (True, "int4")):
        rows = next((rows for rows in range(2, 129) if native.int8dot_isa(rows, int4) != few), None)
        if rows is not None:
            pieces.append(f"{names[native.int8dot_isa(rows, int4)]} from {rows} rows of {label}")
    return f"{name} ({'; '.join([names[few], *pieces])})"


def kernels_for(weight: Tensor) -> str:
    """Ours need whole blocks: 16 output channels by groups of 32 inputs."""
    N, K = weight.shape
    return kernels() if N % 16 == 0 and K % INT4_GROUP == 0 else "torch"


def quads(values: Tensor) -> Tensor:
    """[N, K] -> [N/16, K/32, 8, 64]: quad t, byte 4j+i = values[16 nb + j, 32 kb + 4t + i]."""
    N, K = values.shape
    return values.view(N // 16, 16, K // 32, 8, 4).permute(0, 2, 3, 1, 4).reshape(N // 16, K // 32, 8, 64)


def unquads(packed: Tensor) -> Tensor:
    """The inverse of `quads`."""
    blocks, groups = packed.shape[:2]
    return packed.view(blocks, groups, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(blocks * 16, groups * 32)


def pack_int8(codes: Tensor) -> Tensor:
    """int8 codes [N, K] -> quantized_linear.cpp's layout: quads of the codes + 128, as uint8."""
    return quads((codes.to(torch.int16) + 128).to(torch.uint8)).contiguous()


def pack_int4(codes: Tensor) -> Tensor:
    """codes [N, K] in 0..15 -> [N/16, K/32, 4, 64] uint8: quads 2c and 2c+1 in the low and high
    nibbles of chunk c (quantized_linear.cpp's layout)."""
    N, K = codes.shape
    chunks = quads(codes.to(torch.uint8)).view(N // 16, K // 32, 4, 2, 64)
    return (chunks[:, :, :, 0] | (chunks[:, :, :, 1] << 4)).contiguous()


def per_group(scale: Tensor, zero: Tensor) -> Tensor:
    """scale and zero [N, K/32] -> [N/16, K/32, 2, 16] bf16."""
    N, groups = scale.shape
    per_block = lambda v: v.reshape(N // 16, 16, groups).permute(0, 2, 1)  # noqa: E731
    return torch.stack([per_block(scale), per_block(zero)], dim=2).to(torch.bfloat16).contiguous()


class QuantizedLinear(nn.Module):
    in_features: int
    out_features: int
    bias: Tensor | None

    def matmul(self, x: Tensor) -> Tensor:  # x [M, K] bf16 -> [M, N] bf16
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        out = self.matmul(x.reshape(-1, x.shape[-1]).to(torch.bfloat16)).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)


class Int8Linear(QuantizedLinear):
    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        w = weight.detach().float()
        # The kernel takes bf16 scales: round each up to bf16 first and quantize against that, so
        # every code stays in -127..127 and the error stays within half a step.
        exact = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        scales = exact.to(torch.bfloat16)
        scales = torch.where(scales.float() < exact, torch.nextafter(scales, torch.tensor(float("inf"), dtype=torch.bfloat16)), scales)
        qweight = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
        self.kernels = kernels_for(w)
        self.register_buffer("qweight", qweight if self.kernels == "torch" else pack_int8(qweight))
        self.register_buffer("scales", scales if self.kernels == "torch" else scales.float())  # [N]
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        codes = self.qweight if self.kernels == "torch" else unquads(self.qweight).to(torch.int16) - 128
        return codes.to(dtype) * self.scales.to(dtype)[:, None]

    def matmul(self, x: Tensor) -> Tensor:
        if self.kernels != "torch":
            return native_extension().int8_matmul(x, self.qweight, self.scales)
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)



class Int4Linear(QuantizedLinear):
    """w = q * scale + offset per group of INT4_GROUP inputs, q in 0..15 (GGUF's Q4_1 form), in
    torch's packed layout (blocked and undocumented: `dequantized` asks the kernel itself)."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        w = weight.detach().float()
        N, K = w.shape
        groups = w.view(N, K // INT4_GROUP, INT4_GROUP)
        low = groups.amin(dim=-1, keepdim=True)
        # The kernel computes (q - 8) * scale + zero with bf16 scale and zero: round those first and
        # choose the codes against the grid they make.
        scale = ((groups.amax(dim=-1, keepdim=True) - low) / 15).clamp(min=1e-12).to(torch.bfloat16).float()
        zero = (low + 8 * scale).to(torch.bfloat16).float()
        codes = torch.round((groups - zero) / scale + 8).clamp(0, 15).to(torch.uint8).view(N, K)
        self.kernels = kernels_for(w)
        if self.kernels != "torch":
            self.register_buffer("packed", pack_int4(codes))
            self.register_buffer("scales_and_zeros", per_group(scale.view(N, -1), zero.view(N, -1)))
        else:
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1))
            scales_and_zeros = torch.stack([scale.view(N, -1), zero.view(N, -1)], dim=-1)  # [N, groups, 2]
            self.register_buffer("scales_and_zeros", scales_and_zeros.transpose(0, 1).contiguous().to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        self.in_features, self.out_features = K, N

    @staticmethod
    def fits(weight: Tensor) -> bool:
        N, K = weight.shape
        return K % INT4_GROUP == 0 and N % INT4_ROWS_MULTIPLE == 0

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """The weights as the kernel sees them, rounded to bf16 (for tests and inspection)."""
        identity = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
        return self.matmul(identity).t().to(dtype)

    def matmul(self, x: Tensor) -> Tensor:
        if self.kernels != "torch":
            return native_extension().int4_matmul(x, self.packed, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_and_zeros)



def draft_linear_kind() -> type["QuantizedLinear"]:
    """The format of a served drafter's linears (quantize_draft_linears) and of its head's rows:
    int8, or int4 where our kernels run on AVX2 alone. Why: without VNNI an int8 weight is split
    into two nibbles for vpmaddubsw, so a row of int8 costs twice the multiplies of a row of int4;
    a proposal (8 rows through each layer, 7 through the head) is compute-bound there, and took
    4.1 ms against a 5.8 ms int4 decode step (AMD EPYC Zen 2, 2 threads; bench/propose.py), while
    int4 layers and head kept the same drafts' acceptance (bench/unseen_acceptance.py, trees of 7:
    mean τ 3.12 int8, 3.13 int4). With VNNI an int8 quad is one vpdpbusd as an int4 one is (which
    is unpacked first): int8 stays there. Read on every call, so DFLASH_INT8DOT_ISA=avx2 picks int4
    on any CPU (the tests)."""
    native = native_extension()
    if kernels() == "int8-dot" and native.int8dot_isa(8, False) == "avx2":
        return Int4Linear
    return Int8Linear


def quantize_draft_linears(draft: nn.Module) -> None:
    """Every linear of a DFlash drafter (drafters/dflash.py) to int8 (int4 where draft_linear_kind
    says so), in place: for a target served in int8 or int4, and for one in bf16 where our int8
    kernels run. A proposal runs 8 rows through
    each draft layer, where torch's bf16 matmuls cost ~200 us a call on an AVX512-BF16 CPU without
    AMX (Zen 4; a throwaway profile), and with bf16 weights on an AMX VM a proposal read ~40 MB of
    bf16 weights: 6.7 ms against 1.7 with int8 layers and head (a 35 ms decode step there). The
    int8-dot kernels read half the bytes and the layers run as one C++ call (`bench/propose.py`
    times the proposal both ways). Proposals stay proposals: the target verifies every token, so
    this changes what is accepted, never what is output."""
    kind = draft_linear_kind()
    for module in list(draft.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                fits = kind is Int8Linear or Int4Linear.fits(child.weight)
                setattr(module, name, (kind if fits else Int8Linear)(child.weight, child.bias))


def quantize_linears(model: nn.Module, weights: str) -> None:
    """Replace every decoder linear and the LM head of `model` (a model.Transformer) in place.
    A tied LM head gets its own quantized copy; the embedding table stays in the model's dtype.

    "int4" keeps the LM head in int8: measured on the embedded model (whose GGUF stores the tied
    embedding as Q8_0), an int4 head cost +5.8% perplexity, an int8 one +0.x% (README, Numbers)."""
    if weights not in ("int8", "int4"):
        return
    model.lm_head = Int8Linear(model.lm_head.weight, model.lm_head.bias)
    targets = []
    for layer in model.layers:
        targets += [(layer.attention, "wqkv"), (layer.attention, "wo"),
                    (layer.feed_forward, "w13"), (layer.feed_forward, "w2")]
    for owner, name in targets:
        linear = getattr(owner, name)
        kind = Int4Linear if weights == "int4" and Int4Linear.fits(linear.weight) else Int8Linear
        setattr(owner, name, kind(linear.weight, linear.bias))
