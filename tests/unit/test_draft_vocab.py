"""training/draft_vocab.choose: the most frequent ids, special tokens always in, a multiple of 16."""

import collections

import pytest

from dflash.training.draft_vocab import choose


def test_the_most_frequent_ids_and_the_special_tokens_in_ascending_order():
    counts = collections.Counter({7: 50, 3: 40, 9: 40, 100: 1})
    # 0, 2 always; then by count 7, 3 and 9 (a tie: the lower id first), 100; then ids 1, 4, 5, ... to 16
    assert choose(counts, 16, always=[0, 2], vocab_size=200) == list(range(15)) + [100]


def test_ties_go_to_the_lower_id_and_fewer_seen_ids_are_filled_by_id():
    counts = collections.Counter({40: 5, 30: 5, 20: 9})
    chosen = choose(counts, 16, always=[], vocab_size=64)
    assert len(chosen) == 16 and {20, 30, 40} <= set(chosen) and chosen == sorted(chosen)
    assert set(chosen) - {20, 30, 40} == set(range(13))
    assert choose(collections.Counter({i: 100 - i for i in range(64)}), 16, always=[63], vocab_size=64) == list(range(15)) + [63]


@pytest.mark.parametrize("size", [0, 10, 80])
def test_a_size_that_is_not_a_positive_multiple_of_16_within_the_vocabulary_is_refused(size):
    with pytest.raises(ValueError, match=f"--size {size}"):
        choose(collections.Counter(), size, always=[], vocab_size=64)
