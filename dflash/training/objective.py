"""The DFlash drafter's training objective (shared notes, dflash-algorithm.md §4), for one sample
(train_drafter.py) or a batch of them (at_scale.py).

Blocks are anchored at response positions. Block b is [token a_b, MASK, ...] at positions
a_b..a_b+B-1; it sees the context rows before a_b plus its own rows, nothing else — what the
drafter sees at inference, where the anchor is the pending token that has no rows yet — so one
forward trains every block of a sample. Slot k (k >= 1) is scored by cross-entropy through the
frozen target LM head against token a_b+k, weighted exp(-(k-1)/gamma).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash.engine.drafters.dflash import DFlashDraftModel
from dflash.engine.model import apply_rope, rope_tables


def batched_training_forward(draft: DFlashDraftModel, embed, rows: Tensor, tokens: Tensor, lengths: Tensor,
                             anchors: Tensor, block: int, mask_token: int) -> Tensor:
    """The drafter's final-normed outputs for S sequences at once. rows [S, L, K*H] and tokens [S, L]
    (padded past `lengths`), anchors [S, N] (each < its sequence's length - 1). Block b of sequence
    s sees the context rows before its anchor and its own rows, nothing else. Returns the
    final-normed outputs [S, N, B-1, H] of the masked slots."""
    c = draft.config
    S, L = tokens.shape
    N = anchors.shape[1]
    device = tokens.device
    offsets = torch.arange(block, device=device)
    positions = (anchors[:, :, None] + offsets).reshape(S, N * block)  # [S, NB]
    block_ids = torch.full((S, N, block), mask_token, dtype=torch.long, device=device)
    block_ids[:, :, 0] = tokens.gather(1, anchors)
    context_pos = torch.arange(L, device=device)
    query_anchor = anchors.repeat_interleave(block, dim=1)  # [S, NB]
    allowed_context = context_pos[None, None, :] < query_anchor[:, :, None]  # [S, NB, L]
    query_block = torch.arange(N * block, device=device) // block
    own_block = (query_block[:, None] == query_block[None, :]).expand(S, -1, -1)
    mask = torch.cat([allowed_context, own_block], dim=2)[:, None]  # [S, 1, NB, L+NB]
    span = max(L, int(positions.max()) + 1)
    cos, sin = rope_tables(draft.inv_freq.float(), span, 1.0, torch.float32, device)
    key_positions = torch.cat([context_pos[None].expand(S, -1), positions], dim=1)  # [S, L+NB]
    context = draft.project_context(rows)  # [S, L, H]
    x = embed(block_ids.reshape(S, N * block)).to(context.dtype)
    group = c.num_heads // c.num_kv_heads
    for layer in draft.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_norm(attn.q_proj(h).view(S, -1, c.num_heads, c.head_dim))
        q = apply_rope(q, cos[positions].unsqueeze(2).to(q.dtype), sin[positions].unsqueeze(2).to(q.dtype))
        kv_input = torch.cat([context, h.to(context.dtype)], dim=1)
        k = attn.k_norm(attn.k_proj(kv_input).view(S, -1, c.num_kv_heads, c.head_dim))
        k = apply_rope(k, cos[key_positions].unsqueeze(2).to(k.dtype), sin[key_positions].unsqueeze(2).to(k.dtype))
        v = attn.v_proj(kv_input).view(S, -1, c.num_kv_heads, c.head_dim)
        # Heads repeated rather than enable_gqa: the fused attention kernels take a mask then.
        k, v = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(S, N * block, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return draft.norm(x).view(S, N, block, -1)[:, :, 1:]


def training_forward(draft: DFlashDraftModel, embed, rows: Tensor, tokens: Tensor, anchors: list[int], block: int,
                     mask_token: int) -> Tensor:
    """One sample's outputs [N, B-1, H] for the masked slots of every block (the LM head is applied
    by the caller, to the slots that have a label only: it is most of the cost)."""
    length = torch.tensor([tokens.shape[0]], device=tokens.device)
    return batched_training_forward(draft, embed, rows[None], tokens[None], length,
                                    torch.tensor([anchors], device=tokens.device), block, mask_token)[0]


def warmup_cosine(peak: float, done: float, warmup: float) -> float:
    """The learning rate when a share `done` of training is done (of its steps, or of its time):
    a linear warm-up over the first `warmup` share, then a cosine decay to zero."""
    if done < warmup:
        return peak * done / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (done - warmup) / max(1.0 - warmup, 1e-9)))


def slot_weights(block: int, gamma: float) -> Tensor:
    return torch.tensor([math.exp(-(k - 1) / gamma) for k in range(1, block)])


def acceptance_estimate(logits: Tensor, labels: Tensor) -> float:
    """Mean tokens a verification would commit per block: 1 + the run of correct leading slots."""
    correct = (logits.argmax(-1) == labels) & (labels >= 0)
    run = torch.cumprod(correct.int(), dim=1).sum(dim=1).float()
    return float(run.mean() + 1)


def slot_loss(draft_out: Tensor, labels: Tensor, lm_head_weight: Tensor, weights: Tensor) -> Tensor:
    """Weighted cross-entropy over the slots that have a label (labels [..., B-1], -1 for none);
    the LM head runs on those rows only."""
    valid = labels >= 0
    logits = F.linear(draft_out[valid].to(lm_head_weight.dtype), lm_head_weight).float()
    per_slot = F.cross_entropy(logits, labels[valid], reduction="none")
    slot_weight = weights.to(draft_out.device).expand_as(labels)[valid]
    return (per_slot * slot_weight).sum() / slot_weight.sum().clamp(min=1e-9)
