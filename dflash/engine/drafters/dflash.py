"""The DFlash block-diffusion draft model (see shared notes, dflash-algorithm.md §1-2).

A few Qwen3-style layers predict a whole block at once: the block is [pending token, MASK, ...],
its queries attend without a mask over the block and over "context" keys/values projected from the
target's own hidden states (several target layers, concatenated, through `fc` + `hidden_norm`).
The drafter borrows the target's embeddings and LM head. Its KV cache holds the projected context
of committed tokens only; block rows are computed per proposal and thrown away.

Checkpoints use the z-lab layout: config.json with `block_size` and
`dflash_config.{mask_token_id,target_layer_ids}`, and unprefixed safetensors names (`fc.weight`,
`layers.0.self_attn.q_proj.weight`, ...), which are exactly this module's parameter names.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.engine.kv import KVCache, lazily_zeroed
from dflash.engine.model import (
    Linear,
    RMSNorm,
    apply_rope,
    grouped_query_attention,
    native_extension,
    native_kernels,
    rope_tables,
    widen_to_fp32,
)
from dflash.engine.sampling import greedy_tokens
from dflash.engine.speculative import DraftTree, best_first_tree


class DraftLoadError(ValueError):
    pass


def build_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """The reference default: the middle layer for one feature, else evenly from 1 to n-3."""
    if num_features == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [round(first + (last - first) * i / (num_features - 1)) for i in range(num_features)]


@attrs.frozen
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768

    @classmethod
    def from_json(cls, config: dict[str, Any]) -> "DFlashConfig":
        try:
            extra = config.get("dflash_config") or {}
            num_layers = config["num_hidden_layers"]
            num_target_layers = config.get("num_target_layers", 0)
            layer_ids = extra.get("target_layer_ids") or build_target_layer_ids(num_target_layers, num_layers)
            rope = config.get("rope_parameters") or {}
            return cls(
                hidden_size=config["hidden_size"],
                intermediate_size=config["intermediate_size"],
                num_layers=num_layers,
                num_heads=config["num_attention_heads"],
                num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
                head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                block_size=config["block_size"],
                mask_token_id=extra["mask_token_id"] if "mask_token_id" in extra else config["mask_token_id"],
                target_layer_ids=tuple(layer_ids),
                num_target_layers=num_target_layers or max(layer_ids) + 1,
                vocab_size=config.get("vocab_size", 0),
                rms_norm_eps=config.get("rms_norm_eps", 1e-6),
                rope_theta=rope.get("rope_theta") or config.get("rope_theta", 10000.0),
                max_position_embeddings=config.get("max_position_embeddings", 32768),
            )
        except KeyError as exc:
            raise DraftLoadError(f"DFlash config.json lacks the key {exc.args[0]!r}") from None

    def to_json(self) -> dict[str, Any]:
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "num_target_layers": self.num_target_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
        }


class DraftAttention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.c = c
        self.q_proj = Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def fuse_projections(self) -> None:
        """One `kv_proj` instead of `k_proj` and `v_proj` (serving only: training and checkpoints
        keep them apart). Output channels are independent, so the fused rows are the same sums."""
        self.kv_proj = fused_linear(self.k_proj, self.v_proj)
        del self.k_proj, self.v_proj

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, H] -> rotated, normed keys and values [N, KV, hd]."""
        N, width = x.shape[0], self.c.num_kv_heads * self.c.head_dim
        if "kv_proj" in self._modules:
            k, v = self.kv_proj(x).split(width, dim=-1)
        else:
            k, v = self.k_proj(x), self.v_proj(x)
        k = self.k_norm(k.reshape(N, self.c.num_kv_heads, self.c.head_dim))
        return apply_rope(k, cos, sin), v.reshape(N, self.c.num_kv_heads, self.c.head_dim)

    def forward(self, h: Tensor, context: Tensor, kv: KVCache, layer: int, ctx_start: int, cos: Tensor, sin: Tensor):
        """h [B, H] block rows; context [S, H] new context rows at ctx_start..; block follows them."""
        S, B = context.shape[0], h.shape[0]
        block_start = ctx_start + S
        q = self.q_norm(self.q_proj(h).view(B, self.c.num_heads, self.c.head_dim))
        q = apply_rope(q, cos[block_start : block_start + B], sin[block_start : block_start + B])
        # The new context rows and the block in one projection (a call per linear, not two); the
        # cache keeps the context rows, the block's are overwritten by the next proposal.
        rows = torch.cat([context.to(h.dtype), h]) if S else h
        k, v = self.keys_values(rows, cos[ctx_start : block_start + B], sin[ctx_start : block_start + B])
        keys, values = kv.write(layer, ctx_start, k, v)  # context + block, no mask
        out = block_attention(q.to(keys.dtype), keys, values)
        return self.o_proj(out.reshape(B, -1).to(h.dtype))


def block_attention(q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
    """q [B, H, D] (the block's rows), keys/values [KV, L, D] -> [B, H, D]: every row attends to
    every key (the context and the whole block). On CPU with the native kernels, causal_attention.cpp
    with the block's rows as the query heads of one row at the last position (one call, no mask):
    torch's SDPA cost ~190 us a call for 8 rows over 300 keys on Zen 4, about a sixth of a proposal
    (profiled). A proposal needs no row invariance, only the target's verification does."""
    B, H, D = q.shape
    KV = keys.shape[0]
    native = native_kernels() if q.device.type == "cpu" else None
    if native is None or not native.causal_attention_available() or q.dtype != keys.dtype or D not in (16, 32, 64, 128, 256):
        return grouped_query_attention(q, keys, values, None).reshape(B, H, D)
    G = H // KV
    heads = q.view(B, KV, G, D).transpose(0, 1).reshape(1, KV * B * G, D)  # KV head h's rows together
    out = native.causal_attention(heads, keys, values, keys.shape[1] - 1)
    return out.view(KV, B, G, D).transpose(0, 1).reshape(B, H, D)


class DraftMLP(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def fuse_projections(self) -> None:
        """One `gate_up_proj` instead of `gate_proj` and `up_proj` (serving only)."""
        self.gate_up_proj = fused_linear(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: Tensor) -> Tensor:
        if "gate_up_proj" in self._modules:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def fused_linear(*linears: nn.Linear) -> Linear:
    """One linear whose output channels are those of `linears`, in order (no biases)."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    fused = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    return fused


class DraftLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn = DraftAttention(c)
        self.mlp = DraftMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class DFlashDraftModel(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.config = c
        self.fc = Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))

    def fuse_projections(self) -> "DFlashDraftModel":
        """For serving: each layer's k/v and gate/up projections as one linear each, so a proposal
        makes 5 linear calls a layer instead of 9 (with the context rows projected with the block,
        DraftAttention.forward). Training and checkpoints use the unfused layout."""
        for layer in self.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # a norm: the linears may be quantized (quant.quantize_draft_linears)

    def project_context(self, target_hidden: Tensor) -> Tensor:
        """[S, K*H] concatenated target layers -> [S, H] context features."""
        return self.hidden_norm(self.fc(target_hidden.to(self.dtype)))

    def forward(
        self,
        context: Tensor,  # [S, H] projected context rows, not yet in kv
        block_embeddings: Tensor,  # [B, H]
        kv: KVCache,
        cos: Tensor,
        sin: Tensor,
    ) -> Tensor:
        """Returns the final-normed block outputs [B, H]; kv keeps the new context rows only."""
        ctx_start = kv.length
        x = block_embeddings.to(self.dtype)
        native = native_extension() if x.device.type == "cpu" and not torch.is_grad_enabled() else None
        arguments = self.native_arguments() if native is not None and hasattr(native, "draft_layers") else None
        if arguments is not None and kv.keys.dtype in (torch.float32, torch.bfloat16):
            # draft_layers: the loop below in one C++ call, the same kernels in the same order
            x = native.draft_layers(x, context.to(self.dtype), cos, sin, kv.keys, kv.values, ctx_start, **arguments)
        else:
            for index, layer in enumerate(self.layers):
                h = layer.input_layernorm(x)
                x = x + layer.self_attn(h, context, kv, index, ctx_start, cos, sin)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        kv.length = ctx_start + context.shape[0]
        return self.norm(x)

    def native_arguments(self) -> dict | None:
        """draft_layers' tensors where the drafter is served in bf16 with every linear int8 or int4 on
        our kernels and its projections fused (loading.serving_draft on an int8/int4 target), else None."""
        from dflash.engine.quant import Int4Linear, Int8Linear

        attention_modules = [layer.self_attn._modules for layer in self.layers]
        mlp_modules = [layer.mlp._modules for layer in self.layers]
        linears = [[a.get("q_proj"), a.get("kv_proj"), a.get("o_proj"), m.get("gate_up_proj"), m.get("down_proj")]
                   for a, m in zip(attention_modules, mlp_modules)]
        signature = tuple(id(l) for row in linears for l in row)  # quantize/fuse replace the modules
        cached = self.__dict__.get("_native_arguments")
        if cached is not None and cached[0] == signature:
            return cached[1]
        arguments = None
        c = self.config
        if (self.dtype == torch.bfloat16 and self.norm.weight.device.type == "cpu" and c.head_dim % 16 == 0
                and all(isinstance(l, (Int8Linear, Int4Linear)) and l.kernels != "torch" for row in linears for l in row)):
            arguments = dict(
                norms=[w for layer in self.layers for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                                           layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight)],
                linears=[t for row in linears for l in row
                         for t in ((l.qweight, l.scales) if isinstance(l, Int8Linear) else (l.packed, l.scales_and_zeros))],
                H=c.num_heads, KV=c.num_kv_heads, D=c.head_dim, intermediate=c.intermediate_size, eps=c.rms_norm_eps)
        self.__dict__["_native_arguments"] = (signature, arguments)
        return arguments


CATCH_UP_ROWS = 64  # pending context rows past which running them (projection, layers) counts as catching up

# The drafter attends to the last CONTEXT_WINDOW to 2 * CONTEXT_WINDOW committed rows, not the whole
# context. Why: the shipped drafter's τ falls as its context grows past ~512 rows, though it was
# trained on contexts up to ~1K: after the captured Claude Code system prompt (prompts of ~1.5K
# tokens) the unseen prompts' mean τ, trees of 7, was 2.37 over the whole context, 2.60 over the
# last 1024 rows, 2.94 over 768 and 3.06-3.13 over 128-512 (chat 1.72 -> 2.07, coding 2.66 ->
# 4.04; int4, AVX2); on the unseen prompts alone (40-444 tokens) the same as without a window.
# And a fresh prompt's catch-up runs 256 rows at most, not all of them: ~35 ms for 1.5K rows on
# AVX2 (int4), 4-5 decode steps paid by the first proposal of every reply that used DFlash.
CONTEXT_WINDOW = 256


class DFlashDrafter:
    """Engine-level drafter: mirrors the target's committed tokens with their captured hidden rows
    and the projected context K/V of those rows."""

    name = "dflash"

    def __init__(self, draft: DFlashDraftModel, target, max_ctx: int, vocabulary: Sequence[int] | None = None,
                 window: int | None = CONTEXT_WINDOW):
        c = draft.config
        if c.hidden_size != target.args.hidden_size:
            raise DraftLoadError(
                f"draft hidden_size {c.hidden_size} differs from the target's {target.args.hidden_size}"
            )
        if max(c.target_layer_ids) >= target.args.num_layers:
            raise DraftLoadError(
                f"target_layer_ids {list(c.target_layer_ids)} exceed the target's {target.args.num_layers} layers"
            )
        if not 0 <= c.mask_token_id < target.args.vocab_size:
            raise DraftLoadError(f"mask_token_id {c.mask_token_id} is outside the target vocabulary")
        self.draft = draft
        self.target = target
        self.capture_layers = tuple(c.target_layer_ids)
        device = draft.norm.weight.device
        kv_dtype = torch.float32 if device.type == "cpu" else draft.dtype
        self.kv = KVCache(c.num_layers, c.num_kv_heads, max_ctx + c.block_size, c.head_dim, kv_dtype, device)
        cos, sin = rope_tables(draft.inv_freq.float(), max_ctx + c.block_size, 1.0, draft.dtype, device)
        self.cos, self.sin = cos.unsqueeze(1), sin.unsqueeze(1)
        # Captured target rows [position, K*H] of every committed token; rows kv.length..length are
        # not yet projected into the draft cache (that happens lazily, at the next proposal).
        self.rows = lazily_zeroed((max_ctx, len(c.target_layer_ids) * c.hidden_size), draft.dtype, device)
        self.length = 0
        # The drafter's own cache holds the projected rows offset..offset + kv.length (its slot j is
        # committed position offset + j: RoPE sees only distances, so the shift changes nothing).
        # `window` (CONTEXT_WINDOW; None: the whole context): a proposal that would have more than
        # `window` rows to catch up, or a cache of more than 2 * `window` rows, starts the cache
        # afresh at the last `window` rows.
        self.offset = 0
        self.window = window
        self.catch_up_seconds = 0.0  # of the last proposal: see propose
        # The draft vocabulary (training/draft_vocab.py): drafts are scored against these rows of
        # the target's LM head only; None: against all of them.
        self.vocabulary = None
        self.head = target.lm_head
        if vocabulary is not None:
            ids = sorted(set(int(i) for i in vocabulary))
            if ids[0] < 0 or ids[-1] >= target.args.vocab_size:
                raise DraftLoadError(f"draft vocabulary ids {ids[0]}..{ids[-1]} outside the target's {target.args.vocab_size}")
            self.vocabulary = torch.tensor(ids, dtype=torch.long, device=device)
            self.head = head_rows(target.lm_head, self.vocabulary, quantized=draft.native_arguments() is not None)

    @property
    def block_size(self) -> int:
        return self.draft.config.block_size

    def rows_at(self, start: int, count: int) -> Tensor | None:
        """Where the target's forward over `count` tokens from `start` writes their captured rows
        (Transformer.forward's capture_into; `observed` then counts them), or None when rows before
        `start` are missing: propose() declines until a rollback makes the context whole, so there
        is nothing to capture."""
        if start > self.length:
            return None
        self.crop(start)
        return self.rows[start : start + count]

    def observed(self, start: int, count: int) -> None:
        self.length = start + count

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)
        if self.length <= self.offset:
            self.kv.crop(0)
            self.offset = 0
        else:
            self.kv.crop(min(self.kv.length, self.length - self.offset))

    def context_rows(self, length: int | None = None, start: int = 0) -> Tensor:
        """A copy of the captured rows of committed tokens start..length (for a prefix-cache
        snapshot); all of them by default."""
        end = self.length if length is None else min(length, self.length)
        return self.rows[min(start, end) : end].clone()

    def restore(self, rows: Sequence[Tensor], common: int) -> None:
        """Adopt the committed rows of a restored snapshot, in pieces one after another (a snapshot
        built on others: prefix_cache.py); the first `common` rows are unchanged."""
        self.crop(common)
        start = 0
        for piece in rows:
            end = start + piece.shape[0]
            if end > common:
                self.rows[max(start, common) : end] = piece[max(common - start, 0) :]
            start = end
        self.length = start

    @torch.inference_mode()
    def propose(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        logits = self._slot_logits(tokens, max_tokens)
        if logits is None:
            return []
        # fp32 first: torch's argmax over bf16 rows cost ~0.75 ms for 7 x 49152 on Zen 4 (AVX512-BF16),
        # 0.25 ms with the conversion (the same indices); logits.cpp's, a few tens of us.
        best = greedy_tokens(widen_to_fp32(logits))
        return (best if self.vocabulary is None else self.vocabulary[best]).tolist()

    # Candidates per slot a tree chooses among: more than a few are never likely enough to be chosen.
    TREE_CANDIDATES = 8

    @torch.inference_mode()
    def propose_tree(self, tokens: Sequence[int], rows: int, depth: int | None = None) -> DraftTree:
        """The `rows` likeliest draft paths of a block of `depth` drafts (None: the whole block;
        speculative.best_first_tree); empty where `propose` would decline."""
        drafts = self.block_size - 1 if depth is None else min(depth, self.block_size - 1)
        logits = self._slot_logits(tokens, drafts if rows > 0 else 0)
        if logits is None:
            return DraftTree((), ())
        # softmax, then the top candidates: 0.2 ms for 7 x 16,384 where topk and logsumexp over the
        # logits took 0.45 (int4 target, AMX VM, 2 threads; a plain int4 step is ~6 ms there)
        top = torch.softmax(widen_to_fp32(logits), dim=-1).topk(min(self.TREE_CANDIDATES, rows, logits.shape[-1]), dim=-1)
        ids = top.indices if self.vocabulary is None else self.vocabulary[top.indices]
        return best_first_tree(top.values.log().tolist(), ids.tolist(), rows)

    def _slot_logits(self, tokens: Sequence[int], max_tokens: int) -> Tensor | None:
        """The drafter's logits [drafts, vocabulary] for up to `max_tokens` drafts after the pending
        token (the last of `tokens`), or None where it cannot propose (its context is not whole)."""
        committed = len(tokens) - 1  # the last token is pending: not yet run through the target
        self.catch_up_seconds = 0.0  # none where it does not propose (the policy subtracts it)
        if max_tokens <= 0 or self.length != committed:
            return None
        # Fewer drafts run a shorter block, though training always ran whole ones (attention
        # inside a block goes both ways, so the rows change): measured once (a throwaway comparison,
        # numbers in issue 17's session-16 note) with the shipped drafter on
        # the unseen prompts (int4, 1-3 drafts a step), the whole block with its first drafts kept
        # accepted less (tau on coding, code editing, tool use 1.45-1.73 vs 1.48-1.83 at 2 and 3
        # drafts; chat the same or lower), and it costs more rows.
        block = min(self.block_size, max_tokens + 1)
        if self._starts_afresh():
            self.kv.crop(0)
            self.offset = self.length - self.window
        started, pending = time.perf_counter(), self.pending_rows()
        context = self.draft.project_context(self.rows[self.offset + self.kv.length : self.length])
        ids = torch.full((block,), self.draft.config.mask_token_id, dtype=torch.long, device=self.rows.device)
        ids[0] = tokens[-1]
        projected = time.perf_counter()
        out = self.draft(context, self.target.embed(ids), self.kv, self.cos, self.sin)
        # Rows left pending since the last proposal (a prompt's, or those of a pause) are the
        # context catching up, not this proposal's cost: the policy leaves it out of what it
        # measures (a first proposal after an 8K-token prompt took 121 ms against 5 ms a step
        # later, and DFlash was paused for it; AMX VM). Their projection, and their share of the
        # drafter's layers by rows: counting the projection alone, a first proposal after a
        # 1.5K-token prompt measured 1.6 plain steps (int4, AMX VM) against ~0.4 after it.
        self.catch_up_seconds = ((projected - started) + (time.perf_counter() - projected) * pending / (pending + block)
                                 if pending > CATCH_UP_ROWS else 0.0)
        # Slot 0 is the known pending token; slots 1.. predict the tokens at their own positions.
        return self.head(out[1:].to(self.target.dtype))

    def pending_rows(self) -> int:
        """Context rows the drafter's next proposal runs before its block: the committed rows not yet
        in its own cache, or its window's where it starts that cache afresh (_starts_afresh)."""
        return self.window if self._starts_afresh() else self.length - self.offset - self.kv.length

    def _starts_afresh(self) -> bool:
        """Whether the next proposal starts the drafter's cache afresh at the last `window` rows."""
        if self.window is None:
            return False
        return self.length - self.offset - self.kv.length > self.window or self.length - self.offset > 2 * self.window

    def keep_rows(self, start: int, positions: Tensor) -> None:
        """Rows at `positions` (a draft tree's accepted path) become those of start, start + 1, ..."""
        self.rows[start : start + len(positions)] = self.rows[positions]


def head_rows(head: nn.Module, ids: Tensor, quantized: bool = False) -> nn.Module:
    """The LM head `head` restricted to the output rows `ids`: in the drafter's linears' format
    (quant.draft_linear_kind: int8, int4 on AVX2 alone) where the target's is quantized (its rows
    dequantized and quantized again: a draft needs no more) or where `quantized` asks for it (a
    drafter whose layers run on our kernels: loading.serving_draft), else the rows as they are."""
    from dflash.engine.quant import Int4Linear, Int8Linear, QuantizedLinear, draft_linear_kind

    def in_draft_format(weight: Tensor) -> nn.Module:  # int8 where int4's blocks do not fit the rows
        kind = draft_linear_kind()
        return (kind if kind is Int8Linear or Int4Linear.fits(weight) else Int8Linear)(weight, None)

    if isinstance(head, QuantizedLinear):
        return in_draft_format(head.dequantized(torch.float32)[ids])
    if quantized:
        return in_draft_format(head.weight[ids])
    rows = Linear(head.in_features, len(ids), bias=False, device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        rows.weight.copy_(head.weight[ids])
    return rows


def load_dflash_checkpoint(folder: str | Path, dtype: torch.dtype = torch.float32) -> DFlashDraftModel:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = DFlashConfig.from_json(json.loads((folder / "config.json").read_text()))
    except (OSError, json.JSONDecodeError) as exc:
        raise DraftLoadError(f"cannot read DFlash config {str(folder / 'config.json')!r}: {exc}") from exc
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DraftLoadError(f"DFlash folder {str(folder)!r} has no *.safetensors file")
    state: dict[str, Tensor] = {}
    for file in files:
        try:
            state.update(load_file(file))
        except (SafetensorError, OSError) as exc:
            raise DraftLoadError(f"corrupt DFlash weights {str(file)!r}: {exc}") from exc
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise DraftLoadError(
            f"DFlash checkpoint {str(folder)!r} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise DraftLoadError(
                f"DFlash tensor {name!r} has shape {tuple(tensor.shape)}, config implies {tuple(expected[name].shape)}"
            )
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    model.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim))
    return model.eval()


def random_draft_model(config: DFlashConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> DFlashDraftModel:
    torch.manual_seed(seed)
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                nn.init.normal_(param, std=0.02)
    return model.to(dtype).eval()


def save_dflash_checkpoint(model: DFlashDraftModel, folder: str | Path) -> None:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(model.config.to_json(), indent=2))
