"""The one retry-delay strategy of rackflow's own retry loops (the stream consumers' reads, the worker's writes
through a Valkey outage, the etcd failover client's rounds over the members), after redis-py's `backoff.py`: a
pure function of the number of failures so far, exponential from `base` up to `cap`, optionally with jitter so that
many processes hit by the same outage do not retry in lockstep. Clients inside libraries (redis-py's own Retry, gRPC's
reconnects) keep theirs."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ExponentialBackoff:
    """Delay after the n-th consecutive failure (n >= 1): min(cap, base * 2**(n-1)); with `jitter`, that value
    times a uniform factor in [1, 2) (still at most 2 * cap)."""

    base: float
    cap: float
    jitter: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.base <= self.cap:
            raise ValueError(f"backoff needs 0 < base <= cap, got base={self.base} cap={self.cap}")

    def compute(self, failures: int, rng: random.Random | None = None) -> float:
        d: float = min(self.cap, self.base * 2.0 ** max(0, failures - 1))
        if not self.jitter:
            return d
        if rng is None:  # the core keeps no hidden random state: the caller owns (and may seed) it
            raise ValueError("a jittered backoff needs an rng (random.Random)")
        return d * (1 + rng.random())


@dataclass
class Retrying:
    """A retry loop's state over one strategy: `next_delay()` after each failure, `reset()` after a success."""

    strategy: ExponentialBackoff
    rng: random.Random | None = None
    failures: int = field(default=0)

    def next_delay(self) -> float:
        self.failures += 1
        return self.strategy.compute(self.failures, self.rng)

    def reset(self) -> None:
        self.failures = 0
