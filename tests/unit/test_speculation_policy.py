"""The speculation policy: measure plain decoding first, shrink the block on low acceptance,
pause (with growing pauses) when speculating measures slower than plain decoding."""

import math
import time

from dflash.engine.speculative import (
    SpeculationConfig,
    SpeculationMemory,
    SpeculationPolicy,
    best_block,
    tokens_per_verification,
)


class ScriptedDrafter:
    name = "ngram"

    def __init__(self):
        self.asked = []

    def propose(self, tokens, max_tokens):
        self.asked.append(max_tokens)
        return [1] * max_tokens


def baseline(policy, seconds):
    """The plain steps a generation measures before it speculates."""
    for _ in range(SpeculationPolicy.PLAIN_SAMPLES):
        policy.record_plain(seconds)


class Named(ScriptedDrafter):
    def __init__(self, name):
        super().__init__()
        self.name = name


def test_first_step_is_plain_to_measure_the_baseline():
    policy = SpeculationPolicy(SpeculationConfig(drafter="ngram", max_draft_tokens=8), {"ngram": ScriptedDrafter()})
    assert policy.choose([1, 2, 3]) == (None, [])


def test_the_baseline_is_the_fastest_of_the_first_plain_steps():
    """The first decode step after a prefill runs on cold caches: alone it made plain decoding look
    slower than it is, so speculation looked better than it was."""
    policy = SpeculationPolicy(SpeculationConfig(drafter="ngram", max_draft_tokens=8), {"ngram": ScriptedDrafter()})
    policy.record_plain(0.014)
    assert policy.choose([1, 2, 3]) == (None, [])
    policy.record_plain(0.010)
    assert policy.plain_seconds.value == 0.010
    assert policy.choose([1, 2, 3])[0] is not None


def test_a_drafter_that_never_pays_is_probed_ever_less_often():
    drafter = ScriptedDrafter()
    policy = SpeculationPolicy(SpeculationConfig(drafter="ngram", max_draft_tokens=8), {"ngram": drafter})
    baseline(policy, 0.010)
    speculative_steps = []
    for step in range(600):
        chosen, draft = policy.choose([1, 2, 3])
        if chosen is None:
            policy.record_plain(0.010)
        else:
            speculative_steps.append(step)
            policy.record(chosen, len(draft), 0, 0.030)  # nothing accepted, 3x a plain step
    assert len(speculative_steps) <= 8
    assert drafter.asked[:3] == [2, 1, 1]  # slow start, then the block halves after a failed probe


def test_a_drafter_that_pays_keeps_speculating_with_a_full_block():
    drafter = ScriptedDrafter()
    policy = SpeculationPolicy(SpeculationConfig(drafter="ngram", max_draft_tokens=8), {"ngram": drafter})
    baseline(policy, 0.010)
    for _ in range(50):
        chosen, draft = policy.choose([1, 2, 3])
        assert chosen is drafter
        policy.record(chosen, len(draft), len(draft), 0.020)  # whole blocks in 2 plain steps' time
    assert drafter.asked[:3] == [2, 4, 8] and set(drafter.asked[3:]) == {8}  # slow start, then full blocks


def test_without_adaptation_every_step_speculates():
    drafter = ScriptedDrafter()
    policy = SpeculationPolicy(SpeculationConfig(drafter="ngram", max_draft_tokens=4, adaptive=False), {"ngram": drafter})
    for _ in range(10):
        chosen, draft = policy.choose([1, 2, 3])
        policy.record(chosen, len(draft), 0, 1.0)
    assert drafter.asked == [4] * 10


def test_a_failing_drafter_does_not_pause_one_that_pays():
    good, bad = Named("ngram"), Named("dflash")
    policy = SpeculationPolicy(SpeculationConfig(drafter="auto", max_draft_tokens=4),
                               {"dflash": bad, "ngram": good})
    baseline(policy, 0.010)
    for _ in range(40):
        chosen, draft = policy.choose([1, 2, 3])
        accepted = len(draft) if chosen is good else 0
        policy.record(chosen, len(draft), accepted, 0.015 if chosen is good else 0.040)
    assert len(bad.asked) <= 4 and len(good.asked) >= 30


def test_the_drafter_measured_fastest_proposes_first():
    slow, fast = Named("dflash"), Named("ngram")
    policy = SpeculationPolicy(SpeculationConfig(drafter="auto", max_draft_tokens=4),
                               {"dflash": slow, "ngram": fast})  # dflash preferred while unmeasured
    baseline(policy, 0.010)
    chosen = []
    for _ in range(30):
        drafter, draft = policy.choose([1, 2, 3])
        chosen.append(drafter.name)
        # both pay (faster than a 10 ms plain step), the n-gram drafter twice as much
        policy.record(drafter, len(draft), len(draft), 0.012 if drafter is fast else 0.024)
    assert chosen[:2] == ["dflash", "ngram"]  # each measured once, in preference order
    assert set(chosen[2:]) == {"ngram"}


def generation(policy, steps, accepted_of, seconds):
    """Drive a policy like a generation: plain steps at 10 ms, drafts as scripted."""
    speculated = []
    for step in range(steps):
        chosen, draft = policy.choose([1, 2, 3])
        if chosen is None:
            policy.record_plain(0.010)
        else:
            speculated.append(step)
            policy.record(chosen, len(draft), accepted_of(len(draft)), seconds)
    return speculated


def test_a_drafter_that_did_not_pay_starts_the_next_generation_paused():
    """The engine's memory carries what a generation learned into the next: a drafter that measured
    slower than plain is not probed again at once (where a verification costs several steps those
    probes made auto slower than plain), but its pause is capped so one paying elsewhere soon returns."""
    config = SpeculationConfig(drafter="ngram", max_draft_tokens=8)
    memory = SpeculationMemory(config)
    # each failed probe 0.4 plain steps past a plain step: the cap is CARRIED_PAUSE
    first = generation(SpeculationPolicy(config, {"ngram": ScriptedDrafter()}, memory), 200, lambda n: 0, 0.014)
    assert first[0] == SpeculationPolicy.PLAIN_SAMPLES  # probed right after the baseline steps
    second = generation(SpeculationPolicy(config, {"ngram": ScriptedDrafter()}, memory), 200, lambda n: 0, 0.014)
    assert second and second[0] > SpeculationMemory.CARRIED_PAUSE // 2 and second[0] <= SpeculationMemory.CARRIED_PAUSE + SpeculationPolicy.PLAIN_SAMPLES
    fresh = generation(SpeculationPolicy(config, {"ngram": ScriptedDrafter()}), 200, lambda n: 0, 0.014)
    assert fresh[0] == SpeculationPolicy.PLAIN_SAMPLES  # without memory: as before


def test_a_dearer_probe_carries_a_longer_pause_into_the_next_generation():
    """A failed probe costing 2 plain steps past a plain one waits 4x CARRIED_PAUSE steps into the
    next generation (a DFlash probe on chat: ~1.4 steps on AMX, ~3 with AVX2 kernels), so that
    probing costs about as small a share of the steps as a cheap probe's does."""
    config = SpeculationConfig(drafter="ngram", max_draft_tokens=8)
    memory = SpeculationMemory(config)
    for _ in range(3):
        generation(SpeculationPolicy(config, {"ngram": ScriptedDrafter()}, memory), 300, lambda n: 0, 0.030)
    policy = SpeculationPolicy(config, {"ngram": ScriptedDrafter()}, memory)
    assert policy._probe_cost(policy.state["ngram"]) > 1.5
    assert policy.state["ngram"].pause > SpeculationMemory.CARRIED_PAUSE * 3


def test_a_drafter_that_paid_starts_the_next_generation_with_its_block():
    config = SpeculationConfig(drafter="ngram", max_draft_tokens=8)
    memory = SpeculationMemory(config)
    generation(SpeculationPolicy(config, {"ngram": ScriptedDrafter()}, memory), 20, lambda n: n, 0.020)
    drafter = ScriptedDrafter()
    generation(SpeculationPolicy(config, {"ngram": drafter}, memory), 5, lambda n: n, 0.020)
    assert drafter.asked[0] == 8  # no slow start again


def test_memory_of_another_configuration_is_not_used():
    memory = SpeculationMemory(SpeculationConfig(drafter="ngram", max_draft_tokens=8))
    generation(SpeculationPolicy(memory.config, {"ngram": ScriptedDrafter()}, memory), 200, lambda n: 0, 0.030)
    other = SpeculationConfig(drafter="ngram", max_draft_tokens=4)
    assert generation(SpeculationPolicy(other, {"ngram": ScriptedDrafter()}, memory), 10, lambda n: 0, 0.030)[0] == SpeculationPolicy.PLAIN_SAMPLES


def test_the_block_is_chosen_by_acceptance_and_what_a_verified_row_costs():
    assert tokens_per_verification(1.0, 7) == 8 and tokens_per_verification(0.0, 7) == 1
    assert abs(tokens_per_verification(0.5, 2) - 1.75) < 1e-9  # 1 + 0.5 + 0.25
    assert best_block(0.9, 0.1, 7) == 7  # AMX-like: rows are cheap, draft long
    assert best_block(0.85, 0.4, 7) == 3  # AVX2-like: each row ~0.4 of a step
    assert best_block(0.3, 0.4, 7) == 1
    # a proposal paid once a step (a DFlash forward, half a plain step) makes longer blocks pay
    assert best_block(0.8, 0.17, 7) == 4 and best_block(0.8, 0.17, 7, proposal_cost=0.5) == 5
    # where no block beats a plain step (2 drafts would be the least bad) the probe drafts one token
    assert best_block(0.4, 0.17, 7, proposal_cost=0.5) == 1


def test_a_measured_drafter_drafts_the_block_that_pays_best_on_this_cpu():
    """Verification at 1 + 0.4 steps per draft row and 3 of every 4 drafts accepted: after the slow
    start the policy settles on short blocks, not the longest one whole blocks would earn."""
    import random

    drafter = ScriptedDrafter()
    policy = SpeculationPolicy(SpeculationConfig(drafter="ngram", max_draft_tokens=8), {"ngram": drafter})
    baseline(policy, 0.010)
    rng = random.Random(0)
    for _ in range(60):
        chosen, draft = policy.choose([1, 2, 3])
        if chosen is None:
            policy.record_plain(0.010)
            continue
        matched = 0
        while matched < len(draft) and rng.random() < 0.75:
            matched += 1
        policy.record(chosen, len(draft), matched, 0.010 * (1 + 0.4 * len(draft)))
    assert max(drafter.asked[-20:]) <= 3 and 2 in drafter.asked[-20:]  # best: 2 (1.29 tokens a step's time)


def test_a_proposal_s_own_cost_is_not_charged_to_the_verified_rows(monkeypatch):
    """A drafter whose proposal costs half a plain step and whose verification costs 1 + 0.17 steps a
    row, 80% of drafts accepted: the policy measures the two apart and settles on long blocks. (Charged
    to the rows, as it was, the proposal made 2 drafts look best and kept the block there.)"""
    import random

    import dflash.engine.speculative as speculative

    clock = [0.0]
    monkeypatch.setattr(speculative.time, "perf_counter", lambda: clock[0])

    class SlowProposals(ScriptedDrafter):
        name = "dflash"

        def propose(self, tokens, max_tokens):
            clock[0] += 0.005
            return super().propose(tokens, max_tokens)

    drafter = SlowProposals()
    policy = SpeculationPolicy(SpeculationConfig(drafter="dflash", max_draft_tokens=7), {"dflash": drafter})
    baseline(policy, 0.010)
    rng = random.Random(1)
    for _ in range(80):
        chosen, draft = policy.choose([1, 2, 3])
        if chosen is None:
            policy.record_plain(0.010)
            continue
        matched = 0
        while matched < len(draft) and rng.random() < 0.8:
            matched += 1
        policy.record(chosen, len(draft), matched, 0.005 + 0.010 * (1 + 0.17 * len(draft)))
    assert min(drafter.asked[-20:]) >= 4


class SureDrafter(ScriptedDrafter):
    """A drafter that says when it is sure of its proposal (as the n-gram drafter does while text is copied)."""

    def __init__(self):
        super().__init__()
        self.sure = False

    def confident(self, tokens):
        return self.sure


def test_a_paused_drafter_proposes_where_it_is_sure_and_its_pause_ends_when_that_pays():
    drafter = SureDrafter()
    policy = SpeculationPolicy(SpeculationConfig(drafter="ngram", max_draft_tokens=8), {"ngram": drafter})
    baseline(policy, 0.010)
    chosen, draft = policy.choose([1, 2, 3])
    policy.record(chosen, len(draft), 0, 0.030)  # a failed probe: paused for PAUSE_STEPS
    assert policy.choose([1, 2, 3]) == (None, [])
    drafter.sure = True  # the text starts repeating an earlier span
    chosen, draft = policy.choose([1, 2, 3])
    assert chosen is drafter
    policy.record(chosen, len(draft), len(draft), 0.012)  # it paid
    drafter.sure = False
    assert policy.choose([1, 2, 3])[0] is drafter  # no pause left


def test_a_sure_proposal_that_fails_pauses_the_drafter_again():
    drafter = SureDrafter()
    policy = SpeculationPolicy(SpeculationConfig(drafter="ngram", max_draft_tokens=8), {"ngram": drafter})
    baseline(policy, 0.010)
    chosen, draft = policy.choose([1, 2, 3])
    policy.record(chosen, len(draft), 0, 0.030)
    drafter.sure = True
    chosen, draft = policy.choose([1, 2, 3])
    policy.record(chosen, len(draft), 0, 0.030)
    drafter.sure = False
    assert all(policy.choose([1, 2, 3]) == (None, []) for _ in range(2 * SpeculationPolicy.PAUSE_STEPS - 1))


def test_a_drafter_sure_of_its_proposal_asks_before_one_measured_faster():
    fast, copier = Named("dflash"), SureDrafter()
    policy = SpeculationPolicy(SpeculationConfig(drafter="auto", max_draft_tokens=4), {"dflash": fast, "ngram": copier})
    baseline(policy, 0.010)
    for _ in range(6):  # both pay; the DFlash stand-in twice as much
        drafter, draft = policy.choose([1, 2, 3])
        policy.record(drafter, len(draft), len(draft), 0.012 if drafter is fast else 0.024)
    assert policy.choose([1, 2, 3])[0] is fast
    copier.sure = True  # the text starts repeating an earlier span: the copier asks first
    assert policy.choose([1, 2, 3])[0] is copier
    copier.sure = False
    assert policy.choose([1, 2, 3])[0] is fast


class SlowProposer(ScriptedDrafter):
    """Its proposal costs 2 plain steps whatever the block, as a DFlash forward costs a fixed part of one."""

    def propose(self, tokens, max_tokens):
        time.sleep(0.020)
        return super().propose(tokens, max_tokens)


def test_a_probe_with_every_draft_accepted_earns_a_longer_block_not_a_pause():
    """A short probe whose drafts were all accepted, though its own step ran slower than plain (3
    tokens in 3.5 plain steps' time, 2 of them the proposal's), grows its block instead of being
    paused: the verified rows were cheap, so longer blocks pay."""
    drafter = SlowProposer()
    policy = SpeculationPolicy(SpeculationConfig(drafter="ngram", max_draft_tokens=8), {"ngram": drafter})
    baseline(policy, 0.010)
    chosen, draft = policy.choose([1, 2, 3])
    policy.record(chosen, len(draft), len(draft), 0.035)
    assert policy.choose([1, 2, 3])[0] is drafter and drafter.asked[-1] == 4


def test_a_drafter_that_cannot_pay_even_when_always_right_is_paused():
    drafter = ScriptedDrafter()
    policy = SpeculationPolicy(SpeculationConfig(drafter="ngram", max_draft_tokens=2), {"ngram": drafter})
    baseline(policy, 0.010)
    for _ in range(3):  # every draft accepted, each verification 4 plain steps' time
        chosen, draft = policy.choose([1, 2, 3])
        if chosen is None:
            policy.record_plain(0.010)
            continue
        policy.record(chosen, len(draft), len(draft), 0.040)
    asked = len(drafter.asked)
    generation(policy, 10, lambda n: n, 0.040)
    assert len(drafter.asked) == asked  # paused


def paused_steps(probe_seconds):
    """Plain steps a drafter waits after one failed probe of 2 drafts taking `probe_seconds` (plain: 10 ms)."""
    policy = SpeculationPolicy(SpeculationConfig(drafter="ngram", max_draft_tokens=8), {"ngram": ScriptedDrafter()})
    baseline(policy, 0.010)
    chosen, draft = policy.choose([1, 2, 3])
    policy.record(chosen, len(draft), 0, probe_seconds)
    waited = 0
    while policy.choose([1, 2, 3]) == (None, []):
        waited += 1
    return waited


def test_a_cheap_failed_probe_pauses_for_fewer_steps_than_a_costly_one():
    """The pause is scaled by what the next probe costs: an n-gram probe whose rows cost a tenth of
    a plain step each (AMX) waits a few steps, so a copy that resumes after an edit is caught; one
    costing half a step or more (a DFlash forward) waits the whole PAUSE_STEPS."""
    costly, cheap = paused_steps(0.030), paused_steps(0.012)
    assert costly == SpeculationPolicy.PAUSE_STEPS
    assert 1 <= cheap <= SpeculationPolicy.PAUSE_STEPS // 4


class CatchingUp(ScriptedDrafter):
    """Its first proposal spends `first` seconds catching its context up (DFlashDrafter's rows of a
    long prompt), and says so in catch_up_seconds."""

    def __init__(self, first):
        super().__init__()
        self.first = first
        self.catch_up_seconds = 0.0

    def propose(self, tokens, max_tokens):
        self.catch_up_seconds = self.first if not self.asked else 0.0
        time.sleep(self.catch_up_seconds)
        return super().propose(tokens, max_tokens)


def test_a_drafter_catching_its_context_up_is_not_charged_for_it():
    """The first DFlash proposal after an 8K-token prompt took 121 ms against 17 for a plain step,
    and the policy paused DFlash for it; the catch-up is left out of what the policy measures."""
    drafter = CatchingUp(first=0.050)
    policy = SpeculationPolicy(SpeculationConfig(drafter="ngram", max_draft_tokens=8), {"ngram": drafter})
    baseline(policy, 0.010)
    chosen, draft = policy.choose([1, 2, 3])
    policy.record(chosen, len(draft), len(draft), 0.050 + 0.012)  # every draft accepted in 1.2 plain steps
    assert policy.state["ngram"].proposal_cost.value < 1.0  # not the 5 plain steps of the catch-up
    assert policy.choose([1, 2, 3])[0] is drafter and drafter.asked[-1] == 4  # paying: its block grows


class TreeDrafter:
    """Proposes the tree of LOGPROBS (test_draft_tree.py): rows 10 .5, 10-20 .45, 11 .3, 10-20-30 .27,
    11-20 .27, 11-20-30 .162, 10-20-31 .135."""
    name = "dflash"

    def propose_tree(self, tokens, rows, depth=None):
        from tests.unit.test_draft_tree import IDS, LOGPROBS
        from dflash.engine.speculative import best_first_tree

        return best_first_tree(LOGPROBS, IDS, rows)


def tree_policy(row_cost, proposal_cost=0.2, memory=None, chain_cost=0.05):
    config = SpeculationConfig(drafter="dflash", max_draft_tokens=7, tree_rows=7)
    policy = SpeculationPolicy(config, {"dflash": TreeDrafter()}, memory, trees=True, chain_cost=lambda: chain_cost)
    baseline(policy, 0.010)
    state = policy.state["dflash"]
    state.row_cost.value, state.proposal_cost.value = row_cost, proposal_cost
    return policy, state


def test_a_tree_is_as_large_as_its_rows_pay_for():
    """Each row in the order chosen adds its path's probability to the tokens expected and a row's
    cost, a row that opens a chain (a second child) a chain's cost too: cheap rows take the whole
    tree, dear ones the likeliest path only, and deep in a context (dear chains) the first chain."""
    policy, _ = tree_policy(row_cost=0.01, chain_cost=0.01)
    assert len(policy.choose([1, 2])[1]) == 7
    policy, _ = tree_policy(row_cost=0.25)
    assert policy.choose([1, 2])[1].tokens == (10, 20)
    # 11-20-30 (.162) pays a row; 10-20-31 (.135) would pay one too, but it opens a chain
    policy, _ = tree_policy(row_cost=0.06, chain_cost=0.06)
    assert policy.choose([1, 2])[1].tokens == (10, 20, 30, 11, 20, 30)
    policy, _ = tree_policy(row_cost=0.06, chain_cost=0.0)
    assert len(policy.choose([1, 2])[1]) == 7
    policy, _ = tree_policy(row_cost=0.01, chain_cost=1.0)
    assert policy.choose([1, 2])[1].tokens == (10, 20)


class DepthTreeDrafter(TreeDrafter):
    """Proposes the tree of `probabilities` (one list a slot) cut to the drafts asked for, and keeps
    what it was asked for."""

    def __init__(self, probabilities):
        self.probabilities, self.asked = probabilities, []

    def propose_tree(self, tokens, rows, depth=None):
        from dflash.engine.speculative import best_first_tree

        self.asked.append(depth)
        slots = self.probabilities[: depth or len(self.probabilities)]
        return best_first_tree([[math.log(p) for p in slot] for slot in slots],
                               [[100 * i + j for j in range(len(slot))] for i, slot in enumerate(slots)], rows)


def test_an_unsure_tree_drafter_drafts_short_blocks_until_it_is_sure_to_their_end():
    """A proposal's cost grows with its block, and an unsure drafter's trees are verified a draft or
    two deep: its next block is one draft past the depth verified (MIN_TREE_DEPTH at least), and the
    whole block again once a tree is verified to its deepest row; a declined tree, the shortest."""
    unsure, sure = [[0.4, 0.2]] * 7, [[0.97, 0.01]] * 7
    drafter = DepthTreeDrafter(unsure)
    config = SpeculationConfig(drafter="dflash", max_draft_tokens=7, tree_rows=7)
    policy = SpeculationPolicy(config, {"dflash": drafter}, trees=True, chain_cost=lambda: 0.05)
    baseline(policy, 0.010)
    state = policy.state["dflash"]
    state.row_cost.value, state.proposal_cost.value = 0.2, 0.2
    _, tree = policy.choose([1, 2])
    assert drafter.asked == [None] and tree.depth == 1  # the whole block proposed, one draft verified
    assert state.depth == SpeculationPolicy.MIN_TREE_DEPTH
    policy.choose([1, 2])
    assert drafter.asked[-1] == SpeculationPolicy.MIN_TREE_DEPTH
    drafter.probabilities = sure
    _, tree = policy.choose([1, 2])
    assert tree.depth == SpeculationPolicy.MIN_TREE_DEPTH and state.depth is None  # sure to the block's end
    _, tree = policy.choose([1, 2])
    assert drafter.asked[-1] is None and tree.depth > SpeculationPolicy.MIN_TREE_DEPTH
    drafter.probabilities = [[0.01, 0.01]] * 7  # no row pays: declined
    assert policy.choose([1, 2]) == (None, []) and state.depth == SpeculationPolicy.MIN_TREE_DEPTH


def test_a_drafter_that_keeps_less_than_its_probabilities_say_gets_smaller_trees():
    sizes = {}
    for kept in (2.0, 0.5):
        policy, state = tree_policy(row_cost=0.06)
        for _ in range(10):
            policy.record(TreeDrafter(), 3, kept, 0.015, rows=5, expected=2.0)
        assert abs(state.calibration() - kept / 2.0) < 1e-9
        state.row_cost.value, state.proposal_cost.value = 0.06, 0.2  # as measured before
        state.pause = 0
        sizes[kept] = len(policy.choose([1, 2])[1])
    assert 1 <= sizes[0.5] < sizes[2.0]


def test_a_tree_whose_verification_would_not_pay_is_declined_and_the_drafter_paused():
    """The proposal is paid when the tree is sized; where no part of the tree is likely enough to
    pay for its own verification the step is plain, the proposal's time is measured as the
    drafter's cost and not the plain step's, and the drafter pauses as after a failed probe."""
    policy, state = tree_policy(row_cost=0.06)
    for _ in range(10):  # its drafts never kept
        policy.record(TreeDrafter(), 3, 0, 0.015, rows=5, expected=2.0)
    state.row_cost.value, state.proposal_cost.value, state.pause = 0.06, 0.2, 0
    state.tokens_per_second.value = 1 / 0.010  # neutral: as fast as plain steps
    assert policy.choose([1, 2]) == (None, [])
    assert state.pause > 0 and policy.unmeasured_seconds > 0
    policy.record_plain(0.010 + policy.unmeasured_seconds)
    assert abs(policy.plain_seconds.value - 0.010) < 1e-6 and policy.unmeasured_seconds == 0.0
    pause = state.pause
    assert policy.choose([1, 2]) == (None, []) and state.pause == pause - 1  # paused: not even proposed


def test_a_declined_proposal_is_not_charged_to_the_drafter_that_proposes_after_it():
    """auto: DFlash asks first and declines its tree; the n-gram drafter's proposal then is this
    step's, and its cost is its own, not the declined forward's too."""

    class SlowTreeDrafter(TreeDrafter):
        def propose_tree(self, tokens, rows, depth=None):
            time.sleep(0.02)
            return super().propose_tree(tokens, rows, depth)

    config = SpeculationConfig(drafter="auto", max_draft_tokens=7, tree_rows=7)
    ngram = ScriptedDrafter()
    policy = SpeculationPolicy(config, {"ngram": ngram, "dflash": SlowTreeDrafter()}, trees=True)
    baseline(policy, 0.010)
    dflash = policy.state["dflash"]
    dflash.row_cost.value, dflash.proposal_cost.value = 0.06, 0.2
    dflash.kept, dflash.expected = 0.0, 10.0  # its probabilities never bear out: every tree declined
    dflash.tokens_per_second.value = 1e6  # measured fastest: asks first
    policy.state["ngram"].tokens_per_second.value = 100.0
    chosen, draft = policy.choose([1, 2, 3])
    assert chosen is ngram and draft
    assert 0.0 <= policy.proposal_seconds < 0.01 and policy.unmeasured_seconds >= 0.02


class PendingTreeDrafter(TreeDrafter):
    def __init__(self, pending: int):
        self.pending = pending
        self.asked = 0

    def pending_rows(self):
        return self.pending

    def propose_tree(self, tokens, rows, depth=None):
        self.asked += 1
        return super().propose_tree(tokens, rows, depth)


def carried_pause_policy(kept: float, expected: float, pending: int = 0):
    """A generation after one that paused the tree drafter: its pause carried in (SpeculationMemory),
    its calibration kept/expected, `pending` context rows for it to catch up."""
    config = SpeculationConfig(drafter="dflash", max_draft_tokens=7, tree_rows=7)
    memory = SpeculationMemory(config)
    memory.drafters["dflash"] = (7, 300, 64)  # block, pause left, pause length
    memory.costs["dflash"] = (0.06, 0.2, kept, expected, (0.0, 0.0, 0.0, 0.0, 0.0))
    drafter = PendingTreeDrafter(pending)
    policy = SpeculationPolicy(config, {"dflash": drafter}, memory, trees=True, chain_cost=lambda: 0.05)
    baseline(policy, 0.010)
    return policy, policy.state["dflash"]


def test_a_tree_drafter_looks_at_new_text_once_through_a_carried_pause():
    """A pause carried from the generation before (a chat reply) does not keep the tree drafter off
    the next one's text (a coding reply) where its first proposal says a tree pays: it proposes once,
    and its tree is verified; where the tree would not pay it is declined and the carried pause goes
    on as it was (not doubled), the drafter not asked again until the pause ends."""
    policy, state = carried_pause_policy(kept=10.0, expected=10.0)
    pause = state.pause
    assert 0 < pause <= 300 and state.peek
    chosen, draft = policy.choose([1, 2])
    assert chosen is not None and len(draft) > 0 and not state.peek
    policy, state = carried_pause_policy(kept=0.0, expected=10.0)  # its probabilities never bore out
    pause, length = state.pause, state.pause_length
    assert policy.choose([1, 2]) == (None, []) and not state.peek
    assert state.pause == pause - 1 and state.pause_length == length and policy.unmeasured_seconds > 0
    policy.record_plain(0.010)
    asked = policy.drafters["dflash"].asked
    assert policy.choose([1, 2]) == (None, []) and state.pause == pause - 2  # paused: not even proposed
    assert policy.drafters["dflash"].asked == asked


def test_a_waiting_look_lets_the_carried_pause_count_down():
    """auto: while the n-gram drafter, sure of its copies, takes the steps, the tree drafter is not
    asked and its look waits; its carried pause still counts down, and a tree drafter that proposes
    nothing (its context not whole) has not looked yet."""
    config = SpeculationConfig(drafter="auto", max_draft_tokens=7, tree_rows=7)
    memory = SpeculationMemory(config)
    memory.drafters["dflash"] = (7, 5, 64)
    ngram, dflash = SureDrafter(), PendingTreeDrafter(0)
    ngram.sure = True
    policy = SpeculationPolicy(config, {"ngram": ngram, "dflash": dflash}, memory, trees=True)
    baseline(policy, 0.010)
    state = policy.state["dflash"]
    assert state.peek and state.pause == 5
    for left in (4, 3):
        assert policy.choose([1, 2])[0] is ngram and state.pause == left and state.peek
    assert dflash.asked == 0
    ngram.sure = False
    ngram.propose = lambda tokens, block: []  # nothing to copy now
    dflash.propose_tree = lambda tokens, rows, depth=None: TreeDrafter().propose_tree(tokens, 0)  # an empty tree
    assert policy.choose([1, 2]) == (None, []) and state.peek and state.pause == 2


def test_a_look_that_pays_ends_the_carried_pause_but_keeps_its_length():
    """One lucky step at a reply's start does not restart the pauses from PAUSE_STEPS."""
    policy, state = carried_pause_policy(kept=10.0, expected=10.0)
    chosen, draft = policy.choose([1, 2])
    policy.record(chosen, draft.depth, draft.depth, 0.011, rows=len(draft), expected=draft.expected())
    assert state.pause == 0 and state.pause_length == 64


def test_no_look_where_the_drafter_would_catch_up_a_whole_new_context_first():
    """A look runs the drafter over the context rows it has not seen (a fresh prompt's): past
    LOOK_PENDING_ROWS of them it costs more than a plain step, so the carried pause just goes on."""
    policy, state = carried_pause_policy(kept=10.0, expected=10.0, pending=SpeculationPolicy.LOOK_PENDING_ROWS + 1)
    pause = state.pause
    assert policy.choose([1, 2]) == (None, []) and state.pause == pause - 1 and not state.peek
    assert policy.drafters["dflash"].asked == 0


def test_what_a_drafters_rows_cost_carries_into_the_next_generation():
    memory = SpeculationMemory(SpeculationConfig(drafter="dflash", max_draft_tokens=7, tree_rows=7))
    policy, state = tree_policy(row_cost=None, memory=memory)
    policy.record(TreeDrafter(), 2, 2, 0.02, rows=3, expected=1.0)
    measured = (state.row_cost.value, state.proposal_cost.value, state.kept, state.expected, state.verification.sums)
    assert measured[0] is not None and measured[4][0] == 1.0
    following = SpeculationPolicy(memory.config, {"dflash": TreeDrafter()}, memory, trees=True).state["dflash"]
    assert (following.row_cost.value, following.proposal_cost.value, following.kept, following.expected,
            following.verification.sums) == measured


def test_a_verifications_cost_is_a_line_over_its_rows():
    """What every verification pays and what each row adds, told apart once the rows have varied: a
    cost per row charged the first part to each row, so small trees measured dear rows."""
    from dflash.engine.speculative import VerificationCost

    cost = VerificationCost()
    for rows in (1, 1, 1):
        cost.add(rows, 0.17)
    assert cost.line() is None  # one row count: nothing tells the parts apart
    for rows in (3, 7, 15, 2, 9):
        cost.add(rows, 0.1 + 0.07 * rows)
    fixed, per_row = cost.line()
    assert abs(per_row - 0.07) < 0.01 and abs(fixed - 0.1) < 0.03


def test_a_one_draft_hit_halves_the_pause_length_and_a_several_draft_one_restarts_it():
    """Backoff: on chat a probe keeps its one draft by chance now and then (n-gram: ~1 in 5); had
    such a step restarted the pause length at PAUSE_STEPS, probes would come every few steps again.
    A drafter that pays on new text keeps several drafts a step, and its pauses are short at once."""
    drafter = ScriptedDrafter()
    policy = SpeculationPolicy(SpeculationConfig(drafter="ngram", max_draft_tokens=8), {"ngram": drafter})
    baseline(policy, 0.010)
    state = policy.state["ngram"]
    state.pause_length, state.block = 8 * SpeculationPolicy.PAUSE_STEPS, 1  # after three failed probes
    chosen, draft = policy.choose([1, 2, 3])
    assert len(draft) == 1
    policy.record(chosen, 1, 1, 0.011)  # a lucky one-draft probe: it pays
    assert state.pause == 0 and state.pause_length == 4 * SpeculationPolicy.PAUSE_STEPS
    state.block = 2
    chosen, draft = policy.choose([1, 2, 3])
    policy.record(chosen, len(draft), 2, 0.012)  # two drafts kept
    assert state.pause == 0 and state.pause_length == SpeculationPolicy.PAUSE_STEPS
