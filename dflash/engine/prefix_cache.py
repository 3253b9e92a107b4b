"""Snapshots of the KV state at prompt boundaries, so a later prompt that starts the same way
restores the deepest match and prefills only the rest.

Two tiers share one LRU discipline: boundary entries (message boundaries the chat layer names, the
prefix a conversation's next request will share) and exact-prompt entries (an identical request
skips prefill). Entries are right-sized copies of the cache (`[:length]`), bounded by a slot count
and a memory budget. The engine's live state is not stored here: it is reused directly when the next
prompt extends it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import attrs
from torch import Tensor


@attrs.define
class CacheEntry:
    tokens: tuple[int, ...]
    snapshot: object  # KVSnapshot (built-in decoder) or an HFCache copy
    draft_rows: Tensor | None  # the DFlash drafter's captured target rows for these tokens
    nbytes: int
    generated_from: int | None = None  # tokens from here on were generated (an agent turn checkpoint)


def snapshot_bytes(snapshot, draft_rows: Tensor | None) -> int:
    total = getattr(snapshot, "nbytes", 0)
    if draft_rows is not None:
        total += draft_rows.numel() * draft_rows.element_size()
    return total


class PrefixCache:
    def __init__(self, slots: int, budget_bytes: int):
        self.slots = slots
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[tuple[int, ...], CacheEntry] = OrderedDict()
        self.nbytes = 0
        self.hits = 0  # entries restored for a prompt (counted by the caller that restores them)

    @property
    def enabled(self) -> bool:
        return self.slots > 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens: Sequence[int]) -> bool:
        return tuple(tokens) in self._entries

    def deepest(self, prompt: Sequence[int]) -> CacheEntry | None:
        """The deepest entry that is a proper prefix of `prompt` (one token must stay to compute),
        without counting a hit or moving it in the LRU order."""
        best: CacheEntry | None = None
        for key, entry in self._entries.items():
            n = len(key)
            if n < len(prompt) and (best is None or n > len(best.tokens)) and tuple(prompt[:n]) == key:
                best = entry
        return best

    def lookup(self, prompt: Sequence[int]) -> CacheEntry | None:
        """The deepest entry that is a proper prefix of `prompt`, counted as a hit."""
        best = self.deepest(prompt)
        if best is not None:
            self._entries.move_to_end(best.tokens)
        return best

    def store(self, tokens: Sequence[int], snapshot, draft_rows: Tensor | None = None,
              generated_from: int | None = None) -> None:
        if not self.enabled:
            return
        key = tuple(tokens)
        entry = CacheEntry(key, snapshot, draft_rows, snapshot_bytes(snapshot, draft_rows), generated_from)
        if entry.nbytes > self.budget_bytes:
            return
        if key in self._entries:
            self.nbytes -= self._entries.pop(key).nbytes
        self._entries[key] = entry
        self.nbytes += entry.nbytes
        while len(self._entries) > self.slots or self.nbytes > self.budget_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
