"""How the decisions tier compares the live ranking on P99 TTFT with the simulated one (`ranking_agreement`): a pair
of policies is ordered only where the run's samples order it (bootstrap), and a prediction fails where the live run
orders a pair the other way."""

from __future__ import annotations

import random

from workers.sim.live_decisions import p99_order, ranking_agreement


def tail(seed: int, scale: float, n: int = 900) -> list[float]:
    """n TTFTs with a long tail (lognormal), scaled."""
    rng = random.Random(seed)
    return [scale * rng.lognormvariate(4.0, 0.8) for _ in range(n)]


def test_a_clear_gap_is_ordered_and_a_small_one_is_not() -> None:
    assert p99_order(tail(1, 1.0), tail(2, 2.0))[0] == "<"
    assert p99_order(tail(1, 2.0), tail(2, 1.0))[0] == ">"
    # the same distribution twice: the 9th-worst of 900 does not tell them apart
    order, share = p99_order(tail(1, 1.0), tail(2, 1.0))
    assert order == "~" and 0.05 < share < 0.95


def test_a_live_reversal_of_an_ordered_prediction_is_a_contradiction() -> None:
    raw = {"default": {"live_ttft_ms": tail(1, 2.0), "sim_ttft_ms": tail(2, 1.0)},
           "round_robin": {"live_ttft_ms": tail(3, 1.0), "sim_ttft_ms": tail(4, 2.0)}}
    out = ranking_agreement(raw, ["default", "round_robin"], draws=500)
    assert out["contradicted"] == ["default vs round_robin"] and not out["agreed"]
    pair = out["pairs"]["default vs round_robin"]
    assert (pair["live"], pair["sim"]) == (">", "<")


def test_pairs_ordered_alike_agree_and_a_tie_on_either_side_is_unresolved() -> None:
    raw = {"a": {"live_ttft_ms": tail(1, 1.0), "sim_ttft_ms": tail(2, 1.0)},
           "b": {"live_ttft_ms": tail(3, 2.5), "sim_ttft_ms": tail(4, 2.5)},
           "c": {"live_ttft_ms": tail(5, 2.5), "sim_ttft_ms": tail(6, 5.0)}}
    out = ranking_agreement(raw, ["a", "b", "c"], draws=500)
    assert set(out["agreed"]) == {"a vs b", "a vs c"}
    assert out["unresolved"] == ["b vs c"] and not out["contradicted"]
    assert out["pairs"]["b vs c"]["sim"] == "<" and out["pairs"]["b vs c"]["live"] == "~"
