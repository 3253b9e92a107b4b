"""Which replica a request goes to: the one that holds its conversation, unless that one is overloaded.

A replica's caches (live KV state, agent turn snapshot, prefix snapshots) only help the requests
that come back to it, so a conversation sticks to the replica that served it last: found by the
conversation key the client sent, else by the longest prompt prefix that replica has seen
recently (a record of chained block hashes per replica, the approach of Ray Serve LLM's
PrefixCacheAffinityRouter and the SGLang/vLLM `cache_aware` routers). When the owner has more
than `imbalance_threshold` generations in flight beyond the least loaded replica, the request goes
to the least loaded one instead and that one becomes the owner: a warm cache is not worth a queue.

`Affinity` is the policy, plain Python; the Ray Serve `RequestRouter` classes below adapt it (and
Ray's own power-of-two router, for comparison) to Serve's routing loop. Every request carries a
`Route` keyword argument; control calls (status, turn checkpoints) pin a replica with it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import attrs
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
# Serve's default router is not part of its public request-router API (2.60); the pinned
# version in pyproject keeps this import stable.
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

BLOCK_TOKENS = 64  # prefix granularity: a shorter common prefix saves too little prefill to matter
MAX_BLOCKS_PER_REPLICA = 8192  # about 500k tokens of prompts remembered per replica
MAX_CONVERSATIONS = 100_000


@attrs.frozen
class Route:
    """What the router needs to know of a request, beside it in the handle call."""

    conversation: str | None = None
    prompt_ids: tuple[int, ...] = ()  # filled in by the router from the job (see route_of)
    # A replica's unique id (a turn checkpoint goes where its generation ran; anywhere if that
    # replica is gone) or an index into the sorted replicas (status calls enumerate them).
    pin: str | int | None = None
    generation: bool = True  # counts towards the replica's load


def block_keys(prompt_ids: Sequence[int], block: int = BLOCK_TOKENS) -> list[int]:
    """One key per whole block of the prompt, each chained to the ones before it, so equal keys
    mean equal prefixes."""
    keys, chained = [], 0
    for start in range(0, len(prompt_ids) - block + 1, block):
        chained = hash((chained, tuple(prompt_ids[start:start + block])))
        keys.append(chained)
    return keys


class Affinity:
    """Conversation owners, each replica's recent prompt prefixes, and generations in flight."""

    def __init__(self, imbalance_threshold: int):
        self.imbalance_threshold = imbalance_threshold
        self._owners: OrderedDict[str, str] = OrderedDict()  # conversation -> replica
        self._blocks: dict[str, OrderedDict[int, None]] = {}  # replica -> block keys, oldest first
        self._load: dict[str, int] = {}  # replica -> generations in flight
        self._in_flight: dict[str, str] = {}  # request id -> replica
        self._owned: dict[str, int] = {}  # replica -> conversations it owns

    def choose(self, replicas: Sequence[str], route: Route) -> list[list[str]]:
        """Replicas ranked for `route`: the first rank is tried first (Serve's convention)."""
        if not replicas:
            return []
        pinned = self._pinned(replicas, route.pin)
        if pinned is not None:
            return [[pinned]]
        # Among equally loaded replicas, the one that owns the fewest conversations and prefixes:
        # new conversations spread out even when requests come one at a time.
        by_load = sorted(replicas, key=lambda replica: (self.load(replica), self._owned.get(replica, 0),
                                                        len(self._blocks.get(replica, ()))))
        owner = self.owner(replicas, route)
        if owner is None or self.load(owner) - self.load(by_load[0]) > self.imbalance_threshold:
            return [by_load[:1], by_load[1:]] if len(by_load) > 1 else [by_load]
        rest = [replica for replica in by_load if replica != owner]
        return [[owner], rest] if rest else [[owner]]

    def owner(self, replicas: Sequence[str], route: Route) -> str | None:
        """The replica that served this conversation last; for a request without a key, the one
        with the longest recent prefix of its prompt (at least one block). A keyed conversation
        new here has no owner: the prefix it shares with others is the system prompt and tools,
        cheap to hold on every replica, while each conversation's own state fills a replica."""
        if route.conversation:
            owner = self._owners.get(route.conversation)
            return owner if owner in replicas else None
        keys = block_keys(route.prompt_ids)
        best, best_blocks = None, 0
        for replica in replicas:
            seen = self._blocks.get(replica, {})
            matched = 0
            while matched < len(keys) and keys[matched] in seen:
                matched += 1
            if matched > best_blocks:
                best, best_blocks = replica, matched
        return best

    def load(self, replica: str) -> int:
        return self._load.get(replica, 0)

    def routed(self, request_id: str, replica: str, route: Route) -> None:
        """Count `replica`'s new generation and remember what it now holds. Called again for
        the same request when Serve retries its routing: the last choice counts."""
        if not route.generation:
            return
        self.completed(request_id)
        self._load[replica] = self._load.get(replica, 0) + 1
        self._in_flight[request_id] = replica
        if route.conversation:
            self._set_owner(route.conversation, replica)
        seen = self._blocks.setdefault(replica, OrderedDict())
        for key in block_keys(route.prompt_ids):
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > MAX_BLOCKS_PER_REPLICA:
            seen.popitem(last=False)

    def completed(self, request_id: str) -> None:
        replica = self._in_flight.pop(request_id, None)
        if replica in self._load:  # not a replica forgotten since
            self._load[replica] -= 1

    def forget(self, replica: str) -> None:
        """A replica died: its caches died with it."""
        self._blocks.pop(replica, None)
        self._load.pop(replica, None)
        self._owned.pop(replica, None)
        for conversation in [c for c, owner in self._owners.items() if owner == replica]:
            del self._owners[conversation]

    def _set_owner(self, conversation: str, replica: str) -> None:
        previous = self._owners.pop(conversation, None)
        if previous is not None:
            self._owned[previous] -= 1
        self._owners[conversation] = replica
        self._owned[replica] = self._owned.get(replica, 0) + 1
        if len(self._owners) > MAX_CONVERSATIONS:
            _, oldest = self._owners.popitem(last=False)
            self._owned[oldest] -= 1

    @staticmethod
    def _pinned(replicas: Sequence[str], pin: str | int | None) -> str | None:
        if isinstance(pin, int):
            return sorted(replicas)[pin % len(replicas)]
        return pin if pin in replicas else None


def route_of(request: PendingRequest | None) -> Route:
    """The request's Route, with the prompt of its job (the first argument of `generate`): the
    front leaves the prompt out of the Route so that it crosses to the replica only once."""
    route = request.kwargs.get("route") if request is not None else None
    if not isinstance(route, Route):
        return Route()
    prompt_ids = getattr(request.args[0], "prompt_ids", ()) if request.args else ()
    return attrs.evolve(route, prompt_ids=tuple(prompt_ids)) if prompt_ids else route


class AffineRouter(RequestRouter):
    """Serve's side of `Affinity`. One instance per deployment handle, in the front's process,
    which is why one front sees every request and its record is complete."""

    def initialize_state(self, imbalance_threshold: int = 4, **kwargs) -> None:
        self.affinity = Affinity(imbalance_threshold)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        route = route_of(pending_request)
        ranks = self.affinity.choose(list(by_id), route)
        # Recorded here, not in on_request_routed, which Serve calls only with its rejection
        # protocol on. Replicas never refuse (max_ongoing_requests is far above any queue), so
        # the one replica of the first rank is where the request goes.
        if ranks and pending_request is not None:
            self.affinity.routed(pending_request.metadata.internal_request_id, ranks[0][0], route)
        return [[by_id[unique_id] for unique_id in rank] for rank in ranks]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.affinity.completed(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id.unique_id)


class PinnedPowerOfTwoRouter(PowerOfTwoChoicesRequestRouter):
    """Ray's default router for generations (two random replicas, the shorter queue wins),
    keeping only the pins that status calls and turn checkpoints need: the baseline that
    bench/cluster.py compares the affine router with."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        pinned = Affinity._pinned(list(by_id), route_of(pending_request).pin) if by_id else None
        if pinned is not None:
            return [[by_id[pinned]]]
        return await super().choose_replicas(candidate_replicas, pending_request)


ROUTERS = {"affine": AffineRouter, "power_of_two": PinnedPowerOfTwoRouter}
