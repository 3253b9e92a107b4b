"""Speculative decoding: which drafter proposes, how many tokens, and lossless verification.

Verification (in `Generation._speculative_step`) samples the target at each verified position with
the full sampling chain — penalty history as it stands after the preceding accepted tokens — and
accepts a draft token only when it equals that sample. At temperature 0 the sample is the argmax,
so the output is token for token what plain greedy decoding produces. Above 0 every emitted token is
a target sample given exactly the emitted prefix; for a deterministic drafter that is exact
speculative sampling. Each verified position consumes one draw from the request's generator, as a
plain step does, so a seeded request gives the same tokens with or without speculation.

The policy keeps speculation from costing speed: it measures the time of plain steps and of
verification steps and, when speculating yields fewer tokens per second than plain decoding, it
shrinks the block and then pauses speculation for a while before probing again.
"""

from __future__ import annotations

from typing import Literal, Sequence

import attrs

DrafterMode = Literal["auto", "dflash", "ngram", "none"]


@attrs.frozen
class SpeculationConfig:
    drafter: DrafterMode = "none"
    max_draft_tokens: int = 8  # k: tokens proposed per verification (DFlash: block_size - 1 at most)
    ngram_min: int = 2
    ngram_max: int = 4
    adaptive: bool = True


class _Ema:
    def __init__(self, alpha: float, value: float | None = None):
        self.alpha = alpha
        self.value = value

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self.alpha * (sample - self.value)


class SpeculationPolicy:
    """Per generation: picks the drafter and block size for each decode step."""

    # Plain steps to take after speculation measured slower than plain decoding; doubled after each
    # probe that fails again (so a drafter that never pays costs ever less), reset by one that pays.
    PAUSE_STEPS = 16
    MAX_PAUSE_STEPS = 512

    def __init__(self, config: SpeculationConfig, drafters: dict[str, object]):
        self.config = config
        self.drafters = drafters  # name -> drafter, in preference order for auto mode
        self.block = config.max_draft_tokens
        self.plain_seconds = _Ema(0.3)
        self.tokens_per_second = {name: _Ema(0.3) for name in drafters}
        self.pause = 0
        self.pause_length = self.PAUSE_STEPS

    def choose(self, tokens: Sequence[int]) -> tuple[object | None, list[int]]:
        """The drafter for this step and its proposal; (None, []) means take a plain step."""
        if not self.drafters:
            return None, []
        if self.pause > 0:
            self.pause -= 1
            return None, []
        if self.config.adaptive and self.plain_seconds.value is None:
            return None, []  # measure one plain step first: the baseline speculation must beat
        for name, drafter in self.drafters.items():
            draft = drafter.propose(tokens, self.block)
            if draft:
                return drafter, draft
        return None, []

    def record_plain(self, seconds: float) -> None:
        self.plain_seconds.add(seconds)

    def record(self, drafter, proposed: int, accepted: int, seconds: float) -> None:
        if not self.config.adaptive:
            return
        rate = self.tokens_per_second[drafter.name]
        rate.add((accepted + 1) / max(seconds, 1e-9))
        plain_rate = 1.0 / max(self.plain_seconds.value or seconds, 1e-9)
        if accepted < proposed / 2 and self.block > 1:
            self.block = max(1, self.block // 2)
        elif accepted == proposed:
            self.block = min(self.config.max_draft_tokens, self.block * 2)
        if rate.value < plain_rate:
            self.pause = self.pause_length
            self.pause_length = min(2 * self.pause_length, self.MAX_PAUSE_STEPS)
            rate.value = plain_rate  # probe again from neutral after the pause
        else:
            self.pause_length = self.PAUSE_STEPS
