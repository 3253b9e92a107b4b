"""Cutting generated text before the first stop string.

Text arrives in pieces that split anywhere, so a stop string can span tokens. The longest tail
of the pending text that could still begin a stop string is held back until the next piece
decides it; everything before it is safe to send. The stop string itself is never emitted.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    def __init__(self, stop_strings: Sequence[str]):
        self._stop_strings = [stop for stop in stop_strings if stop]
        self._pending = ""
        self.hit = False

    def push(self, text: str) -> str:
        """The part of `text` (with what was held back) that can go out now."""
        if self.hit:
            return ""
        pending = self._pending + text
        cut = min((index for stop in self._stop_strings if (index := pending.find(stop)) >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            self._pending = ""
            return pending[:cut]
        held = self._held_length(pending)
        self._pending = pending[len(pending) - held:]
        return pending[:len(pending) - held]

    def flush(self) -> str:
        """At the end of generation the held tail can no longer become a stop string."""
        text, self._pending = self._pending, ""
        return "" if self.hit else text

    def _held_length(self, text: str) -> int:
        longest = 0
        for stop in self._stop_strings:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
