"""Call id -> the exact text the model generated for the turn that made the call.

Clients send tool-call turns back re-serialized (arguments re-encoded, reasoning dropped, the
prose and the calls split into items). Rendering that through the template gives different
tokens from the ones the model produced, which misses the prefix cache from that turn on and
shows the model a call format it did not write. With the original text the history is
token-for-token what the engine already holds.

Bounded LRU: by turns and by characters. In memory only; after a restart a miss falls back to
rendering the structured calls through the template.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class ToolMemory:
    def __init__(self, *, max_turns: int = 4096, max_chars: int = 64 * 1024 * 1024):
        self.max_turns = max_turns
        self.max_chars = max_chars
        self._turns: OrderedDict[tuple[str, ...], str] = OrderedDict()  # call ids of one turn -> its text
        self._turn_of: dict[str, tuple[str, ...]] = {}
        self._chars = 0

    def __len__(self) -> int:
        return len(self._turns)

    def remember(self, call_ids: Sequence[str], text: str) -> None:
        if not call_ids or len(text) > self.max_chars:
            return
        key = tuple(call_ids)
        self._drop(key)
        self._turns[key] = text
        self._chars += len(text)
        for call_id in key:
            self._turn_of[call_id] = key
        while len(self._turns) > self.max_turns or self._chars > self.max_chars:
            self._drop(next(iter(self._turns)))

    def recall(self, call_ids: Sequence[str]) -> str | None:
        """The turn's text when every id belongs to the same remembered turn and none is missing:
        a client that edited the calls gets them rendered as it sent them."""
        keys = {self._turn_of.get(call_id) for call_id in call_ids}
        if len(keys) != 1 or None in keys:
            return None
        key = keys.pop()
        if set(key) != set(call_ids):
            return None
        self._turns.move_to_end(key)
        return self._turns[key]

    def _drop(self, key: tuple[str, ...]) -> None:
        text = self._turns.pop(key, None)
        if text is None:
            return
        self._chars -= len(text)
        for call_id in key:
            if self._turn_of.get(call_id) == key:
                del self._turn_of[call_id]
