"""Speculative decoding: which drafter proposes, how many tokens, and lossless verification.

Verification (in `Generation._speculative_step`) samples the target at each verified position with
the full sampling chain — penalty history as it stands after the preceding accepted tokens — and
accepts a draft token only when it equals that sample. At temperature 0 the sample is the argmax,
so the output is token for token what plain greedy decoding produces. Above 0 every emitted token is
a target sample given exactly the emitted prefix; for a deterministic drafter that is exact
speculative sampling. Each verified position consumes one draw from the request's generator, as a
plain step does, so a seeded request gives the same tokens with or without speculation.

The policy keeps speculation from costing speed: it measures the time of plain steps and of
verification steps and, when speculating yields fewer tokens per second than plain decoding, it
shrinks the block and then pauses speculation for a while before probing again. Once it has
measured a drafter's per-token acceptance and what each verified row costs on this CPU, it drafts
the number of tokens that yields the most tokens per second (best_block). With several drafters
(auto), one sure of its proposal (the n-gram drafter while text is copied) proposes first, then the
one measured fastest.
"""

from __future__ import annotations

import time
from typing import Literal, Sequence

import attrs

DrafterMode = Literal["auto", "dflash", "ngram", "none"]


@attrs.frozen
class SpeculationConfig:
    drafter: DrafterMode = "none"
    max_draft_tokens: int = 8  # k: tokens proposed per verification (DFlash: block_size - 1 at most)
    ngram_min: int = 2
    ngram_max: int = 4
    adaptive: bool = True


class _Ema:
    def __init__(self, alpha: float, value: float | None = None):
        self.alpha = alpha
        self.value = value

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self.alpha * (sample - self.value)


class _DrafterState:
    """What the policy has measured of one drafter."""

    def __init__(self, block: int, pause_length: int):
        self.block = block
        self.pause = 0
        self.pause_length = pause_length
        self.tokens_per_second = _Ema(0.3)
        # Per-token acceptance: decayed counts of draft tokens matched and of tokens tried (the
        # matched ones plus the first mismatch; tokens after it were never judged).
        self.matched = 0.0
        self.tried = 0.0
        self.row_cost = _Ema(0.3)  # each verified draft row's cost, in plain steps
        # The proposal's own cost, in plain steps: fixed per step whatever the block (a DFlash
        # forward), so it is not charged to the rows (which made short blocks look best).
        self.proposal_cost = _Ema(0.3, 0.0)

    def acceptance(self) -> float | None:
        return self.matched / self.tried if self.tried >= 4 else None


def tokens_per_verification(acceptance: float, block: int) -> float:
    """Expected tokens a verification of `block` drafts yields (the target's own token included)
    when each draft token is accepted with probability `acceptance` until the first rejection."""
    if acceptance >= 0.999:
        return block + 1.0
    return (1.0 - acceptance ** (block + 1)) / (1.0 - acceptance)


def best_block(acceptance: float, row_cost: float, max_block: int, proposal_cost: float = 0.0) -> int:
    """The block that yields the most tokens per unit of time, a step of k drafts costing
    1 + proposal_cost + row_cost * k plain steps: on AMX (row_cost ~0.1) a long block for a drafter
    accepted 90% of the time, on AVX2 (~0.4) 3 drafts for the same drafter; a proposal that costs
    half a step (a DFlash forward) makes longer blocks pay, since it is paid once a step."""
    fixed = 1.0 + max(proposal_cost, 0.0)
    rate = {k: tokens_per_verification(acceptance, k) / (fixed + max(row_cost, 0.0) * k) for k in range(1, max_block + 1)}
    best = max(rate, key=rate.get)
    # Where no block beats a plain step the drafter is paused; its probes then draft one token, the
    # cheapest probe (on chat two drafts cost auto ~7% against one: bench/speculative.py, Zen 4).
    return best if rate[best] >= 1.0 else 1


class SpeculationMemory:
    """What an engine's earlier generations learned of each drafter: its block size, the pause it
    had left and its pause length, for the configuration it was learned under.

    Why: a generation starts knowing nothing, so each one probed every drafter afresh; where a
    verification costs several decode steps (AVX2: 1+7 rows ~4x a step) those probes made auto
    slower than plain on chat. A drafter that did not pay last time starts the next generation
    paused for the rest of its pause, at most CARRIED_PAUSE steps, so one that pays on other text
    (n-gram on a code edit after chat) loses few steps.
    """

    CARRIED_PAUSE = 64

    def __init__(self, config: SpeculationConfig):
        self.config = config
        self.drafters: dict[str, tuple[int, int, int]] = {}  # name -> (block, pause left, pause length)


class SpeculationPolicy:
    """Per generation: picks the drafter and block size for each decode step. Each drafter keeps its
    own block size and pause, so a drafter that does not pay does not silence one that does; they
    start from what the engine's earlier generations learned (SpeculationMemory), if given."""

    # Plain steps to take after speculation measured slower than plain decoding; doubled after each
    # probe that fails again (so a drafter that never pays costs ever less), reset by one that pays.
    PAUSE_STEPS = 16
    MAX_PAUSE_STEPS = 512
    FULL_PAUSE_PROBE_COST = 0.5  # plain steps: a probe this costly or more waits the whole pause
    FIRST_BLOCK = 2

    def __init__(self, config: SpeculationConfig, drafters: dict[str, object], memory: SpeculationMemory | None = None):
        self.config = config
        self.drafters = drafters  # name -> drafter, in preference order for auto mode
        # Slow start: a drafter begins with a short block (a failed probe then costs little) and
        # earns longer ones by having whole blocks accepted. Without adaptation: the full block.
        first_block = min(self.FIRST_BLOCK, config.max_draft_tokens) if config.adaptive else config.max_draft_tokens
        self.state = {name: _DrafterState(first_block, self.PAUSE_STEPS) for name in drafters}
        self.memory = memory if memory is not None and memory.config == config and config.adaptive else None
        for name, state in self.state.items():
            if self.memory is not None and name in self.memory.drafters:
                state.block, pause, state.pause_length = self.memory.drafters[name]
                state.pause = min(pause, SpeculationMemory.CARRIED_PAUSE)
        self.plain_seconds = _Ema(0.3)
        self.proposal_seconds = 0.0  # the last step's proposals (choose), the start of what record() is given
        self.catch_up_seconds = 0.0  # of this step's proposals: drafters' contexts catching up

    def choose(self, tokens: Sequence[int]) -> tuple[object | None, list[int]]:
        """The drafter for this step and its proposal; (None, []) means take a plain step."""
        if self.config.adaptive and self.plain_seconds.value is None and self.drafters:
            return None, []  # measure one plain step first: the baseline speculation must beat
        ready = []
        for index, (name, drafter) in enumerate(self.drafters.items()):
            state = self.state[name]
            sure = hasattr(drafter, "confident") and drafter.confident(tokens)
            # A paused drafter still proposes where it says it is sure (n-gram: the text is being
            # copied): a pause earned on other text cost a code echo 16 plain steps (Zen 4).
            if state.pause > 0 and not sure:
                state.pause -= 1
                self._remember(name)
            else:
                ready.append((not sure, index, name, drafter))
        # A drafter sure of its proposal asks first, then the fastest measured one (one never
        # measured before all, to measure it); the others propose only when it has nothing: on code
        # editing the n-gram drafter's long acceptances then are not crowded out by a slower drafter
        # that also proposes every step. Sure first: a DFlash rate measured high once (a whole block
        # accepted) kept it first through a tool result being copied, 2-3 tokens a step where the
        # n-gram drafter takes 8, while the n-gram rate it was compared with was never measured
        # again (tool use, bench/speculative.py on an AMX VM: auto 1.98x against n-gram alone 2.73x).
        ready.sort(key=lambda item: (item[0], -(self.state[item[2]].tokens_per_second.value or float("inf")), item[1]))
        started = time.perf_counter()
        for _, _, name, drafter in ready:
            state = self.state[name]
            draft = drafter.propose(tokens, state.block)
            # A drafter's context catching up (DFlashDrafter.catch_up_seconds) is no cost of this
            # step's: left out of every measurement of it, plain or speculative.
            self.catch_up_seconds += getattr(drafter, "catch_up_seconds", 0.0)
            if draft:
                self.proposal_seconds = time.perf_counter() - started - self.catch_up_seconds  # every proposal this step asked for
                return drafter, draft
        return None, []

    def _without_catch_up(self, seconds: float) -> float:
        seconds, self.catch_up_seconds = max(seconds - self.catch_up_seconds, 1e-6), 0.0
        return seconds

    def record_plain(self, seconds: float) -> None:
        self.plain_seconds.add(self._without_catch_up(seconds))

    def record(self, drafter, proposed: int, accepted: int, seconds: float) -> None:
        seconds = self._without_catch_up(seconds)
        if not self.config.adaptive:
            return
        state = self.state[drafter.name]
        state.tokens_per_second.add((accepted + 1) / max(seconds, 1e-9))
        plain_rate = 1.0 / max(self.plain_seconds.value or seconds, 1e-9)
        state.matched = 0.9 * state.matched + accepted
        state.tried = 0.9 * state.tried + accepted + (accepted < proposed)
        if self.plain_seconds.value:
            proposal = min(self.proposal_seconds, seconds) / self.plain_seconds.value
            state.proposal_cost.add(proposal)
            state.row_cost.add((seconds / self.plain_seconds.value - proposal - 1.0) / max(proposed, 1))
        acceptance = state.acceptance()
        if acceptance is not None and state.row_cost.value is not None:
            # Enough measured: the block that pays best on this CPU (verification cost per row,
            # the proposal's own) for this drafter's acceptance, instead of the slow start's
            # doubling and halving.
            state.block = best_block(acceptance, state.row_cost.value, self.config.max_draft_tokens,
                                     state.proposal_cost.value)
        elif accepted < proposed / 2 and state.block > 1:
            state.block = max(1, state.block // 2)
        elif accepted == proposed:
            state.block = min(self.config.max_draft_tokens, state.block * 2)
        if accepted == proposed and self._could_pay(state):
            # Every draft accepted is the best a short probe can show; judged by its own rate it
            # was paused (a DFlash probe of 1 draft, both tokens right, took 12 ms against 5.7 for a
            # plain step on AMX: the proposal costs a fixed half step) and coding lost the 1.2-1.45x
            # DFlash gives there. It keeps the block chosen above (doubled in the slow start),
            # judged on the next steps instead.
            state.tokens_per_second.value = max(state.tokens_per_second.value, plain_rate)
            state.pause, state.pause_length = 0, self.PAUSE_STEPS
        elif state.tokens_per_second.value < plain_rate:
            state.pause = self._pause_steps(state)
            state.pause_length = min(2 * state.pause_length, self.MAX_PAUSE_STEPS)
            state.tokens_per_second.value = plain_rate  # probe again from neutral after the pause
        else:
            state.pause, state.pause_length = 0, self.PAUSE_STEPS  # it pays (a confident proposal in a pause too)
        self._remember(drafter.name)

    def _pause_steps(self, state: _DrafterState) -> int:
        """The plain steps before the next probe: pause_length for a probe that costs
        FULL_PAUSE_PROBE_COST plain steps or more (a DFlash forward and its rows), proportionally
        fewer for a cheaper one. Why: a failed n-gram probe of one draft costs a tenth of a step on
        AMX, and the 16 steps it paused for were the text where the copy resumed (code editing: a
        renamed argument, then 12 plain steps through lines the n-gram drafter had right)."""
        if state.row_cost.value is None:
            return state.pause_length
        probe = max(state.proposal_cost.value, 0.0) + max(state.row_cost.value, 0.0) * state.block
        return max(1, round(state.pause_length * min(1.0, probe / self.FULL_PAUSE_PROBE_COST)))

    def _could_pay(self, state: _DrafterState) -> bool:
        """Whether whole blocks of the longest size, every draft accepted, would beat plain steps at
        the verification and proposal costs measured (unmeasured: assume so)."""
        if state.row_cost.value is None:
            return True
        longest = self.config.max_draft_tokens
        cost = 1.0 + max(state.proposal_cost.value, 0.0) + max(state.row_cost.value, 0.0) * longest
        return tokens_per_verification(1.0, longest) / cost >= 1.0

    def _remember(self, name: str) -> None:
        if self.memory is not None:
            state = self.state[name]
            self.memory.drafters[name] = (state.block, state.pause, state.pause_length)
