"""The live check's in-run speed (workers/sim/live_check.py): the engine simulated at the speed its own speed
belief measured in the run, per operator class."""

from __future__ import annotations

import pytest

from pipeline.costmodel.linear import LinearStepCost
from pipeline.costmodel.online import SpeedBelief
from workers.sim.live_check import SPEED_SKIP, at_speed, in_run_speed

COST = LinearStepCost(base_ms=2.5, per_prefill_token_ms=0.013, per_decode_seq_ms=0.05, per_kv_token_ms=6e-5,
                      prefill_base_ms=2.6, per_prefill_attn_ms=1e-5)


def test_at_speed_scales_each_class_by_its_own_factor() -> None:
    run = at_speed(COST, {"decode": 1.2, "prefill": 0.9})
    dec = COST.step_ms([], 3, 1500)
    assert run.step_ms([], 3, 1500) == pytest.approx(1.2 * dec)
    # an iteration with a prefill: its decode part at the decode factor, the rest at the prefill factor, as the
    # belief splits it (SpeedBelief.observe)
    whole = COST.step_ms([700], 3, 1500, [300])
    assert run.step_ms([700], 3, 1500, [300]) == pytest.approx(1.2 * dec + 0.9 * (whole - dec))
    assert at_speed(COST, {"decode": 1.0, "prefill": 1.0}) == COST


def test_a_belief_fed_a_slower_engine_gives_that_speed_back() -> None:
    """The speed a belief learns from an engine that runs its decode 1.15x and its prefill 1.3x the profile's, read
    back by `in_run_speed` from its reports as the worker publishes them, rebuilds that engine's step times."""
    belief = SpeedBelief()
    reports = []
    for i in range(400):
        dec = COST.step_ms([], 2, 1200)
        if i % 4 == 0:  # an iteration with a prefill of 600 tokens
            pre = COST.step_ms([600], 2, 1200) - dec
            belief.observe(1.15 * dec + 1.3 * pre, pre, dec)
        else:
            belief.observe(1.15 * dec, 0.0, dec)
        reports.append((float(i), 2, 1.15 * dec, belief.decode, belief.prefill if belief.n_pre else 0.0))
    speed = in_run_speed(reports)
    assert speed["reports"] == len(reports) - int(len(reports) * SPEED_SKIP)
    assert speed["decode"] == pytest.approx(1.15, rel=1e-3) and speed["prefill"] == pytest.approx(1.3, rel=1e-3)
    run = at_speed(COST, speed)
    assert run.step_ms([600], 2, 1200) == pytest.approx(
        1.15 * COST.step_ms([], 2, 1200) + 1.3 * (COST.step_ms([600], 2, 1200) - COST.step_ms([], 2, 1200)), rel=2e-3)


def test_no_reports_or_no_prefill_learned_keeps_the_profile() -> None:
    assert in_run_speed([]) == {"decode": 1.0, "prefill": 1.0, "reports": 0}
    speed = in_run_speed([(0.0, 1, 3.0, 1.1, 0.0)] * 8)  # prefill_slowdown 0: not learned
    assert speed["decode"] == 1.1 and speed["prefill"] == 1.0
