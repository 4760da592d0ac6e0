"""The live `sim` engine: the simulator's engine model in real time, one decode step per iteration, its prefix
cache's block events for the routers, and the sequence moves the worker makes (abort, export, import)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from tests.unit.builders import config, request
from workers.engines import build_engine
from workers.engines.sim import SimEngine, placeholder_token


def engine(**kw: Any) -> SimEngine:
    base = build_engine(config(), config().nodes()[0].name, "sim")
    assert isinstance(base, SimEngine)

    async def no_sleep(_s: float) -> None:
        return None

    clock = iter(range(0, 10**12, 7))
    return SimEngine(base.cost, base.kv_capacity_kb, 16, now_ms=lambda: float(next(clock)), sleep=no_sleep, **kw)


def run(eng: SimEngine, limit: int = 10_000) -> list[Any]:
    async def main() -> list[Any]:
        outs = []
        for _ in range(limit):
            if not eng.has_work():
                break
            outs.append(await eng.step())
        return outs

    return asyncio.run(main())


def test_every_sequence_gets_its_tokens_in_order_once_and_finishes_at_max_tokens() -> None:
    eng = engine()
    reqs = [request(request_id=f"q{i}", in_tokens=300 * (i + 1), max_tokens=5 + i, mem_est_kb=1.0) for i in range(6)]
    for r in reqs:
        eng.submit(r)
    outs = run(eng)
    got: dict[str, list[int]] = {}
    for o in outs:
        for t in o.tokens:
            got.setdefault(t.request_id, []).append(t.index)
    assert got == {r.request_id: list(range(r.max_tokens)) for r in reqs}
    finished = {f.request_id: f.out_tokens for o in outs for f in o.finished}
    assert finished == {r.request_id: r.max_tokens for r in reqs}
    assert eng.kv_used_kb == 0 and not eng.has_work()
    tid, _ = placeholder_token("q0", 0, eng.cost.model.vocab)
    assert next(t.token_id for o in outs for t in o.tokens if t.request_id == "q0") == tid


def test_prefix_blocks_are_reused_and_reported_once_as_block_events() -> None:
    eng = engine(prefix_block_tokens=16)
    hashes = tuple(range(100, 110))
    eng.submit(request(request_id="a", in_tokens=160, max_tokens=2, mem_est_kb=1.0, prefix_hashes=hashes))
    run(eng)
    events = eng.take_block_events()
    assert [sorted(s) for s, _ in events] == [sorted(hashes)] and eng.take_block_events() == []
    eng.submit(request(request_id="b", in_tokens=200, max_tokens=2, mem_est_kb=1.0, prefix_hashes=hashes))
    run(eng)
    assert eng.stats().prefix_hit_tokens == 160  # the second prompt prefilled only its last 40 tokens
    off = request(request_id="c", in_tokens=200, max_tokens=2, mem_est_kb=1.0, prefix_hashes=hashes,
                  prefix_cache=False)
    eng.submit(off)
    run(eng)
    assert eng.stats().prefix_hit_tokens == 160  # caching off (the seed's rule): no hit


def test_an_exported_sequence_resumes_elsewhere_with_the_same_next_tokens() -> None:
    a, b = engine(), engine()
    r = request(request_id="m", in_tokens=500, max_tokens=12, mem_est_kb=1.0)
    a.submit(r)

    async def until(eng: SimEngine, n: int) -> list[int]:
        got = []
        while len(got) < n:
            got += [t.index for t in (await eng.step()).tokens]
        return got

    first = asyncio.run(until(a, 5))
    snap = a.export_kv("m", 2, remove=True)
    assert not a.has_work() and len(snap.generated) == 5
    b.import_kv(snap, dataclasses.replace(r, version=2))
    rest = [(t.index, t.token_id) for o in run(b) for t in o.tokens]
    assert first == [0, 1, 2, 3, 4] and [i for i, _ in rest] == list(range(5, 12))
    assert rest[0][1] == placeholder_token("m", 5, b.cost.model.vocab)[0]
    # resident KV: the import prefills one token, not the 505 it holds
    assert b.stats().prompt_tokens == 505 and b.stats().prefix_hit_tokens == 504


def test_the_status_reports_queued_prefill_decode_load_and_kv_use() -> None:
    eng = engine()
    for i in range(4):
        eng.submit(request(request_id=f"s{i}", in_tokens=6000, max_tokens=50, mem_est_kb=1.0))
    s = eng.stats()
    assert (s.waiting, s.prefill_tokens, s.max_seqs) == (4, 24_000, 16)
    run(eng, limit=3)
    s = eng.stats()
    assert s.decode_seqs >= 1 and s.decode_tokens >= 6000 and 0 < s.kv_usage < 1 and s.slowdown == 1.0
