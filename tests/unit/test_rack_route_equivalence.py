"""The one-pass rack choice (pipeline/routing/rack_affinity.py) decides exactly as the ring walk it replaced: the
first acceptable rack in ring order (plain), or the cheapest acceptable rack with ties to the first in ring order
(prefix-aware). Checked against that walk, written out here, on random clusters with many ties."""

from __future__ import annotations

import random

import pytest

from pipeline.routing.hashring import HashRing
from pipeline.routing.rack_affinity import RackAffinityRouter
from pipeline.routing.views import RackView


def _reference(rt: RackAffinityRouter, ring: HashRing, user: str, racks: dict[str, RackView],
               cached: dict[str, float]) -> str | None:
    healthy = [racks[m] for m in ring.members if m in racks and racks[m].healthy]
    if not healthy:
        return None
    by_work = all(v.nodes > 0 for v in healthy)
    if by_work:
        bound = rt.load_bound * (sum(v.work_per_node for v in healthy) / len(healthy)) + rt.work_slack

        def load(v: RackView) -> float:
            return v.work_per_node
    else:
        bound = rt.load_bound * (sum(v.load for v in healthy) / len(healthy)) + rt.load_slack

        def load(v: RackView) -> float:
            return v.load
    walk = ring.walk(user)
    order = [m for m in walk if m in racks and racks[m].healthy and load(racks[m]) <= bound]
    primary = walk[0]
    if not order:
        return min(healthy, key=lambda v: (load(v) - (cached.get(v.name, 0.0) if rt.prefix_aware else 0.0),
                                           v.name)).name
    if not rt.prefix_aware:
        return order[0]

    def cost(m: str) -> float:
        v = racks[m]
        return -cached.get(m, 0.0) + (v.work_per_node if by_work else 0.0) - (
            rt.affinity_tokens if m == primary else 0.0)

    return min(order, key=lambda m: (cost(m), order.index(m)))


@pytest.mark.parametrize("prefix_aware", [False, True])
def test_one_pass_choice_equals_the_ring_walk(prefix_aware: bool) -> None:
    rng = random.Random(7)
    names = [f"r{i}" for i in range(40)]
    rt = RackAffinityRouter({"m": names}, 16, 1.1, prefix_aware=prefix_aware, work_slack=0.0, load_slack=0.0)
    ring = rt._rings["m"]
    for trial in range(3000):
        # few distinct values: many exact ties, racks over the bound, unhealthy racks, racks with no node count
        racks = {n: RackView(n, rng.random() > 0.15, float(rng.choice([0, 1, 2, 5])),
                             float(rng.choice([0, 512, 1024, 4096])), rng.choice([0, 8, 8, 8, 4]) if trial % 3 else 8)
                 for n in names if rng.random() > 0.05}
        cached = {n: float(rng.choice([512, 1024])) for n in rng.sample(names, rng.choice([0, 1, 3]))}
        user = f"u{rng.randrange(500)}"
        got = rt.route(user, "m", racks, cached).rack
        assert got == _reference(rt, ring, user, racks, cached), (trial, user)


def test_distance_orders_members_as_the_walk() -> None:
    ring = HashRing([f"r{i}" for i in range(30)], 20)
    for k in range(200):
        key = f"user-{k}"
        pos = ring.start(key)
        assert sorted(ring.members, key=lambda m: ring.distance(pos, m)) == ring.walk(key)


@pytest.mark.parametrize("prefix_aware", [False, True])
@pytest.mark.parametrize("share_bound", [0.0, 1.2])
def test_indexed_choice_equals_the_pass_over_every_rack(prefix_aware: bool, share_bound: float) -> None:
    """`RackIndex` (the simulator's: the views kept ordered as they change) gives `route` the same decision as the
    pass over every rack, decision after decision (the share ledger moves with each), through ties at every load,
    racks over the bound, racks going unhealthy and back, node counts whose sums are not exact (3 and 7 nodes: the
    router then sums in ring order), racks of another model, and prefix hits."""
    rng = random.Random(11 + int(prefix_aware) + int(10 * share_bound))
    names = [f"r{i}" for i in range(40)]
    other = [f"x{i}" for i in range(5)]
    kw = dict(prefix_aware=prefix_aware, work_slack=512.0, load_slack=0.0, share_bound=share_bound,
              share_window=16, share_heavy=0.05, share_hit_tokens=1024.0)
    by_model = {"m": names, "o": other + names[:10]}
    passed, indexed = RackAffinityRouter(by_model, 16, 1.1, **kw), RackAffinityRouter(by_model, 16, 1.1, **kw)
    racks = {n: RackView(n, True, 0.0, 0.0, 8) for n in names + other}
    index = indexed.index("m", racks)
    fast = 0
    for trial in range(6000):
        for _ in range(rng.choice([1, 1, 2, 5])):  # views change as the simulator changes them: one at a time
            n = rng.choice(names + other)
            nodes = rng.choice([8, 8, 4, 7, 3]) if trial % 97 == 0 else rng.choice([8, 8, 8, 4])
            v = RackView(n, rng.random() > 0.05, float(rng.choice([0, 1, 2, 5])),
                         float(rng.choice([0, 256, 512, 1024, 4096, 4096 + 256])), nodes)
            racks[n] = v
            index.update(v)
        cached = {n: float(rng.choice([256, 1024, 2048])) for n in rng.sample(names + other, rng.choice([0, 1, 3]))}
        user = f"u{rng.randrange(60)}"
        want = passed.route(user, "m", racks, cached)
        got = indexed.route(user, "m", racks, cached, index=index)
        fast += index.exact and index.by_work
        assert (got.rack, got.primary, got.reason) == (want.rack, want.primary, want.reason), trial
        assert indexed._routed == passed._routed
    assert fast > 3000  # the indexed path ran (the rest: inexact sums, summed in ring order as the pass)


def test_index_sums_equal_the_pass_while_exact() -> None:
    rng = random.Random(5)
    names = [f"r{i}" for i in range(160)]
    rt = RackAffinityRouter({"m": names}, 16, 1.1)
    racks = {n: RackView(n, True, 0.0, 0.0, 8) for n in names}
    index = rt.index("m", racks)
    for _ in range(20000):
        n = rng.choice(names)
        v = RackView(n, rng.random() > 0.02, float(rng.randrange(50)), float(rng.randrange(10**7)),
                     rng.choice([8, 8, 8, 8, 4, 2, 1, 7]))
        racks[n] = v
        index.update(v)
        s = rt.summarize("m", racks)
        assert index.healthy_count == len(s.names) and index.nodes_sum == s.nodes_sum
        if index.exact:
            assert (index.work_sum, index.load_sum) == (s.work_sum, s.load_sum)


def test_index_sums_drop_the_rounding_of_a_term_off_the_grid() -> None:
    """A term off the grid (work over 3 or 7 nodes) rounds the running sum; once it has left, the sums are the pass's
    again, to the last bit (found by search: without the re-sum this sequence ends 5e-7 off)."""
    names = ["a", "b", "c"]
    rt = RackAffinityRouter({"m": names}, 4, 1.1)
    racks = {n: RackView(n, True, 0.0, 0.0, 8) for n in names}
    index = rt.index("m", racks)
    for n, work, nodes in [("a", 1.0, 3), ("c", 5.0, 1), ("c", 2.0**33, 8), ("a", 2.0**33, 3), ("a", 12345.0, 7),
                           ("a", 1.0, 1)]:
        racks[n] = RackView(n, True, 0.0, work, nodes)
        index.update(racks[n])
    assert index.exact
    assert index.work_sum == rt.summarize("m", racks).work_sum == 2.0**30 + 1.0
