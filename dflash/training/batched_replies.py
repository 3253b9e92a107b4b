"""Reply data for the drafter at GEMM speed: the target answers many prompts at once.

`generate_data` decodes one prompt at a time through the engine: one row per matmul, each reading
all the weights (17.5–23 reply tok/s with two one-thread workers on the 2-core AVX2 VM), while a
matmul over 32 rows does 32 rows' work for one read (41.8 reply tok/s there at 32; README "More
reply data"). Here a batch of prompts is left-padded and decoded greedily together (plain torch,
the target's own weights and layers, its own KV tensors), and the hidden rows at the drafter's
target layers are kept as they are computed. The shards are `generate_data`'s, so training reads
them the same way.

A batched row is not bit-identical to an engine row (other matmul shapes round differently), so
where two logits nearly tie a reply may take the other token than the engine's greedy decode: the
reply is still the target's greedy choice under these roundings, which is what the labels need.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash.engine.model import Linear, apply_rope, has_bf16_hardware, rope_tables


def dense(linear, x: Tensor) -> Tensor:
    """One GEMM over all the batch's rows. The engine's Linear splits bf16 rows into blocks of a
    few on CPUs with AMX, so that a row's bits do not depend on its batch (exact speculation); the
    data needs no such thing, and one GEMM over 256 rows is ~10x faster there.

    Where bf16 is emulated (no AVX512-BF16 or AMX), bf16 rows go through an fp32 copy of the
    weights, kept on the module (the target is frozen): torch's bf16 GEMM took ~5x an fp32 one's
    time there (a [128, 576] x [576, 49,152] product 0.37 s against 0.07 s; AVX2 Zen 3, 2 threads),
    and the reply stage of the at-scale test ran at 1-8 tok/s. The inputs are bf16 values, exact in
    fp32, and the sums are fp32 either way; only their order and the output's rounding may differ,
    as between any two matmul shapes (see the module's note)."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not has_bf16_hardware():
        return F.linear(x.float(), *fp32_copy(linear)).to(x.dtype)
    return F.linear(x, linear.weight, linear.bias)


def fp32_copy(linear) -> tuple[Tensor, Tensor | None]:
    """The frozen `linear`'s weight and bias in fp32, made once and kept on the module (the at-scale
    loss's LM head uses the same copy: one 113 MB head for the embedded model, not two)."""
    cached = linear.__dict__.get("_fp32_copy")
    if cached is None or cached[0] is not linear.weight:
        bias = None if linear.bias is None else linear.bias.detach().float()
        cached = (linear.weight, linear.weight.detach().float(), bias)
        linear.__dict__["_fp32_copy"] = cached
    return cached[1], cached[2]


def _check_plain_weights(model) -> None:
    # The quantized linears take 2-D bf16 rows (their kernels); training data comes from the float target.
    for name, module in model.named_modules():
        if name.endswith(("wqkv", "wo", "w13", "w2")) and not isinstance(module, Linear):
            raise ValueError(f"batched replies need the target's float weights, but {name} is "
                             f"{type(module).__name__}: load it with weights=None (float32 or bfloat16)")


@torch.inference_mode()
def batched_greedy(model, prompts: Sequence[Sequence[int]], max_new: int, stop_ids: set[int],
                   layer_ids: Sequence[int], choose: Callable[[Tensor], Tensor] | None = None,
                   rows_to_cpu: bool = True) -> list[tuple[list[int], Tensor]]:
    """Greedy replies to `prompts`, decoded as one batch. Per prompt: the output tokens (up to and
    including a stop token, at most `max_new`) and the rows [prompt + output - 1, len(layer_ids) * C]
    of the given layers' outputs (the last output token is never fed back, as in the engine).
    `choose` maps the last logits [B, V] to tokens [B] instead of the argmax (sampled user turns,
    at_scale.py); `rows_to_cpu=False` leaves the rows where the model runs."""
    _check_plain_weights(model)
    if max_new < 1:
        raise ValueError(f"a reply needs at least one token, got max_new={max_new}")
    a = model.args
    B, P = len(prompts), max(len(p) for p in prompts)
    H, KV, D = a.num_heads, a.num_kv_heads, a.head_dim
    total = P + max_new
    device = model.device
    pads = torch.tensor([P - len(p) for p in prompts], device=device)
    tokens = torch.zeros(B, P, dtype=torch.long, device=device)
    for b, prompt in enumerate(prompts):
        tokens[b, int(pads[b]):] = torch.tensor(list(prompt), device=device)
    cos_table, sin_table = rope_tables(model.inv_freq, total, model.rope_attention_scale, model.dtype, model.device)
    # Where bf16 is emulated, keys, values and the attention over them are fp32: each decode step of
    # a batch reads the whole cache, and torch's bf16 attention there took ~4x the fp32 one's time
    # (256 rows over 600 keys: 163 ms against 43 a layer; AVX2 Zen 3, 2 threads), most of a batch's.
    emulated = model.dtype == torch.bfloat16 and device.type == "cpu" and not has_bf16_hardware()
    attention_dtype = torch.float32 if emulated else model.dtype
    keys = torch.zeros(a.num_layers, B, KV, total, D, dtype=attention_dtype, device=device)
    values = torch.zeros_like(keys)
    capture = {layer: i for i, layer in enumerate(layer_ids)}
    rows = torch.zeros(len(layer_ids), B, total, a.hidden_size, dtype=model.dtype, device=device)
    key_index = torch.arange(total, device=device)

    def forward(new: Tensor, start: int) -> Tensor:  # new [B, T] at slots start..start+T-1 -> last logits [B, V]
        B, T = new.shape
        end = start + T
        slots = torch.arange(start, end, device=device)
        positions = (slots[None] - pads[:, None]).clamp(min=0)  # a row's own positions start after its padding
        cos, sin = cos_table[positions].unsqueeze(2), sin_table[positions].unsqueeze(2)  # [B, T, 1, D]
        seen = key_index[None, None, :end]
        allowed = (seen >= pads[:, None, None]) & (seen <= slots[None, :, None])
        allowed |= seen == slots[None, :, None]  # a padding row sees itself: never a row of NaN
        x = model.embed(new)
        for index, layer in enumerate(model.layers):
            attention = layer.attention
            qkv = dense(attention.wqkv, layer.attention_norm(x)).view(B, T, H + 2 * KV, D)
            q, k, v = qkv[:, :, :H], qkv[:, :, H : H + KV], qkv[:, :, H + KV :]
            if attention.q_norm is not None:
                q, k = attention.q_norm(q), attention.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            keys[index, :, :, start:end] = k.transpose(1, 2)
            values[index, :, :, start:end] = v.transpose(1, 2)
            out = F.scaled_dot_product_attention(q.transpose(1, 2).to(attention_dtype), keys[index, :, :, :end],
                                                 values[index, :, :, :end], attn_mask=allowed[:, None], enable_gqa=True)
            x = x + dense(attention.wo, out.transpose(1, 2).reshape(B, T, H * D).to(x.dtype))
            gate, up = dense(layer.feed_forward.w13, layer.ffn_norm(x)).split(a.intermediate_size, dim=-1)
            x = x + dense(layer.feed_forward.w2, F.silu(gate) * up)
            if index in capture:
                rows[capture[index], :, start:end] = x
        return dense(model.lm_head, model.norm(x[:, -1])).float()

    outputs: list[list[int]] = [[] for _ in range(len(prompts))]
    results: list[tuple[list[int], Tensor] | None] = [None] * len(prompts)
    members = list(range(len(prompts)))  # the prompt of each batch row
    logits = forward(tokens, 0)
    for step in range(max_new):
        chosen = (logits.argmax(-1) if choose is None else choose(logits)).cpu()
        for row, b in enumerate(members):
            if results[b] is None:
                outputs[b].append(int(chosen[row]))
                if int(chosen[row]) in stop_ids or step == max_new - 1:
                    length = P - int(pads[row]) + len(outputs[b]) - 1
                    kept = rows[:, row, int(pads[row]) : int(pads[row]) + length].permute(1, 0, 2).reshape(length, -1)
                    results[b] = (outputs[b], kept.cpu() if rows_to_cpu else kept)
        live = [row for row, b in enumerate(members) if results[b] is None]
        if not live:
            break
        # Finished rows leave the batch once they are an eighth of it, so one long reply does not keep
        # a whole batch decoding; not at every finish, since leaving copies the K/V tensors. (On the
        # AVX2 VM 24 fp32 rows cost about what 32 do, so the gain there is small: README.)
        if len(members) - len(live) >= max(1, len(members) // 8):
            kept = torch.tensor(live, device=device)
            keys, values, rows = keys[:, kept], values[:, kept], rows[:, kept]
            pads, chosen = pads[kept], chosen[kept.cpu()]
            members = [members[row] for row in live]
        logits = forward(chosen[:, None].to(device), P + step)
    return results


def batched_reply_data(loaded, prompts: Sequence[str], out: Path, layer_ids: Sequence[int], tokens: int,
                       batch: int = 32, progress: bool = True) -> list[Path]:
    """`generate_data`'s shards (one per prompt, existing ones kept), from batches of `batch` prompts.
    Prompts are batched in order of length, so little of a batch is padding."""
    from tqdm import tqdm

    from dflash.chat.template import render_prompt
    from dflash.training.train_drafter import shard_path, write_reply_shard

    if batch < 1:
        raise ValueError(f"reply batch must be at least 1, got {batch}")
    (out / "data").mkdir(parents=True, exist_ok=True)
    rendered = {i: render_prompt(loaded.tokenizer, [{"role": "user", "content": p}])
                for i, p in enumerate(prompts) if not shard_path(out, i).exists()}
    longest = loaded.engine.kv.max_ctx - tokens
    too_long = [i for i, ids in rendered.items() if len(ids) > longest]
    if too_long:
        raise ValueError(f"prompt {too_long[0]} has {len(rendered[too_long[0]])} tokens: more than the "
                         f"{longest} that leave room for {tokens} reply tokens in {loaded.engine.kv.max_ctx}")
    pending = sorted(rendered, key=lambda i: len(rendered[i]))
    stop_ids = set(loaded.engine.eos_token_ids)
    model = loaded.engine.model
    with tqdm(total=len(prompts), initial=len(prompts) - len(pending), desc="generating (batched)",
              disable=not progress) as bar:
        for first in range(0, len(pending), batch):
            indices = pending[first : first + batch]
            replies = batched_greedy(model, [rendered[i] for i in indices], tokens, stop_ids, layer_ids)
            for index, (output, rows) in zip(indices, replies):
                bar.update(1)
                if len(output) < 2:
                    continue
                write_reply_shard(shard_path(out, index), rendered[index] + output[:-1], len(rendered[index]), rows,
                                  layer_ids)
    return [shard_path(out, i) for i in range(len(prompts)) if shard_path(out, i).exists()]
