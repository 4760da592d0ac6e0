"""The sim engine's `slow` fault: an iteration sleeps factor x the cost model's time (the worker sets the factor
from `rackflow fault inject --kind slow`; the health agent then reports the latency the worker measured)."""

from __future__ import annotations

import asyncio

from tests.unit.builders import config, request
from workers.engines.sim import SimEngine
from workers.roles.worker import build_engine


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


def test_a_sequence_aborted_while_a_step_runs_gets_no_token_and_does_not_crash_the_step() -> None:
    """A cancel (or, before releases waited for the step, a release) aborts a sequence while the engine sleeps out
    an iteration: the step must neither emit a token for it nor end it (ending it deleted it from `running` a second
    time: a KeyError that killed the worker's engine loop)."""
    base = build_engine(config(), config().nodes()[0].name, "sim")
    assert isinstance(base, SimEngine)
    victim, other = request(in_tokens=64, max_tokens=2), request(in_tokens=64, max_tokens=4)

    async def main() -> list[tuple[str, int]]:
        gate = asyncio.Event()

        async def sleep(_s: float) -> None:
            await gate.wait()

        eng = SimEngine(base.cost, base.kv_capacity_kb, 8, now_ms=lambda: 0.0, sleep=sleep)
        for r in (victim, other):
            eng.submit(r)
        gate.set()
        await eng.step()  # both prefilled: token 0 each; the victim's next token is its last
        gate.clear()
        step = asyncio.create_task(eng.step())
        await asyncio.sleep(0)  # the step is asleep now
        assert eng.abort(victim.request_id)
        gate.set()
        out = await step
        assert not out.finished and eng.kv_used_kb == other.mem_est_kb
        return [(t.request_id, t.index) for t in out.tokens]

    assert asyncio.run(main()) == [(other.request_id, 1)]
