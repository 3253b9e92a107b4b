"""A llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3) with a static KV cache.

In the spirit of gpt-fast: one plain module, tensors with their shapes in comments, no framework.
Differences between the architectures are a handful of flags on `ModelArgs`:
qkv bias (Qwen2), q/k RMSNorm (Qwen3), RoPE scaling (llama3, yarn), tied embeddings.

Shapes: B = 1 (one sequence), T = new tokens, L = committed length, H = query heads,
KV = key/value heads, D = head dim, C = hidden size.
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.engine.kv import Int8KVCache, KVCache
from dflash.engine.native import extension as native_extension
from dflash.engine.native import extension as native_kernels  # the kernels; native_extension: the decode loop
from dflash.engine.native import INT4_DOT, INT8_DOT
from dflash.engine.native import layer_arguments as native_layer_arguments
from dflash.engine.cpu import cpu_kind

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@attrs.frozen
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "ModelArgs":
        architectures = config.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise UnsupportedArchitecture(architectures or [config.get("model_type")])
        family = SUPPORTED_ARCHITECTURES[architecture]
        num_heads = config["num_attention_heads"]
        # transformers 5 folds rope_theta and rope_scaling into one rope_parameters dict.
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", None) or config.get("rope_theta", 10000.0)
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        return cls(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope or None,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama-style configs say so with attention_bias.
            attention_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=family == "qwen3",
        )


class UnsupportedArchitecture(ValueError):
    def __init__(self, names: Sequence[Any]):
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        super().__init__(
            f"unsupported model architecture {list(names)!r}; the built-in decoder supports {supported}"
        )


ROPE_SCALING_MODES = ("auto", "none", "yarn", "linear")


def with_rope_scaling(args: ModelArgs, max_ctx: int, mode: str = "auto", factor: float = 0.0,
                      attention_factor: float = 0.0, static: bool = False) -> ModelArgs:
    """`args` with the RoPE scaling that serves `max_ctx` positions.

    "auto" keeps a scaling the model's config declares (it was trained or tuned with it) and
    otherwise takes YaRN once `max_ctx` exceeds the trained context (see README, Numbers: perplexity
    past the trained context); "none" is plain RoPE, extrapolated past the trained context; "yarn"
    and "linear" replace whatever the config declares. `factor` 0 means max_ctx / trained context.
    `attention_factor` > 0 replaces the served YaRN's attention temperature (0: its own, 0.1
    ln(factor) + 1), a declared one's too; where no YaRN is served it changes nothing.

    A scaling chosen here (not one the config declares) applies only from the first position past
    the trained context unless `static`: a sequence within it runs on plain RoPE, the model as
    trained, and switches when it first passes it (`rope_switch`). Static YaRN changes the model at
    every position (its temperature and low frequencies apply throughout): on the embedded model
    perplexity at 0-8K went 5.36 -> 6.10 and needles at 4K 3/3 -> 1/3 (README, Numbers: long
    context), and the DFlash drafter, trained on the unscaled target, accepted less (README: "The
    drafter under the default set-up's YaRN").
    """
    if mode not in ROPE_SCALING_MODES:
        raise ValueError(f"unknown rope_scaling {mode!r}; expected one of {', '.join(ROPE_SCALING_MODES)}")
    if attention_factor < 0:
        raise ValueError(f"rope attention_factor must be 0 (YaRN's own) or positive, got {attention_factor!r}")
    if attention_factor and mode in ("none", "linear"):
        raise ValueError(f"a rope attention_factor ({attention_factor!r}) applies to YaRN only, not to rope_scaling {mode!r}")
    declared = args.rope_scaling or {}
    if mode == "auto":
        if declared and attention_factor and (declared.get("rope_type") or declared.get("type")) == "yarn":
            return attrs.evolve(args, rope_scaling={**declared, "attention_factor": float(attention_factor)})
        if declared or max_ctx <= args.max_position_embeddings:
            return args
        mode = "yarn"
    if mode == "none":
        return attrs.evolve(args, rope_scaling=None)
    trained = declared.get("original_max_position_embeddings") or args.max_position_embeddings
    factor = factor or max(1.0, max_ctx / trained)
    scaling: dict[str, Any] = {"rope_type": mode, "factor": float(factor)}
    if mode == "yarn":
        scaling["original_max_position_embeddings"] = trained
        if attention_factor:
            scaling["attention_factor"] = float(attention_factor)
    if not static and factor > 1:
        scaling["plain_within"] = int(trained)
    return attrs.evolve(args, rope_scaling=scaling)


def rope_switch(args: ModelArgs) -> int | None:
    """The first position whose sequence runs on the scaled RoPE, where the scaling switches in
    (with_rope_scaling's `static`); None where it applies from position 0 or there is none."""
    return (args.rope_scaling or {}).get("plain_within")


def kv_dtype_for(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Keys and values stay in the model's dtype, except a half-precision model on a CPU where neither
    bf16 hardware nor our attention kernel reads a bf16 cache fast: there they are fp32 (torch's bf16
    attention on AVX2 measured 4x slower than its fp32 one).

    Where they are bf16: half the memory (a 32K context of the embedded model: 0.75 GB instead of
    1.5; prefix snapshots alike), prefill at 8K of context 1.7x faster with AMX, decode at 16K 1.1x
    faster with ours on AVX2 than on an fp32 one (bench/attention.py). Rows stay invariant (see attention_kernels), so a
    prefix-cache hit continues exactly as a recomputation (tests/model/test_weight_formats.py,
    test_long_context.py)."""
    if (device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and not has_bf16_hardware()
            and attention_kernels() != "ours"):
        return torch.float32
    return dtype


def torch_attention_rows_invariant() -> bool:
    """Whether torch's flash attention kernel over a half-precision cache computes a row the same
    way whatever the other rows of its call. Measured so on AMX CPUs; not on AVX512-BF16 without AMX
    (AMD Zen 4: a row of 8 differs from the same row alone at 288 or 1024 keys) nor on AVX2;
    bench/row_invariance.py checks a CPU."""
    return cpu_kind() == "AMX"


def attention_kernels() -> str:
    """Which causal attention the CPU runs: "ours" (native/causal_attention.cpp, row-invariant by
    construction) wherever the native extension is built and the CPU has AVX2 + FMA, else "torch"
    (its flash kernel, over key counts padded to KEY_BUCKET; row-invariant only on AMX).

    Ours on AMX too: with it the decode loop runs without ATen calls on the step pool's spinning
    threads. On a Sapphire Rapids-class AMX VM (2 cores, int4) a decode step took 4.0 ms against 11.5 with
    torch's, decode at 16K of context 28.5 ms against 61.4, and prefill was no slower (bench/step.py,
    bench/decode.py). `DFLASH_ATTENTION=ours|torch` forces one (tests and benches run both)."""
    forced = os.environ.get("DFLASH_ATTENTION")
    native = native_kernels()
    available = native is not None and native.causal_attention_available()
    return "ours" if available and forced != "torch" else "torch"


# decode_layers' key/value scales where the cache is not an Int8KVCache.
NO_SCALES = torch.empty(0)


def widen_to_fp32(x: Tensor) -> Tensor:
    """x as fp32: bf16 rows on logits.cpp's one thread where built (torch's copy of a 49152-wide
    row woke OpenMP's threads on 2 cores: 50-65 us against a few), else torch's."""
    native = native_kernels()
    if native is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and not x.requires_grad:
        return native.widen_to_fp32(x)
    return x.float()


def silu_description(dtype: torch.dtype) -> str:
    """Whose SiLU product a model of `dtype` runs (FeedForward, the decode loops): "ours-lanes-r1"
    for bf16 rows where the extension is built, else "torch". They give other bits, so a disk
    snapshot names which."""
    native = native_kernels()
    return f"ours-{native.silu_product_kind()}" if native is not None and dtype == torch.bfloat16 else "torch"


def attention_description(kv_dtype: torch.dtype) -> str:
    """attention_kernels(), with how ours multiplies over a bf16 cache and the revision of its
    sequence of operations: "ours-amx-bf16-r3" (AMX tiles where the CPU has them),
    "ours-avx512-bf16-r3" (bf16 dot products where it has those; DFLASH_ATTENTION_ISA=avx512-bf16),
    "ours-avx2-r3" (fp32 fmas; DFLASH_ATTENTION_ISA=avx2), "ours-r3" over an fp32 cache. They give
    other bits, so a disk snapshot names which. Revision 2: bf16 dot products for the scores;
    revision 3: another exp (causal_attention.cpp, exp_nonpositive), on every path."""
    if kv_dtype == torch.int8:
        return f"ours-int8-vnni-r{native_kernels().int8_kv_revision()}"
    kernels = attention_kernels()
    if kernels != "ours":
        return kernels
    revision = native_kernels().causal_attention_revision()
    if kv_dtype == torch.bfloat16:
        return f"ours-{native_kernels().causal_attention_isa()}-r{revision}"
    return f"ours-r{revision}"


def attention_rows_invariant(dtype: torch.dtype) -> bool:
    """Whether a row's attention is computed the same way whatever the other rows of its call (what
    lossless speculation needs) for a model in `dtype` on this CPU: always with our kernel, with
    torch's only where it is (AMX) and over a half-precision cache."""
    return attention_kernels() == "ours" or (torch_attention_rows_invariant()
                                             and dtype in (torch.bfloat16, torch.float16))


def half_linear_rows_invariant() -> bool:
    """Whether a half-precision Linear (below) of up to FEW_ROWS rows computes a row the same way
    whatever the other rows of its call. With AMX oneDNN's kernels do (measured); without bf16
    hardware the GEMM runs one GEMV per row. On AVX512-BF16 without AMX (AMD Zen 4) they do not:
    a 1536-input matmul differs from 1-row calls from 3-8 rows on, depending on the data and the
    thread count (bench/row_invariance.py), so there bf16 weights cannot verify a draft losslessly
    (int8 and int4, on our kernels, can)."""
    return cpu_kind() == "AMX" or not has_bf16_hardware()


def rope_inverse_frequencies(args: ModelArgs) -> tuple[Tensor, float]:
    """Inverse frequencies [D/2] and the attention scaling factor (yarn's mscale, else 1)."""
    dim = args.head_dim
    base = args.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float(), 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling.get("low_freq_factor", 1.0)
        high_freq_factor = scaling.get("high_freq_factor", 4.0)
        old_context = scaling.get("original_max_position_embeddings", 8192)
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled).float(), 1.0
    if kind == "yarn":
        return _yarn_inverse_frequencies(inv_freq, dim, base, scaling, args.max_position_embeddings)
    if kind != "default":
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3, yarn")
    return inv_freq.float(), 1.0


def _yarn_inverse_frequencies(
    inv_freq: Tensor, dim: int, base: float, scaling: dict[str, Any], max_positions: int
) -> tuple[Tensor, float]:
    factor = scaling["factor"]
    old_context = scaling.get("original_max_position_embeddings") or max_positions
    beta_fast = scaling.get("beta_fast", 32)
    beta_slow = scaling.get("beta_slow", 1)
    mscale = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    interpolated = inv_freq / factor
    blended = interpolated * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return blended.float(), float(mscale)


# Row invariance: the result for a row must not depend on the other rows of its call. Then a verified
# draft row gets exactly the logits plain decoding gives (greedy speculation reproduces plain greedy
# decoding token for token), and prefill rows equal decode rows whatever the chunking (a prompt
# restored from a prefix cache and continued equals one computed from scratch). On AMX CPUs the
# half-precision kernel computes a row the same way in any call of up to FEW_ROWS rows (measured);
# above that oneDNN switches to AMX kernels whose rows depend on the row count (17, 20, 32, 100...
# measured). Other CPUs: half_linear_rows_invariant.
FEW_ROWS = 16


def has_bf16_hardware() -> bool:
    return cpu_kind() in ("AMX", "AVX512-BF16")


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1]
        if (rows <= FEW_ROWS or x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16)
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            # Where gradients flow (drafter training) no row needs the bits of a decode row: one GEMM.
            return F.linear(x, self.weight, self.bias)
        if not half_linear_rows_invariant():  # AVX512-BF16 without AMX
            # No row count is invariant here anyway: one call (on Zen 4 1.4-3.5x faster than 16-row
            # blocks, bench/row_invariance.py).
            return F.linear(x, self.weight, self.bias)
        if has_bf16_hardware():
            # Prefill in blocks of FEW_ROWS rows: row-invariant, and on AMX still 1.5-2x faster than
            # fp32 (one 256-row layer: 18 ms vs 27 ms, 1 thread).
            flat = x.reshape(-1, x.shape[-1])
            out = torch.cat([F.linear(block, self.weight, self.bias) for block in flat.split(FEW_ROWS)])
            return out.view(*x.shape[:-1], self.out_features)
        # Without bf16 hardware a half-precision GEMM degrades to one GEMV per row (measured on AVX2:
        # 256 rows 124 ms vs 24 ms as fp32 on upcast weights), so prefill upcasts and its rows are
        # close to, not equal to, decode rows there.
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # The native decode loop's kernel wherever it runs, so prefill rows (here) equal decode rows
        # (there); torch's where gradients flow (drafter training) or without the extension.
        native = native_kernels()
        if (native is not None and x.device.type == "cpu" and x.dtype == self.weight.dtype
                and x.dtype in (torch.float32, torch.bfloat16)
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return native.rms_norm(x, self.weight, self.eps)
        # Normalize in fp32 like the reference implementations, so bf16 matches transformers.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_tables(inv_freq: Tensor, max_ctx: int, scale: float, dtype: torch.dtype, device) -> tuple[Tensor, Tensor]:
    """cos [max_ctx, D] and a sign-folded sin [max_ctx, D], computed once in fp32, then cast.

    HF's rotate_half(x) * sin equals roll(x, D/2) * [-sin, sin], so RoPE costs a roll, two muls
    and an add per call with the same roundings as the reference (negation is exact).
    """
    positions = torch.arange(max_ctx, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq.to(device))
    cos = (torch.cat((freqs, freqs), dim=-1).cos() * scale).to(dtype)
    sin = (freqs.sin() * scale).to(dtype)
    return cos, torch.cat((-sin, sin), dim=-1)


def plain_and_scaled_frequencies(args: ModelArgs) -> tuple[Tensor, Tensor, float]:
    """Plain RoPE's inverse frequencies, the scaled RoPE's, and the scaled one's attention factor."""
    plain, _ = rope_inverse_frequencies(attrs.evolve(args, rope_scaling=None))
    return plain, *rope_inverse_frequencies(args)


def switched_rope_tables(args: ModelArgs, max_ctx: int, dtype: torch.dtype, device) -> tuple[Tensor, Tensor]:
    """The tables a model whose scaling switches in at `rope_switch(args)` serves with: plain RoPE
    below that position, the scaled one from it on (rope_rotation_tables: the keys below, once past it)."""
    switch = rope_switch(args)
    plain, scaled, scale = plain_and_scaled_frequencies(args)
    plain_cos, plain_sin = rope_tables(plain, min(switch, max_ctx), 1.0, dtype, device)
    scaled_cos, scaled_sin = rope_tables(scaled, max_ctx, scale, dtype, device)
    return torch.cat((plain_cos, scaled_cos[switch:])), torch.cat((plain_sin, scaled_sin[switch:]))


def rope_rotation_tables(args: ModelArgs, device) -> tuple[Tensor, Tensor]:
    """cos and signed sin [switch, D] (fp32) that turn a key rotated by plain RoPE at its position
    into the key the scaled RoPE gives there: rotations in the same planes add up, so the difference
    of the two angles, times the scaled RoPE's attention factor (plain RoPE's is 1)."""
    switch = rope_switch(args)
    plain, scaled, scale = plain_and_scaled_frequencies(args)
    positions = torch.arange(switch, dtype=torch.float32, device=device)
    # Each angle as rope_tables computes it (fp32 products), their difference taken in fp64.
    angles = torch.outer(positions, scaled.to(device)).double() - torch.outer(positions, plain.to(device)).double()
    cos = (torch.cat((angles, angles), dim=-1).cos() * scale).float()
    sin = (angles.sin() * scale).float()
    return cos, torch.cat((-sin, sin), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x [T, heads, D]; cos/signed_sin [T, 1, D] in x's dtype."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        q_size = args.num_heads * args.head_dim
        kv_size = args.num_kv_heads * args.head_dim
        # One matmul for q, k and v: fewer kernel launches per decode step.
        self.wqkv = Linear(args.hidden_size, q_size + 2 * kv_size, bias=args.attention_bias)
        self.wo = Linear(q_size, args.hidden_size, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None

    def forward(
        self,
        x: Tensor,  # [T, C]
        cos: Tensor,  # [T, 1, D]
        sin: Tensor,
        kv: KVCache,
        layer: int,
        start: int,
        mask: Tensor | None,  # [T, start+T] bool (True = may attend) or None for causal
        row_groups: list["RowGroup"] | None = None,  # the attention calls without an explicit mask
        tree: "TreeRows | None" = None,  # a draft tree's rows (cos/sin by depth), instead of causal rows
    ) -> Tensor:
        T = x.shape[0]
        H, KV = self.num_heads, self.num_kv_heads
        qkv = self.wqkv(x).view(T, H + 2 * KV, self.head_dim)
        if self.q_norm is not None:
            q = apply_rope(self.q_norm(qkv[:, :H]), cos, sin)
            k = apply_rope(self.k_norm(qkv[:, H : H + KV]), cos, sin)
        else:  # q and k rotated in one go
            qk = apply_rope(qkv[:, : H + KV], cos, sin)
            q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, H + KV :]
        if tree is not None:  # each chain on its path's keys, as decode_layers.cpp does (tree_chains)
            tree.keys[layer], tree.values[layer] = k, v
            q = q.to(kv.attention_dtype(q.dtype))
            parts = []
            for chain in tree.chains:
                path = torch.tensor(chain.path, device=x.device)
                kv.write(layer, start, k[path], v[path])
                parts.append((chain.first, self._causal(q[chain.first : chain.end], kv, layer, start + chain.depth, None)))
            out = torch.cat([part for _, part in sorted(parts, key=lambda item: item[0])])
            return self.wo(out.reshape(T, H * self.head_dim).to(x.dtype))
        kv.write(layer, start, k, v)
        q = q.to(kv.attention_dtype(q.dtype))
        if mask is not None:  # an explicit mask (tests)
            keys, values = kv.readable(layer, start + T)  # [KV, start+T, D]
            out = grouped_query_attention(q.to(keys.dtype), keys, values, mask)  # [T, H, D]
        else:
            out = self._causal(q, kv, layer, start, row_groups)
        return self.wo(out.reshape(T, H * self.head_dim).to(x.dtype))

    def _causal(self, q: Tensor, kv: KVCache, layer: int, start: int, row_groups: list["RowGroup"] | None) -> Tensor:
        """Causal attention of q [T, H, D] at positions start.. over the layer's cache: [T, H, D]."""
        if kv.quantized:
            return kv.attend(q, layer, start)
        if attention_kernels() == "ours" and q.device.type == "cpu":
            return native_kernels().causal_attention(q, kv.keys[layer], kv.values[layer], start)
        if row_groups is None:  # a caller running layers itself, or a tree's chain
            row_groups = attention_row_groups(start, q.shape[0], kv.max_ctx, self.num_heads // self.num_kv_heads,
                                              kv.keys.dtype, q.device)
        return torch.cat([
            grouped_query_attention(q[group.rows], kv.keys[layer, :, : group.keys], kv.values[layer, :, : group.keys],
                                    group.mask)
            for group in row_groups
        ])


# Every row attends over keys padded to a multiple of this, masked past its own position. The CPU
# attention kernel computes a row the same way whatever other rows a call holds, but not whatever
# the number of keys (its blocked softmax sums differ), so a row must see a key count that depends
# only on its position: then verified rows equal decode rows, and prefill rows equal them too
# whatever the chunking. Decode reads up to 31 masked keys more; a verification block whose rows
# straddle a multiple of it is two calls, a prefill chunk one call per multiple it spans.
KEY_BUCKET = 32

# Keys per partial of our attention kernels (causal_attention.cpp's kChunk): a draft tree's chains
# share the chunks wholly below the tree, and each reads the chunk the tree starts in on its own.
KEY_CHUNK = 256


@attrs.frozen
class RowGroup:
    rows: slice  # of the T new tokens
    keys: int  # padded key count, the same for every row here
    mask: Tensor  # [G * rows, keys] additive float mask, row g*rows + t is token t of head group g


@attrs.frozen
class TreeChain:
    first: int  # rows first..end-1 of the tree, each the child of the one before
    end: int
    depth: int  # of row `first`; row t of the chain sits at position start + depth + (t - first)
    path: tuple[int, ...]  # the rows whose keys go to positions start, start + 1, ...: ancestors, then the chain


def tree_chains(parents: Sequence[int]) -> list[TreeChain]:
    """A draft tree's rows (depth-first: row 0 the pending token, parents[t] the row before t on its
    path, -1 for row 0) as chains, in the order they are attended: the last first, so chain 0 (the
    drafter's first choices, most often accepted) is what the cache holds after. Each chain is
    attended as causal rows over its path's keys, so every row gets the bits a decode step of its
    path would (decode_layers.cpp's tree_chains does the same)."""
    if not parents or parents[0] != -1:
        raise ValueError(f"a draft tree's row 0 has no parent (-1), got parents {list(parents)}")
    for t, parent in enumerate(parents[1:], 1):
        if not 0 <= parent < t:
            raise ValueError(f"row {t}'s parent {parent} is not a row before it")
    depth = tree_depths(parents)
    chains: list[list] = []
    for t, parent in enumerate(parents):
        if t > 0 and parent == t - 1:
            chains[-1][1] = t + 1
            chains[-1][3].append(t)
            continue
        path = []
        a = parent if t > 0 else -1
        while a >= 0:
            path.append(a)
            a = parents[a]
        chains.append([t, t + 1, depth[t], path[::-1] + [t]])
    return [TreeChain(first, end, d, tuple(path)) for first, end, d, path in reversed(chains)]


@attrs.define
class TreeRows:
    """A draft tree's verification (Transformer.forward's `tree`): its rows' parents and chains, and
    every row's key and value per layer [layers, T, KV, D] (the accepted path's go to the cache after)."""
    parents: list[int]
    chains: list[TreeChain]
    keys: Tensor
    values: Tensor

    @classmethod
    def of(cls, parents: Sequence[int], args: "ModelArgs", dtype: torch.dtype, device) -> "TreeRows":
        shape = (args.num_layers, len(parents), args.num_kv_heads, args.head_dim)
        return cls(list(parents), tree_chains(parents), torch.empty(shape, dtype=dtype, device=device),
                   torch.empty(shape, dtype=dtype, device=device))


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each row's depth below the pending token (row 0) of a draft tree's parents (tree_chains)."""
    depth = [0] * len(parents)
    for t in range(1, len(parents)):
        depth[t] = depth[parents[t]] + 1
    return depth


def attention_row_groups(start: int, new_tokens: int, max_ctx: int, groups: int, dtype: torch.dtype, device) -> list[RowGroup]:
    """The attention calls of new tokens at start.. (see KEY_BUCKET)."""
    padded = [min(-(-(start + t + 1) // KEY_BUCKET) * KEY_BUCKET, max_ctx) for t in range(new_tokens)]
    out: list[RowGroup] = []
    first = 0
    for t in range(1, new_tokens + 1):
        if t == new_tokens or padded[t] != padded[first]:
            keys = padded[first]
            positions = torch.arange(start + first, start + t, device=device).unsqueeze(1)
            visible = torch.arange(keys, device=device).unsqueeze(0) <= positions  # [rows, keys]
            mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            out.append(RowGroup(slice(first, t), keys, mask.repeat(groups, 1)))
            first = t
    return out


def grouped_query_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """q [T, H, D], keys/values [KV, L, D], mask [T, L] (or already repeated, [G*T, L]) or None -> [T, H, D].

    The G = H / KV query heads that share a key/value head are laid out as G*T query rows of that
    head, so SDPA runs on KV heads with no copy of the keys; measured 4x faster on CPU than
    `enable_gqa=True` (which falls back to the math kernel) or expanding the keys.
    """
    T, H, D = q.shape
    KV = keys.shape[0]
    G = H // KV
    rows = q.view(T, KV, G, D).permute(1, 2, 0, 3).reshape(KV, G * T, D)
    if mask is not None and mask.shape[0] != G * T:
        mask = mask.repeat(G, 1)  # row g*T + t is query t of head g
    # 4-D inputs: the CPU flash kernel only takes [batch, heads, rows, D]; 3-D ones fall back to math.
    out = F.scaled_dot_product_attention(rows[None], keys[None], values[None], attn_mask=mask)
    return out[0].view(KV, G, T, D).permute(2, 0, 1, 3)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.intermediate_size = args.intermediate_size
        # gate and up projections fused into one matmul.
        self.w13 = Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.w2 = Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.w13(x)
        # bf16 rows: the native decode loop's SiLU product wherever it runs, so prefill rows (here)
        # equal decode rows (there), as RMSNorm; torch's where gradients flow or without the extension.
        native = native_kernels()
        if (native is not None and gate_up.device.type == "cpu" and gate_up.dtype == torch.bfloat16
                and not (torch.is_grad_enabled() and gate_up.requires_grad)):
            return self.w2(native.silu_product(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.w2(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, kv, layer, start, mask, row_groups=None, tree=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, kv, layer, start, mask, row_groups, tree)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        inv_freq, self.rope_attention_scale = rope_inverse_frequencies(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._rope_cache: tuple[Tensor, Tensor] | None = None
        self.rope_switch = rope_switch(args)
        self._served_rope_cache: tuple[Tensor, Tensor] | None = None
        self._rotation: tuple[Tensor, Tensor] | None = None
        self._native_arguments: dict | None = None
        self.kv_cache = "auto"  # or "int8" (loading.load_model's kv_cache)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_kv_cache(self, max_ctx: int, dtype: torch.dtype | None = None) -> KVCache:
        """A cache of `max_ctx` positions in `dtype` (default: `kv_dtype`, the one chosen for this CPU;
        torch.int8: an Int8KVCache)."""
        a = self.args
        dtype = dtype or self.kv_dtype
        if dtype == torch.int8:
            return Int8KVCache(a.num_layers, a.num_kv_heads, max_ctx, a.head_dim, self.device, native_kernels(),
                               rope_switch=self.rope_switch)
        return KVCache(a.num_layers, a.num_kv_heads, max_ctx, a.head_dim, dtype, self.device, self.dtype,
                       rope_switch=self.rope_switch)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The serving cache's dtype: torch.int8 where `kv_cache` is "int8" (set by loading), else kv_dtype_for."""
        return torch.int8 if self.kv_cache == "int8" else kv_dtype_for(self.dtype, self.device)

    def _native_layer_arguments(self) -> dict:
        # Built on first use: quantize_linears replaces the linears after construction.
        if self._native_arguments is None:
            self._native_arguments = native_layer_arguments(self)
        return self._native_arguments

    def attends_trees_in_one_call(self, kv: KVCache) -> bool:
        """Whether a draft tree's chains are attended in one native call that reads the chunks of
        keys below the tree once for them all (causal_attention.cpp, attend_tree), rather than one
        causal call a chain over the whole cache (Attention.forward's tree path)."""
        return (native_extension() is not None and self.device.type == "cpu"
                and (attention_kernels() == "ours" or kv.quantized))

    def _linears_rows_invariant(self) -> bool:
        """Whether every decoder linear runs on our int8/int4 kernels, which compute a row the same
        way whatever the rows beside it (quantized_linear.cpp)."""
        return all(kind in (INT8_DOT, INT4_DOT) for kind in self._native_layer_arguments()["kinds"])

    def _rope_tables(self, max_ctx: int) -> tuple[Tensor, Tensor]:
        """The scaled RoPE's tables at every position (speculative prefill's scorer scores with them)."""
        if self._rope_cache is None or self._rope_cache[0].shape[0] < max_ctx:
            cos, sin = rope_tables(self.inv_freq, max_ctx, self.rope_attention_scale, self.dtype, self.device)
            self._rope_cache = (cos.unsqueeze(1), sin.unsqueeze(1))  # [max_ctx, 1, D]
        return self._rope_cache

    def _served_rope_tables(self, max_ctx: int) -> tuple[Tensor, Tensor]:
        """The tables forward rotates queries and keys with: plain below the switch, if there is one."""
        if self.rope_switch is None:
            return self._rope_tables(max_ctx)
        if self._served_rope_cache is None or self._served_rope_cache[0].shape[0] < max_ctx:
            cos, sin = switched_rope_tables(self.args, max_ctx, self.dtype, self.device)
            self._served_rope_cache = (cos.unsqueeze(1), sin.unsqueeze(1))
        return self._served_rope_cache

    def _switch_rope(self, kv: KVCache) -> None:
        """Before the first position past the switch: the keys below it, rotated by plain RoPE, are
        rotated on to the scaled RoPE's angles, so the scaled queries from here on see every key at
        its true distance. Their values, and the keys' content, stay those of the model as trained."""
        if self._rotation is None:
            self._rotation = rope_rotation_tables(self.args, self.device)
        kv.rotate_keys(lambda keys: apply_rope(keys, *self._rotation))

    def _forward_across_switch(self, tokens: Tensor, start_position: int, kv: KVCache, capture_layers: Sequence[int],
                               logits_positions, capture_into: Tensor | None) -> tuple[Tensor, list[Tensor]]:
        """A call whose tokens straddle the switch, as two: the rows below it are computed as they
        would be alone (so the result does not depend on where calls begin and end), then the keys
        are rotated, then the rest."""
        T, head = tokens.shape[0], self.rope_switch - start_position
        wanted = list(range(T)[logits_positions]) if isinstance(logits_positions, slice) else (
            list(range(T)) if logits_positions is None else [p % T for p in logits_positions])
        logits, captured = [], []
        for begin, end in ((0, head), (head, T)):
            rows = [p - begin for p in wanted if begin <= p < end]
            part_logits, part_captured = self.forward(
                tokens[begin:end], start_position + begin, kv, capture_layers=capture_layers, logits_positions=rows,
                capture_into=None if capture_into is None else capture_into[begin:end])
            logits.append(part_logits)
            captured.append(part_captured)
        # The parts' logits come below-the-switch rows first; put them back in the order asked for.
        made = sorted(range(len(wanted)), key=lambda i: wanted[i] >= head)
        joined = torch.cat(logits)
        if made != list(range(len(wanted))):
            joined = joined[torch.tensor(made).argsort()]
        return joined, [torch.cat(pieces) for pieces in zip(*captured)]

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,  # [T] int64
        start_position: int,
        kv: KVCache,
        *,
        capture_layers: Sequence[int] = (),
        attention_mask: Tensor | None = None,  # [T, start+T] bool over committed + new tokens
        logits_positions: slice | Sequence[int] | None = slice(-1, None),
        capture_into: Tensor | None = None,
        tree: TreeRows | None = None,
    ) -> tuple[Tensor, list[Tensor]]:
        """Run T new tokens at positions start..start+T-1, append them to `kv`.

        Returns logits [len(logits_positions), vocab] in fp32 and the hidden states [T, C] after each
        layer in `capture_layers` (index i = the output of decoder layer i), from the same pass.
        `logits_positions=None` returns logits for every new token (verification). With
        `capture_into` ([T, len(capture_layers) * C], the DFlash drafter's rows) the hidden states
        are written there, in capture_layers order, and the list returned is empty: the native loop
        copies each into place, where returning them cost the drafter a concatenation and a copy a
        step (~100 us of a 4.7 ms int4 step on an AMX VM, paid by every plain step under auto).
        
        With `tree` (TreeRows.of the tree's parents) the tokens are a draft tree's rows, each at
        position start_position + its depth, verified in one pass; their keys and values fill
        `tree.keys`/`tree.values`, and the cache's positions after start_position hold chain 0's.
        """
        T = tokens.shape[0]
        end = start_position + T
        if end > kv.max_ctx:
            raise ValueError(f"positions up to {end} exceed the KV cache size {kv.max_ctx}")
        switch = self.rope_switch
        depths = None if tree is None else tree_depths(tree.parents)
        last = end - 1 if depths is None else start_position + max(depths)
        if switch is not None and start_position < switch <= last:
            if tree is not None or attention_mask is not None:
                raise ValueError(f"a draft tree or masked call at positions {start_position}..{end - 1} straddles "
                                 f"position {switch}, where the RoPE scaling switches in; verify up to it first")
            return self._forward_across_switch(tokens, start_position, kv, capture_layers, logits_positions, capture_into)
        if switch is not None and start_position >= switch and not kv.rope_rotated:
            self._switch_rope(kv)
        cos_table, sin_table = self._served_rope_tables(kv.max_ctx)
        if tree is None:
            cos = cos_table[start_position:end]
            sin = sin_table[start_position:end]
        else:
            positions = torch.tensor(depths, device=tokens.device) + start_position
            cos, sin = cos_table[positions], sin_table[positions]
        x = self.embed(tokens)  # [T, C]
        row_groups = None
        ours = (attention_kernels() == "ours" or kv.quantized) and x.device.type == "cpu"
        if attention_mask is None and not ours and tree is None:
            row_groups = attention_row_groups(start_position, T, kv.max_ctx, self.args.num_heads // self.args.num_kv_heads,
                                              kv.keys.dtype, x.device)
        capture = set(capture_layers)
        # The native loop makes the same calls for decode and verification (few rows), and for
        # prefill where every linear is one of our int8/int4 kernels (row-invariant at any row count;
        # half-precision linears are so only in blocks of FEW_ROWS: Linear). Prefill in Python cost
        # ~20-50 ms more a call whatever its rows (int4, AMX VM, 2 threads: 17 rows 38 -> 16 ms, a
        # 256-row chunk at 1K of context 217 -> 165-171 ms; the same bits).
        causal = attention_mask is None
        rows_invariant = T <= FEW_ROWS or self._linears_rows_invariant()
        native = native_extension() if causal and rows_invariant and x.device.type == "cpu" else None
        if tree is not None and not self.attends_trees_in_one_call(kv):
            native = None  # the native loop attends a tree's chains with our kernels only
        C = self.args.hidden_size
        into_natively = (capture_into is not None and native is not None and capture_into.dtype == torch.bfloat16
                         and x.dtype == torch.bfloat16)
        columns = [list(capture_layers).index(layer) * C for layer in sorted(capture)] if into_natively else []
        if native is not None:
            x, *captured = native.decode_layers(
                x, cos, sin, kv.keys, kv.values, *(
                    (kv.key_scales, kv.value_scales) if kv.quantized else (NO_SCALES, NO_SCALES)
                ), start_position, **self._native_layer_arguments(),
                group_starts=[g.rows.start for g in row_groups or ()], group_ends=[g.rows.stop for g in row_groups or ()],
                group_keys=[g.keys for g in row_groups or ()], group_masks=[g.mask for g in row_groups or ()],
                our_attention=ours,
                num_heads=self.args.num_heads, num_kv_heads=self.args.num_kv_heads, head_dim=self.args.head_dim,
                intermediate=self.args.intermediate_size, eps=self.args.rms_norm_eps, capture=sorted(capture),
                capture_into=capture_into if into_natively else None, capture_columns=columns,
                **({} if tree is None else dict(tree_parents=tree.parents, saved_keys=tree.keys, saved_values=tree.values)))
        else:
            captured: list[Tensor] = []
            for index, layer in enumerate(self.layers):
                x = layer(x, cos, sin, kv, index, start_position, attention_mask, row_groups, tree)
                if index in capture:
                    captured.append(x.clone())
        kv.length = end
        if logits_positions is not None:
            x = x[logits_positions]
        logits = widen_to_fp32(self.lm_head(self.norm(x)))
        if into_natively:
            return logits, []
        if capture:
            order = {layer: i for i, layer in enumerate(sorted(capture))}
            captured = [captured[order[layer]] for layer in capture_layers]
        if capture_into is not None:
            capture_into.copy_(torch.cat(captured, dim=-1))
            return logits, []
        return logits, captured


def hf_state_dict_to_ours(state: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Rename (and fuse) a Hugging Face llama-family state dict into this module's names."""

    def take(name: str) -> Tensor:
        try:
            return state.pop(name)
        except KeyError:
            raise KeyError(f"checkpoint is missing tensor {name!r}") from None

    ours: dict[str, Tensor] = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if "lm_head.weight" in state and not args.tie_word_embeddings:
        ours["lm_head.weight"] = take("lm_head.weight")
    elif args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    else:
        raise KeyError("checkpoint is missing tensor 'lm_head.weight' and embeddings are not tied")
    for i in range(args.num_layers):
        hf = f"model.layers.{i}."
        our = f"layers.{i}."
        ours[our + "attention.wqkv.weight"] = torch.cat(
            [take(hf + f"self_attn.{p}_proj.weight") for p in "qkv"]
        )
        if args.attention_bias:
            ours[our + "attention.wqkv.bias"] = torch.cat([take(hf + f"self_attn.{p}_proj.bias") for p in "qkv"])
        ours[our + "attention.wo.weight"] = take(hf + "self_attn.o_proj.weight")
        if args.qk_norm:
            ours[our + "attention.q_norm.weight"] = take(hf + "self_attn.q_norm.weight")
            ours[our + "attention.k_norm.weight"] = take(hf + "self_attn.k_norm.weight")
        ours[our + "feed_forward.w13.weight"] = torch.cat(
            [take(hf + "mlp.gate_proj.weight"), take(hf + "mlp.up_proj.weight")]
        )
        ours[our + "feed_forward.w2.weight"] = take(hf + "mlp.down_proj.weight")
        ours[our + "attention_norm.weight"] = take(hf + "input_layernorm.weight")
        ours[our + "ffn_norm.weight"] = take(hf + "post_attention_layernorm.weight")
    leftovers = [k for k in state if not k.endswith("rotary_emb.inv_freq")]
    if leftovers:
        raise KeyError(f"checkpoint has unexpected tensors, e.g. {leftovers[:3]!r}")
    return ours


def build_transformer(args: ModelArgs, state: dict[str, Tensor], dtype: torch.dtype, device: str = "cpu") -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    ours = hf_state_dict_to_ours(dict(state), args)
    model.load_state_dict({k: v.to(dtype) for k, v in ours.items()}, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise KeyError(f"checkpoint is missing tensors for {missing[:3]!r}")
    inv_freq, model.rope_attention_scale = rope_inverse_frequencies(args)
    model.inv_freq = inv_freq
    return model.to(device).eval()


@torch.inference_mode()
def first_layers_with_queries(model: Transformer, tokens: Tensor, start: int, kv: KVCache, num_layers: int,
                              query_rows: int = 0, cache_start: int | None = None) -> tuple[Tensor, Tensor] | None:
    """Speculative prefill's scorer (pflash.py): only the first `num_layers` decoder layers over
    `tokens` [T] at positions start..start+T-1, their keys and values written to `kv` (a cache of
    at least that many layers) at rows cache_start.. (default: start), attending over the rows
    before them. Returns the queries of the last `query_rows` tokens at each of those layers,
    before and after RoPE: two [num_layers, query_rows, H, D]; None for 0 rows.

    A `cache_start` other than `start` is a windowed scorer's: `kv` then holds a few of the
    prompt's keys (rotated at their own positions, so relative distances stay true) before the
    new rows, not all of them."""
    end = start + tokens.shape[0]
    at = start if cache_start is None else cache_start
    cos_table, sin_table = model._rope_tables(max(kv.max_ctx, end))
    cos, sin = cos_table[start:end], sin_table[start:end]
    x = model.embed(tokens)  # [T, C]
    before, after = [], []
    for index in range(num_layers):
        layer = model.layers[index]
        if query_rows:
            attention = layer.attention
            rows = attention.wqkv(layer.attention_norm(x[-query_rows:]))
            q = rows.view(query_rows, -1, attention.head_dim)[:, : attention.num_heads]
            if attention.q_norm is not None:
                q = attention.q_norm(q)
            before.append(q)
            after.append(apply_rope(q, cos[-query_rows:], sin[-query_rows:]))
        x = layer(x, cos, sin, kv, index, at, None)
    kv.length = at + tokens.shape[0]
    return (torch.stack(before), torch.stack(after)) if query_rows else None
