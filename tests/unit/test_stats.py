"""The one percentile and the one stream-id ordering (pipeline/stats.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.stats import percentile, percentiles, stream_id_key, stream_id_ms


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=60), st.floats(0, 100))
def test_percentile_is_numpys_linear_method(xs: list[float], q: float) -> None:
    assert np.isclose(percentile(xs, q), float(np.percentile(xs, q)), rtol=1e-9, atol=1e-6)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), max_size=60), st.lists(st.floats(0, 100), max_size=4))
def test_percentiles_are_each_percentile(xs: list[float], qs: list[float]) -> None:
    assert percentiles(xs, qs) == [percentile(xs, q) for q in qs]


def test_percentile_examples() -> None:
    assert percentile([], 99) == 0.0
    assert percentile([5.0], 50) == 5.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99


@given(st.lists(st.tuples(st.integers(0, 2**48), st.integers(0, 2**20)), min_size=2, max_size=30))
def test_stream_ids_sort_as_the_server_orders_them(pairs: list[tuple[int, int]]) -> None:
    ids = [f"{ms}-{seq}" for ms, seq in pairs]
    assert sorted(ids, key=stream_id_key) == [f"{ms}-{seq}" for ms, seq in sorted(pairs)]


def test_empty_id_sorts_first_and_ms_part() -> None:
    assert stream_id_key("") < stream_id_key("0-0") < stream_id_key("0-1") < stream_id_key("1")
    assert stream_id_key("17") == stream_id_key("17-0")
    assert stream_id_ms("1700000000123-4") == 1700000000123.0


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    import random

    import pytest

    from pipeline.backoff import ExponentialBackoff, Retrying

    b = ExponentialBackoff(base=0.1, cap=1.0)
    assert [b.compute(n) for n in range(1, 7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    r = Retrying(ExponentialBackoff(base=0.05, cap=5.0, jitter=True), rng=random.Random(1))
    delays = [r.next_delay() for _ in range(12)]
    for n, d in enumerate(delays, start=1):
        plain = min(5.0, 0.05 * 2 ** (n - 1))
        assert plain <= d < 2 * plain
    r.reset()
    assert r.next_delay() < 0.1
    with pytest.raises(ValueError, match="base <= cap"):
        ExponentialBackoff(base=2.0, cap=1.0)
