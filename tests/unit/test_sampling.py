"""Each stage of the sampling chain against hand-computed values."""

import math

import pytest
import torch

from dflash.engine.sampling import Sampler, SamplingParams


def sampler(**kwargs) -> Sampler:
    return Sampler(SamplingParams(**kwargs), vocab_size=4)


def test_logit_bias_is_added_first():
    out = sampler(logit_bias={1: 5.0, 3: -2.0}).process(torch.tensor([1.0, 2.0, 3.0, 4.0]), [])
    assert out.tolist() == [1.0, 7.0, 3.0, 2.0]


def test_logit_bias_rejects_out_of_vocabulary_ids():
    with pytest.raises(ValueError, match="logit_bias"):
        sampler(logit_bias={7: 1.0})


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    out = sampler(repetition_penalty=2.0).process(torch.tensor([4.0, -4.0, 4.0, -4.0]), [0, 1, 1])
    assert out.tolist() == [2.0, -8.0, 4.0, -4.0]  # tokens 2 and 3 never appeared


def test_frequency_and_presence_penalties_are_additive_per_count():
    out = sampler(frequency_penalty=0.5, presence_penalty=0.25).process(torch.zeros(4), [2, 2, 2, 0])
    assert out.tolist() == [-0.75, 0.0, -1.75, 0.0]  # token 2: 3 * 0.5 + 0.25


def test_penalties_count_only_the_last_rep_window_tokens():
    out = sampler(frequency_penalty=1.0, rep_window=2).process(torch.zeros(4), [1, 1, 1, 2, 3])
    assert out.tolist() == [0.0, 0.0, -1.0, -1.0]


def test_penalties_apply_at_temperature_zero():
    s = sampler(repetition_penalty=10.0)
    assert s.sample(torch.tensor([0.0, 5.0, 4.0, 0.0]), [1]) == 2  # 5 / 10 < 4


def test_top_k_keeps_the_k_largest():
    probs = sampler(temperature=1.0, top_k=2).probabilities(torch.tensor([1.0, 3.0, 2.0, 0.0]))
    e = [math.exp(3.0), math.exp(2.0)]
    assert probs.tolist() == pytest.approx([0.0, e[0] / sum(e), e[1] / sum(e), 0.0])


def test_temperature_scales_before_softmax():
    probs = sampler(temperature=0.5).probabilities(torch.tensor([0.0, 1.0, 0.0, 0.0]))
    e = math.exp(2.0)
    assert probs.tolist() == pytest.approx([1 / (e + 3), e / (e + 3), 1 / (e + 3), 1 / (e + 3)])


def test_top_p_keeps_the_smallest_set_reaching_p():
    # softmax of log([0.5, 0.3, 0.15, 0.05]) is that distribution; p = 0.7 keeps 0.5 and 0.3.
    logits = torch.log(torch.tensor([0.15, 0.5, 0.05, 0.3]))
    probs = sampler(temperature=1.0, top_p=0.7).probabilities(logits)
    assert probs.tolist() == pytest.approx([0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8])


def test_greedy_is_argmax_with_lowest_id_on_ties():
    assert sampler().sample(torch.tensor([1.0, 3.0, 3.0, 0.0]), []) == 1


def test_seed_reproduces_a_sampled_sequence():
    logits = torch.zeros(4)
    first = [sampler(temperature=1.0, seed=42).sample(logits, []) for _ in range(1)]
    draws_a = Sampler(SamplingParams(temperature=1.0, seed=7), 4)
    draws_b = Sampler(SamplingParams(temperature=1.0, seed=7), 4)
    assert [draws_a.sample(logits, []) for _ in range(20)] == [draws_b.sample(logits, []) for _ in range(20)]
    assert first[0] in range(4)


def test_sampling_follows_the_distribution():
    s = Sampler(SamplingParams(temperature=1.0, seed=1), 4)
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    counts = torch.bincount(torch.tensor([s.sample(logits, []) for _ in range(4000)]), minlength=4)
    assert (counts / 4000).tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4], abs=0.03)
