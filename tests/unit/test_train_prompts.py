"""The built-in prompt set of `dflash train-drafter`: a prompt's index names its reply shard, so a
longer set must keep the shorter one's order; and no training prompt is one of the unseen ones."""

from dflash.training.prompts import EVERYDAY_CHAT, EXTRA_CHAT, FIRST_TWO_TIERS, default_prompts
from dflash.training.unseen import UNSEEN_PROMPTS


def test_a_longer_prompt_set_keeps_the_first_prompts_in_their_places():
    everything = default_prompts(100_000)
    assert default_prompts(478) == everything[:478]
    assert default_prompts(120) == everything[:120]
    assert len(set(everything)) > 2000  # 2239 on Python 3.11, a few re-exported functions repeating
    assert set(EXTRA_CHAT) <= set(everything[478:])
    assert default_prompts(FIRST_TWO_TIERS) == everything[:FIRST_TWO_TIERS]
    assert default_prompts(FIRST_TWO_TIERS + 300) == everything[: FIRST_TWO_TIERS + 300]


def test_the_everyday_chat_comes_after_the_first_two_tiers_mixed_with_the_rest_of_the_second():
    everything = default_prompts(100_000)
    assert set(EVERYDAY_CHAT) <= set(everything[FIRST_TWO_TIERS:])
    assert not set(EVERYDAY_CHAT) & set(everything[:FIRST_TWO_TIERS])
    next_ones = everything[FIRST_TWO_TIERS : FIRST_TWO_TIERS + 200]
    chat = sum(prompt in set(EVERYDAY_CHAT) for prompt in next_ones)
    assert 40 < chat < 160  # both kinds, not one block after the other


def test_no_training_prompt_is_an_unseen_prompt():
    unseen = {message["content"] for conversations in UNSEEN_PROMPTS.values() for messages in conversations
              for message in messages if message["role"] == "user"}
    assert not unseen & set(default_prompts(100_000))
