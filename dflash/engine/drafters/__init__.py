"""Drafters propose tokens after the committed sequence; the engine verifies them in one forward."""

from __future__ import annotations

from typing import Protocol, Sequence

from torch import Tensor


class Drafter(Protocol):
    name: str
    # Target layers whose hidden states the drafter consumes (empty when it needs none).
    capture_layers: tuple[int, ...]

    def observe(self, start: int, hidden: list[Tensor]) -> None:
        """The target computed positions start..start+T-1; `hidden` holds their captured layers."""

    def crop(self, length: int) -> None:
        """The target rolled back to `length` committed tokens."""

    def propose(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Up to max_tokens guesses for what follows `tokens` (committed + the pending token)."""
