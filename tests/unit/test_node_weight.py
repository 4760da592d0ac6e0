"""The node weight W = (free/total) * (1 - pcie/100) * exp(-k * latency) and the `weighted` node policy on it
(weighted-random dispatch, sampled in log space so it stays defined when every W underflows)."""

from __future__ import annotations

import collections
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.routing.node_policies.base import NodeChoice
from pipeline.routing.node_policies.weighted import Weighted, node_log_weight, node_weight
from pipeline.routing.views import NodeView
from tests.unit.builders import node_view

K = 0.05
TOTAL = st.floats(1.0, 1000.0)
FRAC = st.floats(0.01, 1.0)
PCIE = st.floats(0.0, 99.0)
LAT = st.floats(0.0, 500.0)


def test_weight_matches_the_formula_for_explicit_numbers() -> None:
    n = node_view("n", vram_total_gb=80.0, free_vram_gb=40.0, pcie_util_pct=25.0, avg_latency_ms=10.0)
    assert node_weight(n, K) == pytest.approx(0.5 * 0.75 * math.exp(-0.5), rel=1e-12)
    assert node_log_weight(n, K) == pytest.approx(math.log(0.5 * 0.75) - 0.5, rel=1e-12)


def test_weight_uses_the_nodes_own_total_memory_not_80_gb() -> None:
    h200 = node_view("n", vram_total_gb=141.0, free_vram_gb=70.5, pcie_util_pct=0.0, avg_latency_ms=0.0)
    assert node_weight(h200, K) == pytest.approx(0.5)


@settings(max_examples=100, deadline=None)
@given(total=TOTAL, f1=FRAC, f2=FRAC, pcie=PCIE, lat=LAT)
def test_weight_increases_with_free_memory(total: float, f1: float, f2: float, pcie: float, lat: float) -> None:
    lo, hi = sorted((f1, f2))
    a = node_view("a", vram_total_gb=total, free_vram_gb=lo * total, pcie_util_pct=pcie, avg_latency_ms=lat)
    b = node_view("b", vram_total_gb=total, free_vram_gb=hi * total, pcie_util_pct=pcie, avg_latency_ms=lat)
    assert node_log_weight(a, K) <= node_log_weight(b, K)
    if hi > lo * 1.001:
        assert node_log_weight(a, K) < node_log_weight(b, K)


@settings(max_examples=100, deadline=None)
@given(total=TOTAL, f=FRAC, p1=PCIE, p2=PCIE, lat=LAT)
def test_weight_decreases_with_pcie_utilisation(total: float, f: float, p1: float, p2: float, lat: float) -> None:
    lo, hi = sorted((p1, p2))
    a = node_view("a", vram_total_gb=total, free_vram_gb=f * total, pcie_util_pct=lo, avg_latency_ms=lat)
    b = node_view("b", vram_total_gb=total, free_vram_gb=f * total, pcie_util_pct=hi, avg_latency_ms=lat)
    assert node_log_weight(a, K) >= node_log_weight(b, K)
    if hi > lo + 0.1:
        assert node_log_weight(a, K) > node_log_weight(b, K)


@settings(max_examples=100, deadline=None)
@given(total=TOTAL, f=FRAC, pcie=PCIE, l1=st.floats(0.0, 50_000.0), l2=st.floats(0.0, 50_000.0))
def test_weight_decreases_with_latency(total: float, f: float, pcie: float, l1: float, l2: float) -> None:
    lo, hi = sorted((l1, l2))
    a = node_view("a", vram_total_gb=total, free_vram_gb=f * total, pcie_util_pct=pcie, avg_latency_ms=lo)
    b = node_view("b", vram_total_gb=total, free_vram_gb=f * total, pcie_util_pct=pcie, avg_latency_ms=hi)
    assert node_log_weight(a, K) >= node_log_weight(b, K)
    if hi > lo + 0.1:
        assert node_log_weight(a, K) > node_log_weight(b, K)


@pytest.mark.parametrize(
    "overrides",
    [
        {"active": False},
        {"free_vram_gb": 0.0},
        {"free_vram_gb": -3.0},
        {"pcie_util_pct": 100.0},
        {"pcie_util_pct": 140.0},
        {"vram_total_gb": 0.0},
    ],
    ids=["inactive", "no-free-memory", "negative-free-memory", "pcie-100", "pcie-over-100", "no-total"],
)
def test_ineligible_node_has_zero_weight_and_is_never_chosen(overrides: dict[str, object]) -> None:
    bad = node_view("bad", **overrides)
    assert node_weight(bad, K) == 0.0
    assert node_log_weight(bad, K) == -math.inf
    sel = Weighted(K, random.Random(1))
    good = node_view("good", free_vram_gb=1.0, pcie_util_pct=99.0, avg_latency_ms=200.0)  # tiny but positive
    assert sel.scores([bad, good]) == {"bad": 0.0, "good": 1.0}
    assert all(sel.choose([bad, good]).node == "good" for _ in range(200))
    ch = sel.choose([bad])
    assert ch.node is None
    assert 0.0 <= ch.draw < 1.0
    assert ch.scores == {"bad": 0.0}


def test_choose_with_no_nodes_returns_none() -> None:
    ch = Weighted(K, random.Random(0)).choose([])
    assert isinstance(ch, NodeChoice)
    assert ch.node is None and dict(ch.scores) == {}


NODES = st.lists(
    st.builds(
        lambda total, f, pcie, lat, active: (total, f, pcie, lat, active),
        TOTAL, st.floats(0.0, 1.0), st.floats(0.0, 100.0), st.floats(0.0, 30_000.0), st.booleans(),
    ),
    min_size=1,
    max_size=6,
)


def views_of(specs: list[tuple[float, float, float, float, bool]]) -> list[NodeView]:
    return [
        node_view(f"n{i}", vram_total_gb=t, free_vram_gb=f * t, pcie_util_pct=p, avg_latency_ms=lat, active=a)
        for i, (t, f, p, lat, a) in enumerate(specs)
    ]


@settings(max_examples=150, deadline=None)
@given(specs=NODES)
def test_scores_sum_to_one_over_eligible_nodes_and_follow_log_weights(
    specs: list[tuple[float, float, float, float, bool]],
) -> None:
    nodes = views_of(specs)
    scores = Weighted(K, random.Random(0)).scores(nodes)
    assert set(scores) == {n.name for n in nodes}
    logs = {n.name: node_log_weight(n, K) for n in nodes}
    eligible = [n for n, lw in logs.items() if lw > -math.inf]
    if not eligible:
        assert set(scores.values()) == {0.0}
        return
    assert math.fsum(scores.values()) == pytest.approx(1.0)
    top = max(logs[n] for n in eligible)
    assert max(scores.values()) > 0.0  # at least the best node is choosable, even when every W underflows
    for n, s in scores.items():
        if logs[n] == -math.inf:
            assert s == 0.0
        # proportional to W: s_n / s_top == exp(log W_n - log W_top)
        assert s / max(scores.values()) == pytest.approx(math.exp(logs[n] - top), rel=1e-9, abs=1e-300)


def test_scores_stay_proportional_to_w_when_every_w_underflows() -> None:
    a = node_view("a", free_vram_gb=60.0, pcie_util_pct=0.0, avg_latency_ms=20_000.0)
    b = node_view("b", free_vram_gb=20.0, pcie_util_pct=0.0, avg_latency_ms=20_010.0)
    assert node_weight(a, K) == node_weight(b, K) == 0.0  # exp(-1000) underflows
    scores = Weighted(K, random.Random(0)).scores([a, b])
    expected_ratio = math.exp(-0.05 * (20_000.0 - 20_010.0)) * (60.0 / 20.0)
    assert scores["a"] / scores["b"] == pytest.approx(expected_ratio, rel=1e-9)
    assert scores["a"] + scores["b"] == pytest.approx(1.0)


def test_empirical_choice_frequencies_match_scores_over_20k_draws() -> None:
    nodes = [
        node_view("a", free_vram_gb=70.0, pcie_util_pct=10.0, avg_latency_ms=8.0),
        node_view("b", free_vram_gb=30.0, pcie_util_pct=50.0, avg_latency_ms=12.0),
        node_view("c", free_vram_gb=60.0, pcie_util_pct=0.0, avg_latency_ms=30.0),
        node_view("d", free_vram_gb=50.0, pcie_util_pct=0.0, avg_latency_ms=5.0, active=False),
    ]
    sel = Weighted(K, random.Random(20231116))
    scores = sel.scores(nodes)
    draws = 20_000
    counts = collections.Counter(sel.choose(nodes).node for _ in range(draws))
    assert counts["d"] == 0
    for name in "abc":
        assert counts[name] / draws == pytest.approx(scores[name], abs=0.02), (name, counts, scores)


@settings(max_examples=30, deadline=None)
@given(specs=NODES, seed=st.integers(0, 2**32))
def test_same_seed_reproduces_the_same_sequence_of_choices_and_draws(
    specs: list[tuple[float, float, float, float, bool]], seed: int
) -> None:
    nodes = views_of(specs)
    a = Weighted(K, random.Random(seed))
    b = Weighted(K, random.Random(seed))
    seq_a = [(c.node, c.draw) for c in (a.choose(nodes) for _ in range(20))]
    seq_b = [(c.node, c.draw) for c in (b.choose(list(reversed(nodes))) for _ in range(20))]
    assert seq_a == seq_b  # node order does not matter


@settings(max_examples=100, deadline=None)
@given(specs=NODES, seed=st.integers(0, 2**32))
def test_choice_is_an_eligible_node_whose_cumulative_probability_covers_the_draw(
    specs: list[tuple[float, float, float, float, bool]], seed: int
) -> None:
    nodes = views_of(specs)
    ch = Weighted(K, random.Random(seed)).choose(nodes)
    choice, draw, probs = ch.node, ch.draw, dict(ch.scores)
    if not any(p > 0 for p in probs.values()):
        assert choice is None
        return
    assert choice is not None
    assert probs[choice] > 0.0
    names = [n for n in sorted(probs) if probs[n] > 0]
    before = math.fsum(probs[n] for n in names[: names.index(choice)])
    assert before <= draw + 1e-12
    assert draw < before + probs[choice] + 1e-12 or choice == names[-1]
