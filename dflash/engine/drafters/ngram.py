"""Prompt lookup: find the latest earlier occurrence of the longest recent n-gram and propose what
followed it. No weights; strong on agent work, where code and tool output are echoed back."""

from __future__ import annotations

import contextlib
import gc
from typing import Sequence


class NgramDrafter:
    name = "ngram"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.sizes = range(max_n, min_n - 1, -1)  # longest match first
        self._tokens: list[int] = []
        # n-gram -> the positions just after its occurrences, in order (the latest last); an
        # occurrence counts once a token follows it. Kept across generations (Engine.drafters, begin):
        # indexing a 20K-token prompt afresh had cost 70-170 ms of Python inside the third decode
        # step of every request (AVX2, Zen 3), against a ~10 ms step, and the policy timed it as
        # that step's cost (a plain step's or a verification's).
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._checked = False  # whether this generation's text was compared with the index in full

    def begin(self, tokens: Sequence[int]) -> None:
        """A generation starts on `tokens` (its prompt as the target computes it): they are compared
        with the indexed text in full, the index cut back to what they share (another conversation
        shares nothing, or a prefix) and extended to them, before the decode steps the policy times."""
        self._checked = False
        self._sync(tokens)

    def observe(self, start, hidden) -> None:
        pass

    def crop(self, length: int) -> None:
        pass

    def _sync(self, tokens: Sequence[int]) -> None:
        """Index the new tokens, after cutting the index back to the tokens it shares with these.
        Within a generation the text only grows, so its last indexed tokens are compared alone."""
        known = len(self._tokens)
        tail = max(0, known - 8)
        if not self._checked or len(tokens) < known or list(tokens[tail:known]) != self._tokens[tail:]:
            shared = shared_prefix(self._tokens, tokens)
            if known - shared > shared:  # indexing the shared tokens again costs less than the cut
                self._tokens, self._ends = [], {}
            else:
                self._cut(shared)
            self._checked = True
            known = len(self._tokens)
        self._tokens.extend(tokens[known:])
        # Register the n-grams ending at `end` (exclusive) once a token follows them: ends from
        # `known` to the last token's position, each size's keys zipped from shifted slices (a
        # prompt's thousands at a time).
        ends, tokens_now = self._ends, self._tokens
        with collector_paused(len(tokens_now) - known):
            for n in self.sizes:
                first, stop = max(known, 1, n), len(tokens_now)
                grams = zip(*(tokens_now[first - n + i : stop - n + i] for i in range(n)))
                for end, key in zip(range(first, stop), grams):
                    ends.setdefault(key, []).append(end)

    def _cut(self, length: int) -> None:
        """Keep the first `length` tokens: forget the occurrences followed by a token past them
        (the tails of their lists, since each list is in order)."""
        with collector_paused(len(self._tokens) - length):
            for end in range(max(length, 1), len(self._tokens)):
                for n in self.sizes:
                    if end >= n:
                        key = tuple(self._tokens[end - n : end])
                        ends = self._ends.get(key)
                        while ends and ends[-1] >= length:
                            ends.pop()
                        if not ends:
                            self._ends.pop(key, None)
        del self._tokens[length:]

    def _follow(self, tokens: Sequence[int], n: int) -> int | None:
        """Where the latest earlier occurrence of the last n tokens was followed (None: nowhere)."""
        ends = self._ends.get(tuple(tokens[-n:]))
        return ends[-1] if ends else None

    def propose(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0 or len(tokens) < 2:
            return []
        self._sync(tokens)
        for n in self.sizes:
            if len(tokens) <= n:
                continue
            follow = self._follow(tokens, n)
            if follow is not None:
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
            follow = self._follow(tokens, n)
            if follow is not None:
                reach = min(self.CONFIDENT_MATCH, follow)
                return reach == self.CONFIDENT_MATCH and list(tokens[follow - reach : follow]) == list(tokens[-reach:])
        return False


@contextlib.contextmanager
def collector_paused(tokens: int):
    """Python's cyclic garbage collector off while `tokens` tokens (over 256) are indexed. Why: the
    index's new lists and keys set off collections that each walk every object the process holds
    (torch's included): a 20K-token prompt took 174-335 ms to index with the collector on and 29-35
    with it off (AVX2, Zen 3). The index holds no cycles; the collector runs again after."""
    if tokens <= 256 or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    length = min(len(a), len(b))
    if list(a[:length]) == list(b[:length]):  # the usual case (a conversation goes on), at C speed
        return length
    low, high = 0, length  # a[:low] == b[:low]; a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if list(a[low:middle]) == list(b[low:middle]):
            low = middle
        else:
            high = middle
    return low
