"""Speculative prefill (PFlash): a cheap scorer reads the whole long prompt, estimates which tokens
the answer will attend to, and the target prefills only the chunks that matter.

Token ids in, kept positions out (see ../../shared/notes/pflash.md for the method this follows):

1. The scorer (by default the target's own first N layers, `self:N`) prefills the prompt into a
   scratch KV cache of its own, in bounded steps the generation takes one at a time.
2. The queries of the last `lookahead` prompt tokens attend over all the prompt's keys (after
   RoPE by default: on the embedded model it kept more needles than before RoPE; README, Numbers),
   per scorer layer: softmax(q·Kᵀ/√d), causal.
3. Max over heads and layers, mean over the lookahead rows, a moving average of width 13 -> one
   score per token; then a mean per chunk of `chunk_tokens` droppable tokens.
4. Protected spans (the chat template's structure, tool definitions, the last user turn, the
   generation prompt: the caller names them) are always kept; so is a prefix the caches already
   hold. Chunks that contain an n-gram of the prompt's tail are kept first (a question's words
   find the passage that answers it); the rest by score, until the budget is spent.
5. The kept tokens, in their original order, become the prompt the target prefills, at new
   contiguous positions.

A compressed prompt is remembered, keyed by the uncompressed tokens: a later prompt that extends
it (the same conversation's next turn) continues on the compressed tokens, whose KV state the
prefix caches hold, and is not recompressed.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Generator, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from dflash.engine.kv import KVCache
from dflash.engine.model import first_layers_with_queries

Span = tuple[int, int]  # token positions [start, end)

COMPRESSION_MODES = ("off", "auto", "always", "fit")
SMOOTHING_WIDTH = 13  # moving average over token scores (SpecPrefill's avg_pool1d kernel)
TAIL_NGRAM = 4  # n-grams of the prompt's tail that force the chunks they occur in
TAIL_TOKENS = 96  # how much of the prompt's tail those n-grams come from
ATTENTION_SINKS = 64  # a windowed scorer's tokens still see the prompt's first ones (attention sinks)


@attrs.frozen
class CompressionSettings:
    mode: str = "off"  # off | auto (long uncached prompts) | always | fit (only prompts past the context)
    threshold_tokens: int = 8192  # auto: compress when this many prompt tokens are not cached
    keep_ratio: float = 0.2  # of the prompt's uncached tokens, protected ones included
    chunk_tokens: int = 32
    scorer: str = "self:8"  # "self:N": the target's first N layers; or a model source (same vocabulary)
    lookahead: int = 8  # tail tokens whose queries score the prompt
    pre_rope: bool = False  # score with queries and keys before RoPE (position-free similarity)
    tail_ngrams: bool = True  # force chunks holding an n-gram of the prompt's tail
    scorer_window: int = 1024  # 0: the scorer's tokens attend over the whole prompt; else over this many before them

    def __attrs_post_init__(self):
        if self.mode not in COMPRESSION_MODES:
            raise ValueError(f"unknown compression mode {self.mode!r}; expected one of {', '.join(COMPRESSION_MODES)}")
        if not 0.0 < self.keep_ratio <= 1.0:
            raise ValueError(f"keep_ratio must be in (0, 1], got {self.keep_ratio}")
        if self.scorer_window < 0:
            raise ValueError(f"scorer_window must be 0 (whole prompt) or a number of tokens, got {self.scorer_window}")


def self_scorer_layers(scorer: str) -> int | None:
    """N for "self:N", None for a model source."""
    if not scorer.startswith("self:"):
        return None
    try:
        layers = int(scorer.removeprefix("self:"))
    except ValueError:
        raise ValueError(f"scorer {scorer!r}: expected 'self:N' with N a number of layers") from None
    if layers < 1:
        raise ValueError(f"scorer {scorer!r}: N must be >= 1")
    return layers


# ---- selection: scores and spans in, kept positions out ----------------------------------------

def droppable_chunks(length: int, protected: Sequence[Span], chunk_tokens: int) -> list[Span]:
    """The unprotected positions of a `length`-token prompt, cut into chunks of at most
    `chunk_tokens` (a chunk never spans a protected token)."""
    flags = [False] * length
    for start, end in protected:
        flags[max(0, start):max(0, min(end, length))] = [True] * max(0, min(end, length) - max(0, start))
    chunks: list[Span] = []
    position = 0
    while position < length:
        if flags[position]:
            position += 1
            continue
        run_end = position
        while run_end < length and not flags[run_end]:
            run_end += 1
        for start in range(position, run_end, chunk_tokens):
            chunks.append((start, min(start + chunk_tokens, run_end)))
        position = run_end
    return chunks


def tail_ngram_chunks(tokens: Sequence[int], chunks: Sequence[Span], protected: Sequence[Span] = (),
                      n: int = TAIL_NGRAM, tail: int = TAIL_TOKENS) -> set[int]:
    """Indices of the chunks where an n-gram of the prompt's tail occurs, and of their neighbours
    (what a question names is usually followed by its answer). The tail is the last `tail`
    tokens, or less: only the protected span that ends the prompt (the last user turn)."""
    tail_start = max(0, len(tokens) - tail)
    last = max(protected, key=lambda span: span[1], default=None)
    if last is not None and last[1] >= len(tokens):
        tail_start = max(tail_start, last[0])
    grams = {tuple(tokens[i:i + n]) for i in range(tail_start, len(tokens) - n + 1)}
    hits: set[int] = set()
    for index, (start, end) in enumerate(chunks):
        # n-grams that start in the chunk (they may run into the next one), outside the tail
        if any(tuple(tokens[i:i + n]) in grams for i in range(start, min(end, tail_start - n + 1))):
            hits.update(i for i in (index - 1, index, index + 1) if 0 <= i < len(chunks))
    return hits


def select_positions(token_scores: Tensor, protected: Sequence[Span], keep_tokens: int, chunk_tokens: int,
                     forced: set[int] = frozenset(), chunks: Sequence[Span] | None = None) -> list[int]:
    """Kept positions, ascending: every protected one, then whole droppable chunks — the `forced`
    ones first, the rest by mean score — while the total stays within `keep_tokens`."""
    length = token_scores.shape[0]
    if chunks is None:
        chunks = droppable_chunks(length, protected, chunk_tokens)
    droppable = sum(end - start for start, end in chunks)
    budget = keep_tokens - (length - droppable)
    means = [float(token_scores[start:end].mean()) for start, end in chunks]
    # forced chunks first, then higher scores; ties go to the earlier chunk
    order = sorted(range(len(chunks)), key=lambda i: (i not in forced, -means[i], i))
    chosen = [False] * len(chunks)
    for index in order:
        size = chunks[index][1] - chunks[index][0]
        if size <= budget:
            chosen[index] = True
            budget -= size
    dropped = torch.zeros(length, dtype=torch.bool)
    for index, (start, end) in enumerate(chunks):
        if not chosen[index]:
            dropped[start:end] = True
    return (~dropped).nonzero().flatten().tolist()


def smoothed(scores: Tensor, width: int = SMOOTHING_WIDTH) -> Tensor:
    """Moving average over positions (edges padded by their own values)."""
    if scores.shape[0] < 2:
        return scores
    padded = F.pad(scores[None, None], (width // 2, width // 2), mode="replicate")
    return F.avg_pool1d(padded, width, stride=1)[0, 0]


def keep_budget(settings: CompressionSettings, length: int, cached: int, max_ctx: int, max_tokens: int) -> int | None:
    """How many of a `length`-token prompt's tokens to keep, or None to prefill it whole.
    `cached`: its prefix the caches hold (never recompressed: only the rest counts as new)."""
    if settings.mode == "off":
        return None
    limit = max_ctx - min(max_tokens, max(1, max_ctx // 8))  # leave room to generate
    overlong = length >= max_ctx  # no room for even one generated token
    if settings.mode == "fit":
        return limit if overlong else None
    new = length - cached
    if settings.mode == "auto" and new < settings.threshold_tokens and not overlong:
        return None
    if new < 2 * settings.chunk_tokens and not overlong:
        return None
    return min(cached + math.ceil(settings.keep_ratio * new), limit)


# ---- scoring ----------------------------------------------------------------------------------

class AttentionScorer:
    """Scores a prompt with the first `layers` decoder layers of `model` (the target itself, or a
    smaller model of the same vocabulary), in a scratch KV cache sized to the prompt.

    With a `window`, the prompt's tokens attend only over the first ATTENTION_SINKS tokens and the
    `window` tokens before their chunk (sliding-window attention with sinks), so scoring costs time
    linear in the prompt's length instead of quadratic: at 32K, full causal attention is most of a
    prefill's work. The lookahead rows' scores still cover every key of the prompt."""

    def __init__(self, model, layers: int, *, lookahead: int = 8, pre_rope: bool = False, chunk: int = 512,
                 window: int = 0):
        if not 1 <= layers <= model.args.num_layers:
            raise ValueError(f"the scorer needs 1 to {model.args.num_layers} layers, got {layers}")
        if window < 0:
            raise ValueError(f"the scorer's window must be 0 (whole prompt) or a number of tokens, got {window}")
        self.model = model
        self.layers = layers
        self.lookahead = lookahead
        self.pre_rope = pre_rope
        self.chunk = chunk
        self.window = window

    def steps(self, tokens: Sequence[int]) -> Generator[None, None, Tensor]:
        """Yields after each bounded piece of work; returns the per-layer scores [layers, S]."""
        queries_pre, queries_post, kv = yield from self._prefill(tokens)
        return self._layer_scores(queries_pre if self.pre_rope else queries_post, kv, len(tokens), self.pre_rope)

    def score(self, tokens: Sequence[int]) -> Tensor:
        """Per-token scores [S] (max over the scorer's layers), all steps at once."""
        return combine(run(self.steps(tokens)))

    def _prefill(self, tokens: Sequence[int]):
        model = self.model
        args = model.args
        S = len(tokens)
        rows = min(self.lookahead, S)
        kv = KVCache(self.layers, args.num_kv_heads, S, args.head_dim, model.dtype, model.device)
        ids = torch.tensor(list(tokens), dtype=torch.long, device=model.device)
        # The tail rows are their own last piece, so their queries come from one call.
        bounds = list(range(0, S - rows, self.chunk)) + [S - rows]
        queries = None
        window = None  # the windowed scorer's own small cache: sinks, window, the chunk's new rows
        for index, start in enumerate(bounds):
            last = index + 1 == len(bounds)
            end = S if last else bounds[index + 1]
            query_rows = rows if last else 0
            if self.window and start > ATTENTION_SINKS + self.window:
                if window is None:
                    window = KVCache(self.layers, args.num_kv_heads, ATTENTION_SINKS + self.window + max(self.chunk, rows),
                                     args.head_dim, model.dtype, model.device)
                queries = self._windowed_piece(ids[start:end], start, kv, window, query_rows)
            else:
                queries = first_layers_with_queries(model, ids[start:end], start, kv, self.layers, query_rows)
            yield
        return queries[0], queries[1], kv

    def _windowed_piece(self, ids: Tensor, start: int, kv: KVCache, window: KVCache, query_rows: int):
        """The tokens at start.. over the sinks and the `window` keys before them, then their rows
        copied into the prompt's cache (the lookahead scores read them there)."""
        sinks, at = ATTENTION_SINKS, ATTENTION_SINKS + self.window
        end = start + ids.shape[0]
        for mine, full in ((window.keys, kv.keys), (window.values, kv.values)):
            mine[:, :, :sinks] = full[:, :, :sinks]
            mine[:, :, sinks:at] = full[:, :, start - self.window:start]
        queries = first_layers_with_queries(self.model, ids, start, window, self.layers, query_rows, cache_start=at)
        kv.keys[:, :, start:end] = window.keys[:, :, at:at + ids.shape[0]]
        kv.values[:, :, start:end] = window.values[:, :, at:at + ids.shape[0]]
        kv.length = end
        return queries

    @torch.inference_mode()
    def _layer_scores(self, queries: Tensor, kv: KVCache, S: int, pre_rope: bool) -> Tensor:
        """queries [layers, rows, H, D] -> [layers, S]: per layer, the max over heads of each
        tail row's attention, averaged over rows."""
        layers, rows, H, D = queries.shape
        KV = kv.keys.shape[1]
        G = H // KV
        positions = torch.arange(S, device=queries.device)
        row_positions = torch.arange(S - rows, S, device=queries.device)
        causal = positions[None, :] <= row_positions[:, None]  # [rows, S]
        scores = []
        for layer in range(layers):
            keys = kv.keys[layer, :, :S].float()  # [KV, S, D], after RoPE
            if pre_rope:
                keys = self._unrotated(keys, S)
            q = queries[layer].float().view(rows, KV, G, D).permute(1, 2, 0, 3)  # [KV, G, rows, D]
            logits = torch.matmul(q, keys.transpose(1, 2)[:, None]) / math.sqrt(D)  # [KV, G, rows, S]
            logits = logits.masked_fill(~causal, float("-inf"))
            probs = torch.softmax(logits, dim=-1).amax(dim=(0, 1))  # [rows, S]
            scores.append(probs.mean(dim=0))
        return torch.stack(scores)

    def _unrotated(self, keys: Tensor, S: int) -> Tensor:
        """Undo RoPE on keys [KV, S, D]: rotate back by the same angles (the tables carry yarn's
        attention scale on cos and sin alike, hence the division by its square)."""
        cos, signed_sin = self.model._rope_tables(S)
        cos = cos[:S, 0].float()  # [S, D]
        signed_sin = signed_sin[:S, 0].float()
        scale = self.model.rope_attention_scale
        half = keys.shape[-1] // 2
        return (keys * cos - torch.roll(keys, half, dims=-1) * signed_sin) / (scale * scale)


def run(steps: Generator[None, None, Tensor]) -> Tensor:
    """Drive a step generator to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def combine(layer_scores: Tensor, layers: int | None = None) -> Tensor:
    """[layers, S] -> [S]: max over the first `layers` layers (all by default), then smoothed."""
    return smoothed(layer_scores[:layers].amax(dim=0))


# ---- remembering compressed prompts -----------------------------------------------------------

class CompressedPrompts:
    """Uncompressed prompt -> the tokens it was compressed to, the few most recent."""

    def __init__(self, slots: int = 8):
        self.slots = slots
        self._entries: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def remember(self, original: Sequence[int], compressed: Sequence[int]) -> None:
        key = tuple(original)
        self._entries[key] = tuple(compressed)
        self._entries.move_to_end(key)
        while len(self._entries) > self.slots:
            self._entries.popitem(last=False)

    def longest_prefix(self, prompt: Sequence[int]) -> tuple[int, tuple[int, ...]] | None:
        """(length of the uncompressed prefix, its compressed tokens) for the deepest remembered
        prompt that `prompt` starts with."""
        best: tuple[int, ...] | None = None
        for key in self._entries:
            if len(key) <= len(prompt) and (best is None or len(key) > len(best)) and tuple(prompt[:len(key)]) == key:
                best = key
        if best is None:
            return None
        self._entries.move_to_end(best)
        return len(best), self._entries[best]


@attrs.frozen
class PromptPlan:
    """The prompt the target will see before any scoring: the uncompressed one, or a remembered
    compression of its prefix followed by the rest, with spans and boundaries moved to match."""

    tokens: list[int]
    protected: tuple[Span, ...]
    snapshot_at: tuple[int, ...]


def continue_compressed(memory: CompressedPrompts, prompt: Sequence[int], protected: Sequence[Span],
                        snapshot_at: Sequence[int]) -> PromptPlan:
    found = memory.longest_prefix(prompt)
    if found is None:
        return PromptPlan(list(prompt), tuple(protected), tuple(snapshot_at))
    original_length, compressed = found
    shift = len(compressed) - original_length
    moved = tuple((max(start, original_length) + shift, end + shift) for start, end in protected if end > original_length)
    boundaries = tuple(p + shift for p in snapshot_at if p > original_length)
    # the compressed prefix itself is kept whole: the caches hold its state
    return PromptPlan([*compressed, *prompt[original_length:]], ((0, len(compressed)),) + moved, boundaries)


def kept_boundaries(snapshot_at: Sequence[int], kept: Sequence[int]) -> tuple[int, ...]:
    """Message boundaries in the kept prompt: a boundary after position p becomes the number of
    kept positions before p."""
    return tuple(sorted({bisect.bisect_left(kept, p) for p in snapshot_at}))


class PromptCompressor:
    """What the engine asks: how a prompt continues an earlier compression, whether to compress
    it, and (in steps) what to keep."""

    def __init__(self, settings: CompressionSettings, scorer, *, memory_slots: int = 8):
        self.settings = settings
        self.scorer = scorer  # steps(tokens) -> per-layer scores, as AttentionScorer
        self.memory = CompressedPrompts(memory_slots)

    def continued(self, prompt: Sequence[int], protected: Sequence[Span], snapshot_at: Sequence[int]) -> PromptPlan:
        return continue_compressed(self.memory, prompt, protected, snapshot_at)

    def budget(self, length: int, cached: int, max_ctx: int, max_tokens: int) -> int | None:
        return keep_budget(self.settings, length, cached, max_ctx, max_tokens)

    def compress(self, plan: PromptPlan, cached: int, keep_tokens: int) -> Generator[None, None, list[int]]:
        """Score `plan.tokens` step by step; returns the kept positions. The first `cached`
        tokens (held by the caches) are kept like the protected spans."""
        layer_scores = yield from self.scorer.steps(plan.tokens)
        protected = (*plan.protected, (0, cached))
        chunks = droppable_chunks(len(plan.tokens), protected, self.settings.chunk_tokens)
        forced = tail_ngram_chunks(plan.tokens, chunks, protected) if self.settings.tail_ngrams else set()
        return select_positions(combine(layer_scores), protected, keep_tokens, self.settings.chunk_tokens,
                                forced, chunks)
