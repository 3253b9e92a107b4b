"""Prompt lookup: find the latest earlier occurrence of the longest recent n-gram and propose what
followed it. No weights; strong on agent work, where code and tool output are echoed back."""

from __future__ import annotations

from typing import Sequence


class NgramDrafter:
    name = "ngram"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.sizes = range(max_n, min_n - 1, -1)  # longest match first
        self._tokens: list[int] = []
        # n-gram -> position just after its latest occurrence, for every n in sizes.
        self._latest: dict[tuple[int, ...], int] = {}

    def observe(self, start, hidden) -> None:
        pass

    def crop(self, length: int) -> None:
        pass

    def _sync(self, tokens: Sequence[int]) -> None:
        """Index the new tokens; start over when the sequence is not an extension of the last one."""
        known = len(self._tokens)
        if len(tokens) < known or list(tokens[max(0, known - 8) : known]) != self._tokens[max(0, known - 8) :]:
            self._tokens, self._latest, known = [], {}, 0
        self._tokens.extend(tokens[known:])
        for end in range(max(known, 1), len(self._tokens)):
            # Register n-grams ending at `end` (exclusive) — but only once a token follows them.
            for n in self.sizes:
                if end >= n:
                    self._latest[tuple(self._tokens[end - n : end])] = end

    def propose(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0 or len(tokens) < 2:
            return []
        self._sync(tokens)
        for n in self.sizes:
            if len(tokens) <= n:
                continue
            follow = self._latest.get(tuple(tokens[-n:]))
            if follow is not None and follow < len(tokens):
                return list(tokens[follow : follow + max_tokens])
        return []

    # Tokens the recent text must repeat of an earlier span for a proposal to be `confident`.
    CONFIDENT_MATCH = 8

    def confident(self, tokens: Sequence[int]) -> bool:
        """Whether the last CONFIDENT_MATCH tokens repeat the span that the proposal continues: the
        model is copying (a file echoed with an edit, a tool's output quoted), where its drafts are
        accepted far more often than on average, so the policy lets them through a pause."""
        if len(tokens) <= self.CONFIDENT_MATCH:
            return False
        self._sync(tokens)
        for n in self.sizes:
            follow = self._latest.get(tuple(tokens[-n:]))
            if follow is not None and follow < len(tokens):
                reach = min(self.CONFIDENT_MATCH, follow)
                return reach == self.CONFIDENT_MATCH and list(tokens[follow - reach : follow]) == list(tokens[-reach:])
        return False
