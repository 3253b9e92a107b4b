"""Weight formats: weight-only int8 (one scale per output channel) and int4 (asymmetric, groups of 32
along the input), quantized at load time for every linear of our decoder and its LM head.

Decoding reads every weight once per token, so on these CPUs a decode step is bound by weight bytes
(README, Numbers): bf16 reads 270 MB per token of the embedded model, int8 half, int4 a quarter.
Both kernels are torch's own (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`): bf16
activations only (with fp32 ones they run scalar loops), and each output row is computed the same
way whatever the number of rows (tested in tests/model/test_weight_formats.py), so a verified row
gets exactly the logits a decoded row gets and greedy speculation stays lossless.

Prefill chunks (many rows) instead dequantize the weights to the CPU's fast GEMM dtype and use
one ordinary matmul: the weight-only kernels have no AMX/VNNI path and cost 10x more there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.engine.cpu import cpu_kind

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


def fast_bf16_gemm() -> bool:
    """Whether many-row bf16 matmuls run on bf16 hardware (AMX or AVX512-BF16); elsewhere oneDNN
    does them a row at a time and fp32 on upcast weights is 5x faster (measured on AVX2)."""
    return cpu_kind() in ("AMX", "AVX512-BF16")


def many_row_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a many-row (prefill) matmul of `dtype` activations runs in on this CPU."""
    if dtype in (torch.bfloat16, torch.float16) and not fast_bf16_gemm():
        return torch.float32
    return dtype


# Decode (1 row) and verification (up to 16 rows) use the weight-only kernel; from this many rows
# on (prefill chunks) one GEMM on dequantized weights is faster. Same threshold as model.Linear.
MANY_ROWS = 17


class QuantizedLinear(nn.Module):
    in_features: int
    out_features: int
    bias: Tensor | None

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        raise NotImplementedError

    def matmul_few_rows(self, x: Tensor) -> Tensor:  # x [M, K] bf16
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] >= MANY_ROWS:
            dtype = many_row_dtype(x.dtype)
            bias = None if self.bias is None else self.bias.to(dtype)
            out = F.linear(flat.to(dtype), self.dequantized(dtype), bias).to(x.dtype)
        else:
            out = self.matmul_few_rows(flat.to(torch.bfloat16)).to(x.dtype)
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
        self.register_buffer("qweight", torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8))  # [N, K]
        self.register_buffer("scales", scales)  # [N]
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]

    def matmul_few_rows(self, x: Tensor) -> Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)



class Int4Linear(QuantizedLinear):
    """w = q * scale + offset per group of INT4_GROUP inputs, q in 0..15 (GGUF's Q4_1 form).

    Two copies of the codes: torch's packed layout for the decode kernel, and plain nibble pairs that
    prefill unpacks with two bit operations (the packed layout is blocked and undocumented).
    """

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
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1))
        self.register_buffer("nibbles", codes[:, 0::2] | (codes[:, 1::2] << 4))  # [N, K/2]
        scales_and_zeros = torch.stack([scale.view(N, -1), zero.view(N, -1)], dim=-1)  # [N, groups, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.transpose(0, 1).contiguous().to(torch.bfloat16))
        # For prefill's dequantization: w = q * scale + offset, offset = zero - 8 * scale.
        self.register_buffer("scale_offset", torch.stack([scale.view(N, -1), (zero - 8 * scale).view(N, -1)], dim=-1))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        self.in_features, self.out_features = K, N

    @staticmethod
    def fits(weight: Tensor) -> bool:
        N, K = weight.shape
        return K % INT4_GROUP == 0 and N % INT4_ROWS_MULTIPLE == 0

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        # Prefill pays this once per chunk and layer: for the embedded model's 256-row chunks about
        # as much as the matmuls (broadcasting the group scales is the slow part). Not bit-equal to
        # the kernel's own dequantization (offset rounded once); prefill rows need not equal decode rows.
        N, K = self.out_features, self.in_features
        codes = torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1)  # [N, K/2, 2]: codes in order
        codes = codes.view(N, K // INT4_GROUP, INT4_GROUP).to(dtype)
        scale, offset = self.scale_offset.to(dtype).unbind(-1)  # [N, groups] each
        return (codes * scale.unsqueeze(-1) + offset.unsqueeze(-1)).view(N, K)

    def matmul_few_rows(self, x: Tensor) -> Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_and_zeros)



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
