"""The engine as the scheduler drives it: start a generation, step it, close it; check grammars;
hold an agent's turn; close at shutdown.

`dflash.engine.generate` implements it, and so does the fake engine the server tests run on
(tests/unit/fakes.py); tests/model/test_engine_contract.py checks both against these Protocols,
member by member and signature by signature, so neither drifts from what the scheduler relies on.
The numbers a generation reports are plain data, one class both use. Every call runs in the
scheduler's engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol

import attrs

from dflash.sampling_params import SamplingParams

if TYPE_CHECKING:
    from torch import Tensor

FinishReason = Literal["stop", "length"]


def acceptance_length(accepted_tokens: int, verification_steps: int) -> float:
    """Mean tokens committed per verification forward (accepted drafts + the target's token)."""
    if not verification_steps:
        return 0.0
    return (accepted_tokens + verification_steps) / verification_steps


@attrs.define
class DraftCounts:
    """One drafter's share of a generation's speculation."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    verification_steps: int = 0

    @property
    def acceptance_length(self) -> float:
        return acceptance_length(self.accepted_tokens, self.verification_steps)


@attrs.define
class GenerationStats:
    """A generation's numbers so far: data, one class for every engine (the scheduler hands a copy
    to the handler after each step)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV state was reused, not computed
    prefilled_tokens: int = 0  # prompt tokens computed for this request
    generated_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    agent_turn_cache_hit: bool = False  # the reused prefix includes a turn this server generated
    draft_tokens: int = 0  # proposed by a drafter
    accepted_tokens: int = 0  # of those, verified equal to the target's own choice
    verification_steps: int = 0
    compressed_from_tokens: int = 0  # the prompt's length before speculative prefill dropped tokens; 0 if it did not
    scoring_ms: float = 0.0  # speculative prefill's scorer
    # The same three numbers for each drafter that proposed (by drafter name: "ngram", "dflash").
    drafters: dict[str, DraftCounts] = attrs.field(factory=dict)

    def record_draft(self, drafter: str, proposed: int, accepted: int) -> None:
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        self.verification_steps += 1
        counts = self.drafters.setdefault(drafter, DraftCounts())
        counts.draft_tokens += proposed
        counts.accepted_tokens += accepted
        counts.verification_steps += 1

    @property
    def acceptance_length(self) -> float:
        return acceptance_length(self.accepted_tokens, self.verification_steps)


@attrs.frozen
class CacheTier:
    """One tier of the prefix caches: what it holds and how often a lookup found an entry."""

    entries: int = 0
    bytes: int = 0
    hits: int = 0


@attrs.frozen
class CacheStats:
    """What the engine keeps between requests, read in the engine thread between steps."""

    kv_tokens: int = 0  # tokens whose keys/values the live KV state holds
    kv_capacity: int = 0  # the most it can hold (max_ctx)
    tiers: dict[str, CacheTier] = attrs.field(factory=dict)  # "prefix", "exact", "disk" when enabled


class Step(Protocol):
    tokens: list[int]  # committed in this step; empty for a prefill chunk
    finished: FinishReason | None  # set on the last step


class TokenSampler(Protocol):
    """A generation's sampler. Every sampled token passes through `sample`, which is why the
    scheduler's logprob recorder stands in for it; `process` and `probabilities` let the recorder
    see the distribution the token was drawn from."""

    params: SamplingParams

    def sample(self, logits: Tensor, history: Sequence[int]) -> int: ...
    def process(self, logits: Tensor, history: Sequence[int]) -> Tensor: ...
    def probabilities(self, logits: Tensor) -> Tensor: ...


class Generation(Protocol):
    sampler: TokenSampler  # replaceable before the first step
    stats: GenerationStats

    def step(self) -> Step:
        """One bounded unit of work: a prefill chunk, or one decode or speculative step."""
        ...

    def close(self) -> None:
        """End the generation (at any step boundary); the engine is then ready for the next."""
        ...


class GrammarChecker(Protocol):
    def validate(self, grammar: str) -> None:
        """Raise dflash.engine.grammar.GrammarError if `grammar` is invalid or unsupported."""
        ...


class Engine(Protocol):
    def start(self, prompt_ids: Sequence[int], sampling: SamplingParams, max_tokens: int, *,
              snapshot_at: Sequence[int] = (), grammar: str | None = None,
              protected: Sequence[tuple[int, int]] = ()) -> Generation:
        """A new generation. One is live at a time: the scheduler closes each before the next.
        `snapshot_at`: message boundaries to keep in the prefix cache; `grammar`: an llguidance
        grammar the output must follow; `protected`: token spans [start, end) that prompt
        compression must keep."""
        ...

    def checkpoint_prefix(self, tokens: Sequence[int]) -> int:
        """Agent turn cache, between generations: hold `tokens` and keep a snapshot of them."""
        ...

    def grammar_tokenizer(self) -> GrammarChecker: ...

    def cache_stats(self) -> CacheStats:
        """The live KV state and the prefix caches, for metrics; between steps."""
        ...

    def close(self) -> None:
        """At shutdown, after the last generation."""
        ...
