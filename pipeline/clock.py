"""Time as an injected dependency: policies take `now_ms` from a Clock, never from the system.

The live shell passes a wall clock (in `workers/`), the simulator and tests a ManualClock they advance.
"""

from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> float:
        """Milliseconds since the Unix epoch (wall) or since the start of a simulation (virtual)."""
        ...


class ManualClock:
    def __init__(self, start_ms: float = 0.0) -> None:
        self._now = start_ms

    def now_ms(self) -> float:
        return self._now

    def advance(self, ms: float) -> None:
        if ms < 0:
            raise ValueError(f"time cannot go backwards (advance by {ms} ms)")
        self._now += ms
