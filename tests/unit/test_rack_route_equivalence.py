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
