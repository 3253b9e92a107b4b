"""A request's sampling settings: the one type the dialects parse into and the engine samples with.

Pure data, no torch, in neither `protocols` nor `engine`, so both may import it (the import rule
keeps `protocols` away from `engine` and the engine away from `protocols`): a request's sampling
goes from the parsed JSON to the engine's sampler as it is, not copied field by field.
The chain these settings drive is in dflash/engine/sampling.py.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    rep_window: int = 256
    logit_bias: dict[int, float] = attrs.field(factory=dict)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
