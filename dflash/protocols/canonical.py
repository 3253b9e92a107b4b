"""The dialect-neutral request and result: what every dialect parses into and renders from.

Small on purpose; later dialects and features (tools, reasoning, output formats) grow it.
"""

from __future__ import annotations

import attrs

DEFAULT_MAX_TOKENS = 4096


@attrs.frozen
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@attrs.frozen
class GenerationRequest:
    messages: list[dict]  # [{"role": str, "content": str}], in conversation order
    model: str | None = None  # the name the client asked for; echoed back
    sampling: Sampling = Sampling()
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # a separate usage event at the end of a stream


@attrs.frozen
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
