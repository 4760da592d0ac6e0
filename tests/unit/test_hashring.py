"""HashRing (consistent hashing with virtual nodes) and the rack-affinity router built on it."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.routing.hashring import HashRing, stable_hash64
from pipeline.routing.rack_affinity import RackAffinityRouter
from pipeline.routing.views import RackView
from tests.unit.builders import rack_view

MEMBERS = st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=8, unique=True)
KEYS = st.lists(st.text(max_size=16), min_size=1, max_size=30)
KEY_SET = [f"user-{i}" for i in range(20_000)]


def test_stable_hash64_is_a_fixed_function_of_the_text() -> None:
    # Values computed once (blake2b, 8-byte digest, big endian); a change here re-maps every user in production.
    assert stable_hash64("user-42") == 8043651368623730598
    assert stable_hash64("") == 16476032584258269876
    assert 0 <= stable_hash64("r0#159") < 2**64


@settings(max_examples=50, deadline=None)
@given(members=MEMBERS, keys=KEYS, data=st.data())
def test_ring_mapping_does_not_depend_on_member_order_or_instance(
    members: list[str], keys: list[str], data: st.DataObject
) -> None:
    shuffled = data.draw(st.permutations(members))
    a, b = HashRing(members, 16), HashRing(shuffled + members[:1], 16)  # duplicates are ignored too
    for k in keys:
        assert a.walk(k) == b.walk(k)
        assert a.primary(k) == b.primary(k)


@settings(max_examples=50, deadline=None)
@given(members=MEMBERS, keys=KEYS, vnodes=st.integers(1, 32))
def test_walk_visits_every_member_exactly_once_starting_at_the_primary(
    members: list[str], keys: list[str], vnodes: int
) -> None:
    ring = HashRing(members, vnodes)
    for k in keys:
        walk = ring.walk(k)
        assert sorted(walk) == sorted(members)
        assert walk[0] == ring.primary(k)


def test_ring_rejects_no_members_and_no_virtual_nodes() -> None:
    with pytest.raises(ValueError, match="at least one member"):
        HashRing([])
    with pytest.raises(ValueError, match="virtual_nodes"):
        HashRing(["a"], 0)


def test_160_virtual_nodes_spread_20k_keys_over_8_members_within_ratio_1_5() -> None:
    ring = HashRing([f"rack-{i}" for i in range(8)], 160)
    counts = collections.Counter(ring.primary(k) for k in KEY_SET)
    assert len(counts) == 8
    ratio = max(counts.values()) / min(counts.values())
    assert ratio < 1.5, f"max/min share {ratio:.2f} (measured 1.31 for this key set)"


@pytest.mark.parametrize("n", [3, 5, 8])
def test_removing_a_member_moves_only_the_keys_it_owned(n: int) -> None:
    members = [f"r{i}" for i in range(n)]
    before = HashRing(members)
    gone = members[n // 2]
    after = HashRing([m for m in members if m != gone])
    for k in KEY_SET[:5000]:
        old = before.primary(k)
        if old != gone:
            assert after.primary(k) == old, k
        else:
            assert after.primary(k) == before.walk(k)[1]  # the next member on the ring inherits the key


@pytest.mark.parametrize("n", [3, 5, 8])
def test_adding_a_member_moves_about_one_in_n_plus_1_keys_and_only_to_it(n: int) -> None:
    members = [f"r{i}" for i in range(n)]
    before, after = HashRing(members), HashRing([*members, "new"])
    moved = [k for k in KEY_SET if before.primary(k) != after.primary(k)]
    assert all(after.primary(k) == "new" for k in moved)
    share = len(moved) / len(KEY_SET)
    expected = 1 / (n + 1)
    assert abs(share - expected) < 0.35 * expected, f"moved {share:.3f}, expected about {expected:.3f}"


@settings(max_examples=50, deadline=None)
@given(members=MEMBERS, key=st.text(max_size=16), data=st.data())
def test_lookup_returns_the_first_accepted_member_in_walk_order(
    members: list[str], key: str, data: st.DataObject
) -> None:
    ring = HashRing(members, 8)
    accepted = set(data.draw(st.lists(st.sampled_from(members), unique=True)))
    expected = next((m for m in ring.walk(key) if m in accepted), None)
    assert ring.lookup(key, lambda m: m in accepted) == expected
    assert ring.lookup(key) == ring.primary(key)


# -- rack-affinity router ----------------------------------------------------------------------------------------

RACKS = ["r0", "r1", "r2", "r3"]


def router(load_bound: float = 1.25) -> RackAffinityRouter:
    return RackAffinityRouter({"qwen2-7b": RACKS, "llama-2-7b": ["r0"], "unserved": []}, 160, load_bound)


def views() -> dict[str, RackView]:
    return {r: rack_view(r) for r in RACKS}


@settings(max_examples=50, deadline=None)
@given(user=st.text(max_size=16), load=st.floats(0, 1e4))
def test_same_user_routes_to_its_primary_rack_when_loads_are_equal(user: str, load: float) -> None:
    rt = router()
    racks = {r: rack_view(r, load=load) for r in RACKS}
    d1, d2 = rt.route(user, "qwen2-7b", racks), router().route(user, "qwen2-7b", racks)
    assert d1 == d2
    assert d1.rack == d1.primary == HashRing(RACKS, 160).primary(user)
    assert d1.reason == "affinity"


def test_rack_over_the_load_bound_is_skipped_for_the_next_rack_on_the_walk() -> None:
    rt = router()
    user = "user-7"
    walk = HashRing(RACKS, 160).walk(user)
    racks = {r: rack_view(r, load=10.0) for r in RACKS}
    racks[walk[0]] = rack_view(walk[0], load=100.0)  # mean 32.5, bound 1.25*32.5+1 = 41.6
    d = rt.route(user, "qwen2-7b", racks)
    assert (d.rack, d.primary, d.reason) == (walk[1], walk[0], "walked")
    racks[walk[0]] = rack_view(walk[0], load=14.0)  # mean 11, bound 14.75: within the bound, keeps affinity
    assert rt.route(user, "qwen2-7b", racks).rack == walk[0]


def test_unhealthy_racks_are_skipped_in_walk_order() -> None:
    rt = router()
    user = "user-8"
    walk = HashRing(RACKS, 160).walk(user)
    racks = {r: rack_view(r, healthy=r not in walk[:2]) for r in RACKS}
    d = rt.route(user, "qwen2-7b", racks)
    assert (d.rack, d.primary, d.reason) == (walk[2], walk[0], "walked")


def test_all_racks_unhealthy_gives_no_rack() -> None:
    d = router().route("u", "qwen2-7b", {r: rack_view(r, healthy=False) for r in RACKS})
    assert d.rack is None
    assert d.primary in RACKS
    assert d.reason == "no healthy rack"


def test_racks_missing_from_the_views_are_never_chosen() -> None:
    rt = router()
    for i in range(200):
        d = rt.route(f"user-{i}", "qwen2-7b", {"r2": rack_view("r2")})
        assert d.rack == "r2"


@settings(max_examples=100, deadline=None)
@given(
    user=st.text(max_size=16),
    loads=st.lists(st.floats(0, 1000), min_size=4, max_size=4),
    healthy=st.lists(st.booleans(), min_size=4, max_size=4),
    bound=st.floats(1.0, 3.0),
)
def test_chosen_rack_is_the_first_healthy_rack_within_the_load_bound_on_the_walk(
    user: str, loads: list[float], healthy: list[bool], bound: float
) -> None:
    racks = {r: rack_view(r, load=ld, healthy=h) for r, ld, h in zip(RACKS, loads, healthy, strict=True)}
    d = router(bound).route(user, "qwen2-7b", racks)
    ok = [v for v in racks.values() if v.healthy]
    if not ok:
        assert d.rack is None
        return
    limit = bound * sum(v.load for v in ok) / len(ok) + 1.0
    expected = next(r for r in HashRing(RACKS, 160).walk(user) if racks[r].healthy and racks[r].load <= limit)
    assert d.rack == expected


def test_unknown_model_raises_key_error_listing_served_models() -> None:
    with pytest.raises(KeyError) as exc:
        router().route("u", "gpt-5", views())
    msg = str(exc.value)
    assert "'gpt-5'" in msg
    assert "served: llama-2-7b, qwen2-7b" in msg  # a model with no rack is not served


def test_load_bound_below_one_is_rejected() -> None:
    with pytest.raises(ValueError, match="load_bound"):
        router(0.99)


def test_load_slack_is_the_absolute_headroom_above_load_bound_times_mean() -> None:
    user = "user-7"
    walk = HashRing(RACKS, 160).walk(user)
    racks = {r: rack_view(r, load=2.0) for r in RACKS}
    racks[walk[0]] = rack_view(walk[0], load=14.0)  # mean 5, 1.25 x mean = 6.25
    slack = RackAffinityRouter({"qwen2-7b": RACKS}, 160, 1.25, load_slack=8.0)  # bound 14.25: keeps affinity
    assert slack.route(user, "qwen2-7b", racks).rack == walk[0]
    tight = RackAffinityRouter({"qwen2-7b": RACKS}, 160, 1.25, load_slack=7.0)  # bound 13.25: walks
    assert (tight.route(user, "qwen2-7b", racks).rack, tight.route(user, "qwen2-7b", racks).reason) == (
        walk[1], "walked")


def test_negative_load_slack_is_rejected() -> None:
    with pytest.raises(ValueError, match="load_slack"):
        RackAffinityRouter({"qwen2-7b": RACKS}, 160, 1.25, load_slack=-1.0)
