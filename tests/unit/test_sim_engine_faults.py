"""The sim engine's `slow` fault: an iteration sleeps factor x the cost model's time (the worker sets the factor
from `rackflow fault inject --kind slow`; the health agent then reports the latency the worker measured)."""

from __future__ import annotations

import asyncio

from tests.unit.builders import config, request
from workers.engines.sim import SimEngine
from workers.worker import build_engine


def _sleeps(factor: float) -> list[float]:
    base = build_engine(config(), config().nodes()[0].name, "sim")
    assert isinstance(base, SimEngine)
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    clock = iter(range(0, 10**9, 1))
    eng = SimEngine(base.cost, base.kv_capacity_kb, 8, now_ms=lambda: float(next(clock)), sleep=sleep)
    eng.slow_factor = factor

    async def main() -> None:
        eng.submit(request(in_tokens=512, max_tokens=4))
        while eng.has_work():
            await eng.step()

    asyncio.run(main())
    return slept


def test_slow_factor_multiplies_every_iteration() -> None:
    normal, slow = _sleeps(1.0), _sleeps(3.0)
    assert len(normal) == len(slow) == 4 and all(s > 0 for s in normal)
    for a, b in zip(normal, slow, strict=True):
        assert abs(b - 3.0 * a) < 1e-3 * max(1.0, b)
