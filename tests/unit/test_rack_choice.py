"""Rack choice that sees prefixes and work, and admission above capacity (pipeline/admission.py)."""

from __future__ import annotations

import math

import pytest

from pipeline.admission import RATE_WINDOW_S, Admission, ShedReason
from pipeline.config import GatewayConfig
from pipeline.routing.rack_affinity import RackAffinityRouter, RouteDecision, keeps_prefix_cache, rack_cached_tokens
from pipeline.routing.views import RackView

RACKS = ["r0", "r1", "r2"]


def router(**kw: float | bool) -> RackAffinityRouter:
    return RackAffinityRouter({"m": RACKS}, 160, 1.25, 16.0, prefix_aware=True, affinity_tokens=8192.0,
                              work_slack=32768.0, **kw)  # type: ignore[arg-type]


def views(work: dict[str, float] | None = None, healthy: set[str] | None = None) -> dict[str, RackView]:
    w = work or {}
    return {r: RackView(r, healthy is None or r in healthy, 0.0, w.get(r, 0.0) * 4, 4) for r in RACKS}


def user_with_primary(rack: str) -> str:
    r = router()
    return next(u for u in (f"user-{i}" for i in range(1000)) if r.route(u, "m", views()).primary == rack)


def test_without_a_cached_prefix_the_user_keeps_its_rack() -> None:
    u = user_with_primary("r1")
    d = router().route(u, "m", views())
    assert (d.rack, d.reason) == ("r1", "affinity")


def test_a_cached_prefix_elsewhere_wins_when_it_saves_more_than_affinity_is_worth() -> None:
    u = user_with_primary("r1")
    d = router().route(u, "m", views(), cached={"r2": 20_000.0})
    assert (d.rack, d.primary, d.reason) == ("r2", "r1", "prefix")
    small = router().route(u, "m", views(), cached={"r2": 4_000.0})  # 4 k tokens < 8 k of affinity
    assert small.rack == "r1"


def test_work_per_node_is_weighed_against_the_prefix_and_the_bound_still_holds() -> None:
    u = user_with_primary("r1")
    # r2 holds 20 k tokens of the prompt but has 15 k more work queued per node than r1: 20 k - 15 k < 8 k
    assert router().route(u, "m", views({"r2": 15_000.0}), cached={"r2": 20_000.0}).rack == "r1"
    # the primary is far over load_bound x mean + slack: it is skipped (walked), whatever the affinity
    d = router().route(u, "m", views({"r1": 400_000.0}))
    assert d.rack != "r1" and d.reason == "walked"


def test_unhealthy_racks_are_never_chosen_and_none_healthy_gives_none() -> None:
    u = user_with_primary("r1")
    d = router().route(u, "m", views(healthy={"r0"}), cached={"r2": 1e9})
    assert d.rack == "r0"
    assert router().route(u, "m", views(healthy=set())).rack is None


def test_seed_mode_is_the_plain_bounded_load_hash_ring() -> None:
    seed = RackAffinityRouter({"m": RACKS}, 160, 1.25, 16.0)
    u = user_with_primary("r1")
    assert seed.route(u, "m", views(), cached={"r2": 1e9}).rack == "r1"  # blind to prefixes


def test_the_seed_prefix_rule_spares_a_request_sent_for_its_prefix() -> None:
    assert keeps_prefix_cache(True, 512, 4000, RouteDecision("r2", "r1", "prefix"), True)
    assert not keeps_prefix_cache(True, 512, 4000, RouteDecision("r2", "r1", "walked"), True)


def test_rack_cached_tokens_is_the_best_node_of_each_rack_capped_below_the_prompt() -> None:
    got = rack_cached_tokens({"a": 2, "b": 5, "c": 1}, {"a": "r0", "b": "r0", "c": "r1"}, 512, 2000)
    assert got == {"r0": 1999.0, "r1": 512.0}


# -- admission ---------------------------------------------------------------------------------------------------


def adm(**kw: float) -> Admission:
    return Admission(GatewayConfig(**kw))  # type: ignore[arg-type]


def test_admission_sheds_on_the_count_bound_at_once() -> None:
    v = adm(max_rack_queue=100).decide(100, None)
    assert not v.admit and v.reason is ShedReason.RACK_QUEUE
    assert adm(max_rack_queue=100).decide(99, None).admit


def test_admission_sheds_on_seconds_of_work_only_once_the_queue_has_lasted_a_rate_window() -> None:
    a = adm(max_queue_s=5.0, max_retry_after_s=30)
    early = a.decide(60, 10.0, queued_for_s=RATE_WINDOW_S - 0.1)  # 6 s of work, but the queue is new
    assert early.admit and early.wait_s == pytest.approx(6.0)
    late = a.decide(60, 10.0, queued_for_s=RATE_WINDOW_S)
    assert not late.admit and late.reason is ShedReason.QUEUE_TIME


def test_admission_time_bound_examples() -> None:
    a = adm(max_queue_s=5.0, max_retry_after_s=30, retry_after_s=1)
    assert a.decide(40, 10.0, math.inf).admit  # 4 s of work
    v = a.decide(60, 10.0, math.inf)
    assert not v.admit and v.reason is ShedReason.QUEUE_TIME and v.retry_after_s == 6
    assert a.decide(60, 10.0, 1.0).admit  # a burst after a quiet spell: the rate is not the drain rate yet
    assert a.decide(60, None, math.inf).admit  # no rate measured: only the count bound
    assert adm(max_queue_s=0.0).decide(1999, 0.1, math.inf).admit  # time bound off: only the count (2000)


def test_retry_after_is_the_drain_time_within_bounds() -> None:
    a = adm(retry_after_s=2, max_retry_after_s=20)
    assert a.retry_after(100, None) == 20
    assert a.retry_after(1, 10.0) == 2
    assert a.retry_after(100, 10.0) == 10
    assert a.retry_after(10_000, 10.0) == 20
