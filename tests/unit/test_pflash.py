"""Speculative prefill's selection on synthetic scores (engine/pflash.py) and the spans the chat
template protects: no model."""

from __future__ import annotations

import pytest
import torch

from dflash.engine.pflash import (CompressedPrompts, CompressionSettings, continue_compressed, droppable_chunks,
                                  keep_budget, kept_boundaries, select_positions, self_scorer_layers, smoothed,
                                  tail_ngram_chunks)
from dflash.protocols.canonical import GenerationRequest, Message
from tests.unit.fakes import FAKE_TEMPLATE


def test_chunks_cover_exactly_the_unprotected_positions_and_never_cross_a_protected_one():
    chunks = droppable_chunks(100, [(0, 10), (40, 45), (95, 100)], 8)
    assert chunks[0] == (10, 18) and (34, 40) in chunks and (45, 53) in chunks and chunks[-1] == (93, 95)
    covered = [p for start, end in chunks for p in range(start, end)]
    assert covered == [p for p in range(100) if not (p < 10 or 40 <= p < 45 or p >= 95)]
    assert all(end - start <= 8 for start, end in chunks)


def test_protected_positions_are_kept_whatever_the_scores():
    scores = torch.zeros(100)
    scores[50:60] = 1.0  # the droppable text that matters
    kept = select_positions(scores, [(0, 4), (90, 100)], keep_tokens=30, chunk_tokens=8)
    assert set(range(0, 4)) | set(range(90, 100)) <= set(kept)
    assert kept == sorted(kept) and len(kept) <= 30
    assert set(range(52, 60)) <= set(kept)  # the best chunk (52..60 by chunks from 4) survives


def test_the_keep_ratio_is_honoured_in_whole_chunks():
    scores = torch.rand(1000, generator=torch.Generator().manual_seed(0))
    for keep in (100, 200, 300):
        kept = select_positions(scores, [(990, 1000)], keep_tokens=keep, chunk_tokens=32)
        assert keep - 32 < len(kept) <= keep
        chunks = droppable_chunks(1000, [(990, 1000)], 32)
        for start, end in chunks:  # a chunk is kept whole or dropped whole
            assert len(set(range(start, end)) & set(kept)) in (0, end - start)


def test_chunks_are_chosen_by_mean_score_and_forced_ones_first():
    scores = torch.zeros(64)
    scores[8:16] = 2.0
    scores[40:48] = 1.0
    assert select_positions(scores, [], keep_tokens=8, chunk_tokens=8) == list(range(8, 16))
    forced = select_positions(scores, [], keep_tokens=16, chunk_tokens=8, forced={5})
    assert forced == list(range(8, 16)) + list(range(40, 48))
    assert select_positions(scores, [], keep_tokens=8, chunk_tokens=8, forced={0}) == list(range(0, 8))


def test_when_protected_tokens_exceed_the_budget_only_they_are_kept():
    kept = select_positions(torch.ones(50), [(0, 30)], keep_tokens=10, chunk_tokens=8)
    assert kept == list(range(30))


def test_tail_ngrams_find_the_chunk_that_holds_the_question_words():
    tokens = list(range(100, 200)) + [7, 8, 9, 10] + list(range(300, 340)) + [1, 2, 7, 8, 9, 10, 3]
    chunks = droppable_chunks(len(tokens) - 7, [], 16)
    hits = tail_ngram_chunks(tokens, chunks, n=4, tail=7)
    assert sorted(chunks[i] for i in hits) == [(80, 96), (96, 112), (112, 128)]  # and its neighbours
    # only the protected span that ends the prompt is the tail
    assert tail_ngram_chunks(tokens, chunks, [(len(tokens) - 3, len(tokens))], n=4, tail=7) == set()


def test_budget_modes():
    settings = CompressionSettings(mode="auto", threshold_tokens=1000, keep_ratio=0.1)
    assert keep_budget(settings, 999, 0, 4096, 100) is None
    assert keep_budget(settings, 3000, 0, 4096, 100) == 300
    assert keep_budget(settings, 3000, 2500, 4096, 100) is None  # the cached prefix is not recompressed
    assert keep_budget(settings, 3000, 1000, 4096, 100) == 1000 + 200  # kept whole, the ratio applies to the rest
    assert keep_budget(CompressionSettings(mode="off"), 9000, 0, 4096, 100) is None
    fit = CompressionSettings(mode="fit")
    assert keep_budget(fit, 4000, 0, 4096, 100) is None
    assert keep_budget(fit, 5000, 0, 4096, 100) == 4096 - 100  # room to generate stays
    assert keep_budget(fit, 5000, 0, 4096, 10000) == 4096 - 512
    always = CompressionSettings(mode="always", keep_ratio=0.5)
    assert keep_budget(always, 200, 0, 4096, 100) == 100
    assert keep_budget(always, 10000, 0, 4096, 100) == 4096 - 100  # never more than fits


def test_a_conversation_continues_on_its_compressed_prefix():
    memory = CompressedPrompts(slots=2)
    memory.remember([1, 2, 3, 4, 5, 6], [1, 4, 6])
    plan = continue_compressed(memory, [1, 2, 3, 4, 5, 6, 7, 8, 9], [(0, 1), (7, 9)], [6, 8])
    assert plan.tokens == [1, 4, 6, 7, 8, 9]
    assert plan.protected == ((0, 3), (4, 6)) and plan.snapshot_at == (5,)
    other = continue_compressed(memory, [1, 2, 9], [(2, 3)], [])
    assert other.tokens == [1, 2, 9] and other.protected == ((2, 3),)
    memory.remember([7], [7])
    memory.remember([8], [8])
    assert memory.longest_prefix([1, 2, 3, 4, 5, 6]) is None  # evicted: two slots


def test_boundaries_move_to_the_kept_positions():
    assert kept_boundaries([5, 10, 20], [0, 1, 2, 8, 9, 15, 19]) == (3, 5, 7)


def test_smoothing_keeps_the_length_and_spreads_a_peak():
    scores = torch.zeros(40)
    scores[20] = 13.0
    out = smoothed(scores)
    assert out.shape == (40,) and out[14:27].allclose(torch.ones(13)) and out[:14].eq(0).all()


def test_scorer_spec():
    assert self_scorer_layers("self:8") == 8 and self_scorer_layers("/models/small") is None
    with pytest.raises(ValueError):
        self_scorer_layers("self:x")
    with pytest.raises(ValueError):
        CompressionSettings(mode="sometimes")


def test_the_template_protects_all_but_earlier_message_contents():
    request = GenerationRequest((Message("system", "SYSTEM PROMPT"), Message("user", "first question " * 4),
                                 Message("assistant", "an answer"), Message("user", "the last question")))
    prompt = FAKE_TEMPLATE.render(request)
    text = prompt.text
    dropped = [p for p in range(len(prompt.token_ids)) if not any(s <= p < e for s, e in prompt.protected)]
    dropped_text = "".join(text[p] for p in dropped)  # one byte token per ASCII character
    assert dropped_text == "first question " * 4 + "an answer"
    kept_text = "".join(text[p] for s, e in prompt.protected for p in range(s, e))
    assert "SYSTEM PROMPT" in kept_text and "the last question" in kept_text
    assert kept_text.endswith("<|im_start|>assistant\n") and kept_text.count("<|im_start|>") == 5


def test_a_single_user_turn_is_protected_whole():
    prompt = FAKE_TEMPLATE.render(GenerationRequest((Message("user", "only this"),)))
    assert prompt.protected == ((0, len(prompt.token_ids)),)


def replies(max_ctx: int, compresses_to_fit: bool):
    import attrs

    from dflash.reply import Replies
    from tests.unit.fakes import fake_text

    class NoScheduler:
        async def check_grammar(self, grammar):
            raise AssertionError("not needed")

    return Replies(attrs.evolve(fake_text(max_ctx), compresses_to_fit=compresses_to_fit), NoScheduler())


def long_history(last: str) -> GenerationRequest:
    return GenerationRequest((Message("user", "filler " * 80), Message("assistant", "ok"), Message("user", last)),
                             max_tokens=50)


async def test_fit_lets_a_prompt_longer_than_the_context_through_when_its_protected_part_fits():
    from dflash.protocols.errors import APIError

    reply = replies(300, compresses_to_fit=True).prepare(long_history("short?"), call_id=lambda: "c")
    assert len(reply.prompt.token_ids) > 300 and reply.max_tokens == 50  # the engine clamps after compressing
    assert reply.prompt.protected
    with pytest.raises(APIError) as refused:  # what must be kept does not fit
        replies(300, compresses_to_fit=True).prepare(long_history("long " * 80), call_id=lambda: "c")
    assert refused.value.status == 400
    with pytest.raises(APIError):  # compression off: refused as before
        replies(300, compresses_to_fit=False).prepare(long_history("short?"), call_id=lambda: "c")
