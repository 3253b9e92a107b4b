"""Speculative decoding is lossless: greedy output equals plain greedy output token for token, and
sampled output keeps the target's distribution (a seeded request is even reproduced exactly)."""

import collections

import pytest

from dflash.engine.drafters.ngram import NgramDrafter
from dflash.engine.generate import Engine
from dflash.engine.sampling import SamplingParams
from dflash.engine.speculative import SpeculationConfig
from tests.model.tiny import ours_from_hf, tiny_hf_model

PROMPTS = [
    [5, 9, 33, 2, 7, 100, 4, 61, 12, 90, 3, 5, 9, 33, 2],
    [1, 2, 3, 4, 1, 2, 3, 4, 1, 2],
    [77, 12, 77, 12, 8, 8, 8, 40],
]


@pytest.fixture(scope="module")
def model():
    return ours_from_hf(tiny_hf_model("qwen3"))


def generate(model, prompt, sampling, speculation=SpeculationConfig(), n=24, drafter=None):
    engine = Engine(model, max_ctx=128, prefill_chunk=8, speculation=speculation, dflash_drafter=drafter)
    generation = engine.start(prompt, sampling, max_tokens=n)
    return generation.run(), generation.stats


NGRAM = SpeculationConfig(drafter="ngram", max_draft_tokens=4, ngram_min=1, ngram_max=3, adaptive=False)
PENALTIES = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(frequency_penalty=0.7, presence_penalty=0.4, rep_window=8),
]


@pytest.mark.parametrize("sampling", PENALTIES, ids=["plain", "repetition", "frequency-presence"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_ngram_greedy_equals_plain_greedy(model, prompt, sampling):
    plain, _ = generate(model, prompt, sampling)
    speculative, stats = generate(model, prompt, sampling, NGRAM)
    assert speculative == plain
    assert stats.verification_steps > 0


def test_seeded_sampling_gives_the_same_tokens_with_speculation(model):
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=20, seed=1234)
    plain, _ = generate(model, PROMPTS[1], sampling)
    speculative, stats = generate(model, PROMPTS[1], sampling, NGRAM)
    assert speculative == plain and stats.verification_steps > 0
    again, _ = generate(model, PROMPTS[1], sampling, NGRAM)
    assert again == speculative


def test_sampled_distribution_matches_plain_sampling(model):
    """300 runs each, different seeds on each side: the total variation distance between the
    empirical distributions of the tokens at positions 0..3 stays under 0.15. top_k=3 keeps at most
    three outcomes per position, where two independent samples of 300 differ by ~0.05 (0.15 is
    over 4 standard deviations); a verifier that accepted drafts without sampling would move
    positions 1..3 far more."""
    runs = 300

    def histogram(speculation, seed_base):
        counts = [collections.Counter() for _ in range(4)]
        for seed in range(seed_base, seed_base + runs):
            out, _ = generate(model, PROMPTS[1], SamplingParams(temperature=1.0, top_k=3, seed=seed), speculation, n=4)
            for position, token in enumerate(out):
                counts[position][token] += 1
        return counts

    plain = histogram(SpeculationConfig(), 0)
    speculative = histogram(NGRAM, 10_000)
    for position in range(4):
        tokens = set(plain[position]) | set(speculative[position])
        distance = sum(abs(plain[position][t] - speculative[position][t]) for t in tokens) / (2 * runs)
        assert distance < 0.15, (position, distance)


def test_ngram_proposes_what_followed_the_latest_longest_match():
    drafter = NgramDrafter(min_n=1, max_n=3)
    assert drafter.propose([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 2) == [8, 5]
    assert drafter.propose([4, 4, 4], 5) == [4]  # the latest occurrence of [4, 4] is followed by 4
    assert NgramDrafter(min_n=2, max_n=2).propose([1, 2, 3, 4], 3) == []


def test_ngram_is_confident_only_where_the_recent_text_repeats_an_earlier_span():
    drafter = NgramDrafter(min_n=2, max_n=4)
    span = list(range(100, 100 + NgramDrafter.CONFIDENT_MATCH))
    copying = [1, 2] + span + [7, 8, 9] + [3] + span  # the span again: its continuation [7, 8, 9] is likely
    assert drafter.confident(copying) and drafter.propose(copying, 3) == [7, 8, 9]
    shorter = [1, 2] + span + [7, 8, 9] + [3] + span[1:]  # the same proposal, one token less repeated
    assert NgramDrafter(min_n=2, max_n=4).propose(shorter, 3) == [7, 8, 9]
    assert not NgramDrafter(min_n=2, max_n=4).confident(shorter)
    assert not NgramDrafter(min_n=2, max_n=4).confident(span)  # nothing earlier to repeat


def test_ngram_index_kept_across_generations_answers_as_a_fresh_one():
    """The engine keeps one n-gram drafter (its index of a 20K-token prompt took 166 ms to build
    afresh on every request): each generation's text is compared with the indexed one in full and
    the index cut back to what they share, so whatever came before, it proposes what a fresh drafter
    would, token for token, and nothing of another conversation's text."""
    import random

    rng = random.Random(0)
    kept = NgramDrafter(min_n=1, max_n=3)
    previous: list[int] = []
    for trial in range(60):
        shared = rng.randrange(len(previous) + 1) if previous and trial % 4 else 0
        text = previous[:shared] + [rng.randrange(6) for _ in range(rng.randrange(1, 40))]
        kept.begin(text[: max(shared, 2)])
        for length in range(max(shared, 2), len(text) + 1):  # the text growing as a generation's does
            fresh = NgramDrafter(min_n=1, max_n=3)
            sequence = text[:length]
            assert kept.propose(sequence, 4) == fresh.propose(sequence, 4), (trial, length)
            assert kept.confident(sequence) == fresh.confident(sequence), (trial, length)
        previous = text
    ends = {key: list(value) for key, value in kept._ends.items()}
    fresh = NgramDrafter(min_n=1, max_n=3)
    fresh.propose(previous, 1)
    assert ends == fresh._ends  # nothing stale left behind


def test_ngram_index_is_cut_back_only_where_the_next_text_differs(monkeypatch):
    drafter = NgramDrafter()
    first = list(range(50)) * 4
    drafter.propose(first, 3)
    cuts = []
    cut = NgramDrafter._cut
    monkeypatch.setattr(NgramDrafter, "_cut", lambda self, length: (cuts.append(length), cut(self, length)))
    drafter.begin(first + [7, 8])  # the conversation goes on: nothing re-indexed
    drafter.begin(first[:120] + [9])  # another turn from an earlier point: cut back
    assert cuts == [200, 120]
    assert drafter._tokens == first[:120] + [9]
    drafter.begin(first[:50])  # most of it differs: indexed again rather than cut
    assert cuts == [200, 120] and drafter._tokens == first[:50]
    assert drafter.propose(first[:50], 3) == NgramDrafter().propose(first[:50], 3)


def test_an_engine_keeps_its_ngram_drafter_across_generations(model):
    engine = Engine(model, max_ctx=128, prefill_chunk=8, speculation=NGRAM)
    first = engine.drafters()["ngram"]
    assert engine.drafters()["ngram"] is first
    engine.speculation = SpeculationConfig(drafter="ngram", ngram_min=2)
    assert engine.drafters()["ngram"] is not first  # other sizes: another index
    # each generation after the first: the same tokens as a fresh engine's, and its prompt indexed
    # as it starts (before the decode steps the policy times), whatever was indexed before
    for prompt in PROMPTS:
        generation = engine.start(prompt, SamplingParams(), max_tokens=16)
        assert engine.drafters()["ngram"]._tokens == prompt
        assert generation.run() == generate(model, prompt, SamplingParams(), n=16)[0]
