"""The engines' mean step time over the last 10 s (`StepWindow`): exact, expiring, O(1) per step and per read."""

from __future__ import annotations

import pytest

from workers.engines.base import StepWindow


def test_mean_over_the_window_and_expiry() -> None:
    w = StepWindow(1_000.0)
    assert w.mean() == 0.0
    for t, ms in ((0.0, 2.0), (100.0, 4.0), (600.0, 6.0)):
        w.add(t, ms)
    assert w.mean() == pytest.approx(4.0)
    w.add(1_050.0, 10.0)  # the first step (t=0) is now older than the window
    assert len(w) == 3
    assert w.mean() == pytest.approx((4.0 + 6.0 + 10.0) / 3)
    assert w.mean(1_700.0) == pytest.approx(10.0)  # read later: only the last step is within a second
    assert w.mean(5_000.0) == 0.0 and len(w) == 0


def test_many_steps_stay_exact() -> None:
    w = StepWindow(10_000.0)
    for i in range(200_000):  # a zero-time engine's step rate: the window never holds more than its span
        w.add(i * 0.1, 0.5 if i % 2 else 1.5)
    kept = [0.5 if i % 2 else 1.5 for i in range(200_000) if i * 0.1 >= 199_999 * 0.1 - 10_000.0]
    assert len(w) == len(kept)
    assert w.mean() == pytest.approx(sum(kept) / len(kept), rel=1e-9)
