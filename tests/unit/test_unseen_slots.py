"""How the unseen-prompt measurement turns verification steps into τ and per-slot hit rates."""

from dflash.training.unseen import acceptance_length, slot_hit_rates


def test_tau_counts_the_pending_token_and_the_accepted_drafts_per_verification():
    assert acceptance_length([(7, 0), (7, 3), (7, 7)]) == round((0 + 3 + 7 + 3) / 3, 3)
    assert acceptance_length([]) == 0.0


def test_a_slots_hit_rate_counts_only_blocks_right_up_to_it_that_proposed_it():
    steps = [(7, 0), (7, 0), (7, 1), (7, 3), (2, 2)]
    # slot 1: 3 of 5 accepted; slot 2: reached by (7,1), (7,3), (2,2): 2 accepted; slot 3: (7,3) only, the
    # two-draft block never proposed it; slot 4: reached by (7,3), missed.
    assert slot_hit_rates(steps, 5) == [0.6, round(2 / 3, 3), 1.0, 0.0, None]
