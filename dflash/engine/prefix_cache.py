"""Snapshots of the KV state at prompt boundaries, so a later prompt that starts the same way
restores the deepest match and prefills only the rest.

Two tiers share one LRU discipline: boundary entries (message boundaries the chat layer names, the
prefix a conversation's next request will share) and exact-prompt entries (an identical request
skips prefill). Entries are right-sized copies of the cache (`[:length]`), each built on the entry
of its longest prefix where there is one (kv.KVSnapshot: only its own positions are copied), bounded
by a slot count and a memory budget. The engine's live state is not stored here: it is reused directly when the next
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
    draft_rows: tuple[Tensor, ...] | None  # the DFlash drafter's captured target rows for these tokens, in pieces
    nbytes: int
    generated_from: int | None = None  # tokens from here on were generated (an agent turn checkpoint)


def snapshot_bytes(snapshot, draft_rows: Sequence[Tensor] | None) -> int:
    """The entry's memory: its snapshot's whole chain (the bases it shares included) and rows."""
    return sum(_parts(snapshot, draft_rows).values())


def _parts(snapshot, draft_rows: Sequence[Tensor] | None) -> dict[int, int]:
    """id -> bytes of each piece of memory an entry holds: its snapshot's chain (kv.KVSnapshot)
    and its draft rows' pieces, which it may share with other entries."""
    links = snapshot.chain() if hasattr(snapshot, "chain") else [snapshot]
    parts = {id(link): getattr(link, "nbytes", 0) for link in links}
    for piece in draft_rows or ():
        parts[id(piece)] = piece.numel() * piece.element_size()
    return parts


def _given(key: tuple[int, ...], generated_from: int | None, prompt: Sequence[int]) -> int:
    """How many of `prompt`'s tokens the entry keyed `key` gives (see PrefixCache.deepest)."""
    n = len(key)
    if n < len(prompt) and tuple(prompt[:n]) == key:
        return n
    if generated_from is None or generated_from >= len(prompt):
        return 0
    shared = generated_from + 1  # the turn's prompt and its first generated token, at least
    if tuple(prompt[:shared]) != key[:shared]:
        return 0
    last = min(n, len(prompt) - 1)
    while shared < last and key[shared] == prompt[shared]:
        shared += 1
    return shared


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

    def deepest(self, prompt: Sequence[int]) -> tuple[CacheEntry, int] | None:
        """The entry that gives the most of `prompt`, and how many of its tokens it gives (one
        token must stay to compute), without counting a hit or moving it in the LRU order.

        An entry gives all its tokens when it is a proper prefix of the prompt. An agent turn
        snapshot (`generated_from` set) also gives the tokens the prompt shares with it past the
        turn's start: the follow-up renders the generated turn from its text, which may tokenize
        differently from what was generated (a grammar-constrained tool call often does), and
        the shared part up to the first differing token is still valid."""
        best: tuple[CacheEntry, int] | None = None
        for key, entry in self._entries.items():
            given = _given(key, entry.generated_from, prompt)
            if given and (best is None or given > best[1]):
                best = entry, given
        return best

    def longest_prefix_of(self, tokens: Sequence[int]) -> CacheEntry | None:
        """The entry whose tokens are the longest proper prefix of `tokens` (all of them)."""
        best = None
        for key, entry in self._entries.items():
            if len(key) < len(tokens) and (best is None or len(key) > len(best.tokens)) and tuple(tokens[: len(key)]) == key:
                best = entry
        return best

    def lookup(self, prompt: Sequence[int]) -> tuple[CacheEntry, int] | None:
        """`deepest`, counted as a hit."""
        best = self.deepest(prompt)
        if best is not None:
            self._entries.move_to_end(best[0].tokens)
        return best

    def store(self, tokens: Sequence[int], snapshot, draft_rows: tuple[Tensor, ...] | None = None,
              generated_from: int | None = None) -> None:
        if not self.enabled:
            return
        key = tuple(tokens)
        entry = CacheEntry(key, snapshot, draft_rows, snapshot_bytes(snapshot, draft_rows), generated_from)
        if entry.nbytes > self.budget_bytes:
            return
        self._entries.pop(key, None)
        self._entries[key] = entry
        self.nbytes = self._held_bytes()
        while len(self._entries) > self.slots or self.nbytes > self.budget_bytes:
            self._entries.popitem(last=False)
            self.nbytes = self._held_bytes()

    def _held_bytes(self) -> int:
        """What the entries hold, a piece shared by several snapshots once. An evicted snapshot that
        is the base of one still here stays held (and counted) until that one goes too."""
        parts: dict[int, int] = {}
        for entry in self._entries.values():
            parts |= _parts(entry.snapshot, entry.draft_rows)
        return sum(parts.values())

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
