"""What the KV state holds, and how the next prompt reuses it.

The engine computes tokens; this class keeps account of them: the committed tokens (those whose
keys/values sit in kv[:length]), where their generated part begins, and the three places a
prompt's prefix can come from instead of being computed again: the live state itself, snapshots
in memory (message boundaries and exact prompts) and the disk tier. Rolling back, restoring and
snapshotting move the KV cache and the DFlash drafter's context together, so the drafter always
sees the context the target holds.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from dflash.engine.disk_cache import DiskCache
from dflash.engine.kv import KVSnapshot
from dflash.engine.prefix_cache import CacheEntry, PrefixCache


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixReuse:
    def __init__(self, kv, *, prefix_cache: PrefixCache, prompt_cache: PrefixCache, disk_cache: DiskCache | None,
                 drafter, reuse_live_state: bool, agent_turn_replay: bool, agent_turn_cache: bool = False):
        self.kv = kv
        self.prefix_cache = prefix_cache  # snapshots at message boundaries
        self.prompt_cache = prompt_cache  # snapshots of exact prompts (minus the last token)
        self.disk_cache = disk_cache
        self.drafter = drafter  # the DFlash drafter, whose context mirrors the KV; or None
        # Off: every prompt starts from a snapshot or from nothing (what "caches off" means in benches).
        self.reuse_live_state = reuse_live_state
        self.agent_turn_replay = agent_turn_replay  # recompute a turn that renders differently (checkpoint)
        # Snapshot a generated turn the live state holds before another conversation's prompt
        # replaces it (see `_keep_live_turn`).
        self.agent_turn_cache = agent_turn_cache
        self.committed: list[int] = []
        # Where the generated part of the committed tokens begins (the last prompt's length).
        self.generated_from: int | None = None

    @property
    def keeps_boundaries(self) -> bool:
        return self.prefix_cache.enabled

    @property
    def keeps_prompts(self) -> bool:
        return self.prompt_cache.enabled

    def computed(self, tokens: Sequence[int]) -> None:
        """The KV state now holds `tokens` after the committed ones."""
        self.committed.extend(tokens)

    def available(self, prompt: Sequence[int]) -> int:
        """How many of `prompt`'s tokens the live state or a snapshot in memory holds, without
        changing anything (`begin` reuses at least as many; the disk tier is not asked)."""
        live = self.kv.keepable(common_prefix_length(self.committed, prompt)) if self.reuse_live_state else 0
        found = [c for c in (self.prefix_cache.deepest(prompt), self.prompt_cache.deepest(prompt)) if c is not None]
        return min(max([live] + [given for _, given in found]), len(prompt) - 1)

    def begin(self, prompt: Sequence[int]) -> tuple[int, int | None]:
        """Make the KV state hold the longest available prefix of `prompt` (see `_resume`), and
        count what follows the prompt as generated. Returns how many prompt tokens it holds, and
        where a generated turn among them begins (None when they include none)."""
        held, turn_hit = self._resume(prompt)
        turn_from = self.generated_from if turn_hit else None
        self.generated_from = len(prompt)
        return held, turn_from

    def rollback(self, length: int) -> int:
        """Keep the first `length` committed tokens; returns how many the KV state really kept
        (the transformers backend may have to start over when a sliding window lost the states)."""
        self.kv.crop(length)
        kept = self.kv.length
        del self.committed[kept:]
        if self.drafter is not None:
            self.drafter.crop(kept)
        return kept

    def keep_boundary(self, length: int, generated_from: int | None) -> None:
        """Snapshot the first `length` committed tokens, a message boundary."""
        self._snapshot(self.prefix_cache, generated_from, length)

    def keep_prompt(self, length: int, generated_from: int | None) -> None:
        """Snapshot the first `length` committed tokens, a prompt minus its last token."""
        self._snapshot(self.prompt_cache, generated_from, length)

    def rewind_for_turn(self, turn: Sequence[int]) -> int | None:
        """Agent turn cache, before computing `turn` (a prompt plus the turn generated for it, as
        the next request will render it): roll back to what it shares with the committed tokens
        and return where computing must start. None when the turn renders differently from what
        was generated and replaying it is off."""
        common = common_prefix_length(self.committed, turn)
        if common < len(self.committed) and not self.agent_turn_replay:
            return None
        if self.kv.keepable(common) < common:
            return None  # the state would start over (kv.keepable): the idle engine would compute it all again
        return self.rollback(common)

    def keep_turn(self) -> None:
        """Agent turn cache, after computing the turn: snapshot all the committed tokens."""
        if self.generated_from is not None and self.generated_from >= len(self.committed):
            self.generated_from = None
        self._snapshot(self.prefix_cache, self.generated_from)

    def _resume(self, prompt: Sequence[int]) -> tuple[int, bool]:
        """The live state's common prefix or a cached snapshot, whichever is deeper (keeping at
        least one token to compute: its logits give the first generated token). Returns how many
        prompt tokens the KV state holds, and whether they include a generated turn."""
        shared = common_prefix_length(self.committed, prompt)
        if self.agent_turn_cache:
            self._keep_live_turn(shared)
        live = self.kv.keepable(min(shared, len(prompt) - 1)) if self.reuse_live_state else 0
        found = [(cache, cache.lookup(prompt)) for cache in (self.prefix_cache, self.prompt_cache)]
        source, (entry, given) = max(((cache, match) for cache, match in found if match is not None),
                                     key=lambda pair: pair[1][1], default=(None, (None, 0)))
        if self.disk_cache is not None:
            loaded = self.disk_cache.lookup(prompt, deeper_than=max(live, given))
            if loaded is not None:
                self.prefix_cache.store(loaded.tokens, loaded.snapshot, loaded.draft_rows)
                source, entry = self.disk_cache, CacheEntry(loaded.tokens, loaded.snapshot, loaded.draft_rows, 0)
                given = len(loaded.tokens)
        if entry is None or given <= live:
            kept = self.rollback(live)
            return kept, self.generated_from is not None and kept > self.generated_from
        source.hits += 1
        kept = self._restore(entry, given)
        return kept, self.generated_from is not None and kept > self.generated_from

    def _keep_live_turn(self, shared: int) -> None:
        """Agent turn cache, before a prompt that shares `shared` tokens with the live state takes
        it: if the live state holds a generated turn that prompt does not continue, snapshot it.
        The turn's checkpoint (`keep_turn`) runs only while the engine is idle and the turn still
        live; when another conversation's request is already waiting as the turn ends (several
        conversations on one engine), it never runs, and without this snapshot the conversation's
        follow-up would compute its turn again. The snapshot holds the turn as generated: the
        follow-up computes the closing tokens, the tool result, and whatever of the turn it
        tokenizes differently (see PrefixCache.deepest)."""
        if self.generated_from is not None and shared <= self.generated_from < len(self.committed):
            self._snapshot(self.prefix_cache, self.generated_from)

    def _restore(self, entry: CacheEntry, given: int) -> int:
        """Make the KV state hold the first `given` tokens of `entry`; returns how many it holds."""
        common = common_prefix_length(self.committed, entry.tokens)
        if isinstance(entry.snapshot, KVSnapshot):  # positions the live state holds already stay
            self.kv.restore(entry.snapshot, held=min(common, self.kv.length))
        else:
            self.kv.restore(entry.snapshot)
        self.committed = list(entry.tokens)
        self.generated_from = entry.generated_from
        if self.drafter is not None:
            if entry.draft_rows is not None:
                self.drafter.restore(entry.draft_rows, common)
            else:
                self.drafter.crop(common)
        return self.rollback(given) if given < len(entry.tokens) else len(entry.tokens)

    def _kept_prefix(self, tokens: Sequence[int]) -> CacheEntry | None:
        """The entry in memory of the longest proper prefix of `tokens` (all its tokens, so the
        live state's first positions hold what its snapshot holds: they are the same tokens)."""
        best = None
        for cache in (self.prefix_cache, self.prompt_cache):
            found = cache.longest_prefix_of(tokens)
            if found is not None and isinstance(found.snapshot, KVSnapshot) and (best is None or len(found.tokens) > len(best.tokens)):
                best = found
        return best

    def _snapshot(self, cache: PrefixCache, generated_from: int | None = None, length: int | None = None) -> None:
        """Store the state of the first `length` committed tokens (all by default) in `cache`: a
        right-sized copy, or only the positions past the entry of its longest prefix, built on it."""
        tokens = self.committed if length is None else self.committed[:length]
        if not cache.enabled or tokens in cache or not self.kv.can_snapshot(len(tokens)):
            return
        if self.kv.snapshots_any_prefix:
            base = self._kept_prefix(tokens)
            snapshot = self.kv.snapshot(len(tokens), base=base.snapshot if base is not None else None)
            if snapshot.base is None:
                base = None  # declined (a chain at its longest): a whole copy
        else:
            base, snapshot = None, self.kv.snapshot(len(tokens))
        rows = self._draft_rows(len(tokens), base)
        cache.store(tokens, snapshot, rows, generated_from)
        if self.disk_cache is not None and isinstance(snapshot, KVSnapshot):  # not the transformers backend
            self.disk_cache.store(tokens, snapshot, rows)

    def _draft_rows(self, length: int, base: CacheEntry | None) -> tuple[Tensor, ...] | None:
        """The DFlash drafter's rows of the first `length` committed tokens, in pieces: the base
        entry's, then a copy of the rest; None without a drafter or where its context is incomplete
        (a restore then rebuilds what it can)."""
        if self.drafter is None:
            return None
        shared = base.draft_rows if base is not None and base.draft_rows is not None else ()
        start = sum(piece.shape[0] for piece in shared)
        own = self.drafter.context_rows(length, start=start)
        if start + own.shape[0] != length:
            return None
        return (*shared, own)
