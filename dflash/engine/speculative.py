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

import heapq
import math
import time
from typing import Callable, Literal, Sequence

import attrs

DrafterMode = Literal["auto", "dflash", "ngram", "none"]


@attrs.frozen
class SpeculationConfig:
    drafter: DrafterMode = "none"
    max_draft_tokens: int = 8  # k: tokens proposed per verification (DFlash: block_size - 1 at most)
    ngram_min: int = 2
    ngram_max: int = 4
    adaptive: bool = True
    # DFlash proposes a tree of its most likely continuations instead of one chain (DraftTree), of
    # at most tree_rows rows (its depth stays within the block); 0: the chain of its first choices
    tree_rows: int = 15


@attrs.frozen
class DraftTree:
    """Draft tokens as a tree, verified in one target pass (Generation._tree_step). Rows are in
    depth-first order after the pending token (row 0): `tokens[i]` is row i + 1, `parents[i]` the
    row before it on its path (0: the pending token). A parent's most likely child is the row right
    after it, so rows 1.. down the first children (chain 0) are the chain a drafter would propose.
    `probabilities[i]`: the drafter's probability of row i + 1's whole path; `ranks[i]`: the order
    the row was chosen in (best_first_tree), so the rows ranked below k are a tree too (`first`).

    Why: DFlash predicts each slot of its block at once, with a distribution over the vocabulary;
    where its first choice at a slot is wrong its second or third often is right. On chat its first
    slot is right 43% of the time (bf16, AMX): spending some of the verified rows on the likeliest
    alternatives, rather than on deep slots a chain rarely reaches, keeps more tokens per
    verification for as many rows (bench/unseen_acceptance.py: chain against tree)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    probabilities: tuple[float, ...] = ()
    ranks: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return max(self.depths(), default=0)

    def depths(self) -> list[int]:
        depth = [0]
        for parent in self.parents:
            depth.append(depth[parent] + 1)
        return depth[1:]

    def expected(self) -> float:
        """Draft tokens a verification keeps, by the drafter's own probabilities: each row's path is
        kept whole with its probability, and a kept path of d rows keeps each of its d prefixes."""
        return sum(self.probabilities)

    def chains(self) -> int:
        """Runs of rows each the child of the row before (model.tree_chains): a verification attends
        each over its own path's keys, so each past the first reads keys again (the engine's
        chain_cost: those of the tree's chunk where the native loop attends all chains in one call,
        the whole context where each is a call of its own)."""
        return sum(1 for row, parent in enumerate(self.parents, 1) if parent != row - 1) + (1 if self.parents else 0)

    def within(self, depth: int) -> "DraftTree":
        """The rows at most `depth` deep (a reply's last tokens), depth-first order kept."""
        return self._keep([d <= depth for d in self.depths()])

    def first(self, rows: int) -> "DraftTree":
        """The `rows` rows chosen first: the likeliest paths (a row's ancestors were chosen before it)."""
        if rows >= len(self) or not self.ranks:
            return self
        return self._keep([rank < rows for rank in self.ranks])

    def _keep(self, kept: list[bool]) -> "DraftTree":
        keep = [i for i, k in enumerate(kept) if k]
        if len(keep) == len(self):
            return self
        row = {0: 0} | {i + 1: n + 1 for n, i in enumerate(keep)}
        pick = lambda values: tuple(values[i] for i in keep) if values else ()  # noqa: E731
        return DraftTree(pick(self.tokens), tuple(row[self.parents[i]] for i in keep), pick(self.probabilities),
                         pick(self.ranks))


def best_first_tree(logprobs: Sequence[Sequence[float]], ids: Sequence[Sequence[int]], rows: int) -> DraftTree:
    """The `rows` most likely draft paths as a tree, from each slot's candidates (`ids[d]` in
    descending `logprobs[d]`, slot d + 1 after the pending token). The slots are predicted at once,
    so a path's log-probability is the sum of its tokens'; every prefix of a path is at least as
    likely as the path, so taking paths best first gives a tree. Rows come out depth-first with
    each row's likelier children first (chain 0 is the first choice at every slot)."""
    slots = len(ids)
    if rows < 1 or slots == 0:
        return DraftTree((), ())
    chosen: dict[tuple[int, ...], tuple[int, float]] = {}  # rank path -> (order chosen, log-probability)
    frontier = [(-logprobs[0][0], (0,))]
    while frontier and len(chosen) < rows:
        score, path = heapq.heappop(frontier)
        chosen[path] = (len(chosen), -score)
        depth, rank = len(path) - 1, path[-1]
        if rank + 1 < len(ids[depth]):  # the next candidate at this slot, same ancestors
            heapq.heappush(frontier, (score + logprobs[depth][rank] - logprobs[depth][rank + 1], path[:-1] + (rank + 1,)))
        if depth + 1 < slots:  # this path's first-choice child
            heapq.heappush(frontier, (score - logprobs[depth + 1][0], path + (0,)))
    tokens: list[int] = []
    parents: list[int] = []
    probabilities: list[float] = []
    ranks: list[int] = []
    # Depth-first: the paths in lexicographic order of their candidate ranks.
    row_of: dict[tuple[int, ...], int] = {}
    for path in sorted(chosen):
        order, logprob = chosen[path]
        tokens.append(ids[len(path) - 1][path[-1]])
        parents.append(row_of.get(path[:-1], 0))
        probabilities.append(math.exp(logprob))
        ranks.append(order)
        row_of[path] = len(tokens)
    return DraftTree(tuple(tokens), tuple(parents), tuple(probabilities), tuple(ranks))


class _Ema:
    def __init__(self, alpha: float, value: float | None = None):
        self.alpha = alpha
        self.value = value

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self.alpha * (sample - self.value)


class VerificationCost:
    """A verification's cost past a plain step, in plain steps, as a line over its rows (less a
    tree's chains' own attention calls: Engine.chain_cost), fitted by least squares over the recent verifications (each weighing 0.9 of the
    one after it).

    Why: a cost per row (the cost over the rows) charges the part every verification pays,
    whatever its rows, to each row: on int4 (AMX VM) 1 row costs ~0.17 plain steps more than a
    step, 7 rows ~0.6 and 15 ~1.6, so one row seemed to cost 0.16 where the next costs 0.07, trees
    came out smaller, and each smaller tree measured a dearer row."""

    def __init__(self):
        self.sums = [0.0] * 5  # weight, x, y, x², xy

    def add(self, rows: int, cost: float) -> None:
        for i, term in enumerate((1.0, rows, cost, rows * rows, rows * cost)):
            self.sums[i] = 0.9 * self.sums[i] + term

    def line(self) -> tuple[float, float] | None:
        """(the cost every verification pays, the cost of each row), or None before the rows have
        varied enough to tell them apart."""
        w, x, y, xx, xy = self.sums
        spread = w * xx - x * x
        if w < 2.0 or spread < 0.5 * w * w:  # rows varied by less than ~0.7 of a row
            return None
        slope = max((w * xy - x * y) / spread, 0.0)
        return max((y - slope * x) / w, 0.0), slope


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
        # A tree proposer's calibration: decayed sums of draft tokens kept and of what its own
        # probabilities expected (DraftTree.expected) of the same verifications.
        self.kept = 0.0
        self.expected = 0.0
        # A verification's cost over a plain step against its rows, as a line (VerificationCost):
        # what a tree's next row costs is its slope.
        self.verification = VerificationCost()
        # A pause carried in from an earlier generation, and the drafter's first proposal on this
        # one's text not yet looked at (SpeculationPolicy.choose); `looked`: the verification
        # being measured is that look's.
        self.peek = False
        self.looked = False
        # A tree proposer's drafts in its next block (SpeculationPolicy._next_depth); None: its whole block.
        self.depth: int | None = None

    def acceptance(self) -> float | None:
        return self.matched / self.tried if self.tried >= 4 else None

    def calibration(self) -> float:
        """Draft tokens kept per token the drafter's probabilities expected (1 until measured)."""
        return self.kept / self.expected if self.expected >= 2.0 else 1.0


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
    paused for the rest of its pause, at most CARRIED_PAUSE steps for a probe that costs
    FULL_PAUSE_PROBE_COST plain steps and proportionally more for a dearer one (a failed probe then
    costs at most ~1% of the steps it waits for), so one that pays on other text (n-gram on a code
    edit after chat) loses few steps. A tree proposer (DFlash) looks at the new text once through
    that pause: its first proposal's calibrated probabilities decide whether it is verified or the
    pause goes on (_DrafterState.peek).
    """

    CARRIED_PAUSE = 64

    def __init__(self, config: SpeculationConfig):
        self.config = config
        self.drafters: dict[str, tuple[int, int, int]] = {}  # name -> (block, pause left, pause length)
        # name -> (row cost, proposal cost, kept, expected, VerificationCost sums): what a drafter's steps cost on this CPU
        # and how its probabilities bear out, which the text does not change much. Why: a tree's
        # first step is sized before its rows are measured (UNMEASURED_ROW_COST), and where a row
        # costs 0.4 plain steps (AVX2) a first tree of 10 rows cost each generation 3 steps.
        self.costs: dict[str, tuple] = {}


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
    MIN_TREE_DEPTH = 2  # the shortest block a tree proposer drafts (_next_depth)
    # Plain steps a generation measures before it speculates, the fastest taken: the first decode
    # step after a prefill runs on cold caches (int4, AMX VM: 9 ms against 6.5 the steps after;
    # bf16 59 against 48), and as the only plain step measured it made speculation look better
    # than it was for the whole reply.
    PLAIN_SAMPLES = 2
    # A verified row's cost in plain steps before it is measured: between AMX with bf16 weights
    # (~0.02) and int4 (~0.06) and AVX2 (~0.4 for chains, whose blocks start short instead).
    UNMEASURED_ROW_COST = 0.1
    # The most context rows a drafter may have to catch up for a look through a carried pause
    # (_DrafterState.peek). Why: its first proposal runs them through its layers, ~1.2 plain steps
    # for a 1.5K-token prompt with int4 (AMX VM), paid on every reply where the look declines (auto
    # on chat after a 2K-token system prompt, prefilled afresh each time: 0.93x against 0.96x).
    # The served DFlash drafter catches up its window's rows at most (drafters/dflash.py
    # CONTEXT_WINDOW, 256), so this bounds only a drafter built without a window.
    LOOK_PENDING_ROWS = 256

    def __init__(self, config: SpeculationConfig, drafters: dict[str, object], memory: SpeculationMemory | None = None,
                 trees: bool = False, chain_cost: Callable[[], float] = lambda: 0.05):
        self.config = config
        self.drafters = drafters  # name -> drafter, in preference order for auto mode
        # Drafters that can propose a tree do (DraftTree), where the engine verifies trees and the
        # configuration asks for them; `block` then counts the tree's rows.
        self.trees = trees and config.tree_rows > 0
        # What a tree's chain past the first costs, in plain steps: Engine.chain_cost (a read of the
        # keys in the tree's chunk, or of the whole context where chains are attended one by one).
        self.chain_cost = chain_cost
        # Slow start: a drafter begins with a short block (a failed probe then costs little) and
        # earns longer ones by having whole blocks accepted. Without adaptation: the full block.
        self.longest = {name: config.tree_rows if self._proposes_trees(drafter) else config.max_draft_tokens
                        for name, drafter in drafters.items()}
        self.state = {name: _DrafterState(min(self.FIRST_BLOCK, self.longest[name]) if config.adaptive else self.longest[name],
                                          self.PAUSE_STEPS) for name in drafters}
        self.memory = memory if memory is not None and memory.config == config and config.adaptive else None
        for name, state in self.state.items():
            if self.memory is not None and name in self.memory.costs:
                state.row_cost.value, state.proposal_cost.value, state.kept, state.expected, sums = self.memory.costs[name]
                state.verification.sums = list(sums)
            if self.memory is not None and name in self.memory.drafters:
                state.block, pause, state.pause_length = self.memory.drafters[name]
                state.pause = min(pause, self._carried_pause(state))  # after the costs: it weighs them
                # A tree proposer looks at the new text once through a carried pause: its proposal's
                # probabilities, calibrated, say whether a verification would pay (_tree_rows). Why:
                # a pause carried from a chat reply kept DFlash off the coding reply after it (int4,
                # AMX VM, chat then coding: DFlash alone 1.01x, auto 1.06x, against 1.37x and 1.41x
                # with no pause carried), while a look costs a proposal alone (~0.4 plain steps with
                # int4), the pause going on where it declines.
                state.peek = state.pause > 0 and self._proposes_trees(drafters[name])
        self.plain_seconds = _Ema(0.3)
        self.first_plain: list[float] = []  # the first PLAIN_SAMPLES plain steps; their fastest starts plain_seconds
        self.proposal_seconds = 0.0  # the last step's proposals (choose), the start of what record() is given
        # Of this step's time, what is no cost of the step measured: drafters' contexts catching up,
        # and declined proposals (_decline), which are measured on their own.
        self.unmeasured_seconds = 0.0

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
            if state.peek and getattr(drafter, "pending_rows", lambda: 0)() > self.LOOK_PENDING_ROWS:
                state.peek = False  # a look would run the drafter over a whole new context first
            if state.pause > 0 and not sure:
                # the pause counts down while a look waits too (the n-gram drafter may take the steps)
                state.pause -= 1
                state.peek = state.peek and state.pause > 0
                self._remember(name, costs=False)  # a paused drafter's costs do not change
                if not state.peek:
                    continue
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
            asked = time.perf_counter()
            tree = self._proposes_trees(drafter)
            draft = drafter.propose_tree(tokens, self.longest[name], state.depth) if tree else drafter.propose(tokens, state.block)
            # A drafter's context catching up (DFlashDrafter.catch_up_seconds) is no cost of this
            # step's: left out of every measurement of it, plain or speculative.
            catch_up = getattr(drafter, "catch_up_seconds", 0.0)
            self.unmeasured_seconds += catch_up
            if tree and draft:
                peek, state.peek = state.peek, False  # looked: a tree was proposed
                rows = self._tree_rows(state, draft)
                state.depth = self._next_depth(draft, rows)
                if rows == 0:  # verifying no part of it would pay: a plain step instead
                    self._decline(name, time.perf_counter() - asked - catch_up, pause=not peek)
                    continue
                draft = draft.first(rows)
                state.looked = peek
            if draft:
                self.proposal_seconds = time.perf_counter() - started - self.unmeasured_seconds  # every proposal this step asked for
                return drafter, draft
        return None, []

    def _proposes_trees(self, drafter) -> bool:
        return self.trees and hasattr(drafter, "propose_tree")

    def _tree_rows(self, state: _DrafterState, tree: DraftTree) -> int:
        """How many of a proposed tree's rows to verify: the k that yields the most tokens per unit
        of time, a verification of k rows keeping 1 + (the k likeliest rows' probabilities, summed,
        times the drafter's measured calibration) tokens and costing 1 + proposal + row_cost * k
        plain steps. So the tree is as large as this step's drafts are likely: few rows where the
        drafter is unsure (chat), more where it is sure, fewer where rows cost more (int4 against
        bf16 weights). Until a row's cost is measured it is taken as UNMEASURED_ROW_COST: a tree
        needs no slow start, its size following its drafts' probabilities from the first step.
        0 where no k makes the verification pay on its own (the step is then plain: _decline)."""
        if not self.config.adaptive:
            return len(tree)
        if not tree.probabilities:
            return min(state.block, len(tree))
        measured, line = state.row_cost.value, state.verification.line()
        scale = state.calibration()
        if line is not None:  # what every verification pays, and each row
            verification, row_cost = line
        else:
            verification, row_cost = 0.0, self.UNMEASURED_ROW_COST if measured is None else measured
        row_cost = max(row_cost, 0.01)
        proposal = max(state.proposal_cost.value, 0.0)
        fixed = 1.0 + proposal + verification
        chain_cost = self.chain_cost()
        # Rows in the order they were chosen (a row after its ancestors); a row whose parent has a
        # child already opens a chain, which reads keys again (DraftTree.chains): attended one call
        # a chain, at 7K of context with int4 weights and the int8 cache a chain cost 0.4 plain steps
        # where a row cost 0.1 (AMX VM); attended in one call, a chain reads only the tree's chunk.
        # The proposal is paid by the time the tree is sized: the verification goes ahead where some
        # k makes it pay on its own (its tokens against its cost past the proposal), else the step
        # is plain (0). Why: a DFlash probe after a pause on chat, unsure of every slot, cost 2.5
        # plain steps for 1.1 tokens (int4, AMX VM), where the proposal alone is half a step.
        best, best_rate, pays, total, cost, parents_with_child = 1, 0.0, False, 0.0, fixed, set()
        for k, row in enumerate(sorted(range(len(tree)), key=tree.ranks.__getitem__), 1):
            total += tree.probabilities[row]
            parent = tree.parents[row]
            cost += row_cost + (chain_cost if parent in parents_with_child else 0.0)
            parents_with_child.add(parent)
            rate = (1.0 + scale * total) / cost
            pays = pays or 1.0 + scale * total >= cost - proposal
            if rate > best_rate:
                best, best_rate = k, rate
        return best if pays else 0

    def _next_depth(self, tree: DraftTree, rows: int) -> int | None:
        """The drafts of the next proposal's block (None: the drafter's whole block): one past the
        depth this tree was verified to, MIN_TREE_DEPTH at least; the whole block again where the
        verified rows reached the deepest proposed one (the drafter was sure to the block's end).
        Why: a proposal's cost grows with its block (the drafter's layers over every slot, the LM
        head over every draft), while an unsure drafter's trees stop after one or two drafts: on
        chat the whole block's forward cost ~0.5 plain steps for trees verified one draft deep
        (int4, AVX2), a block of 3 about half that."""
        if not self.config.adaptive:
            return None
        if rows == 0:
            return self.MIN_TREE_DEPTH
        verified = tree.first(rows).depth
        return None if verified >= tree.depth else max(self.MIN_TREE_DEPTH, verified + 1)

    def _decline(self, name: str, seconds: float, pause: bool = True) -> None:
        """A proposal whose verification would not pay (_tree_rows): the step is plain, and for the
        drafter it yielded one token in a plain step and the proposal's `seconds`; that is judged as
        a verification's rate is (record), so declines pause a drafter as failed probes do. A look
        through a carried pause (`pause` False) that declines leaves that pause to go on."""
        state = self.state[name]
        plain = self.plain_seconds.value
        self.unmeasured_seconds += seconds  # not the plain step's cost
        state.proposal_cost.add(seconds / plain)
        if pause:
            state.tokens_per_second.add(1.0 / (plain + seconds))
            if state.tokens_per_second.value < 1.0 / plain:
                self._pause(state, 1.0 / plain)
        self._remember(name)

    def _pause(self, state: _DrafterState, plain_rate: float) -> None:
        """Pause a drafter measured slower than plain steps, the next pause twice as long."""
        state.pause = self._pause_steps(state)
        state.pause_length = min(2 * state.pause_length, self.MAX_PAUSE_STEPS)
        state.tokens_per_second.value = plain_rate  # probe again from neutral after the pause

    def _measured(self, seconds: float) -> float:
        seconds, self.unmeasured_seconds = max(seconds - self.unmeasured_seconds, 1e-6), 0.0
        return seconds

    def record_plain(self, seconds: float) -> None:
        seconds = self._measured(seconds)
        if len(self.first_plain) < self.PLAIN_SAMPLES:
            self.first_plain.append(seconds)
            if len(self.first_plain) == self.PLAIN_SAMPLES:
                self.plain_seconds.value = min(self.first_plain)
            return
        self.plain_seconds.add(seconds)

    def record(self, drafter, proposed: int, accepted: int, seconds: float, rows: int | None = None,
               expected: float | None = None, chains: int = 1) -> None:
        """A verification step: `proposed` drafts deep (a tree's depth), `accepted` of them kept,
        `rows` draft rows verified (a tree's; default `proposed`, a chain's) in `chains` chains,
        `expected` what the tree's probabilities expected kept (DraftTree.expected)."""
        rows = proposed if rows is None else rows
        seconds = self._measured(seconds)
        if not self.config.adaptive:
            return
        state = self.state[drafter.name]
        looked, state.looked = state.looked, False
        # A verification that pays ends the pause and restarts its length at PAUSE_STEPS where it
        # kept two drafts or more; where it kept one it halves the length, back towards
        # PAUSE_STEPS. Why: on chat a probe now and then keeps its one draft by chance (n-gram: ~1
        # in 5), and each such step had restarted the backoff, so probes came every few steps
        # again; a drafter that pays on new text (coding after chat) keeps several drafts a step
        # and gets short pauses back at once. A look through a carried pause keeps the length:
        # one lucky step at a chat reply's start had restarted the pauses, and the probes after it
        # cost deep in a context (int4, AMX VM, 2K-token system prompt: auto on chat 0.93x).
        if looked:
            pause_length = state.pause_length
        elif accepted >= 2:
            pause_length = self.PAUSE_STEPS
        else:
            pause_length = max(self.PAUSE_STEPS, state.pause_length // 2)
        calibration = state.calibration()
        if expected is not None:
            state.kept = 0.9 * state.kept + accepted
            state.expected = 0.9 * state.expected + expected
        # A tree's step is credited the mean of the tokens it kept and of what the drafter's
        # probabilities expected, scaled by how they bore out (the scale as it stood before this
        # step). Why: kept tokens are a draw (a coding reply's drafter, τ ~3, keeps 0-1 of a tree
        # now and then), and a probe after a pause is judged on one step: one such draw paused
        # DFlash for the rest of a coding reply (auto, int4, AMX: a chat reply's pause carried in,
        # then a probe that kept 1 paused it 128 steps). The expectation is a smoother estimate.
        credited = accepted if expected is None else 0.5 * (accepted + calibration * expected)
        state.tokens_per_second.add((credited + 1) / max(seconds, 1e-9))
        plain_rate = 1.0 / max(self.plain_seconds.value or seconds, 1e-9)
        state.matched = 0.9 * state.matched + accepted
        state.tried = 0.9 * state.tried + accepted + (accepted < proposed)
        if self.plain_seconds.value:
            proposal = min(self.proposal_seconds, seconds) / self.plain_seconds.value
            state.proposal_cost.add(proposal)
            # what the rows cost: the verification past a plain step, less its chains' own reads
            rows_part = seconds / self.plain_seconds.value - proposal - 1.0
            if chains > 1:
                rows_part -= self.chain_cost() * (chains - 1)
            state.row_cost.add(rows_part / max(rows, 1))
            state.verification.add(rows, rows_part)
        acceptance = state.acceptance()
        if acceptance is not None and state.row_cost.value is not None:
            # Enough measured: the block that pays best on this CPU (verification cost per row,
            # the proposal's own) for this drafter's acceptance, instead of the slow start's
            # doubling and halving.
            state.block = best_block(acceptance, state.row_cost.value, self.longest[drafter.name],
                                     state.proposal_cost.value)
        elif accepted < proposed / 2 and state.block > 1:
            state.block = max(1, state.block // 2)
        elif accepted == proposed:
            state.block = min(self.longest[drafter.name], state.block * 2)
        if accepted == proposed and self._could_pay(state, self.longest[drafter.name]):
            # Every draft accepted is the best a short probe can show; judged by its own rate it
            # was paused (a DFlash probe of 1 draft, both tokens right, took 12 ms against 5.7 for a
            # plain step on AMX: the proposal costs a fixed half step) and coding lost the 1.2-1.45x
            # DFlash gives there. It keeps the block chosen above (doubled in the slow start),
            # judged on the next steps instead.
            state.tokens_per_second.value = max(state.tokens_per_second.value, plain_rate)
            state.pause, state.pause_length = 0, pause_length
        elif state.tokens_per_second.value < plain_rate:
            self._pause(state, plain_rate)
        else:
            state.pause, state.pause_length = 0, pause_length  # it pays (a confident proposal in a pause too)
        self._remember(drafter.name)

    def _probe_cost(self, state: _DrafterState) -> float | None:
        """What a probe of this drafter costs past a plain step, in plain steps (None: unmeasured)."""
        if state.row_cost.value is None:
            return None
        return max(state.proposal_cost.value, 0.0) + max(state.row_cost.value, 0.0) * state.block

    def _carried_pause(self, state: _DrafterState) -> int:
        """The most of a pause a generation takes over from the one before (SpeculationMemory). Why
        it grows with the probe's cost: a DFlash probe cost ~1.4 plain steps past the step it replaced
        (int4, AMX VM) and ~3 with the AVX2 kernels, and one per 64 steps made auto on chat 2-4%
        slower than plain decoding."""
        probe = self._probe_cost(state)
        scale = 1.0 if probe is None else max(1.0, probe / self.FULL_PAUSE_PROBE_COST)
        return round(SpeculationMemory.CARRIED_PAUSE * scale)

    def _pause_steps(self, state: _DrafterState) -> int:
        """The plain steps before the next probe: pause_length for a probe that costs
        FULL_PAUSE_PROBE_COST plain steps or more (a DFlash forward and its rows), proportionally
        fewer for a cheaper one. Why: a failed n-gram probe of one draft costs a tenth of a step on
        AMX, and the 16 steps it paused for were the text where the copy resumed (code editing: a
        renamed argument, then 12 plain steps through lines the n-gram drafter had right)."""
        probe = self._probe_cost(state)
        if probe is None:
            return state.pause_length
        return max(1, round(state.pause_length * min(1.0, probe / self.FULL_PAUSE_PROBE_COST)))

    def _could_pay(self, state: _DrafterState, longest: int) -> bool:
        """Whether whole blocks of the longest size, every draft accepted, would beat plain steps at
        the verification and proposal costs measured (unmeasured: assume so)."""
        if state.row_cost.value is None:
            return True
        cost = 1.0 + max(state.proposal_cost.value, 0.0) + max(state.row_cost.value, 0.0) * longest
        return tokens_per_verification(1.0, longest) / cost >= 1.0

    def _remember(self, name: str, costs: bool = True) -> None:
        if self.memory is not None:
            state = self.state[name]
            self.memory.drafters[name] = (state.block, state.pause, state.pause_length)
            if costs:
                self.memory.costs[name] = (state.row_cost.value, state.proposal_cost.value, state.kept, state.expected,
                                           tuple(state.verification.sums))
