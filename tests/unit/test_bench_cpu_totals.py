"""`bench pipeline`'s CPU per request (workers/bench/pipeline.py `cpu_us_per_request`): each role's median in µs, and
the control plane's total as the median of each run's sum, the keys `bench gateway` gives."""

from __future__ import annotations

from workers.bench.pipeline import cpu_us_per_request


def test_roles_in_us_and_the_total_is_the_median_of_the_runs_sums() -> None:
    got = cpu_us_per_request({"router": [0.5, 0.7, 0.6], "worker": [2.0, 1.0, 3.0], "valkey": [0.4, 0.4, 0.4]})
    assert got["router"] == 600.0 and got["worker"] == 2000.0 and got["valkey"] == 400.0
    # runs' sums: 2.9, 2.1, 4.0 ms -> median 2.9 ms (the roles' medians would sum to 3.0)
    assert got["control_plane"] == 2900.0


def test_no_runs_no_figures() -> None:
    assert cpu_us_per_request({}) == {}
