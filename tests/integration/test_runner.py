"""The consumer-group runner against a real Valkey: dead letters, poison entries, claiming, heartbeats."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

import msgpack
import pytest
import redis.asyncio as aioredis

from pipeline.events import RequestEvent
from streams import codec, keys
from streams.runner import Delivery, StreamConsumer, StreamProducer
from workers.shell.runtime import WALL

pytestmark = pytest.mark.integration


def req(i: int) -> RequestEvent:
    return RequestEvent(
        request_id=f"req-{i}", version=1, tenant="t", user_id="u", model="qwen2-7b", in_tokens=10, out_tokens=5,
        max_tokens=5, mem_est_kb=100.0, arrival_ms=1.0,
    )


def consumer(r: aioredis.Redis, stream: str, name: str, handler: Callable[[list[Delivery]], Awaitable[None]],
             **kw: int) -> StreamConsumer:
    opts = {"count": 10, "block_ms": 20, "claim_idle_ms": 400, "max_deliveries": 3}
    opts.update(kw)
    return StreamConsumer(r, stream, "g", name, handler, now_ms=WALL.now_ms, **opts)


async def until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def pending_count(r: aioredis.Redis, stream: str) -> int:
    return int((await r.xpending(stream, "g"))["pending"])


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_malformed_entries_go_to_dlq_and_consumer_continues(clean_services):  # type: ignore[no-untyped-def]
    async def body() -> None:
        r = aioredis.Redis.from_url(clean_services.redis_url)
        stream = f"rf:test:{uuid.uuid4().hex}"
        producer = StreamProducer(r, WALL.now_ms, 3_600_000)
        bad = [
            {b"junk": b"1"},
            {b"v": b"9", b"t": b"request", b"d": b""},
            {b"v": b"1", b"t": b"nope", b"d": msgpack.packb({})},
            {b"v": b"1", b"t": b"request", b"d": b"\xc1\xc1"},
            {b"v": b"1", b"t": b"request", b"d": msgpack.packb({"request_id": 5})},
        ]
        await producer.add(stream, req(0))
        for f in bad:
            await r.xadd(stream, f)
        await producer.add_many([(stream, req(1)), (stream, req(2))])
        seen: list[str] = []

        async def handle(ds: list[Delivery]) -> None:
            seen.extend(d.event.request_id for d in ds)  # type: ignore[union-attr]

        c = consumer(r, stream, "c1", handle)
        task = asyncio.create_task(c.run())
        await until(lambda: len(seen) == 3)
        await until(lambda: c.stats.dead_lettered == len(bad))
        c.stop()
        await task
        await c.close()
        assert seen == ["req-0", "req-1", "req-2"]
        dlq = await r.xrange(keys.DLQ)
        assert len(dlq) == len(bad)
        reasons = [e[1][b"reason"].decode() for e in dlq]
        assert "missing field 'v'" in reasons[0]
        assert "version 9 not supported" in reasons[1]
        assert "unknown event type 'nope'" in reasons[2]
        assert "not valid msgpack" in reasons[3]
        assert "request_id" in reasons[4] and "expected a string" in reasons[4]
        # the original bytes are kept
        assert msgpack.unpackb(dlq[3][1][b"fields"]) == bad[3]
        assert all(e[1][b"stream"] == stream.encode() for e in dlq)
        assert await pending_count(r, stream) == 0
        await r.aclose()

    run(body())


def test_poison_entry_dead_lettered_after_max_deliveries(clean_services):  # type: ignore[no-untyped-def]
    async def body() -> None:
        r = aioredis.Redis.from_url(clean_services.redis_url)
        stream = f"rf:test:{uuid.uuid4().hex}"
        producer = StreamProducer(r, WALL.now_ms, 3_600_000)
        await producer.add_many([(stream, req(i)) for i in range(5)])
        handled: list[str] = []
        attempts = 0

        async def handle(ds: list[Delivery]) -> None:
            nonlocal attempts
            for d in ds:
                assert isinstance(d.event, RequestEvent)
                if d.event.request_id == "req-3":
                    attempts += 1
                    raise RuntimeError("handler bug on this entry")
            handled.extend(d.event.request_id for d in ds)  # type: ignore[union-attr]

        c = consumer(r, stream, "c1", handle, claim_idle_ms=200, max_deliveries=3)
        task = asyncio.create_task(c.run())
        await until(lambda: c.stats.dead_lettered == 1, timeout_s=15)
        c.stop()
        await task
        await c.close()
        assert sorted(handled) == ["req-0", "req-1", "req-2", "req-4"]
        # first batch attempt + one-by-one retry, then two more deliveries by claim
        assert attempts >= 3
        dlq = await r.xrange(keys.DLQ)
        assert len(dlq) == 1 and b"delivered 4 times (max 3)" in dlq[0][1][b"reason"]
        assert codec.decode(msgpack.unpackb(dlq[0][1][b"fields"])).request_id == "req-3"  # type: ignore[union-attr]
        assert await pending_count(r, stream) == 0
        await r.aclose()

    run(body())


def test_entries_of_a_dead_consumer_are_claimed(clean_services):  # type: ignore[no-untyped-def]
    async def body() -> None:
        r = aioredis.Redis.from_url(clean_services.redis_url)
        stream = f"rf:test:{uuid.uuid4().hex}"
        producer = StreamProducer(r, WALL.now_ms, 3_600_000)
        await r.xgroup_create(stream, "g", id="0", mkstream=True)
        await producer.add_many([(stream, req(i)) for i in range(6)])
        # "dead" consumer: read 4 entries and never acknowledge them (as if killed right after XREADGROUP)
        await r.xreadgroup("g", "dead", {stream: ">"}, count=4)
        handled: list[str] = []

        async def handle(ds: list[Delivery]) -> None:
            handled.extend(d.event.request_id for d in ds)  # type: ignore[union-attr]

        c = consumer(r, stream, "alive", handle, claim_idle_ms=300)
        task = asyncio.create_task(c.run())
        await until(lambda: len(handled) == 6)
        c.stop()
        await task
        await c.close()
        assert sorted(handled) == [f"req-{i}" for i in range(6)]
        assert c.stats.claimed == 4
        assert await pending_count(r, stream) == 0
        await r.aclose()

    run(body())


def test_deferred_entries_are_kept_alive_and_not_stolen(clean_services):  # type: ignore[no-untyped-def]
    async def body() -> None:
        r = aioredis.Redis.from_url(clean_services.redis_url)
        stream = f"rf:test:{uuid.uuid4().hex}"
        producer = StreamProducer(r, WALL.now_ms, 3_600_000)
        await producer.add(stream, req(0))
        held: list[Delivery] = []
        stolen: list[str] = []

        async def hold(ds: list[Delivery]) -> None:
            for d in ds:
                d.defer()
                held.append(d)

        async def steal(ds: list[Delivery]) -> None:
            stolen.extend(d.id for d in ds)

        owner = consumer(r, stream, "owner", hold, claim_idle_ms=300)
        other = consumer(r, stream, "other", steal, claim_idle_ms=300)
        t1 = asyncio.create_task(owner.run())
        await until(lambda: len(held) == 1)
        t2 = asyncio.create_task(other.run())
        await asyncio.sleep(1.5)  # 5x the claim timeout: without the heartbeat "other" would claim it
        assert stolen == []
        await owner.ack([held[0].id])
        assert await pending_count(r, stream) == 0
        for c, t in ((owner, t1), (other, t2)):
            c.stop()
            await t
            await c.close()
        await r.aclose()

    run(body())


def test_restart_under_same_name_rereads_own_pending(clean_services):  # type: ignore[no-untyped-def]
    async def body() -> None:
        r = aioredis.Redis.from_url(clean_services.redis_url)
        stream = f"rf:test:{uuid.uuid4().hex}"
        producer = StreamProducer(r, WALL.now_ms, 3_600_000)
        await r.xgroup_create(stream, "g", id="0", mkstream=True)
        await producer.add_many([(stream, req(i)) for i in range(3)])
        await r.xreadgroup("g", "w1", {stream: ">"}, count=3)  # delivered, then the process restarted
        handled: list[str] = []

        async def handle(ds: list[Delivery]) -> None:
            handled.extend(d.event.request_id for d in ds)  # type: ignore[union-attr]

        c = consumer(r, stream, "w1", handle, claim_idle_ms=60_000)  # no claim: only the own-PEL read
        task = asyncio.create_task(c.run())
        await until(lambda: len(handled) == 3)
        c.stop()
        await task
        await c.close()
        assert await pending_count(r, stream) == 0
        await r.aclose()

    run(body())


def test_streams_are_trimmed_by_age(clean_services):  # type: ignore[no-untyped-def]
    """Retention: every XADD trims entries older than the retention (MINID, approximate: whole radix-tree nodes
    go, so at most one node of old entries, ~100, may stay until the next ones come)."""
    from pipeline.events import DecisionEvent

    async def run() -> tuple[int, int, bytes]:
        r = aioredis.Redis.from_url(clean_services.redis_url)
        now = 10 * 86_400_000.0
        try:
            ev = DecisionEvent("route", "p", "r0", ("x",), 0.0)
            # two days of history, one entry a minute, written with their own (old) ids
            for m in range(2 * 24 * 60):
                await r.xadd("rf:decisions", codec.encode(ev), id=f"{int(now - 2 * 86_400_000 + m * 60_000)}-0")
            before = await r.xlen("rf:decisions")
            prod = StreamProducer(r, lambda: now, retention_ms=86_400_000)
            await prod.add("rf:decisions", ev)
            first = (await r.xrange("rf:decisions", count=1))[0][0]
            return before, await r.xlen("rf:decisions"), first
        finally:
            await r.aclose()

    before, after, first = asyncio.run(run())
    assert before == 2880
    assert 1440 <= after <= 1440 + 101  # the last day stays, the first is gone (up to one approximate node)
    assert int(first.split(b"-")[0]) >= 10 * 86_400_000 - 86_400_000 - 101 * 60_000


def test_an_idle_consumer_blocks_longer_yet_takes_an_entry_at_once_and_stops_at_once(clean_services):  # type: ignore[no-untyped-def]
    """Idle, each empty read blocks twice as long as the last (up to idle_block_ms): a handful of reads in two
    seconds instead of one every block_ms. An entry still ends the block at once, and `stop` cancels a blocked read
    instead of waiting it out."""

    async def body() -> None:
        r = aioredis.Redis.from_url(clean_services.redis_url)
        stream = f"rf:test:{uuid.uuid4().hex}"
        producer = StreamProducer(r, WALL.now_ms, 3_600_000)
        seen: list[tuple[str, float]] = []

        async def handle(ds: list[Delivery]) -> None:
            seen.extend((d.event.request_id, asyncio.get_running_loop().time()) for d in ds)  # type: ignore[union-attr]

        # a long idle block (30 s): an entry or a stop that waited for the block's end would take seconds, so the
        # bounds below hold on a busy machine and still fail if the block were waited out
        c = consumer(r, stream, "c1", handle, block_ms=20, idle_block_ms=30_000)
        reads = 0
        real = r.xreadgroup

        async def counted(*a, **k):  # type: ignore[no-untyped-def]
            nonlocal reads
            reads += 1
            return await real(*a, **k)

        r.xreadgroup = counted  # type: ignore[method-assign]
        task = asyncio.create_task(c.run())
        await asyncio.sleep(2.5)  # 20 ms blocks would be 125 reads; doubling from 20 ms, about 7 (fewer on a slow box)
        assert reads <= 10, reads
        sent = asyncio.get_running_loop().time()
        await producer.add(stream, req(1))
        await until(lambda: len(seen) == 1)
        assert seen[0][1] - sent < 5.0  # the block (by now over a second long) ended on the entry
        await asyncio.sleep(1.5)  # idle again: a block of seconds in flight
        t0 = asyncio.get_running_loop().time()
        c.stop()
        await asyncio.wait_for(task, timeout=5)
        assert asyncio.get_running_loop().time() - t0 < 5.0  # the blocked read was cancelled, not waited out
        await c.close()
        await producer.add(stream, req(2))  # nothing was lost by the cancelled read: a new consumer reads on
        c2 = consumer(r, stream, "c1", handle, block_ms=20)
        task = asyncio.create_task(c2.run())
        await until(lambda: len(seen) == 2)
        c2.stop()
        await task
        await c2.close()
        assert [s for s, _ in seen] == ["req-1", "req-2"]
        await r.aclose()

    run(body())


def test_a_paced_consumer_lets_entries_gather_but_reads_a_backlog_at_once_and_stops_at_once(clean_services):  # type: ignore[no-untyped-def]
    """`pace_ms`: after a read that took entries, the next read waits until the pace has gone by since the last one
    started (the monitor's idle heartbeats: a few reads a second instead of one per entry). A full read (a backlog)
    reads again at once, and `stop` ends the wait. The pace is 30 s here: the bounds below hold on a busy machine and
    fail if a wait were skipped (entries read early) or always waited out (a backlog, a stop)."""

    async def body() -> None:
        r = aioredis.Redis.from_url(clean_services.redis_url)
        stream = f"rf:test:{uuid.uuid4().hex}"
        producer = StreamProducer(r, WALL.now_ms, 3_600_000)
        seen: list[str] = []
        calls: list[int] = []

        async def handle(ds: list[Delivery]) -> None:
            calls.append(len(ds))
            seen.extend(d.event.request_id for d in ds)  # type: ignore[union-attr]

        c = StreamConsumer(r, stream, "g", "c1", handle, now_ms=WALL.now_ms, count=10, block_ms=20,
                           pace_ms=lambda: 30_000.0)
        task = asyncio.create_task(c.run())
        await producer.add(stream, req(0))
        await until(lambda: len(seen) == 1)
        await producer.add_many((stream, req(i)) for i in range(1, 6))
        await asyncio.sleep(1.0)
        assert seen == ["req-0"]  # they wait for the next read, 30 s after the first
        t0 = asyncio.get_running_loop().time()
        c.stop()
        await asyncio.wait_for(task, timeout=5)
        assert asyncio.get_running_loop().time() - t0 < 5.0  # the stop ended the wait
        await c.close()

        # 25 entries waiting (5 never read, 20 more): reads of 10, 10 and 5, the full ones followed at once
        await producer.add_many((stream, req(i)) for i in range(6, 26))
        c2 = StreamConsumer(r, stream, "g", "c1", handle, now_ms=WALL.now_ms, count=10, block_ms=20,
                            pace_ms=lambda: 30_000.0)
        task = asyncio.create_task(c2.run())
        await until(lambda: len(seen) == 26)
        assert calls[1:] == [10, 10, 5]
        assert seen == [f"req-{i}" for i in range(26)]
        c2.stop()
        await asyncio.wait_for(task, timeout=5)
        await c2.close()
        assert await pending_count(r, stream) == 0
        await r.aclose()

    run(body())


def test_add_with_writes_the_first_entry_then_the_rest_and_says_which_failed(clean_services):  # type: ignore[no-untyped-def]
    """The batcher writes a batch and its dispatch decisions in one round trip (`StreamProducer.add_with`). The first
    entry is written first and its id returned; a failure among the rest is returned beside it, not raised, because
    the first entry is out (the batcher books the batch as dispatched); a failure of the first entry raises, and
    nothing after it is lost track of."""
    async def body() -> None:
        r = aioredis.Redis.from_url(clean_services.redis_url)
        first, rest, wrong = (f"rf:test:{uuid.uuid4().hex}" for _ in range(3))
        await r.set(wrong, "not a stream")
        producer = StreamProducer(r, WALL.now_ms, 3_600_000)
        entry, err = await producer.add_with((first, req(0)), [(rest, req(1)), (rest, req(2))])
        assert err is None and [e[0].decode() for e in await r.xrange(first)] == [entry]
        assert [codec.decode(f).request_id for _i, f in await r.xrange(rest)] == ["req-1", "req-2"]  # type: ignore[union-attr]
        entry2, err2 = await producer.add_with((first, req(3)), [(wrong, req(4)), (rest, req(5))])
        assert err2 is not None and "WRONGTYPE" in str(err2)
        assert [e[0].decode() for e in await r.xrange(first)] == [entry, entry2]
        assert await r.xlen(rest) == 3  # the entry after the failed one is written too
        with pytest.raises(Exception, match="WRONGTYPE"):
            await producer.add_with((wrong, req(6)), [(rest, req(7))])
        await r.aclose()

    run(body())
