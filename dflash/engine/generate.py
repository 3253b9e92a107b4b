"""Prefill in chunks, then decode one token at a time — every call to `step()` is one bounded unit.

The scheduler drives a `Generation` step by step from its worker thread and may stop between any
two steps: the KV cache is consistent after every step, so closing a generation early leaves the
engine ready for the next one.
"""

from __future__ import annotations

import functools
import time
from typing import Literal, Sequence

import attrs
import torch

from dflash.engine.contract import CacheStats, CacheTier, FinishReason, GenerationStats
from dflash.engine.disk_cache import DiskCache
from dflash.engine.drafters.ngram import NgramDrafter
from dflash.engine.pflash import PromptCompressor, Span, kept_boundaries
from dflash.engine.prefix_cache import PrefixCache
from dflash.engine.prefix_reuse import PrefixReuse
from dflash.engine.sampling import Sampler
from dflash.engine.model import KEY_CHUNK, Transformer, TreeRows
from dflash.engine.speculative import DraftTree, SpeculationConfig, SpeculationMemory, SpeculationPolicy
from dflash.sampling_params import SamplingParams

# A prompt whose last boundary snapshot lies at most this many tokens before its end gets no exact
# snapshot of its own (Generation._begin): an identical request computes those tokens again.
EXACT_PROMPT_SLACK = 16


@attrs.define
class StepOutput:
    tokens: list[int]  # tokens committed in this step (empty for all prefill chunks but the last)
    finished: FinishReason | None
    phase: Literal["prefill", "decode"]


def _reuse_setting(name: str) -> property:
    """An engine attribute that belongs to its prefix reuse; tests and benches set them on a
    built engine."""
    return property(lambda engine: getattr(engine.prefix_reuse, name),
                    lambda engine, value: setattr(engine.prefix_reuse, name, value))


class Engine:
    """One model, one KV cache, one live generation at a time."""

    prefix_cache = _reuse_setting("prefix_cache")
    prompt_cache = _reuse_setting("prompt_cache")
    reuse_live_state = _reuse_setting("reuse_live_state")
    agent_turn_replay = _reuse_setting("agent_turn_replay")
    agent_turn_cache = _reuse_setting("agent_turn_cache")
    # The DFlash drafter mirrors the engine's KV: it sees the captured hidden states of every
    # token the target computes and is cropped and restored with it, so its context is complete.
    dflash_drafter = _reuse_setting("drafter")

    def __init__(
        self,
        model,
        *,
        max_ctx: int,
        prefill_chunk: int = 256,
        eos_token_ids: Sequence[int] = (),
        speculation: SpeculationConfig = SpeculationConfig(),
        dflash_drafter=None,
        prefix_cache: PrefixCache | None = None,
        prompt_cache: PrefixCache | None = None,
        disk_cache: DiskCache | None = None,
        grammar_tokenizer_factory=None,
        agent_turn_replay: bool = False,
        agent_turn_cache: bool = False,
        reuse_live_state: bool = True,
        compressor: PromptCompressor | None = None,
    ):
        self.model = model
        self.compressor = compressor  # speculative prefill of long prompts (pflash.py), or None
        self.disk_cache = disk_cache
        # Built on the first constrained request (llguidance takes about a second to read a vocabulary).
        self._grammar_tokenizer_factory = grammar_tokenizer_factory
        self._grammar_tokenizer = None
        self.speculation = speculation
        # What generations learned of the drafters, per speculation configuration (newest last).
        self._speculation_memories: dict[SpeculationConfig, SpeculationMemory] = {}
        # The n-gram drafter, its index kept from one generation to the next (NgramDrafter.begin).
        self._ngram: NgramDrafter | None = None
        if speculation.drafter == "dflash" and dflash_drafter is None:
            raise ValueError("speculative drafter 'dflash' needs a draft model")
        self.max_ctx = max_ctx
        self.prefill_chunk = prefill_chunk
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = model.args.vocab_size
        self.kv = model.new_kv_cache(max_ctx)
        self.prefix_reuse = PrefixReuse(
            self.kv,
            # (`is None`, not `or`: an empty cache has len() 0 and is falsy)
            prefix_cache=PrefixCache(0, 0) if prefix_cache is None else prefix_cache,
            prompt_cache=PrefixCache(0, 0) if prompt_cache is None else prompt_cache,
            disk_cache=disk_cache, drafter=dflash_drafter, reuse_live_state=reuse_live_state,
            agent_turn_replay=agent_turn_replay, agent_turn_cache=agent_turn_cache)
        self._live: Generation | None = None

    def start(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        max_tokens: int,
        *,
        snapshot_at: Sequence[int] = (),
        grammar: str | None = None,
        protected: Sequence[Span] = (),
    ) -> "Generation":
        """`snapshot_at`: prompt positions (message boundaries) to keep in the prefix cache.
        `grammar`: an llguidance grammar (see grammar.py) the output must follow.
        `protected`: token spans [start, end) prompt compression must never drop."""
        if self._live is not None:
            self._live.close()
        constraint = self.grammar_tokenizer().matcher(grammar) if grammar is not None else None
        generation = Generation(self, list(prompt_ids), sampling, max_tokens, snapshot_at, constraint, protected)
        self._live = generation
        return generation

    @property
    def verifies_trees(self) -> bool:
        """Whether this engine's model verifies a draft tree in one pass (ours does; transformers' not)."""
        return isinstance(self.model, Transformer)

    # An attention call's own cost past its reads, in plain steps (AMX VM, 512 of context: a chain
    # past the first 0.09 int4 steps, 0.03 bf16, of which reading the cache is ~0.06 and ~0.04)
    ATTENTION_CALL = 0.03
    # A chain's own cost past its reads where all of a tree's chains are attended in one call
    # (AMX VM, int4, 2 threads: 14 chains more cost 0.01-0.16 steps with 32 keys in the tree's chunk)
    CHAIN_IN_ONE_CALL = 0.005

    def chain_cost(self) -> float:
        """What one more chain of a draft tree costs past the first, in plain steps. A decode step
        reads the weights once and the cache once, so a chain's reads of the cache cost their share
        of the two, as bytes. The native loop attends all chains in one call (attend_tree), which
        reads the chunks of keys below the tree once for them all: a chain reads again only the
        keys of the chunk the tree starts in (AMX VM, int4, bench/step.py twice: 14 chains more cost
        0.24-0.34 steps at 240 of context and 0.18-0.39 at 1000, modelled 0.33 and 0.31). Chain by
        chain (model.py), each reads the whole cache and pays a call."""
        weights, per_token = self._step_bytes
        cache = per_token * self.kv.length
        if self.model.attends_trees_in_one_call(self.kv):
            return self.CHAIN_IN_ONE_CALL + per_token * (self.kv.length % KEY_CHUNK) / max(weights + cache, 1)
        return self.ATTENTION_CALL + cache / max(weights + cache, 1)

    @functools.cached_property
    def _step_bytes(self) -> tuple[int, int]:
        """Bytes a decode step of our Transformer reads: the weights (parameters and buffers:
        quantized codes and scales), and the cache's keys and values (with their scales) a token."""
        kv = self.kv
        tensors = [kv.keys, kv.values] + ([kv.key_scales, kv.value_scales] if kv.quantized else [])
        return (sum(t.numel() * t.element_size() for t in self.model.state_dict().values()),
                sum(t[:, :, :1].numel() * t.element_size() for t in tensors))

    def draft_room(self) -> int:
        """How many drafted tokens may follow the pending one in a verification: past the position
        where the model's RoPE scaling switches in (model.rope_switch), none may lie beyond it, so
        the rows below it are computed as plain decoding computes them."""
        switch = getattr(self.model, "rope_switch", None)
        base = self.kv.length  # the pending token's position
        return self.max_ctx if switch is None or base >= switch else switch - base - 1

    def forward_tree(self, tree: DraftTree, pending: int) -> tuple[torch.Tensor, TreeRows]:
        """Append the pending token and a draft tree's rows after the committed ones (Transformer.forward's
        `tree`); returns every row's logits and what keep_tree_path needs."""
        rows = TreeRows.of((-1,) + tree.parents, self.model.args, self.model.dtype, self.model.device)
        return self.forward([pending, *tree.tokens], logits_positions=None, tree=rows), rows

    def keep_tree_path(self, base: int, tree: DraftTree, rows: TreeRows, path: list[int]) -> None:
        """After forward_tree at `base`: keep the pending token and the tree rows `path` (1-based, a
        path down from the pending token) as the committed tokens after it."""
        if path != list(range(1, len(path) + 1)):  # chain 0's rows hold base + 1.. already (tree_chains)
            index = torch.tensor(path, device=rows.keys.device)
            self.kv.write_rows(base + 1, rows.keys[:, index], rows.values[:, index])
            if self.dflash_drafter is not None and self.dflash_drafter.length >= base + 1 + len(tree):
                self.dflash_drafter.keep_rows(base + 1, index + base)
            self.prefix_reuse.committed[base + 1 : base + 1 + len(path)] = [tree.tokens[row - 1] for row in path]
        self.rollback(base + 1 + len(path))

    def forward(self, tokens: list[int], **kwargs):
        """Append `tokens` after the committed ones; returns their logits (see Transformer.forward)."""
        start = self.kv.length
        ids = torch.tensor(tokens, dtype=torch.long, device=self.model.device)
        drafter = self.dflash_drafter
        # the drafter's rows for these tokens, written by the forward itself (None: nothing to capture)
        into = drafter.rows_at(start, len(tokens)) if drafter is not None else None
        capture = drafter.capture_layers if into is not None else ()
        logits, _ = self.model(ids, start, self.kv, capture_layers=capture, capture_into=into, **kwargs)
        if into is not None:
            drafter.observed(start, len(tokens))
        self.prefix_reuse.computed(tokens)
        return logits

    @property
    def committed(self) -> list[int]:
        """Tokens whose keys/values sit in kv[:length]; the next prompt reuses the common prefix."""
        return self.prefix_reuse.committed

    def rollback(self, length: int) -> int:
        """Keep the first `length` committed tokens; returns how many the KV state really kept."""
        return self.prefix_reuse.rollback(length)

    def checkpoint_prefix(self, tokens: Sequence[int]) -> int:
        """Agent turn cache: make the live state hold `tokens` — a prompt plus the turn generated
        for it, as the next request will render it, closing tokens included — and keep a snapshot.
        Usually only the closing tokens are new; where the rendering tokenizes the generated text
        differently, the differing tail is recomputed (while the server is idle) if
        `agent_turn_replay` is on, else nothing is done. Returns the committed length."""
        if self.compressor is not None:  # a compressed conversation's turn follows its kept tokens
            tokens = self.compressor.continued(tokens, (), ()).tokens
        if len(tokens) > self.max_ctx:
            return self.kv.length
        kept = self.prefix_reuse.rewind_for_turn(tokens)
        if kept is None:
            return self.kv.length  # the turn renders differently; replaying it is the opt-in fallback
        for start in range(kept, len(tokens), self.prefill_chunk):
            self.forward(list(tokens[start : start + self.prefill_chunk]))
        self.prefix_reuse.keep_turn()
        return self.kv.length

    def close(self) -> None:
        """At shutdown: finish the disk cache's queued writes."""
        if self.disk_cache is not None:
            self.disk_cache.close()

    def cache_stats(self) -> CacheStats:
        tiers = {name: CacheTier(len(cache), cache.nbytes, cache.hits)
                 for name, cache in (("prefix", self.prefix_cache), ("exact", self.prompt_cache)) if cache.enabled}
        if self.disk_cache is not None and self.disk_cache.enabled:
            tiers["disk"] = CacheTier(len(self.disk_cache), self.disk_cache.nbytes, self.disk_cache.hits)
        return CacheStats(kv_tokens=self.kv.length, kv_capacity=self.max_ctx, tiers=tiers)

    def grammar_tokenizer(self):
        if self._grammar_tokenizer is None:
            if self._grammar_tokenizer_factory is None:
                raise ValueError("this engine was built without a tokenizer for constrained decoding")
            self._grammar_tokenizer = self._grammar_tokenizer_factory()
        return self._grammar_tokenizer

    # Configurations whose memories are kept: a switch back finds what was learned under it (a bench
    # interleaving modes then measures each as a server running it alone would); older ones are dropped.
    REMEMBERED_CONFIGURATIONS = 8

    def speculation_memory(self) -> SpeculationMemory:
        """What earlier generations under the current configuration learned of the drafters."""
        memory = self._speculation_memories.pop(self.speculation, None) or SpeculationMemory(self.speculation)
        self._speculation_memories[self.speculation] = memory  # newest last
        while len(self._speculation_memories) > self.REMEMBERED_CONFIGURATIONS:
            del self._speculation_memories[next(iter(self._speculation_memories))]
        return memory

    def drafters(self) -> dict[str, object]:
        """The drafters for a generation of the configured mode, in auto mode's preference order."""
        mode = self.speculation.drafter
        chosen: dict[str, object] = {}
        if mode in ("auto", "ngram"):
            sizes = (self.speculation.ngram_min, self.speculation.ngram_max)
            if self._ngram is None or (self._ngram.min_n, self._ngram.max_n) != sizes:
                self._ngram = NgramDrafter(*sizes)
            chosen["ngram"] = self._ngram
        if mode in ("auto", "dflash") and self.dflash_drafter is not None:
            chosen["dflash"] = self.dflash_drafter
        return chosen


class Generation:
    def __init__(
        self,
        engine: Engine,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_tokens: int,
        snapshot_at: Sequence[int] = (),
        constraint=None,
        protected: Sequence[Span] = (),
    ):
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.engine = engine
        self.requested_tokens = max_tokens
        self.sampler = Sampler(sampling, engine.vocab_size)
        self.constraint = constraint  # a GrammarConstraint, or None
        self.output: list[int] = []
        self.finished: FinishReason | None = None
        self.closed = False
        # A grammar's matcher checks drafts as a chain: a constrained generation proposes chains.
        self.speculation = SpeculationPolicy(engine.speculation, engine.drafters(), engine.speculation_memory(),
                                             trees=engine.verifies_trees and constraint is None, chain_cost=engine.chain_cost)
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.original_prompt = prompt_ids
        self.kept_positions: list[int] | None = None  # of the plan's tokens, once compressed
        self._scoring = None  # the compressor's steps while the prompt is being scored
        compressor = engine.compressor
        if compressor is None:
            self._begin(prompt_ids, snapshot_at)
            return
        # Prefix cache first: a prompt that continues a compressed one continues on its kept
        # tokens, and what the caches hold of it is never recompressed.
        self.plan = compressor.continued(prompt_ids, protected, snapshot_at)
        cached = engine.prefix_reuse.available(self.plan.tokens)
        keep = compressor.budget(len(self.plan.tokens), cached, engine.max_ctx, max_tokens)
        if keep is None:
            self._begin(self.plan.tokens, self.plan.snapshot_at, compressed=self.plan.tokens != prompt_ids)
        else:
            self._scoring = compressor.compress(self.plan, cached, keep)

    def _begin(self, prompt_ids: list[int], snapshot_at: Sequence[int], *, compressed: bool = False) -> None:
        """Set up prefill of `prompt_ids`, the tokens the target computes (`compressed`: fewer
        than the request's prompt)."""
        engine = self.engine
        if len(prompt_ids) >= engine.max_ctx:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the context holds {engine.max_ctx} "
                "including at least one generated token"
            )
        self.prompt_ids = prompt_ids
        for drafter in self.speculation.drafters.values():
            if hasattr(drafter, "begin"):  # the n-gram index follows the prompt before decoding
                drafter.begin(prompt_ids)
        if compressed:
            self.stats.compressed_from_tokens = len(self.original_prompt)
            engine.compressor.memory.remember(self.original_prompt, prompt_ids)
        self.max_tokens = min(self.requested_tokens, engine.max_ctx - len(prompt_ids))
        # Reuse the live KV state or a cached snapshot for the shared prefix; at least one prompt
        # token is always computed, because its logits give the first generated token.
        reused, self.turn_from = engine.prefix_reuse.begin(prompt_ids)  # snapshots still hold that turn
        self.position = reused  # next prompt index to prefill
        # Where prefill pauses to snapshot: message boundaries, then the prompt minus its last token
        # (an identical request restores that and computes one token).
        self.boundaries: list[int] = []
        if engine.prefix_reuse.keeps_boundaries:
            self.boundaries = sorted(p for p in set(snapshot_at) if reused < p < len(prompt_ids) - 1)
        exact = len(prompt_ids) - 1
        # The exact prompt's own snapshot only where no boundary snapshot lies just before it: a
        # chat prompt's last boundary closes its last message, a few tokens (the assistant header)
        # short of the prompt's end, so the two were near-identical copies of the whole cache
        # (460 MB each at 20K tokens, a tenth of a second or more on the engine thread every turn). An identical
        # request restores that boundary and computes those few tokens.
        near_boundary = any(exact - p <= EXACT_PROMPT_SLACK for p in self.boundaries)
        self.exact_prompt_boundary = (exact if engine.prefix_reuse.keeps_prompts and exact > reused and not near_boundary
                                      else None)
        self.stats.cached_tokens = reused
        self.stats.agent_turn_cache_hit = self.turn_from is not None

    @property
    def prefilling(self) -> bool:
        return self._scoring is not None or self.position < len(self.prompt_ids)

    def step(self) -> StepOutput:
        if self.finished is not None or self.closed:
            raise RuntimeError("step() called on a finished generation")
        started = time.perf_counter()
        if self._scoring is not None:
            self._score()
            self.stats.scoring_ms += (time.perf_counter() - started) * 1000
            return StepOutput([], None, "prefill")
        if self.prefilling:
            out = self._prefill_chunk()
            self.stats.prefill_ms += (time.perf_counter() - started) * 1000
        else:
            out = self._decode_one()
            self.stats.decode_ms += (time.perf_counter() - started) * 1000
        return out

    def _score(self) -> None:
        """One bounded piece of the scorer's work; after the last, the kept tokens' prefill begins."""
        try:
            next(self._scoring)
        except StopIteration as done:
            self._scoring = None
            kept = done.value
            self.kept_positions = kept
            self._begin([self.plan.tokens[p] for p in kept], kept_boundaries(self.plan.snapshot_at, kept),
                        compressed=len(kept) < len(self.original_prompt))

    def _prefill_chunk(self) -> StepOutput:
        start = self.position
        end = start + self.engine.prefill_chunk
        exact = self.exact_prompt_boundary
        if not self.engine.kv.snapshots_any_prefix:  # the transformers backend: pause at each snapshot
            pauses = self.boundaries + ([exact] if exact is not None else [])
            end = min([end] + [p for p in pauses if p > start])
        # Otherwise boundaries inside the chunk are snapshotted after it: splitting a chunk there
        # would leave short pieces, and short bf16 matmuls cost per row on a CPU. A chunk does stop
        # where the RoPE scaling switches in, so the boundaries below are kept before the keys turn.
        switch = getattr(self.engine.model, "rope_switch", None)
        if switch is not None and start < switch < end:
            end = switch
        chunk = self.prompt_ids[start:end]
        self.position += len(chunk)
        self.stats.prefilled_tokens += len(chunk)
        logits = self.engine.forward(chunk)
        for boundary in self.boundaries:
            if start < boundary <= self.position:
                self.engine.prefix_reuse.keep_boundary(boundary, self._turn_within(boundary))
        if exact is not None and start < exact <= self.position:
            self.engine.prefix_reuse.keep_prompt(exact, self._turn_within(exact))
        if self.prefilling:
            return StepOutput([], None, "prefill")
        emitted = self._emit(self._sample(logits[-1]))
        return StepOutput(emitted, self.finished, "prefill")

    def _turn_within(self, length: int) -> int | None:
        return self.turn_from if self.turn_from is not None and self.turn_from < length else None

    def _decode_one(self) -> StepOutput:
        # Steps are timed from before the proposal: a drafter's own forward is part of what its
        # speculation costs, and the policy weighs that against plain steps.
        started = time.perf_counter()
        drafter, draft = self.speculation.choose(self.engine.committed + self.output[-1:])
        if draft and self.constraint is not None:
            # The pending token is committed to the matcher already; drafts past the first token
            # the grammar refuses could never be accepted.
            draft = draft[: self.constraint.valid_prefix(draft)]
        room = min(self.max_tokens - len(self.output), self.engine.draft_room())
        draft = draft.within(room) if isinstance(draft, DraftTree) else (draft or [])[:room]
        if draft:
            if isinstance(draft, DraftTree):
                return self._tree_step(drafter, draft, started)
            return self._speculative_step(drafter, draft, started)
        logits = self.engine.forward([self.output[-1]])
        emitted = self._emit(self._sample(logits[-1]))
        self.speculation.record_plain(time.perf_counter() - started)
        return StepOutput(emitted, self.finished, "decode")

    def _speculative_step(self, drafter, draft: list[int], started: float) -> StepOutput:
        """Verify `draft` after the pending token in one target forward (see speculative.py)."""
        base = self.engine.kv.length
        logits = self.engine.forward([self.output[-1]] + draft, logits_positions=None)
        emitted: list[int] = []
        accepted = 0  # draft tokens whose KV stays: matched, and not the final emitted token
        matched = 0
        for i in range(len(draft) + 1):
            token = self._sample(logits[i])  # masked with the matcher's state after the tokens before
            emitted += self._emit(token)
            is_match = i < len(draft) and token == draft[i]
            matched += is_match
            if self.finished is not None or not is_match:
                break
            accepted += 1
        # Keep the pending token and the accepted drafts; the last emitted token is the new pending one.
        self.engine.rollback(base + 1 + accepted)
        self.stats.record_draft(drafter.name, len(draft), matched)
        self.speculation.record(drafter, len(draft), matched, time.perf_counter() - started)
        return StepOutput(emitted, self.finished, "decode")

    def _tree_step(self, drafter, tree: DraftTree, started: float) -> StepOutput:
        """Verify a draft tree after the pending token in one target forward: walk down from the
        pending token, at each row sampling the target's token and going on to the child that
        drafted it. Each verified position consumes one draw, as a chain's does (speculative.py)."""
        base = self.engine.kv.length
        logits, rows = self.engine.forward_tree(tree, self.output[-1])
        children: dict[tuple[int, int], int] = {}
        for row, (token, parent) in enumerate(zip(tree.tokens, tree.parents), 1):
            children.setdefault((parent, token), row)  # a tree holds one row per token under a parent
        emitted: list[int] = []
        path: list[int] = []
        row = 0
        while True:
            token = self._sample(logits[row])
            emitted += self._emit(token)
            child = children.get((row, token))
            if self.finished is not None or child is None:
                break
            path.append(child)
            row = child
        self.engine.keep_tree_path(base, tree, rows, path)
        self.stats.record_draft(drafter.name, len(tree), len(path))
        self.speculation.record(drafter, tree.depth, len(path), time.perf_counter() - started,
                                rows=len(tree), expected=tree.expected(), chains=tree.chains())
        return StepOutput(emitted, self.finished, "decode")

    def _sample(self, logits: torch.Tensor) -> int:
        if self.constraint is not None:
            logits = self.constraint.apply(logits)
        return self.sampler.sample(logits, self.output)

    def _emit(self, token: int) -> list[int]:
        """Commit one sampled token to the output; sets `finished` when generation must stop."""
        self.stats.generated_tokens += 1
        if self.constraint is not None:
            self.constraint.consume(token)
        if token in self.engine.eos_token_ids:
            self.finished = "stop"
            return []
        self.output.append(token)
        if len(self.output) >= self.max_tokens:
            self.finished = "length"
        return [token]

    def close(self) -> None:
        """Release the engine; its KV state keeps every computed token for the next prompt to reuse."""
        self.closed = True

    def run(self) -> list[int]:
        """Step to the end (for the CLI, tests and benchmarks); returns the generated tokens."""
        while self.finished is None:
            self.step()
        self.close()
        return self.output
