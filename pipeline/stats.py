"""The one percentile every report uses (simulator, demo, replay, benchmarks), and the one ordering of Redis stream
ids, so that two reports of the same samples, or two components comparing the same ids, never disagree."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, SupportsFloat


class Sorted(Protocol):
    """Values in ascending order, read by index: a list, or a sorted numpy array."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int, /) -> SupportsFloat: ...


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linearly interpolated between closest ranks (numpy's default method); 0.0 for no
    values (callers that must tell "no data" apart check emptiness first)."""
    if not values:
        return 0.0
    return _interpolated(sorted(values), q)


def percentiles(values: Sequence[float], qs: Sequence[float]) -> list[float]:
    """`percentile` at each of `qs`, sorting the values once (a 2 M request report asks three of the same list)."""
    if not values:
        return [0.0 for _ in qs]
    return sorted_percentiles(sorted(values), qs)


def sorted_percentiles(s: Sorted, qs: Sequence[float]) -> list[float]:
    """`percentiles` of values already in ascending order: a list, or a sorted numpy array (its elements are read as
    Python floats, so the result is the same float as from the list)."""
    if not len(s):
        return [0.0 for _ in qs]
    return [_interpolated(s, q) for q in qs]


def _interpolated(s: Sorted, q: float) -> float:
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    a, b = float(s[lo]), float(s[hi])
    return a + (b - a) * (k - lo)


def stream_id_key(entry_id: str) -> tuple[int, int]:
    """Sort key of a Redis stream id "ms-seq" (a bare "ms" is "ms-0"); an empty id (none yet) sorts before every
    real id, "0-0" included."""
    if not entry_id:
        return (-1, -1)
    ms, _, seq = entry_id.partition("-")
    return (int(ms), int(seq or 0))


def stream_id_ms(entry_id: str) -> float:
    """The millisecond time part of a stream id (when the server appended the entry)."""
    return float(stream_id_key(entry_id)[0])
