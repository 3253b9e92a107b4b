"""Which positions a drafter is trained to start a block at, and which labels its slots get, for
reply shards (the target's own output) and teacher-forced shards (offline text + the target's
greedy predictions)."""

import random

import pytest
import torch

from dflash.training.corpus import parse_mix
from dflash.training import train_drafter
from dflash.training.train_drafter import TrainOptions, anchor_candidates, block_batch, block_labels, learning_rate


def forced(tokens, greedy):
    return {"tokens": torch.tensor(tokens), "greedy": torch.tensor(greedy, dtype=torch.int32)}


def test_reply_shards_anchor_anywhere_in_the_reply_and_label_the_following_tokens():
    sample = {"tokens": torch.tensor([9, 9, 9, 10, 11, 12, 13]), "response_start": 3}
    assert anchor_candidates(sample).tolist() == [3, 4, 5]
    assert block_labels(sample, [3, 5], 4).tolist() == [[11, 12, 13], [13, -1, -1]]


def test_teacher_forced_anchors_sit_where_the_text_is_the_targets_own_greedy_token():
    # greedy[p] is the target's prediction for position p+1.
    sample = forced([5, 6, 7, 8, 9, 4], [6, 1, 8, 9, 3, 0])
    # position 1: text 6 == greedy[0]; 2: 7 != 1; 3: 8 == 8; 4: 9 == 9; 5 (last) never anchors.
    assert anchor_candidates(sample).tolist() == [1, 3, 4]


def test_teacher_forced_labels_follow_the_greedy_continuation_up_to_the_first_disagreement():
    tokens = [5, 6, 7, 8, 9, 4, 2]
    greedy = [6, 7, 8, 1, 3, 0, 0]
    # From anchor 1: slot 1 = greedy[1] = 7 (text agrees), slot 2 = greedy[2] = 8 (text agrees),
    # slot 3 = greedy[3] = 1 (text says 9: the target's continuation is 1, known exactly; beyond it,
    # unknown).
    assert block_labels(forced(tokens, greedy), [1], 5).tolist() == [[7, 8, 1, -1]]
    # Near the end of the window the labels stop at the last position.
    assert block_labels(forced(tokens, greedy), [5], 5).tolist() == [[0, -1, -1, -1]]


def test_a_block_batch_draws_distinct_sorted_anchors_from_the_candidates():
    sample = forced(list(range(40)), list(range(1, 41)))  # the text always agrees
    anchors = block_batch(sample, 8, random.Random(3))
    assert anchors == sorted(set(anchors)) and len(anchors) == 8 and min(anchors) >= 1 and max(anchors) <= 38
    assert block_batch(forced([1, 2], [9, 9]), 8, random.Random(0)) == []


def test_the_learning_rate_warms_up_then_decays_to_zero():
    options = TrainOptions(steps=100, warmup=0.1, learning_rate=1.0)
    rates = [learning_rate(options, step) for step in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:])) and rates[-1] < 0.01


def test_corpus_mix_parsing_names_the_bad_item():
    assert parse_mix("source=0.5, agent=0.5") == {"source": 0.5, "agent": 0.5}
    with pytest.raises(ValueError, match="'docs'"):
        parse_mix("docs")
    with pytest.raises(ValueError, match="kinds are"):
        parse_mix("novels=1")


@pytest.mark.parametrize("bf16_hardware, expected", [(True, "bfloat16"), (False, "float32")])
def test_the_training_dtype_follows_the_cpus_bf16_hardware_unless_named(monkeypatch, bf16_hardware, expected):
    monkeypatch.setattr(train_drafter, "has_bf16_hardware", lambda: bf16_hardware)
    assert train_drafter.training_dtype("auto") == expected
    assert train_drafter.training_dtype("bfloat16") == "bfloat16" and train_drafter.training_dtype("float32") == "float32"
