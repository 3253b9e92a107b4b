"""Tiny random-weight models of each supported architecture, built with transformers' own classes."""

from __future__ import annotations

import torch
import transformers

from dflash.engine.model import ModelArgs, build_transformer

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"tie_word_embeddings": True}),
    "llama3-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}},
    ),
    "yarn-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64}},
    ),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": False}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
}


def tiny_hf_model(name: str, seed: int = 0, **sizes):
    """`sizes` override COMMON's (e.g. hidden_size), for tests that need wider layers."""
    config_class, model_class, extra = ARCHITECTURES[name]
    config = config_class(**{**COMMON, **sizes}, **extra)
    config.architectures = [model_class.__name__]
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # random biases too, so the Qwen2 qkv bias path is exercised
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def ours_from_hf(hf_model, dtype=torch.float32):
    args = ModelArgs.from_hf_config(hf_model.config.to_dict())
    return build_transformer(args, hf_model.state_dict(), dtype)
