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
from collections.abc import Sequence

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


def decoded_acceptance(logits: Tensor, labels: Tensor) -> tuple[int, int]:
    """(tokens committed, verifications) of a greedy decode with a full block at every step through
    the consecutive anchors a, a+1, ..., a+N-1 of logits [N, B-1, V] and labels [N, B-1] (-1: past
    the text): from the first anchor, a verification commits the run of right leading slots and the
    target's own token, and the next block starts after them. Why not acceptance_estimate's mean
    over every anchor: a decode lands on few anchors inside a stretch the drafter gets right and on
    every one where it fails, so that mean overrated τ (coding replies of the training pool, bf16 on
    AMX: 3.25 against 2.62 decoded on the same reply and rows; this walk gives 2.68, the rest being
    the training forward's rounding against the served drafter's: bench/drafter_paths.py)."""
    correct = (logits.argmax(-1) == labels) & (labels >= 0)
    runs = torch.cumprod(correct.int(), dim=1).sum(dim=1).tolist()
    tokens = steps = anchor = 0
    while anchor < len(runs):
        tokens += runs[anchor] + 1
        steps += 1
        anchor += runs[anchor] + 1
    return tokens, steps


class HeadCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(head(h_i), label_i) through a frozen LM head, in chunks of rows, with the
    gradient for h computed in the forward: the [rows, vocabulary] logits (27K x 49,152 floats in an
    at-scale step, 5 GB) never exist whole, and autograd's log-softmax backward over them (most of a
    CPU step: 1.9 s of 5.2 at 5.6K rows on AMX) is two GEMMs and one exp a chunk instead."""

    @staticmethod
    def forward(ctx, h: Tensor, head: Tensor, labels: Tensor, weights: Tensor, chunk: int) -> Tensor:
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        rows_given = h.shape[0]
        # The last chunk padded to a multiple of 128 rows of weight 0: a handful of matmul shapes,
        # not one per step (oneDNN keeps memory for each shape it meets; at_scale.LENGTH_BUCKET).
        padding = -rows_given % min(chunk, 128)
        if padding:
            h = torch.cat([h, h.new_zeros(padding, h.shape[1])])
            labels = torch.cat([labels, labels.new_zeros(padding)])
            weights = torch.cat([weights, weights.new_zeros(padding)])
        grad = torch.empty_like(h)
        for first in range(0, h.shape[0], chunk):
            rows = slice(first, first + chunk)
            logits = F.linear(h[rows].to(head.dtype), head).float()
            label, weight = labels[rows], weights[rows].float()
            norm = torch.logsumexp(logits, dim=-1)
            total += (weight * (norm - logits.gather(1, label[:, None])[:, 0])).sum()
            # d/dlogits of w * CE = w * (softmax - onehot)
            probs = logits.sub_(norm[:, None]).exp_()
            probs[torch.arange(len(label), device=h.device), label] -= 1.0
            probs.mul_(weight[:, None])
            grad[rows] = (probs.to(head.dtype) @ head).to(h.dtype)
        ctx.save_for_backward(grad[:rows_given])
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None


def vocabulary_head(head: Tensor, ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The rows of a frozen LM head [V, C] for a draft vocabulary's `ids` (the server scores drafts
    against these only: DFlashDrafter.head), and the map [V] from a token id to its row there (-1:
    outside the vocabulary). Why: the loss's head is most of a CPU training step by FLOPs (7K rows
    x 49,152 x 576, forward and gradient), and the served drafter proposes from 16,384 of them."""
    index = torch.tensor(sorted(set(int(i) for i in ids)), dtype=torch.long, device=head.device)
    if len(index) == 0 or index[0] < 0 or index[-1] >= head.shape[0]:
        raise ValueError(f"vocabulary ids must lie in 0..{head.shape[0] - 1}, the head's rows")
    row_of = torch.full((head.shape[0],), -1, dtype=torch.long, device=head.device)
    row_of[index] = torch.arange(len(index), device=head.device)
    return head[index].contiguous(), row_of


def vocabulary_labels(labels: Tensor, row_of: Tensor, miss: int | None = None) -> Tensor:
    """Labels (token ids, -1 for none) as rows of vocabulary_head's head. A token outside the
    vocabulary becomes -1, left out of slot_loss (no draft can be it), or `miss` where given: a row
    no logit stands for (the vocabulary's size), so that an acceptance walk counts it as a miss."""
    rows = row_of[labels.clamp(min=0)]
    if miss is not None:
        rows = rows.masked_fill(rows < 0, miss)
    return rows.masked_fill(labels < 0, -1)


def slot_loss(draft_out: Tensor, labels: Tensor, lm_head_weight: Tensor, weights: Tensor, chunk: int = 1024) -> Tensor:
    """Weighted cross-entropy over the slots that have a label (labels [..., B-1], -1 for none);
    the LM head runs on those rows only (HeadCrossEntropy: chunked, the logits in fp32)."""
    valid = labels >= 0
    slot_weight = weights.to(draft_out.device).expand_as(labels)[valid]
    slot_weight = slot_weight / slot_weight.sum().clamp(min=1e-9)
    return HeadCrossEntropy.apply(draft_out[valid], lm_head_weight, labels[valid], slot_weight, chunk)
