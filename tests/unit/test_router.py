"""The cluster router's policy (dflash/cluster/router.py), without Ray's routing loop."""

import pytest

pytest.importorskip("ray.serve")

from dflash.cluster.router import BLOCK_TOKENS, Affinity, Route, block_keys  # noqa: E402

REPLICAS = ["r1", "r2", "r3"]


def first_choice(affinity: Affinity, route: Route, request_id: str) -> str:
    chosen = affinity.choose(REPLICAS, route)[0][0]
    affinity.routed(request_id, chosen, route)
    return chosen


def test_a_conversation_comes_back_to_its_replica_and_new_ones_spread():
    affinity = Affinity(imbalance_threshold=2)
    owners = {}
    for turn in range(3):
        for conversation in ("a", "b", "c"):
            request_id = f"{conversation}{turn}"
            chosen = first_choice(affinity, Route(conversation=conversation), request_id)
            affinity.completed(request_id)
            assert owners.setdefault(conversation, chosen) == chosen
    assert sorted(owners.values()) == REPLICAS


def test_without_a_key_the_longest_recent_prefix_wins():
    affinity = Affinity(imbalance_threshold=2)
    shared = list(range(3 * BLOCK_TOKENS))
    first = first_choice(affinity, Route(prompt_ids=tuple(shared + [1] * 10)), "1")
    affinity.completed("1")
    other = first_choice(affinity, Route(prompt_ids=tuple(range(1000, 1000 + 2 * BLOCK_TOKENS))), "2")
    affinity.completed("2")
    assert other != first  # no common prefix: the least loaded replica with the fewest conversations
    assert first_choice(affinity, Route(prompt_ids=tuple(shared + [2] * 70)), "3") == first


def test_an_overloaded_owner_loses_the_conversation_to_the_least_loaded():
    affinity = Affinity(imbalance_threshold=1)
    route = Route(conversation="a")
    owner = first_choice(affinity, route, "1")
    assert first_choice(affinity, route, "2") == owner  # 1 more than the idle ones: within the threshold
    moved = first_choice(affinity, route, "3")  # 2 more: past it
    assert moved != owner
    affinity.completed("1"), affinity.completed("2")
    assert first_choice(affinity, route, "4") == moved  # the new owner keeps it


def test_pins_and_control_calls():
    affinity = Affinity(imbalance_threshold=0)
    assert affinity.choose(REPLICAS, Route(pin="r2", generation=False)) == [["r2"]]
    assert affinity.choose(REPLICAS, Route(pin=4, generation=False)) == [["r2"]]  # index into the sorted ids
    assert affinity.choose(["r1"], Route(pin="gone")) == [["r1"]]  # a gone replica: anywhere
    affinity.routed("s", "r1", Route(generation=False))
    assert affinity.load("r1") == 0  # control calls are not load


def test_a_dead_replica_is_forgotten_and_a_retried_routing_counts_once():
    affinity = Affinity(imbalance_threshold=2)
    route = Route(conversation="a")
    affinity.routed("1", "r1", route)
    affinity.routed("1", "r2", route)  # Serve retried the routing elsewhere
    assert (affinity.load("r1"), affinity.load("r2")) == (0, 1)
    affinity.forget("r2")
    assert affinity.owner(REPLICAS, route) is None


def test_block_keys_are_chained():
    a = block_keys(list(range(2 * BLOCK_TOKENS)))
    b = block_keys([7] * BLOCK_TOKENS + list(range(BLOCK_TOKENS, 2 * BLOCK_TOKENS)))
    assert len(a) == 2 and a[1] != b[1]  # same second block, different prefix
    assert block_keys(list(range(BLOCK_TOKENS - 1))) == []
