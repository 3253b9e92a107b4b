"""Prefill in chunks, then decode one token at a time — every call to `step()` is one bounded unit.

The scheduler drives a `Generation` step by step from its worker thread and may stop between any
two steps: the KV cache is consistent after every step, so closing a generation early leaves the
engine ready for the next one.
"""

from __future__ import annotations

import time
from typing import Literal, Sequence

import attrs
import torch

from dflash.engine.sampling import Sampler, SamplingParams

FinishReason = Literal["stop", "length"]


@attrs.define
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV state was reused, not computed
    prefilled_tokens: int = 0  # prompt tokens computed for this request
    generated_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0


@attrs.define
class StepOutput:
    tokens: list[int]  # tokens committed in this step (empty for all prefill chunks but the last)
    finished: FinishReason | None
    phase: Literal["prefill", "decode"]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Engine:
    """One model, one KV cache, one live generation at a time."""

    def __init__(self, model, *, max_ctx: int, prefill_chunk: int = 256, eos_token_ids: Sequence[int] = ()):
        self.model = model
        self.max_ctx = max_ctx
        self.prefill_chunk = prefill_chunk
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = model.args.vocab_size
        self.kv = model.new_kv_cache(max_ctx)
        # Tokens whose keys/values sit in kv[:length]; the next prompt reuses the common prefix.
        self.committed: list[int] = []
        self._live: Generation | None = None

    def start(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        max_tokens: int,
        stop_token_ids: Sequence[Sequence[int]] = (),
    ) -> "Generation":
        if self._live is not None:
            self._live.close()
        generation = Generation(self, list(prompt_ids), sampling, max_tokens, stop_token_ids)
        self._live = generation
        return generation

    def forward(self, tokens: list[int], **kwargs):
        """Append `tokens` after the committed ones; returns (logits, captured hidden states)."""
        start = self.kv.length
        ids = torch.tensor(tokens, dtype=torch.long, device=self.model.device)
        logits, hidden = self.model(ids, start, self.kv, **kwargs)
        self.committed.extend(tokens)
        return logits, hidden

    def rollback(self, length: int) -> None:
        self.kv.crop(length)
        del self.committed[length:]


class Generation:
    def __init__(
        self,
        engine: Engine,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_tokens: int,
        stop_token_ids: Sequence[Sequence[int]],
    ):
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= engine.max_ctx:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the context holds {engine.max_ctx} "
                "including at least one generated token"
            )
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.sampler = Sampler(sampling, engine.vocab_size)
        self.max_tokens = min(max_tokens, engine.max_ctx - len(prompt_ids))
        self.stop_token_ids = [list(s) for s in stop_token_ids if s]
        self.output: list[int] = []
        self.finished: FinishReason | None = None
        self.closed = False
        # Reuse the engine's live KV state for the shared prefix; at least one prompt token is
        # always computed, because its logits give the first generated token.
        reused = min(common_prefix_length(engine.committed, prompt_ids), len(prompt_ids) - 1)
        engine.rollback(reused)
        self.position = reused  # next prompt index to prefill
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids), cached_tokens=reused)

    @property
    def prefilling(self) -> bool:
        return self.position < len(self.prompt_ids)

    def step(self) -> StepOutput:
        if self.finished is not None or self.closed:
            raise RuntimeError("step() called on a finished generation")
        started = time.perf_counter()
        if self.prefilling:
            out = self._prefill_chunk()
            self.stats.prefill_ms += (time.perf_counter() - started) * 1000
        else:
            out = self._decode_one()
            self.stats.decode_ms += (time.perf_counter() - started) * 1000
        return out

    def _prefill_chunk(self) -> StepOutput:
        chunk = self.prompt_ids[self.position : self.position + self.engine.prefill_chunk]
        self.position += len(chunk)
        self.stats.prefilled_tokens += len(chunk)
        logits, _ = self.engine.forward(chunk)
        if self.prefilling:
            return StepOutput([], None, "prefill")
        return self._accept(logits[-1], "prefill")

    def _decode_one(self) -> StepOutput:
        logits, _ = self.engine.forward([self.output[-1]])
        return self._accept(logits[-1], "decode")

    def _accept(self, logits: torch.Tensor, phase) -> StepOutput:
        token = self.sampler.sample(logits, self.output)
        self.stats.generated_tokens += 1
        if token in self.engine.eos_token_ids:
            self.finished = "stop"
            return StepOutput([], "stop", phase)
        self.output.append(token)
        if any(self.output[-len(s) :] == s for s in self.stop_token_ids):
            self.finished = "stop"
        elif len(self.output) >= self.max_tokens:
            self.finished = "length"
        return StepOutput([token], self.finished, phase)

    def close(self) -> None:
        """Release the engine; its KV state keeps every computed token for the next prompt to reuse."""
        self.closed = True
        if self.engine._live is self:
            self.engine._live = None

    def run(self) -> list[int]:
        """Step to the end (for the CLI, tests and benchmarks); returns the generated tokens."""
        while self.finished is None:
            self.step()
        self.close()
        return self.output
