"""Speculative prefill on a tiny random model: the engine with compression generates exactly what
a prefill of the kept tokens generates; the scorer's steps; caches come first."""

import random

import pytest
import torch

from dflash.engine.generate import Engine
from dflash.engine.kv import KVCache
from dflash.engine.model import first_layers_with_queries
from dflash.engine.pflash import AttentionScorer, CompressionSettings, PromptCompressor
from dflash.engine.prefix_cache import PrefixCache
from dflash.engine.sampling import SamplingParams
from tests.model.tiny import ours_from_hf, tiny_hf_model

MAX_CTX = 256
PROMPT = [random.Random(3).randrange(3, 120) for _ in range(150)]
TAIL = (140, 150)  # the "last user turn": protected


def make_engine(mode="always", keep_ratio=0.3, layers=2, max_ctx=MAX_CTX, **cache):
    model = ours_from_hf(tiny_hf_model("llama"))
    settings = CompressionSettings(mode=mode, keep_ratio=keep_ratio, chunk_tokens=8, scorer=f"self:{layers}")
    compressor = PromptCompressor(settings, AttentionScorer(model, layers, chunk=32))
    return Engine(model, max_ctx=max_ctx, prefill_chunk=16, compressor=compressor, **cache)


def greedy(engine, prompt, n, **kwargs):
    generation = engine.start(prompt, SamplingParams(), max_tokens=n, **kwargs)
    return generation, generation.run()


@pytest.mark.parametrize("attention", ["ours", "torch"])
def test_compressed_generation_equals_plain_prefill_of_the_kept_tokens(attention, monkeypatch):
    # The scorer runs layers itself: both attention kernels (torch's is the default on AMX) must
    # find their row groups without the engine's help.
    monkeypatch.setenv("DFLASH_ATTENTION", attention)
    engine = make_engine()
    generation, out = greedy(engine, PROMPT, 6, protected=[TAIL])
    kept = generation.kept_positions
    assert set(range(*TAIL)) <= set(kept) and kept == sorted(kept)
    assert len(kept) <= round(0.3 * len(PROMPT))
    plain = Engine(engine.model, max_ctx=MAX_CTX, prefill_chunk=16)
    _, expected = greedy(plain, [PROMPT[p] for p in kept], 6)
    assert out == expected
    stats = generation.stats
    assert stats.prompt_tokens == len(PROMPT) and stats.compressed_from_tokens == len(PROMPT)
    assert stats.prefilled_tokens == len(kept) and stats.scoring_ms > 0


def test_scoring_takes_bounded_steps_before_prefill():
    engine = make_engine()
    generation = engine.start(PROMPT, SamplingParams(), max_tokens=2, protected=[TAIL])
    phases = []
    while generation.kept_positions is None:
        phases.append(generation.step().phase)
    # 142 tokens in 5 pieces of at most 32, the 8 lookahead rows, then the selection
    assert len(phases) == 7 and set(phases) == {"prefill"}
    assert engine.kv.length == 0  # the scorer used its own cache


def test_compression_off_is_plain_generation():
    engine = make_engine(mode="off")
    generation, out = greedy(engine, PROMPT, 5)
    plain = Engine(engine.model, max_ctx=MAX_CTX, prefill_chunk=16)
    assert out == greedy(plain, PROMPT, 5)[1]
    assert generation.stats.compressed_from_tokens == 0 and generation.stats.scoring_ms == 0
    assert generation.kept_positions is None


def test_a_cached_prefix_is_not_recompressed():
    engine = make_engine(prompt_cache=PrefixCache(4, 1 << 30))
    first, out = greedy(engine, PROMPT, 4, protected=[TAIL])
    kept = [PROMPT[p] for p in first.kept_positions]
    # the conversation's next turn: continues on the compressed tokens, scores nothing
    follow_up = PROMPT + out + [7, 8, 9]
    second, _ = greedy(engine, follow_up, 3, protected=[(len(follow_up) - 3, len(follow_up))])
    assert second.kept_positions is None and second.stats.scoring_ms == 0
    assert second.prompt_ids == kept + out + [7, 8, 9]
    assert second.stats.cached_tokens == len(kept) + len(out) - 1  # the live state, not recomputed
    assert second.stats.compressed_from_tokens == len(follow_up)
    # the same uncompressed prompt again: its compressed state comes from the caches
    engine.start([1, 2, 3], SamplingParams(), max_tokens=1).run()  # something else in between
    again, out_again = greedy(engine, PROMPT, 4, protected=[TAIL])
    assert again.stats.scoring_ms == 0 and again.prompt_ids == kept
    assert again.stats.cached_tokens == len(kept) - 1 and out_again == out


def test_fit_compresses_only_a_prompt_longer_than_the_context():
    engine = make_engine(mode="fit", max_ctx=128)
    generation, out = greedy(engine, PROMPT, 4, protected=[TAIL])
    assert len(generation.prompt_ids) <= 128 - 4 and len(out) == 4
    assert set(range(*TAIL)) <= set(generation.kept_positions)
    short, _ = greedy(engine, PROMPT[:100], 2)
    assert short.kept_positions is None and short.stats.compressed_from_tokens == 0


def test_first_layers_write_the_same_keys_as_the_full_model():
    model = ours_from_hf(tiny_hf_model("qwen3"))
    ids = torch.tensor(PROMPT[:40])
    full = model.new_kv_cache(64)
    model(ids, 0, full)
    partial = KVCache(2, model.args.num_kv_heads, 64, model.args.head_dim, full.keys.dtype, model.device)
    assert first_layers_with_queries(model, ids[:32], 0, partial, 2) is None
    before, after = first_layers_with_queries(model, ids[32:], 32, partial, 2, query_rows=8)
    assert before.shape == after.shape == (2, 8, model.args.num_heads, model.args.head_dim)
    torch.testing.assert_close(partial.keys[:, :, :40], full.keys[:2, :, :40])
    scores = AttentionScorer(model, 2, lookahead=8, chunk=16).score(PROMPT[:40])
    assert scores.shape == (40,) and torch.isfinite(scores).all()


def test_a_windowed_scorer_attends_over_the_sinks_and_the_window_before_each_chunk(monkeypatch):
    from dflash.engine import pflash

    monkeypatch.setattr(pflash, "ATTENTION_SINKS", 4)
    model = ours_from_hf(tiny_hf_model("llama"))
    S, chunk, window, rows = 120, 16, 24, 8
    ids = torch.tensor(PROMPT[:S])
    scorer = AttentionScorer(model, 2, lookahead=rows, chunk=chunk, window=window)
    queries_pre, queries_post, keys = pflash.run(scorer._prefill(PROMPT[:S]))
    # the same attention spelled out as a mask over the whole prompt: a token sees the sinks and,
    # from `window` tokens before its own chunk's start, everything up to itself
    starts = [*range(0, S - rows, chunk), S - rows]
    chunk_start = torch.tensor([max(s for s in starts if s <= i) for i in range(S)])
    key = torch.arange(S)[None, :]
    query = torch.arange(S)[:, None]
    visible = (key <= query) & ((key < 4) | (key >= chunk_start[:, None] - window))
    assert not visible[100].all() and visible[100, :4].all()  # the window does cut something
    reference = model.new_kv_cache(S)
    model(ids, 0, reference, attention_mask=visible)
    torch.testing.assert_close(keys.keys[:, :, :S], reference.keys[:2, :, :S])
    torch.testing.assert_close(keys.values[:, :, :S], reference.values[:2, :, :S])
    # a window that covers the prompt is full attention, same scores
    full = AttentionScorer(model, 2, lookahead=rows, chunk=chunk).score(PROMPT[:S])
    torch.testing.assert_close(AttentionScorer(model, 2, lookahead=rows, chunk=chunk, window=S).score(PROMPT[:S]), full)
    causal = model.new_kv_cache(S)
    model(ids, 0, causal)
    assert not torch.allclose(keys.keys[1, :, 100:S], causal.keys[1, :, 100:S])
    assert queries_post.shape == (2, rows, model.args.num_heads, model.args.head_dim)


def test_a_separate_model_of_the_same_vocabulary_can_score(tmp_path):
    import pytest

    from dflash.engine.loading import ModelLoadError, prompt_compressor

    target = ours_from_hf(tiny_hf_model("llama"))
    tiny_hf_model("qwen2", seed=1).save_pretrained(tmp_path / "scorer")
    settings = CompressionSettings(mode="always", keep_ratio=0.3, chunk_tokens=8, scorer=str(tmp_path / "scorer"))
    compressor = prompt_compressor(settings, target, "native", tmp_path, "float32", MAX_CTX)
    assert compressor.scorer.model is not target and compressor.scorer.layers == 3
    engine = Engine(target, max_ctx=MAX_CTX, prefill_chunk=16, compressor=compressor)
    generation, out = greedy(engine, PROMPT, 3, protected=[TAIL])
    assert set(range(*TAIL)) <= set(generation.kept_positions) and len(out) == 3
    with pytest.raises(ModelLoadError, match="layers"):
        prompt_compressor(CompressionSettings(mode="auto", scorer="self:9"), target, "native", tmp_path, "float32", 64)
    assert prompt_compressor(CompressionSettings(), target, "native", tmp_path, "float32", 64) is None


def test_the_agent_turn_checkpoint_of_a_compressed_conversation_follows_its_kept_tokens():
    engine = make_engine(prefix_cache=PrefixCache(4, 1 << 30))
    first, out = greedy(engine, PROMPT, 4, protected=[TAIL])
    kept = [PROMPT[p] for p in first.kept_positions]
    turn = PROMPT + out + [11, 12]  # the turn as the follow-up renders it, closing tokens included
    assert engine.checkpoint_prefix(turn) == len(kept) + len(out) + 2
    assert engine.committed == kept + out + [11, 12]
