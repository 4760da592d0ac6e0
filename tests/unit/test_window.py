"""WindowBatcher: memory-budget packing, window close rules, the no-starvation guarantee, model-aware placement,
per-request policy overrides and the dispatch decisions recorded for replay."""

from __future__ import annotations

import collections
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.batching.ledger import ReservationLedger, stream_id_key
from pipeline.batching.window import CloseReason, PendingRequest, StopReason, WindowBatcher, WindowOutcome
from pipeline.clock import ManualClock
from pipeline.config import NodePolicyName
from tests.unit.builders import node_view, pending, request, window_batcher

ALL_POLICIES: tuple[NodePolicyName, ...] = (
    "round_robin", "random", "least_outstanding", "power_of_two", "static_weight", "weighted", "kv_aware"
)


def make_batcher(caps: Mapping[str, float], seed: int = 0, **policy: Any) -> WindowBatcher:
    """A batcher with the seed's node policy (`weighted`, W-weighted random) and window."""
    return window_batcher(caps, seed, **policy)


def sized(
    mem_kb: float, *, arrival_ms: float = 0.0, enqueued_ms: float = 0.0, waited: int = 0, **req: Any
) -> PendingRequest:
    p = pending(request(mem_est_kb=float(mem_kb), arrival_ms=arrival_ms, **req), enqueued_ms=enqueued_ms)
    p.windows_waited = waited
    return p


def node_of(out: WindowOutcome, p: PendingRequest) -> str | None:
    return next((plan.node for plan in out.plans if p in plan.requests), None)


# -- packing invariants (one close) ------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeSpec:
    cap: int
    kv_free: int
    active: bool
    idle: bool
    pcie: float
    free_frac: float


NODE_SPECS = st.builds(
    NodeSpec,
    cap=st.integers(1_000, 100_000),
    kv_free=st.integers(-5_000, 120_000),
    active=st.sampled_from([True, True, True, False]),
    idle=st.booleans(),
    pcie=st.sampled_from([0.0, 30.0, 99.0, 100.0]),
    free_frac=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
)


@settings(max_examples=200, deadline=None)
@given(
    specs=st.lists(NODE_SPECS, min_size=1, max_size=5),
    uncapped_node=st.booleans(),
    sizes=st.lists(st.tuples(st.integers(1, 130_000), st.integers(0, 7)), max_size=40),
    age_after=st.integers(1, 6),
    seed=st.integers(0, 2**32),
)
def test_close_packs_within_budgets_and_accounts_for_every_request(
    specs: list[NodeSpec], uncapped_node: bool, sizes: list[tuple[int, int]], age_after: int, seed: int
) -> None:
    caps = {f"n{i}": float(s.cap) for i, s in enumerate(specs)}
    nodes = [
        node_view(f"n{i}", kv_free_kb=float(s.kv_free), active=s.active, running=0 if s.idle else 3,
                  pcie_util_pct=s.pcie, free_vram_gb=80.0 * s.free_frac)
        for i, s in enumerate(specs)
    ]
    if uncapped_node:  # a node the batcher has no cap for (another rack's) must never receive work
        nodes.append(node_view("stranger", kv_free_kb=1e9))
    batcher = make_batcher(caps, seed, age_after_windows=age_after)
    offered = [sized(m, arrival_ms=float(i), waited=w) for i, (m, w) in enumerate(sizes)]
    waited_before = {id(p): p.windows_waited for p in offered}
    for p in offered:
        batcher.offer(p)

    out = batcher.close(1_000.0, nodes)

    views = {n.name: n for n in nodes}
    max_cap = max(caps.values())
    planned = [p for plan in out.plans for p in plan.requests]
    rejected = [r.pending for r in out.rejections]
    # none lost, none duplicated
    ids = [id(p) for p in planned + rejected + batcher.pending]
    assert sorted(ids) == sorted(id(p) for p in offered)
    assert out.waiting == len(batcher.pending)
    assert all(p.windows_waited == waited_before[id(p)] + 1 for p in offered)
    # rejected exactly when larger than every cap, with a reason
    assert all(r.pending.request.mem_est_kb > max_cap and "exceeds" in r.reason for r in out.rejections)
    assert all(p.request.mem_est_kb <= max_cap for p in planned + batcher.pending)
    # each plan fits its budget, and the budget fits the node
    assert len({plan.node for plan in out.plans}) == len(out.plans)
    for plan in out.plans:
        view = views[plan.node]
        assert plan.node in caps and view.active
        assert plan.node != out.reserved_node
        assert plan.requests
        assert plan.mem_est_kb == sum(p.request.mem_est_kb for p in plan.requests)  # integers: exact
        assert plan.mem_est_kb <= plan.budget_kb <= min(caps[plan.node], max(0.0, view.kv_free_kb))
        assert sum(plan.probabilities.values()) == pytest.approx(1.0)
        assert plan.probabilities[plan.node] > 0.0
        # one weighted decision per plan: the node was chosen once and then packed first fit
        assert [(c.policy, c.node) for c in plan.choices] == [("weighted", plan.node)]
        assert plan.choices[0].request_ids == tuple(p.request.request_id for p in plan.requests)
        assert 0.0 <= plan.draw < 1.0
        # aged requests first (oldest first), then fresh ones by ascending memory
        aged = [p for p in plan.requests if p.windows_waited >= age_after]
        fresh = [p for p in plan.requests if p.windows_waited < age_after]
        assert list(plan.requests) == aged + fresh
        assert [p.request.arrival_ms for p in aged] == sorted(p.request.arrival_ms for p in aged)
        assert [p.request.mem_est_kb for p in fresh] == sorted(p.request.mem_est_kb for p in fresh)
        # first fit: nothing left waiting would have fitted into what this plan left of its budget
        assert all(p.request.mem_est_kb > plan.budget_kb - plan.mem_est_kb for p in batcher.pending)
    assert (out.stop is StopReason.ALL_PACKED) == (not batcher.pending)
    assert batcher.window_open_ms == (1_000.0 if batcher.pending else None)


def test_fresh_requests_are_packed_smallest_first_so_the_most_requests_fit() -> None:
    batcher = make_batcher({"n0": 100.0})
    for m in (60, 10, 50, 30, 20):
        batcher.offer(sized(m))
    out = batcher.close(100.0, [node_view("n0", kv_free_kb=100.0)])
    assert [p.request.mem_est_kb for p in out.plans[0].requests] == [10, 20, 30]
    assert sorted(p.request.mem_est_kb for p in batcher.pending) == [50, 60]
    assert out.stop is StopReason.NO_BUDGET


def test_budget_is_the_smaller_of_cap_and_live_free_memory() -> None:
    batcher = make_batcher({"n0": 100.0, "n1": 100.0})
    assert batcher.budgets([node_view("n0", kv_free_kb=40.0), node_view("n1", kv_free_kb=1e9),
                            node_view("n2", kv_free_kb=1e9), node_view("n0x", active=False)]) == {
        "n0": 40.0, "n1": 100.0}
    assert batcher.budgets([node_view("n0", kv_free_kb=-5.0)]) == {"n0": 0.0}


def test_request_larger_than_every_cap_is_rejected_with_a_reason_not_dropped() -> None:
    batcher = make_batcher({"n0": 72e6, "n1": 60e6})
    big = sized(80e6)
    batcher.offer(big)
    out = batcher.close(100.0, [node_view("n0", kv_free_kb=72e6)])
    assert [r.pending for r in out.rejections] == [big]
    assert "80.0 GB exceeds the largest node budget 72.0 GB" in out.rejections[0].reason
    assert not out.plans and not batcher.pending


def test_negative_memory_estimate_is_rejected_not_packed() -> None:
    """A negative estimate (a corrupt entry) would make room in a node's budget that is not there."""
    batcher = make_batcher({"n0": 100.0})
    neg, ok = sized(-1e308), sized(60.0)
    batcher.offer(neg)
    batcher.offer(ok)
    out = batcher.close(100.0, [node_view("n0", kv_free_kb=100.0)])
    assert [r.pending for r in out.rejections] == [neg] and "negative" in out.rejections[0].reason
    assert [p for plan in out.plans for p in plan.requests] == [ok]


def test_no_eligible_node_keeps_everything_pending() -> None:
    batcher = make_batcher({"n0": 100.0})
    batcher.offer(sized(10))
    out = batcher.close(100.0, [node_view("n0", active=False)])
    assert out.plans == () and out.stop is StopReason.NO_NODE
    assert len(batcher.pending) == 1 and batcher.window_open_ms == 100.0


# -- close_reason ------------------------------------------------------------------------------------------------

BUSY = {"running": 2, "waiting": 0}


def test_close_reason_empty_without_requests() -> None:
    assert make_batcher({"n0": 100.0}).close_reason(1e9, [node_view("n0")]) is CloseReason.EMPTY


def test_close_reason_is_not_yet_before_window_ms_with_busy_nodes_then_window_elapsed() -> None:
    batcher = make_batcher({"n0": 100.0}, window_ms=100)
    batcher.offer(sized(10, enqueued_ms=1_000.0))
    batcher.offer(sized(10, enqueued_ms=1_090.0))  # a later request does not move the window's start
    nodes = [node_view("n0", kv_free_kb=100.0, **BUSY)]
    assert batcher.close_reason(1_099.9, nodes) is CloseReason.NOT_YET
    assert batcher.close_reason(1_100.0, nodes) is CloseReason.WINDOW_ELAPSED
    assert batcher.close_reason(5_000.0, nodes) is CloseReason.WINDOW_ELAPSED


def test_close_reason_node_idle_only_for_an_idle_node_with_budget_when_enabled() -> None:
    caps = {"n0": 100.0, "n1": 100.0}
    busy = node_view("n0", kv_free_kb=100.0, **BUSY)
    for idle, expect in [
        (node_view("n1", kv_free_kb=100.0), CloseReason.NODE_IDLE),
        (node_view("n1", kv_free_kb=100.0, waiting=1), CloseReason.NOT_YET),  # queued work: not idle
        (node_view("n1", kv_free_kb=0.0), CloseReason.NOT_YET),  # idle but no memory to offer
        (node_view("n1", kv_free_kb=100.0, active=False), CloseReason.NOT_YET),  # draining
    ]:
        batcher = make_batcher(caps, close_when_node_idle=True)
        batcher.offer(sized(10, enqueued_ms=0.0))
        assert batcher.close_reason(1.0, [busy, idle]) is expect, idle
    batcher = make_batcher(caps, close_when_node_idle=False)
    batcher.offer(sized(10))
    assert batcher.close_reason(1.0, [busy, node_view("n1", kv_free_kb=100.0)]) is CloseReason.NOT_YET


def test_close_reason_budget_full_when_pending_memory_reaches_the_largest_budget() -> None:
    batcher = make_batcher({"n0": 100.0, "n1": 300.0})
    nodes = [node_view("n0", kv_free_kb=100.0, **BUSY), node_view("n1", kv_free_kb=80.0, **BUSY)]  # budgets 100, 80
    batcher.offer(sized(60))
    assert batcher.close_reason(1.0, nodes) is CloseReason.NOT_YET
    batcher.offer(sized(39))
    assert batcher.close_reason(1.0, nodes) is CloseReason.NOT_YET
    batcher.offer(sized(1))
    assert batcher.close_reason(1.0, nodes) is CloseReason.BUDGET_FULL


def test_window_reopens_at_close_time_for_leftovers_and_resets_when_empty() -> None:
    batcher = make_batcher({"n0": 100.0}, window_ms=100)
    batcher.offer(sized(80, enqueued_ms=0.0))
    batcher.offer(sized(90, enqueued_ms=10.0))
    nodes = [node_view("n0", kv_free_kb=100.0, **BUSY)]
    batcher.close(100.0, nodes)
    assert batcher.window_open_ms == 100.0
    assert batcher.close_reason(150.0, nodes) is CloseReason.NOT_YET
    assert batcher.close_reason(200.0, nodes) is CloseReason.WINDOW_ELAPSED
    batcher.close(200.0, nodes)
    assert batcher.pending == [] and batcher.window_open_ms is None


# -- starvation ---------------------------------------------------------------------------------------------------


def simulate_large_request(
    caps: Mapping[str, float],
    recover_per_window: Mapping[str, float],
    initial_used: Mapping[str, float],
    large_kb: float,
    small_kb: tuple[int, int],
    small_per_window: int,
    age_after: int,
    seed: int,
    max_windows: int,
) -> int | None:
    """Windows until the large request is dispatched (None: not within max_windows).

    Model: each window a burst of small requests arrives, the window closes, every plan's memory is taken from its
    node, then every node finishes `recover_per_window` KB of work (so a node that gets no new batches recovers its
    whole cap within cap / recover_per_window windows)."""
    rng = random.Random(seed)
    clock = ManualClock(0.0)
    window_ms = 100.0
    batcher = make_batcher(caps, seed, window_ms=int(window_ms), age_after_windows=age_after,
                           close_when_node_idle=False)
    used = dict(initial_used)
    large = sized(large_kb, arrival_ms=0.0, enqueued_ms=0.0)
    batcher.offer(large)
    for window in range(1, max_windows + 1):
        clock.advance(1.0)
        for _ in range(small_per_window):
            batcher.offer(sized(rng.randint(*small_kb), arrival_ms=clock.now_ms(), enqueued_ms=clock.now_ms()))
        clock.advance(window_ms - 1.0)
        assert batcher.close_reason(clock.now_ms(), []) is CloseReason.WINDOW_ELAPSED
        views = [
            node_view(n, kv_free_kb=caps[n] - used[n], free_vram_gb=1.0 + 79.0 * (caps[n] - used[n]) / caps[n],
                      running=5)
            for n in sorted(caps)
        ]
        out = batcher.close(clock.now_ms(), views)
        assert not out.rejections
        for plan in out.plans:
            used[plan.node] += plan.mem_est_kb
            assert used[plan.node] <= caps[plan.node]
            if large in plan.requests:
                return window
        for n in used:
            used[n] = max(0.0, used[n] - recover_per_window[n])
    return None


@settings(max_examples=25, deadline=None)
@given(
    n_nodes=st.integers(1, 5),
    k=st.integers(2, 5),
    age_after=st.integers(1, 6),
    large_frac=st.floats(0.5, 0.95),
    seed=st.integers(0, 2**32),
)
def test_large_request_is_dispatched_within_age_plus_recovery_windows_despite_a_stream_of_small_ones(
    n_nodes: int, k: int, age_after: int, large_frac: float, seed: int
) -> None:
    cap = 100_000.0
    caps = {f"n{i}": cap for i in range(n_nodes)}
    small = (1_000, 5_000)
    # arrivals exceed what the nodes finish, so every node not reserved is kept (nearly) full of small work
    per_window = int(1.5 * n_nodes * (cap / k) / 3_000) + 1
    bound = age_after + k + 2
    got = simulate_large_request(
        caps, dict.fromkeys(caps, cap / k), dict.fromkeys(caps, 0.95 * cap), large_frac * cap, small,
        per_window, age_after, seed, max_windows=bound + 1,
    )
    assert got is not None and got <= bound, f"dispatched after {got} windows, bound {bound}"


def test_without_aging_the_large_request_would_starve() -> None:
    """Control for the property above: with aging effectively off, the same stream starves the large request."""
    cap = 100_000.0
    caps = {"n0": cap, "n1": cap}
    got = simulate_large_request(caps, dict.fromkeys(caps, cap / 3), dict.fromkeys(caps, 0.95 * cap), 0.8 * cap,
                                 (1_000, 5_000), 40, age_after=10_000, seed=3, max_windows=30)
    assert got is None


def test_reserved_node_is_one_whose_cap_can_hold_the_aged_request() -> None:
    batcher = make_batcher({"big": 100_000.0, "small": 60_000.0}, age_after_windows=1)
    batcher.offer(sized(80_000))
    batcher.offer(sized(1_000, arrival_ms=1.0))
    nodes = [node_view("big", kv_free_kb=10_000.0, running=4), node_view("small", kv_free_kb=60_000.0, running=4)]
    out = batcher.close(100.0, nodes)
    assert out.reserved_node == "big"


def test_large_request_is_not_starved_in_a_rack_with_mixed_caps() -> None:
    caps = {"big": 100_000.0, "small": 60_000.0}
    recover = {"big": 10_000.0, "small": 30_000.0}  # the big node is the slower one (10 windows to drain)
    age_after = 3
    got = simulate_large_request(caps, recover, {"big": 95_000.0, "small": 57_000.0}, 80_000.0, (1_000, 5_000),
                                 20, age_after, seed=1, max_windows=60)
    assert got is not None and got <= age_after + 10 + 2


# -- reservation ledger ------------------------------------------------------------------------------------------

STREAM_IDS = st.tuples(st.integers(0, 2**48), st.integers(0, 2**20))


def test_stream_id_key_orders_numerically_with_empty_first() -> None:
    assert stream_id_key("10-2") > stream_id_key("9-99")
    assert stream_id_key("9-100") > stream_id_key("9-99")
    assert stream_id_key("") < stream_id_key("0-0")
    assert stream_id_key("5") == stream_id_key("5-0")


@settings(max_examples=100, deadline=None)
@given(a=STREAM_IDS, b=STREAM_IDS)
def test_stream_id_key_order_is_the_order_of_ms_then_seq(a: tuple[int, int], b: tuple[int, int]) -> None:
    ka, kb = stream_id_key(f"{a[0]}-{a[1]}"), stream_id_key(f"{b[0]}-{b[1]}")
    assert (ka < kb) == (a < b)
    assert (ka == kb) == (a == b)


@settings(max_examples=100, deadline=None)
@given(
    records=st.lists(st.tuples(st.sampled_from(["n0", "n1"]), STREAM_IDS, st.integers(1, 10_000),
                               st.integers(1, 8)), max_size=12),
    last=st.one_of(st.none(), STREAM_IDS),
    free=st.integers(0, 50_000),
)
def test_reservations_subtract_from_free_memory_until_the_node_admits_their_entry(
    records: list[tuple[str, tuple[int, int], int, int]], last: tuple[int, int] | None, free: int
) -> None:
    ledger = ReservationLedger()
    for node, sid, mem, n in records:
        ledger.record(node, f"{sid[0]}-{sid[1]}", float(mem), n)
    last_id = "" if last is None else f"{last[0]}-{last[1]}"
    inflight = [(mem, n) for node, sid, mem, n in records if node == "n0" and (last is None or sid > last)]
    view = node_view("n0", kv_free_kb=float(free), waiting=2)
    out = ledger.apply(view, last_id)
    assert out.kv_free_kb == max(0.0, free - sum(m for m, _ in inflight))
    assert out.waiting == 2 + sum(n for _, n in inflight)
    assert ledger.reserved_kb("n0") == sum(m for m, _ in inflight)
    assert ledger.reserved_kb("n1") == sum(m for node, _, m, _ in records if node == "n1")  # untouched
    assert ledger.apply(view, last_id) == out  # idempotent
    assert ledger.apply(view, "") == out  # admitted reservations do not come back


def test_ledger_without_reservations_returns_the_view_unchanged() -> None:
    view = node_view("n0", kv_free_kb=5.0)
    assert ReservationLedger().apply(view, "") == view


# -- model-aware placement ----------------------------------------------------------------------------------------

MODELS = ("m1", "m2", "m3")  # m3 is served by no node of the rack
ROUTE_POLICIES = st.sampled_from(["", "bogus", *ALL_POLICIES])


@settings(max_examples=150, deadline=None)
@given(
    served=st.lists(st.sets(st.sampled_from(MODELS[:2]), min_size=1), min_size=1, max_size=4),
    caps=st.lists(st.integers(1_000, 100_000), min_size=4, max_size=4),
    free=st.lists(st.integers(0, 120_000), min_size=4, max_size=4),
    reqs=st.lists(st.tuples(st.integers(1, 110_000), st.sampled_from(MODELS), ROUTE_POLICIES, st.integers(0, 6),
                            st.integers(0, 3)), max_size=30),
    allowed=st.lists(st.sampled_from(ALL_POLICIES), unique=True),
    default=st.sampled_from(ALL_POLICIES),
    seed=st.integers(0, 2**32),
)
def test_requests_go_only_to_nodes_serving_their_model_and_each_is_recorded_in_exactly_one_decision(
    served: list[set[str]], caps: list[int], free: list[int], reqs: list[tuple[int, str, str, int, int]],
    allowed: list[NodePolicyName], default: NodePolicyName, seed: int,
) -> None:
    names = [f"n{i}" for i in range(len(served))]
    node_models = {n: frozenset(m) for n, m in zip(names, served, strict=False)}
    node_caps = {n: float(c) for n, c in zip(names, caps, strict=False)}
    batcher = window_batcher(node_caps, seed, node_models=node_models, age_after_windows=3,
                             selection={"policy": default, "allowed_overrides": tuple(allowed)})
    views = [node_view(n, kv_free_kb=float(f), running=i % 3)
             for i, (n, f) in enumerate(zip(names, free, strict=False))]
    hashes = {k: tuple(range(k * 100, k * 100 + 4)) for k in range(4)}  # four shared prompt prefixes
    offered = [
        sized(m, arrival_ms=float(i), waited=w, model=model, route_policy=rp, in_tokens=64, prefix_hashes=hashes[k])
        for i, (m, model, rp, w, k) in enumerate(reqs)
    ]
    for p in offered:
        batcher.offer(p)

    out = batcher.close(1_000.0, views)

    planned = {id(p): plan for plan in out.plans for p in plan.requests}
    rejected = {id(r.pending): r.reason for r in out.rejections}
    assert len(planned) + len(rejected) + len(batcher.pending) == len(offered)  # none lost, none duplicated
    for p in offered:
        req = p.request
        serving_caps = [node_caps[n] for n in names if req.model in node_models[n]]
        if not serving_caps:
            assert rejected[id(p)] == f"no node of this rack serves model {req.model!r}"
        elif req.mem_est_kb > max(serving_caps):
            assert "exceeds the largest node budget" in rejected[id(p)] and req.model in rejected[id(p)]
        else:
            assert id(p) not in rejected  # it fits a node serving its model: it is planned or waits
        if id(p) in planned:
            assert req.model in node_models[planned[id(p)].node]
    # every planned request is in exactly one decision, of the plan that holds it, made by the policy it asked for
    decided = collections.Counter(rid for c in out.choices for rid in c.request_ids)
    for plan in out.plans:
        assert plan.mem_est_kb <= plan.budget_kb
        assert sorted(rid for c in plan.choices for rid in c.request_ids) == sorted(
            p.request.request_id for p in plan.requests)
        for c in plan.choices:
            assert c.node == plan.node and c.request_ids
        for p in plan.requests:
            assert decided[p.request.request_id] == 1
            (c,) = [c for c in plan.choices if p.request.request_id in c.request_ids]
            asked = p.request.route_policy
            assert c.policy == (asked if asked in allowed else default)
    assert sum(decided.values()) == len(planned)


def test_request_for_a_model_no_node_of_the_rack_serves_is_rejected_naming_the_model() -> None:
    batcher = window_batcher({"a": 100.0, "b": 100.0}, node_models={"a": frozenset({"m1"}), "b": frozenset({"m2"})})
    lost = sized(10, model="qwen2-72b")
    batcher.offer(lost)
    batcher.offer(sized(10, model="m2"))
    out = batcher.close(100.0, [node_view("a", kv_free_kb=100.0), node_view("b", kv_free_kb=100.0)])
    assert [(r.pending, r.reason) for r in out.rejections] == [
        (lost, "no node of this rack serves model 'qwen2-72b'")]
    assert [(plan.node, len(plan.requests)) for plan in out.plans] == [("b", 1)]


def test_a_request_is_never_placed_on_a_node_that_does_not_serve_its_model_even_when_only_that_node_has_room() -> None:
    batcher = window_batcher({"a": 100.0, "b": 100.0}, node_models={"a": frozenset({"m1"}), "b": frozenset({"m2"})})
    p = sized(50, model="m1")
    batcher.offer(p)
    out = batcher.close(100.0, [node_view("a", kv_free_kb=20.0), node_view("b", kv_free_kb=100.0)])
    assert out.plans == () and batcher.pending == [p] and out.rejections == ()
    assert out.stop is StopReason.NO_BUDGET


def test_size_limit_is_the_largest_cap_among_nodes_serving_the_model() -> None:
    caps = {"small": 60e6, "big": 100e6}
    batcher = window_batcher(caps, node_models={"small": frozenset({"m1"}), "big": frozenset({"m2"})})
    too_big = sized(80e6, model="m1")  # fits "big", which does not serve m1: it could never run here
    batcher.offer(too_big)
    out = batcher.close(100.0, [node_view("small", kv_free_kb=60e6), node_view("big", kv_free_kb=100e6)])
    assert [r.pending for r in out.rejections] == [too_big]
    assert "80.0 GB exceeds the largest node budget 60.0 GB for m1" in out.rejections[0].reason


def test_reserved_node_serves_the_aged_request_model() -> None:
    caps = {"a": 100_000.0, "b": 100_000.0, "c": 100_000.0}
    models = {"a": frozenset({"m2"}), "b": frozenset({"m1"}), "c": frozenset({"m1", "m2"})}
    batcher = window_batcher(caps, node_models=models, age_after_windows=1)
    batcher.offer(sized(80_000, model="m1"))
    nodes = [node_view("a", kv_free_kb=90_000.0, running=3), node_view("b", kv_free_kb=20_000.0, running=3),
             node_view("c", kv_free_kb=10_000.0, running=3)]
    out = batcher.close(100.0, nodes)
    assert out.reserved_node == "b"  # "a" is closest to holding it but cannot run m1


# -- node policies in the window: overrides, batch-level vs per-request, decision records -------------------------


def override_nodes() -> list[Any]:
    """`idle` has no outstanding work but W = 0 (saturated PCIe link): `weighted` never picks it and
    `least_outstanding` always does."""
    return [node_view("busy", kv_free_kb=1e6, running=9, waiting=4), node_view("idle", kv_free_kb=1e6,
                                                                             pcie_util_pct=100.0)]


@pytest.mark.parametrize("seed", range(5))
def test_a_request_asking_for_least_outstanding_is_placed_by_it_while_the_default_is_weighted(seed: int) -> None:
    batcher = window_batcher({"busy": 1e6, "idle": 1e6}, seed)
    mine, other = sized(10, route_policy="least_outstanding"), sized(20)
    batcher.offer(mine)
    batcher.offer(other)
    out = batcher.close(100.0, override_nodes())
    assert (node_of(out, mine), node_of(out, other)) == ("idle", "busy")
    assert {(c.policy, c.node, c.request_ids) for c in out.choices} == {
        ("least_outstanding", "idle", (mine.request.request_id,)), ("weighted", "busy", (other.request.request_id,))}
    lo = next(c for c in out.choices if c.policy == "least_outstanding")
    assert dict(lo.scores) == {"busy": 13.0, "idle": 0.0} and lo.draw == -1.0  # what it saw; deterministic


@pytest.mark.parametrize(
    "selection",
    [{"allowed_overrides": ("random", "kv_aware")}, {"allow_request_override": False}],
    ids=["not-allowed", "overrides-off"],
)
def test_a_disallowed_override_falls_back_to_the_default_policy(selection: dict[str, Any]) -> None:
    batcher = window_batcher({"busy": 1e6, "idle": 1e6}, selection=selection)
    mine = sized(10, route_policy="least_outstanding")
    batcher.offer(mine)
    out = batcher.close(100.0, override_nodes())
    assert node_of(out, mine) == "busy"
    assert [c.policy for c in out.choices] == ["weighted"]


def test_batch_level_policy_makes_one_decision_and_packs_first_fit_into_the_node_it_chose() -> None:
    batcher = window_batcher({"n0": 100.0, "n1": 100.0, "n2": 100.0}, selection={"policy": "round_robin"})
    small = [sized(m, arrival_ms=float(i)) for i, m in enumerate((30, 30, 30, 60))]
    for p in small:
        batcher.offer(p)
    out = batcher.close(100.0, [node_view(n, kv_free_kb=100.0) for n in ("n0", "n1", "n2")])
    assert [(c.node, len(c.request_ids)) for c in out.choices] == [("n0", 3), ("n1", 1)]
    assert [node_of(out, p) for p in small] == ["n0", "n0", "n0", "n1"]
    assert all(c.policy == "round_robin" for c in out.choices)


def test_per_request_kv_aware_places_each_request_and_sees_earlier_placements_of_the_same_window() -> None:
    batcher = window_batcher({"a": 1e6, "b": 1e6}, selection={"policy": "kv_aware"})
    shared = tuple(range(64))  # 64 blocks of 16 tokens: the whole 1024-token prompt
    first = sized(10, arrival_ms=0.0, in_tokens=1024, prefix_hashes=shared)
    again = sized(10, arrival_ms=1.0, in_tokens=1024, prefix_hashes=shared)
    fresh = sized(10, arrival_ms=2.0, in_tokens=1024, prefix_hashes=tuple(range(1000, 1064)))
    for p in (first, again, fresh):
        batcher.offer(p)
    out = batcher.close(100.0, [node_view("a", kv_free_kb=1e6), node_view("b", kv_free_kb=1e6)])
    # first: a tie (1024 each) goes to "a"; again: cached on "a" (0 + 256 x 1 outstanding) beats "b" (1024);
    # fresh: "a" costs 1024 + 256 x 2, "b" 1024
    assert [node_of(out, p) for p in (first, again, fresh)] == ["a", "a", "b"]
    assert [(c.policy, c.node, len(c.request_ids)) for c in out.choices] == [
        ("kv_aware", "a", 1), ("kv_aware", "a", 1), ("kv_aware", "b", 1)]
    assert dict(out.plans[0].choices[1].scores) == {"a": 256.0, "b": 1024.0}


def test_same_seed_and_window_reproduce_the_same_plans_and_decisions() -> None:
    def run(seed: int) -> list[tuple[str, str, tuple[str, ...], float]]:
        batcher = window_batcher({f"n{i}": 100.0 for i in range(4)}, seed)
        rng = random.Random(7)
        for i in range(30):
            batcher.offer(pending(request(request_id=f"r{i}", mem_est_kb=float(rng.randint(1, 60)),
                                          route_policy=rng.choice(["", "random", "power_of_two"]))))
        out = batcher.close(100.0, [node_view(f"n{i}", kv_free_kb=100.0, running=i) for i in range(4)])
        return [(c.policy, c.node, c.request_ids, c.draw) for c in out.choices]

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_stop_reason_is_no_node_when_the_policy_finds_no_eligible_node_among_nodes_with_room() -> None:
    batcher = make_batcher({"a": 100.0, "b": 100.0})
    batcher.offer(sized(10))
    out = batcher.close(100.0, [node_view("a", kv_free_kb=100.0, pcie_util_pct=100.0),
                                node_view("b", kv_free_kb=100.0, free_vram_gb=0.0)])
    assert out.plans == () and out.waiting == 1
    assert out.stop is StopReason.NO_NODE
