"""A llama-architecture GGUF file's tensors as a Hugging Face-named float state dict, read with the
`gguf` package's reader and dequantized here with torch, without transformers.

transformers' GGUF loader (loading.gguf_to_folder) is what serving uses; this reader exists for
places that have torch and the `gguf` package but not a matching transformers, or no tokenizer
at all: the drafter's at-scale data run on an accelerator machine (training/at_scale.py), which
gets the embedded model's GGUF file and nothing else. tests/model checks that both give the same
numbers bit for bit.

Two things llama.cpp's converter does to a Hugging Face checkpoint are undone here: the q and k
projections' rows are interleaved per head for its RoPE kernel (`_unpermute`), and the shape is
written innermost-first (GGUF [in, out] is torch [out, in]).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

# GGUF tensor name -> Hugging Face name ({i}: the layer).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFTensorError(ValueError):
    pass


def _q8_0(raw: np.ndarray, count: int) -> Tensor:
    """Blocks of 32: an fp16 scale, then 32 int8 codes; w = d * q."""
    blocks = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1, 34).copy())
    scale = blocks[:, :2].contiguous().view(torch.float16).float()
    codes = blocks[:, 2:].contiguous().view(torch.int8).float()
    return (scale * codes).reshape(-1)[:count]


def _q4_1(raw: np.ndarray, count: int) -> Tensor:
    """Blocks of 32: fp16 scale d, fp16 minimum m, 16 bytes of nibbles (low nibbles are weights
    0..15, high nibbles 16..31); w = d * q + m."""
    blocks = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1, 20).copy())
    scale = blocks[:, 0:2].contiguous().view(torch.float16).float()
    minimum = blocks[:, 2:4].contiguous().view(torch.float16).float()
    packed = blocks[:, 4:].to(torch.int16)
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=1).float()
    return (scale * codes + minimum).reshape(-1)[:count]


def _dequantize(tensor: Any) -> Tensor:
    kind = tensor.tensor_type.name
    count = int(tensor.n_elements)
    if kind in ("F32", "F16"):
        flat = torch.from_numpy(np.ascontiguousarray(tensor.data).astype(np.float32).reshape(-1))
    elif kind == "Q8_0":
        flat = _q8_0(tensor.data, count)
    elif kind == "Q4_1":
        flat = _q4_1(tensor.data, count)
    else:
        raise GGUFTensorError(f"GGUF tensor {tensor.name!r} is {kind}; this reader knows F32, F16, Q8_0 and Q4_1")
    shape = [int(n) for n in reversed(tensor.shape.tolist())]  # GGUF lists the innermost dimension first
    return flat.reshape(shape)


def _unpermute(weight: Tensor, heads: int) -> Tensor:
    """llama.cpp stores q/k rows per head as (pairs, 2) interleaved; Hugging Face as (2, pairs)."""
    rows, columns = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise GGUFTensorError(f"GGUF file lacks the field {key!r}")
    return field.parts[field.data[0]].tolist()[0]


def read_gguf_state(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(Hugging Face-named fp32 tensors, a Hugging Face config.json dict) of a llama GGUF file."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if architecture != "llama":
        raise GGUFTensorError(f"GGUF file {str(path)!r} holds a {architecture!r} model; this reader reads llama")
    heads = int(_field(reader, "llama.attention.head_count"))
    kv_heads = int(_field(reader, "llama.attention.head_count_kv"))
    state: dict[str, Tensor] = {}
    for tensor in reader.tensors:
        stem, _, suffix = tensor.name.rpartition(".")
        parts = stem.split(".")
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
        elif stem in _TOP_NAMES:
            name = f"{_TOP_NAMES[stem]}.{suffix}"
        else:
            raise GGUFTensorError(f"unknown GGUF tensor {tensor.name!r}")
        value = _dequantize(tensor)
        if name.endswith("q_proj.weight"):
            value = _unpermute(value, heads)
        elif name.endswith("k_proj.weight"):
            value = _unpermute(value, kv_heads)
        state[name] = value
    hidden = int(_field(reader, "llama.embedding_length"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "vocab_size": state["model.embed_tokens.weight"].shape[0],
        "tie_word_embeddings": "lm_head.weight" not in state,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
    }
    return state, config
