"""The gateway's reply stream on a real Valkey: one reader for every open request (workers/stores/replies.py),
fed by the real writer (workers/stores/results.py).

What it must hold: every token once and in order, then the result; a bounded buffer per request (a slow reader
catches up from the request's own stream, losing nothing); a result that never reached the reply stream is found by
the sweep; a `reply_to` that is not a gateway reply stream is never written to; many open requests, one connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from pipeline.events import RequestEvent, ResultEvent, TokenEvent
from streams import codec, keys
from workers.local.services import ServiceEndpoints
from workers.stores.replies import ReplyMux
from workers.stores.results import ResultWriter

pytestmark = pytest.mark.integration
NAME = "rackflow-test-replies"


def _req(reply_to: str) -> RequestEvent:
    return RequestEvent(request_id=str(uuid.uuid4()), version=1, tenant="t", user_id="u", model="qwen2-7b",
                        in_tokens=4, out_tokens=8, max_tokens=8, mem_est_kb=1.0, arrival_ms=time.time() * 1000,
                        reply_to=reply_to)


def _tokens(req: RequestEvent, start: int, n: int) -> TokenEvent:
    return TokenEvent(req.request_id, req.version, start, tuple(range(start, start + n)),
                      tuple(f" t{i}" for i in range(start, start + n)), time.time() * 1000, "r0-n0", req.reply_to)


def _result(req: RequestEvent, out_tokens: int) -> ResultEvent:
    return ResultEvent.of(req, "ok", "r0-n0", "r0", time.time() * 1000, out_tokens=out_tokens,
                          text="".join(f" t{i}" for i in range(out_tokens)))


def _run(ep: ServiceEndpoints, test: Callable[[aioredis.Redis], Awaitable[None]]) -> None:
    async def main() -> None:
        r = aioredis.Redis.from_url(ep.redis_url, client_name=NAME)
        try:
            await test(r)
        finally:
            await r.aclose()

    asyncio.run(main())


async def _ready(mux: ReplyMux) -> None:
    await mux.start()
    for _ in range(200):
        if mux.ready:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the reply stream never became ready")


async def _collect(mux: ReplyMux, rid: str, timeout_s: float = 10.0) -> tuple[list[int], ResultEvent]:
    ids: list[int] = []
    async for ev in mux.outputs(rid, timeout_s):
        if isinstance(ev, ResultEvent):
            return ids, ev
        ids += ev.token_ids
    raise AssertionError("outputs ended without a result")


def test_many_open_requests_share_one_reader(clean_services: ServiceEndpoints) -> None:
    _run(clean_services, _test_many_open_requests_share_one_reader)


async def _test_many_open_requests_share_one_reader(r: aioredis.Redis) -> None:
    mux = ReplyMux(r, sweep_ms=200)
    await _ready(mux)
    writer = ResultWriter(r, lambda: time.time() * 1000, 60_000)
    reqs = [_req(mux.key) for _ in range(300)]
    try:
        for q in reqs:
            mux.subscribe(q.request_id)
        readers = [asyncio.create_task(_collect(mux, q.request_id)) for q in reqs]
        for step in range(4):  # 4 chunks of 2 tokens each, then the results (a worker's steps)
            await writer.write_many([], [_tokens(q, 2 * step, 2) for q in reqs])
        await writer.write_many([_result(q, 8) for q in reqs], [])
        got = await asyncio.gather(*readers)
        # a few connections for the writes and the reader, not one per open request
        assert sum(1 for c in await r.client_list() if c.get("name") == NAME) <= 4
    finally:
        await mux.close()
    for ids, res in got:
        assert ids == list(range(8)) and res.status == "ok"
    assert mux.open_requests == 0 and mux.stats.catch_ups == 0


def test_a_slow_reader_has_a_bounded_buffer_and_loses_nothing(clean_services: ServiceEndpoints) -> None:
    _run(clean_services, _test_a_slow_reader_has_a_bounded_buffer_and_loses_nothing)


async def _test_a_slow_reader_has_a_bounded_buffer_and_loses_nothing(r: aioredis.Redis) -> None:
    mux = ReplyMux(r, queue_events=4, sweep_ms=200)
    await _ready(mux)
    writer = ResultWriter(r, lambda: time.time() * 1000, 60_000)
    q = _req(mux.key)
    mux.subscribe(q.request_id)
    try:
        for i in range(40):  # nobody reads yet: the buffer holds 4 events, the rest stays in rf:out:{id}
            await writer.stream_tokens([_tokens(q, i, 1)])
        await writer.write_many([_result(q, 40)], [])
        deadline = time.monotonic() + 30  # the reader reaches the 40 entries when it is scheduled: a state, polled
        while not mux.stats.dropped and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert mux.stats.queue_max <= 4 and mux.stats.dropped > 0
        ids, res = await _collect(mux, q.request_id)
    finally:
        await mux.close()
    assert ids == list(range(40)) and res.out_tokens == 40
    assert mux.stats.catch_ups >= 1


def test_a_result_that_missed_the_reply_stream_is_found_by_the_sweep(clean_services: ServiceEndpoints) -> None:
    _run(clean_services, _test_a_result_that_missed_the_reply_stream_is_found_by_the_sweep)


async def _test_a_result_that_missed_the_reply_stream_is_found_by_the_sweep(r: aioredis.Redis) -> None:
    mux = ReplyMux(r, sweep_ms=100)
    await _ready(mux)
    writer = ResultWriter(r, lambda: time.time() * 1000, 60_000)
    q = _req(mux.key)
    mux.subscribe(q.request_id)
    try:
        # written by a writer that does not know the reply stream (an older worker): only rf:out:{id} has it
        old = dataclasses.replace(q, reply_to="")
        await writer.write_many([_result(old, 3)], [_tokens(old, 0, 3)])
        ids, res = await _collect(mux, q.request_id, timeout_s=5)
    finally:
        await mux.close()
    assert ids == [0, 1, 2] and res.out_tokens == 3
    assert mux.stats.swept_missed == 1


def test_a_reader_behind_a_burst_makes_no_false_catch_up(clean_services: ServiceEndpoints) -> None:
    _run(clean_services, _test_a_reader_behind_a_burst_makes_no_false_catch_up)


async def _test_a_reader_behind_a_burst_makes_no_false_catch_up(r: aioredis.Redis) -> None:
    """A result marker written before the reader reaches its entry (a burst: the reader's last read was full) is
    not a missed result, however many sweeps see it; once the reader is caught up, it takes two sweeps in a row
    to call it missed. The sweeps are driven by hand (no sweep loop), so no timing decides the outcome."""
    mux = ReplyMux(r, sweep_ms=3_600_000)
    mux.subscribe(q_id := str(uuid.uuid4()))
    await r.set(keys.result_done(q_id), b"1", ex=60)
    w = mux._waiters[q_id]
    mux._behind = True
    for _ in range(3):
        await mux._sweep()
    assert not w.lagging and mux.stats.swept_missed == 0
    mux._behind = False
    await mux._sweep()
    assert not w.lagging and w.marked, "one sweep marks it, it does not call it missed"
    mux._dispatch({})  # an entry without an event changes nothing
    await mux._sweep()
    assert w.lagging and mux.stats.swept_missed == 1


def test_a_reply_to_that_is_not_a_gateway_stream_is_never_written(clean_services: ServiceEndpoints) -> None:
    _run(clean_services, _test_a_reply_to_that_is_not_a_gateway_stream_is_never_written)


async def _test_a_reply_to_that_is_not_a_gateway_stream_is_never_written(r: aioredis.Redis) -> None:
    writer = ResultWriter(r, lambda: time.time() * 1000, 60_000)
    for target in (keys.INGRESS, "rf:gw:{x}:out:extra", "anything"):
        q = _req(target)
        await writer.write_many([_result(q, 1)], [_tokens(q, 0, 1)])
        assert not await r.exists(target)
    # and an expired reply stream (its gateway stopped) is not re-created
    gone = keys.gateway_replies("stopped-gateway")
    q = _req(gone)
    await writer.write_many([_result(q, 1)], [_tokens(q, 0, 1)])
    assert not await r.exists(gone)
    assert await r.exists(keys.request_out(q.request_id))  # the request's own stream has it all


def test_results_survive_a_flushed_script_cache_exactly_once(clean_services: ServiceEndpoints) -> None:
    """The writer sends its scripts as plain EVALSHA (no SCRIPT EXISTS per pipeline): after the server lost them
    (a restart, a SCRIPT FLUSH), each script that did not run is loaded and run once, and nothing is doubled."""

    async def test(r: aioredis.Redis) -> None:
        w = ResultWriter(r, lambda: time.time() * 1000, 60_000, out_ttl_s=120)
        req = _req(keys.gateway_replies("gw-flush"))
        await r.xadd(req.reply_to, {"x": "1"})
        await r.config_resetstat()
        await r.script_flush()
        written = await w.write_many([], [_tokens(req, 0, 2)])  # the first chunk: a script
        assert written == []
        await r.script_flush()
        assert await w.write_many([_result(req, 4)], [_tokens(req, 2, 2)]) == [True]
        assert await w.write_many([_result(req, 4)], []) == [False]  # exactly once, script cached again
        entries = await r.xrange(keys.request_out(req.request_id))
        assert len(entries) >= 3  # first chunk, last chunk, result (and the repeat's end of stream)
        assert await r.xlen(keys.RESULTS) == 1
        assert 0 < await r.ttl(keys.request_out(req.request_id)) <= 120
        stats = await r.info("commandstats")
        assert "cmdstat_script|exists" not in stats

    _run(clean_services, test)


def test_streamed_chunks_renew_their_stream_ttl_without_an_expire_per_chunk(clean_services: ServiceEndpoints) -> None:
    async def test(r: aioredis.Redis) -> None:
        now = [1_000_000.0]
        w = ResultWriter(r, lambda: now[0], 60_000, out_ttl_s=40)
        req = _req("")
        await r.config_resetstat()
        await w.stream_tokens([_tokens(req, 0, 1)])
        for i in range(1, 6):
            await w.stream_tokens([_tokens(req, i, 1)])
        assert (await r.info("commandstats"))["cmdstat_expire"]["calls"] == 1
        assert 0 < await r.ttl(keys.request_out(req.request_id)) <= 40
        now[0] += 10_001  # a quarter of the TTL later: renewed
        await w.stream_tokens([_tokens(req, 6, 1)])
        assert (await r.info("commandstats"))["cmdstat_expire"]["calls"] == 2

    _run(clean_services, test)


def test_copies_ride_in_the_scripts_and_a_failed_copy_fails_nothing(clean_services: ServiceEndpoints) -> None:
    """A request's first chunk and its finish copy themselves to the gateway's reply stream inside their scripts (one
    command each, not one per copy); a reply stream of the wrong type (WRONGTYPE) is counted, and the result is
    written all the same."""
    from workers.shell import metrics

    async def test(r: aioredis.Redis) -> None:
        w = ResultWriter(r, lambda: time.time() * 1000, 60_000, out_ttl_s=120)
        ok = _req(keys.gateway_replies("gw-copies"))
        await r.xadd(ok.reply_to, {"x": "1"})
        await r.config_resetstat()
        assert await w.write_many([], [_tokens(ok, 0, 2)]) == []
        assert await w.write_many([_result(ok, 4)], [_tokens(ok, 2, 2)]) == [True]
        calls = {k: v["calls"] for k, v in (await r.info("commandstats")).items()}
        assert calls.get("cmdstat_evalsha") == 2 and "cmdstat_script|exists" not in calls
        copies = [codec.decode(f) for _, f in (await r.xrange(ok.reply_to))[1:]]
        assert [type(ev).__name__ for ev in copies] == ["TokenEvent", "TokenEvent", "ResultEvent"]
        assert [ev.index for ev in copies[:2]] == [0, 2]  # type: ignore[union-attr]

        bad = _req(keys.gateway_replies("gw-wrongtype"))
        await r.set(bad.reply_to, "not a stream")
        before = metrics.REPLY_COPY_ERRORS._value.get()
        assert await w.write_many([], [_tokens(bad, 0, 1)]) == []
        assert await w.write_many([_result(bad, 2)], [_tokens(bad, 1, 1)]) == [True]
        assert metrics.REPLY_COPY_ERRORS._value.get() == before + 2
        assert await r.get(bad.reply_to) == b"not a stream"
        own = [codec.decode(f) for _, f in await r.xrange(keys.request_out(bad.request_id))]
        assert [type(ev).__name__ for ev in own] == ["TokenEvent", "TokenEvent", "ResultEvent"]

    _run(clean_services, test)
