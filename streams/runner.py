"""Consumer-group runner and producer for Redis Streams (ARCHITECTURE §6: at-least-once, dead letters).

The runner owns the read/ack/claim loop of one consumer in one group on one stream:
- XREADGROUP in batches with BLOCK; the handler gets the decoded deliveries; entries are XACKed after the handler
  returns (after the effect), except those the handler `defer()`s: it acks them later with `ack()`, and until
  then the runner keeps them alive with XCLAIM JUSTID (resets idle time, not the delivery count);
- on start it first re-reads its own pending entries (a restart under the same consumer name loses nothing);
- XAUTOCLAIM of entries idle longer than `claim_idle_ms` (their consumer died, e.g. `kill -9`);
- an entry that does not decode, that is an event of a type the stream does not carry (`accepts`), or that was
  delivered more than `max_deliveries` times, goes to the dead-letter stream with the reason and the original
  fields, and is acknowledged: a bad entry never stops a consumer;
- a handler error is retried entry by entry, so one poison entry cannot hold back the others of its batch;
- `stop()` (SIGTERM) ends the loop after the current batch; deferred entries stay pending for a successor.
It never decides what an event means: that is the handler's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import BusyLoadingError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.backoff import ExponentialBackoff, Retrying
from pipeline.events import Event
from streams import codec, keys
from streams.errors import DecodeError, TransientStreamError

log = logging.getLogger(__name__)

TRANSIENT = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, TransientStreamError)
READ_BACKOFF = ExponentialBackoff(base=0.05, cap=5.0, jitter=True)
"""A consumer's reads through an outage: 0.05 s doubling to 5 s, each times [1, 2) so consumers spread out."""


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None, every_s: float = 0.5) -> None:
    """Cancel the tasks and wait until each has ended, cancelling again every `every_s` while one runs on. One
    cancel is not always enough: one that lands inside a client call can come out of it as another error (redis-py
    reads under `asyncio.timeout`, which on Python 3.11 can turn a cancel into its TimeoutError), and a loop that
    retries on that error runs on as if never cancelled. A consumer's heartbeat did: in 3 of 45 runs of the batcher
    fuzz test its task sat in its sleep, "cancelling", and the role never stopped. Exceptions of the tasks are
    retrieved, not raised (as gather's return_exceptions). A task's own cleanup after its cancel must take less than
    `every_s`, or the next cancel interrupts it: the loops this stops have none that long."""
    live = {t for t in tasks if t is not None}
    while live:
        for t in live:
            t.cancel()
        done, pending = await asyncio.wait(live, timeout=every_s)
        for t in done:
            if not t.cancelled():
                t.exception()  # one that turned its cancel into an error: retrieved, as gather would
        live = set(pending)


try:
    import hiredis

    class HiredisPackConnection(aioredis.Connection):
        """redis-py's asyncio connection packs commands in pure Python (its sync client uses hiredis): on a stream
        hop that is a third of the client's CPU. Pack with hiredis instead; anything it cannot take (a memoryview,
        a bool) goes through the original packer."""

        def pack_command(self, *args: Any) -> list[bytes]:
            head = args[0]
            if isinstance(head, str) and " " in head:
                args = (*head.split(), *args[1:])
            try:
                return [hiredis.pack_command(args)]
            except TypeError:
                return super().pack_command(*args)

    FAST_CONNECTION: type[aioredis.Connection] | None = HiredisPackConnection
except ImportError:  # pragma: no cover - hiredis is a dependency
    FAST_CONNECTION = None


CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def is_cluster_url(url: str) -> bool:
    """`redis+cluster://HOST:PORT` (or `rediss+cluster://`) names a Redis/Valkey Cluster through one seed node."""
    return url.startswith(CLUSTER_SCHEMES)


def plain_url(url: str) -> str:
    """The URL without the `+cluster` marker (what redis-py's clients parse)."""
    return url.replace("+cluster://", "://", 1) if is_cluster_url(url) else url


def connect(url: str, **kwargs: Any) -> aioredis.Redis:
    """An asyncio client that retries transient failures with jittered exponential backoff (and packs commands
    with hiredis on plain TCP connections). A `redis+cluster://` URL gives a cluster client (same interface:
    every multi-key command rackflow sends keeps its keys in one slot, see `streams.keys`)."""
    if is_cluster_url(url):
        from redis.asyncio.cluster import RedisCluster

        kwargs.pop("connection_class", None)
        cluster = RedisCluster.from_url(
            plain_url(url),
            retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), retries=8),
            **{k: v for k, v in kwargs.items() if k not in ("health_check_interval",)},
        )
        return cluster  # type: ignore[return-value]
    return aioredis.Redis.from_url(url, **{**retrying_connection_kwargs(url), **kwargs})


def retrying_connection_kwargs(url: str) -> dict[str, Any]:
    """The connection settings of `connect` for a single server, for a pool built elsewhere (the gateway's bounded
    pool): retries of transient failures with jittered exponential backoff (about 8 s in all), a health check of
    idle connections, and hiredis command packing on plain TCP."""
    kw: dict[str, Any] = {
        "retry": Retry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), retries=8),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError, BusyLoadingError],
        "health_check_interval": 30,
    }
    if FAST_CONNECTION is not None and url.startswith("redis://"):
        kw["connection_class"] = FAST_CONNECTION
    return kw


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def minid_for(now_ms: float, retention_ms: int) -> str:
    return f"{max(0, int(now_ms) - retention_ms)}-0"


@dataclass(slots=True)
class Delivery:
    stream: str
    id: str
    event: Event
    fields: dict[bytes, bytes]
    deliveries: int = 1
    deferred: bool = False

    def defer(self) -> None:
        """The handler acknowledges this entry later (runner.ack), when its effect is complete."""
        self.deferred = True


Handler = Callable[[list[Delivery]], Awaitable[None]]
NowMs = Callable[[], float]


class StreamProducer:
    """XADD with trimming by age (MINID ~) and pipelining of many entries in one round trip."""

    def __init__(self, r: aioredis.Redis, now_ms: NowMs, retention_ms: int) -> None:
        self.r = r
        self.now_ms = now_ms
        self.retention_ms = retention_ms

    async def add(self, stream: str, event: Event) -> str:
        return _s(
            await self.r.xadd(
                stream, codec.encode(event), minid=minid_for(self.now_ms(), self.retention_ms), approximate=True
            )
        )

    async def add_with(self, first: tuple[str, Event],
                       rest: Iterable[tuple[str, Event]]) -> tuple[str, Exception | None]:
        """Append `first`, then `rest`, in one round trip, in that order. Returns the first entry's id and the first
        error among `rest` (None when every one was written): the caller books `first` as written either way. An
        error on `first` itself raises (it was not written); so does a lost connection (nothing is known)."""
        replies = await self._xadd_all(itertools.chain((first,), rest))
        if isinstance(replies[0], Exception):
            raise replies[0]
        return _s(replies[0]), next((x for x in replies[1:] if isinstance(x, Exception)), None)

    async def add_many(self, items: Iterable[tuple[str, Event | dict[bytes, bytes]]]) -> list[str]:
        """Append many entries in one round trip; an item is an event, or entry fields already encoded. The first
        error raises (after the round trip: the entries around it are written)."""
        replies = await self._xadd_all(items)
        for x in replies:
            if isinstance(x, Exception):
                raise x
        return [_s(x) for x in replies]

    async def add_each(self, items: Iterable[tuple[str, Event | dict[bytes, bytes]]]) -> list[Any]:
        """Append many entries in one round trip; each reply is the entry's id or the error it got (nothing raises
        but a lost connection, after which nothing is known)."""
        return [x if isinstance(x, Exception) else _s(x) for x in await self._xadd_all(items)]

    async def _xadd_all(self, items: Iterable[tuple[str, Event | dict[bytes, bytes]]]) -> list[Any]:
        """XADD each item in one pipelined round trip, in order; each reply an id or the error it got."""
        minid = minid_for(self.now_ms(), self.retention_ms)
        pipe = self.r.pipeline(transaction=False)
        n = 0
        for stream, event in items:
            fields = event if isinstance(event, dict) else codec.encode(event)
            pipe.xadd(stream, fields, minid=minid, approximate=True)  # type: ignore[arg-type]
            n += 1
        if not n:
            return []
        return list(await pipe.execute(raise_on_error=False))


async def last_delivered(r: aioredis.Redis, stream: str, group: str) -> str:
    """The id of the last entry of `stream` delivered to `group` ("" when none was, or the stream or group does not
    exist)."""
    try:
        groups = await r.xinfo_groups(stream)
    except ResponseError:  # no such stream
        return ""
    for g in groups:
        name = g.get("name", g.get(b"name"))
        if name in (group, group.encode()):
            last = g.get("last-delivered-id", g.get(b"last-delivered-id")) or ""
            last = last.decode() if isinstance(last, bytes) else str(last)
            return "" if last == "0-0" else last
    return ""


async def ensure_group(r: aioredis.Redis, stream: str, group: str) -> None:
    """Create the group at the start of the stream (entries written before the first consumer are not lost)."""
    try:
        await r.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


DEAD_LETTER_OBSERVERS: list[Callable[[str, str], None]] = []
"""Called with (stream, group) after each entry sent to the dead-letter stream (the roles' metrics count them)."""


async def dead_letter(
    r: aioredis.Redis,
    *,
    stream: str,
    group: str,
    consumer: str,
    entry_id: str,
    fields: dict[Any, Any] | None,
    reason: str,
    now_ms: float,
    retention_ms: int,
) -> None:
    entry = {
        b"stream": stream.encode(),
        b"id": entry_id.encode(),
        b"group": group.encode(),
        b"consumer": consumer.encode(),
        b"reason": reason.encode("utf-8", "replace")[:4096],
        b"ts_ms": str(int(now_ms)).encode(),
        b"fields": codec.encode_fields_for_dlq(fields or {}),
    }
    await r.xadd(keys.DLQ, entry, minid=minid_for(now_ms, retention_ms), approximate=True)  # type: ignore[arg-type]
    for observe in DEAD_LETTER_OBSERVERS:
        observe(stream, group)


@dataclass
class RunnerStats:
    delivered: int = 0
    acked: int = 0
    claimed: int = 0
    dead_lettered: int = 0
    handler_errors: int = 0


IDLE_BLOCK_MS = 2000
"""The longest a consumer's read blocks while its stream is idle (`StreamConsumer.idle_block_ms`)."""


class StreamConsumer:
    def __init__(
        self,
        r: aioredis.Redis,
        stream: str,
        group: str,
        consumer: str,
        handler: Handler,
        *,
        now_ms: NowMs,
        count: int = 128,
        block_ms: int = 200,
        claim_idle_ms: int = 10_000,
        max_deliveries: int = 5,
        retention_ms: int = 86_400_000,
        accepts: tuple[type[Any], ...] | None = None,
        idle_block_ms: int | None = None,
        pace_ms: Callable[[], float] | None = None,
    ) -> None:
        self.r = r
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.handler = handler
        self.now_ms = now_ms
        self.count = count
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self.retention_ms = retention_ms
        self.accepts = accepts
        """The event types this stream carries (None: any); a valid event of another type is a bad entry too."""
        self.stats = RunnerStats()
        self._stopping = asyncio.Event()
        self._deferred: set[str] = set()
        self._backoff = Retrying(READ_BACKOFF, random.Random())
        self._heartbeat: asyncio.Task[None] | None = None
        self.idle_block_ms = max(block_ms, IDLE_BLOCK_MS if idle_block_ms is None else idle_block_ms)
        """While the stream is idle, each empty read blocks twice as long as the last, up to this: an idle consumer
        wakes every 2 s instead of every `block_ms` (an entry still ends the block at once; `stop` cancels it)."""
        self._block_ms = block_ms
        self._reading: asyncio.Future[Any] | None = None
        self.pace_ms = pace_ms
        """The least time between the starts of two reads that took entries, asked after each such read (None or
        0: none). An owner whose stream carries only slow, steady traffic while its cluster is idle (heartbeats)
        sets it, so entries that arrive meanwhile wait for the next read and come in one batch: one read and one
        XACK for several entries instead of one each. A full read (`count` entries: a backlog) reads again at once,
        and `stop` ends the wait."""

    # -- public ------------------------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stopping.set()
        reading = self._reading
        if reading is not None and not reading.done():
            reading.cancel()  # a blocked read would otherwise hold the stop for up to idle_block_ms

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def deferred(self) -> int:
        return len(self._deferred)

    async def ack(self, ids: Sequence[str]) -> None:
        if not ids:
            return
        await self.r.xack(self.stream, self.group, *ids)
        self._deferred.difference_update(ids)
        self.stats.acked += len(ids)

    async def run(self) -> None:
        """Read until stop(). Deferred entries keep their heartbeat after the loop ends (a draining worker
        finishing what it holds), until close()."""
        await ensure_group(self.r, self.stream, self.group)
        claim = asyncio.create_task(self._claim_loop())
        if self._heartbeat is None:
            self._heartbeat = asyncio.create_task(self._heartbeat_loop())
        try:
            await self._guarded(self._read_own_pending)
            while not self._stopping.is_set():
                await self._guarded(self._read_new)
        finally:
            await cancel_and_wait(claim)

    async def close(self) -> None:
        """Stop the heartbeat of deferred entries (they become claimable by others after claim_idle_ms)."""
        self.stop()
        if self._heartbeat is not None:
            await cancel_and_wait(self._heartbeat)
            self._heartbeat = None

    # -- loops -------------------------------------------------------------------------------------------------
    async def _guarded(self, step: Callable[[], Awaitable[None]]) -> None:
        try:
            await step()
            self._backoff.reset()
        except TRANSIENT as e:
            delay = self._backoff.next_delay()
            log.warning("%s/%s: server unavailable (%s); retrying in %.2fs", self.stream, self.consumer, e, delay)
            await asyncio.sleep(delay)

    async def _read_own_pending(self) -> None:
        start = "0-0"
        while not self._stopping.is_set():
            resp = await self.r.xreadgroup(self.group, self.consumer, {self.stream: start}, count=self.count)
            entries = resp[0][1] if resp else []
            if not entries:
                return
            await self._process(entries, redelivered=True)
            start = _s(entries[-1][0])

    async def _read_new(self) -> None:
        started = time.monotonic()
        read = asyncio.ensure_future(self.r.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=self.count, block=self._block_ms
        ))
        self._reading = read
        try:
            resp = await read
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._stopping.is_set() and read.cancelled() and not (task is not None and task.cancelling()):
                return  # `stop` cancelled the blocked read (an entry it had taken stays pending: claimed later)
            raise
        finally:
            self._reading = None
        if resp:
            self._block_ms = self.block_ms
            entries = resp[0][1]
            await self._process(entries, redelivered=False)
            pace = self.pace_ms() if self.pace_ms is not None and len(entries) < self.count else 0.0
            wait = started + pace / 1000.0 - time.monotonic()
            if wait > 0 and not self._stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), timeout=wait)
        else:
            self._block_ms = min(self.idle_block_ms, self._block_ms * 2)

    async def _claim_loop(self) -> None:
        interval = max(0.05, self.claim_idle_ms / 2000.0)
        while not self._stopping.is_set():
            await asyncio.sleep(interval)
            try:
                await self.claim_once()
            except TRANSIENT as e:
                log.warning("%s: claim failed (%s)", self.stream, e)
            except Exception:
                log.exception("%s: claim loop error", self.stream)

    async def claim_once(self) -> int:
        """Claim entries idle past claim_idle_ms from any consumer of the group; returns how many."""
        cursor = "0-0"
        total = 0
        while True:
            resp = await self.r.xautoclaim(
                self.stream, self.group, self.consumer, self.claim_idle_ms, start_id=cursor, count=self.count
            )
            cursor = _s(resp[0])
            entries = [(i, f) for i, f in resp[1] if f is not None]
            if entries:
                total += len(entries)
                self.stats.claimed += len(entries)
                log.info("%s: claimed %d idle entries for %s", self.stream, len(entries), self.consumer)
                await self._process(entries, redelivered=True)
            if cursor == "0-0":
                return total

    async def _heartbeat_loop(self) -> None:
        interval = max(0.05, self.claim_idle_ms / 3000.0)
        while True:
            await asyncio.sleep(interval)
            ids = list(self._deferred)
            if not ids:
                continue
            try:
                await self.r.xclaim(self.stream, self.group, self.consumer, 0, ids, justid=True)
            except TRANSIENT as e:
                log.warning("%s: heartbeat of %d in-flight entries failed (%s)", self.stream, len(ids), e)

    # -- processing --------------------------------------------------------------------------------------------
    async def _delivery_counts(self, ids: list[str]) -> dict[str, int]:
        if not ids:
            return {}
        rows = await self.r.xpending_range(
            self.stream, self.group, min=ids[0], max=ids[-1], count=len(ids) + 1000, consumername=self.consumer
        )
        return {_s(row["message_id"]): int(row["times_delivered"]) for row in rows}

    async def _dead_letter(self, entry_id: str, fields: dict[Any, Any] | None, reason: str) -> None:
        await dead_letter(
            self.r,
            stream=self.stream,
            group=self.group,
            consumer=self.consumer,
            entry_id=entry_id,
            fields=fields,
            reason=reason,
            now_ms=self.now_ms(),
            retention_ms=self.retention_ms,
        )
        await self.r.xack(self.stream, self.group, entry_id)
        self.stats.dead_lettered += 1
        log.warning("%s: entry %s dead-lettered: %s", self.stream, entry_id, reason)

    async def _process(self, entries: list[tuple[Any, Any]], *, redelivered: bool) -> None:
        counts: dict[str, int] = {}
        if redelivered:
            counts = await self._delivery_counts([_s(i) for i, _ in entries])
        batch: list[Delivery] = []
        gone: list[str] = []
        for raw_id, fields in entries:
            entry_id = _s(raw_id)
            if fields is None:  # trimmed away while pending
                gone.append(entry_id)
                continue
            n = counts.get(entry_id, 1)
            if entry_id in self._deferred:
                continue  # our own in-flight entry came back through the PEL: still being worked on
            if n > self.max_deliveries:
                await self._dead_letter(entry_id, fields, f"delivered {n} times (max {self.max_deliveries})")
                continue
            try:
                event = codec.decode(fields)
            except DecodeError as e:
                await self._dead_letter(entry_id, fields, str(e))
                continue
            if self.accepts is not None and not isinstance(event, self.accepts):
                expected = ", ".join(c.TYPE for c in self.accepts)
                await self._dead_letter(entry_id, fields, f"unexpected event type {event.TYPE!r} on {self.stream} "
                                                          f"(expected: {expected})")
                continue
            batch.append(Delivery(self.stream, entry_id, event, dict(fields), n))
        if gone:
            await self.ack(gone)
        if not batch:
            return
        self.stats.delivered += len(batch)
        try:
            await self.handler(batch)
        except TRANSIENT:
            raise
        except Exception:
            self.stats.handler_errors += 1
            if len(batch) == 1:
                log.exception("%s: handler failed on %s; left pending for retry", self.stream, batch[0].id)
                return
            log.exception("%s: handler failed on a batch of %d; retrying one by one", self.stream, len(batch))
            for d in batch:
                d.deferred = False
                try:
                    await self.handler([d])
                except TRANSIENT:
                    raise
                except Exception:
                    log.exception("%s: handler failed on %s; left pending for retry", self.stream, d.id)
                    continue
                await self._settle([d])
            return
        await self._settle(batch)

    async def _settle(self, batch: list[Delivery]) -> None:
        done = [d.id for d in batch if not d.deferred]
        self._deferred.update(d.id for d in batch if d.deferred)
        await self.ack(done)
