"""Any other transformers causal LM (e.g. Gemma 3), behind the same interface as model.Transformer.

Slower than the built-in decoder (transformers' generic code path and a growing DynamicCache), but it
lets the server run architectures the built-in decoder does not implement.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

import attrs
import torch
from torch import Tensor


@attrs.frozen
class HFArgs:
    vocab_size: int
    num_layers: int
    max_position_embeddings: int


class HFCache:
    """KV state over a transformers DynamicCache: a length, crop, snapshot and restore."""

    snapshots_any_prefix = False  # a sliding-window layer may not crop back: snapshot where it stands

    def __init__(self, config, max_ctx: int):
        self.config = config
        self.max_ctx = max_ctx
        self._reset()

    def _reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.config)
        # Sliding-window layers drop old states unless told to keep them until the next crop.
        self.cache.activate_past_recording()
        self.length = 0

    def keepable(self, length: int) -> int:
        """How many of the first `length` positions a crop keeps, as far as known beforehand: all
        (a sliding-window layer's loss shows only in crop)."""
        return length

    def can_snapshot(self, length: int) -> bool:
        return True

    def crop(self, length: int) -> None:
        """Roll back to `length`; where a sliding-window layer no longer holds the states needed,
        start over empty (length 0) — the caller reads `length` and recomputes."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop KV length {self.length} to {length}")
        if length == self.length:
            return
        try:
            self.cache.crop(length - self.length)  # transformers 5 crops by a negative count
            self.length = length
        except RuntimeError:
            self._reset()

    def snapshot(self, length: int | None = None) -> "HFCache":
        snap = copy.deepcopy(self)
        if length is not None:
            snap.crop(length)
        return snap

    def restore(self, snap: "HFCache") -> None:
        self.cache = copy.deepcopy(snap.cache)
        self.length = snap.length


class HFModel:
    def __init__(self, model):
        self.model = model
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = config
        self.args = HFArgs(
            vocab_size=config.vocab_size,
            num_layers=config.num_hidden_layers,
            max_position_embeddings=getattr(config, "max_position_embeddings", 4096),
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def new_kv_cache(self, max_ctx: int) -> HFCache:
        return HFCache(self.config, max_ctx)

    @torch.inference_mode()
    def __call__(
        self,
        tokens: Tensor,
        start_position: int,
        kv: HFCache,
        *,
        capture_layers: Sequence[int] = (),
        attention_mask: Tensor | None = None,
        logits_positions: slice | Sequence[int] | None = slice(-1, None),
        capture_into: Tensor | None = None,
    ) -> tuple[Tensor, list[Tensor]]:
        if start_position != kv.length:
            kv.crop(start_position)
        T = tokens.shape[0]
        end = start_position + T
        if end > kv.max_ctx:
            raise ValueError(f"positions up to {end} exceed the KV cache size {kv.max_ctx}")
        positions = torch.arange(start_position, end, device=tokens.device).unsqueeze(0)
        mask = None
        if attention_mask is not None:  # bool [T, end] -> additive [1, 1, T, end]
            mask = torch.zeros(attention_mask.shape, dtype=self.dtype, device=tokens.device)
            mask = mask.masked_fill(~attention_mask, torch.finfo(self.dtype).min)[None, None]
        out = self.model(
            input_ids=tokens.unsqueeze(0),
            past_key_values=kv.cache,
            position_ids=positions,
            cache_position=positions[0],
            attention_mask=mask,
            use_cache=True,
            output_hidden_states=bool(capture_layers),
        )
        kv.length = end
        logits = out.logits[0]
        if logits_positions is not None:
            logits = logits[logits_positions]
        # hidden_states[0] is the embedding output; layer i's output is hidden_states[i + 1].
        captured = [out.hidden_states[i + 1][0].clone() for i in capture_layers] if capture_layers else []
        if capture_into is not None:  # as Transformer.forward: written there, none returned
            capture_into.copy_(torch.cat(captured, dim=-1))
            return logits.float(), []
        return logits.float(), captured


def load_hf_model(folder: Path, dtype: torch.dtype) -> HFModel:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return HFModel(model.eval())
