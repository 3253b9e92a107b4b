"""Weight formats: weight-only int8 (one scale per output channel) and int4 (asymmetric, groups of 32
along the input), quantized at load time for every linear of our decoder and its LM head.

Decoding reads every weight once per token, so on these CPUs a decode step is bound by weight bytes
(README, Numbers): bf16 reads 270 MB per token of the embedded model, int8 about half, int4 (its
LM head stays int8) about a third.
Both kernels are torch's own (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`): bf16
activations only (with fp32 ones they run scalar loops), and each output row is computed the same
way whatever the number of rows (tested in tests/model/test_weight_formats.py). Every row — decode,
verification and prefill — goes through them, so a verified row gets exactly the logits a decoded
row gets (greedy speculation stays lossless) and a prompt's keys do not depend on how it was
chunked (a prefix-cache hit equals a recomputation). Prefill pays for it: these kernels have no
AMX/VNNI path (one layer of the embedded model over 256 rows: ~33 ms int4, ~18 ms bf16 in 16-row
blocks, 1 thread on AMX).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

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
        self.register_buffer("qweight", torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8))  # [N, K]
        self.register_buffer("scales", scales)  # [N]
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]

    def matmul(self, x: Tensor) -> Tensor:
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
