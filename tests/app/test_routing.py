"""Document-affine routing (consistent hashing with bounded loads): a document set's requests stay on one replica
while it is under the cap, spill along the ring past it, never exceed it, and a replica joining or leaving moves only
the keys it owned."""

from __future__ import annotations

import pytest

from app.cluster.routing import AffinityRouter, routing_key

NAMES = [f"replica-{i}" for i in range(10)]
KEYS = [routing_key([f"doc-{i}"]) for i in range(2000)]


def test_the_key_is_the_tenant_and_the_set_of_documents() -> None:
    assert routing_key(["b", "a", "a"]) == routing_key(["a", "b"])
    assert routing_key(["a"], tenant="t1") != routing_key(["a"], tenant="t2")
    assert routing_key([]) != routing_key(["a"])


def test_a_document_set_goes_to_its_owner_while_the_owner_is_under_the_cap() -> None:
    router = AffinityRouter(NAMES)
    loads = {name: 3 for name in NAMES}
    for key in KEYS[:50]:
        owner = router.owner(key)
        assert router.route(key, loads) == owner == router.owners(key)[0]
    assert sorted(router.owners(KEYS[0])) == sorted(NAMES)


def test_past_the_cap_a_request_spills_to_the_next_replica_along_the_ring() -> None:
    router = AffinityRouter(NAMES, load_factor=1.25)
    key = KEYS[7]
    first, second, third = router.owners(key)[:3]
    loads = {name: 2 for name in NAMES}
    cap = router.cap(sum(loads.values()))  # ceil(1.25 * 21 / 10) = 3
    assert cap == 3
    loads[first] = cap
    assert router.route(key, loads) == second
    loads[second] = cap + 4
    assert router.route(key, loads, total=20) == third  # the cap of 20 in flight: still 3
    assert router.route(key, loads, total=40) == first  # the caller's total sets the cap: 6 now


def test_a_hot_document_never_puts_a_replica_over_the_cap() -> None:
    router = AffinityRouter(NAMES, load_factor=1.25)
    loads = dict.fromkeys(NAMES, 0)
    for _ in range(500):
        total = sum(loads.values())
        name = router.route(KEYS[0], loads)
        assert loads[name] < router.cap(total)
        loads[name] += 1
    assert max(loads.values()) <= router.cap(500)
    used = [name for name in router.owners(KEYS[0]) if loads[name]]
    assert used == router.owners(KEYS[0])[: len(used)]  # the same neighbours along the ring, in order
    assert len(used) >= len(NAMES) / 1.25 - 1  # as many as the cap needs: about replicas / load_factor


def test_keys_spread_over_the_replicas() -> None:
    router = AffinityRouter(NAMES, vnodes=64)
    counts = dict.fromkeys(NAMES, 0)
    for key in KEYS:
        counts[router.owner(key)] += 1
    mean = len(KEYS) / len(NAMES)
    assert max(counts.values()) < 1.5 * mean and min(counts.values()) > 0.5 * mean


def test_a_replica_leaving_or_joining_moves_only_its_own_keys() -> None:
    router = AffinityRouter(NAMES)
    before = {key: router.owner(key) for key in KEYS}
    router.set_replicas(NAMES[:-1])  # the last one is gone
    after = {key: router.owner(key) for key in KEYS}
    moved = [key for key in KEYS if after[key] != before[key]]
    assert moved and all(before[key] == NAMES[-1] for key in moved)
    assert NAMES[-1] not in after.values()
    router.set_replicas([*NAMES, "replica-new"])
    joined = {key: router.owner(key) for key in KEYS}
    assert all(joined[key] in (before[key], "replica-new") for key in KEYS)
    assert "replica-new" in joined.values()


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="load_factor"):
        AffinityRouter(NAMES, load_factor=1.0)
    with pytest.raises(ValueError, match="vnodes"):
        AffinityRouter(NAMES, vnodes=0)
    with pytest.raises(ValueError, match="at least one replica"):
        AffinityRouter([])
