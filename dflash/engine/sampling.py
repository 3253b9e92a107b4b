"""The sampling chain, in the order of the reference API's "Sampling Chain" (shared/spec/API.md
beside the repository).

logit_bias -> repetition_penalty (HF, multiplicative) -> frequency + presence penalty (OpenAI,
additive) -> top_k -> temperature softmax -> top_p -> random draw, or argmax at temperature 0.

Penalties count the last `rep_window` tokens generated in this request (not the prompt: an agent
echoing code from its context must not be pushed away from it), and apply at temperature 0 too.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from dflash.engine.native import extension
from dflash.sampling_params import SamplingParams


def greedy_token(logits: Tensor) -> int:
    """torch.argmax of fp32 logits [V] (the first largest; NaN above all): native/logits.cpp's
    where built (torch's took ~45 us a 49152-wide row on Zen 4, a verification makes 8), else torch's."""
    native = extension()
    if native is not None and logits.dtype == torch.float32 and logits.device.type == "cpu":
        return int(native.argmax_rows(logits))
    return int(torch.argmax(logits))


def greedy_tokens(logits: Tensor) -> Tensor:
    """torch.argmax(logits, dim=-1) of fp32 rows [R, V], as greedy_token does each."""
    native = extension()
    if native is not None and logits.dtype == torch.float32 and logits.device.type == "cpu":
        return native.argmax_rows(logits)
    return logits.argmax(dim=-1)


class Sampler:
    """Applies one request's chain; owns the request's random generator so `seed` reproduces it."""

    def __init__(self, params: SamplingParams, vocab_size: int):
        self.params = params
        self.vocab_size = vocab_size
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self._bias: Tensor | None = None
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias.keys()), dtype=torch.long)
            if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
                raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}), got {params.logit_bias!r}")
            bias = torch.zeros(vocab_size)
            bias[ids] = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
            self._bias = bias

    def process(self, logits: Tensor, history: Sequence[int]) -> Tensor:
        """Logits [V] fp32 -> processed logits before temperature (bias and penalties applied)."""
        p = self.params
        if self._bias is not None:
            logits = logits + self._bias.to(logits.device)
        if p.has_penalties and history:
            window = torch.tensor(list(history[-p.rep_window :]), dtype=torch.long, device=logits.device)
            ids, counts = torch.unique(window, return_counts=True)
            logits = logits.clone()
            if p.repetition_penalty != 1.0:
                chosen = logits[ids]
                logits[ids] = torch.where(chosen > 0, chosen / p.repetition_penalty, chosen * p.repetition_penalty)
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                logits[ids] -= counts.to(logits.dtype) * p.frequency_penalty + p.presence_penalty
        return logits

    def probabilities(self, logits: Tensor) -> Tensor:
        """Processed logits [V] -> the distribution the draw uses (top_k, temperature, top_p)."""
        p = self.params
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits / max(p.temperature, 1e-5), dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = sorted_probs.cumsum(-1)
            # Drop a token when the tokens before it already reach top_p; the top one always stays.
            drop_sorted = (cumulative - sorted_probs) >= p.top_p
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
            probs = probs / probs.sum()
        return probs

    def sample(self, logits: Tensor, history: Sequence[int]) -> int:
        processed = self.process(logits, history)
        if self.params.greedy:
            return greedy_token(processed)
        probs = self.probabilities(processed)
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))
