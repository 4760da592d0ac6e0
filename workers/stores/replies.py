"""One reader per gateway: every open request's tokens and result, multiplexed over one Valkey connection.

A gateway process owns a reply stream `rf:gw:{ID}:out` (streams/keys.py). The requests it admits name it in
`reply_to`, and the writers (workers/stores/results.py) append each token chunk and final result there as well as
to the request's own stream `rf:out:{id}`. `ReplyMux` runs ONE blocking XREAD on the reply stream and hands each
event to the in-process queue of its request, so that 10,000 open streams cost one connection, not 10,000 (the
previous design: a blocking XREAD per request, each holding a pooled connection).

The per-request stream stays the durable copy and the fallback: nothing is lost if the fast path misses an event.
- A queue is bounded (`gateway.reply_queue_events`). When a slow client lets it fill, further events for it are
  dropped from memory and the request is marked lagging; its reader then catches up from `rf:out:{id}` (tokens
  are skipped by index, so nothing repeats). Memory per open request is bounded by the queue, whatever the client.
- A gap in the token indexes, or a result whose token count is ahead of what arrived, is caught up the same way.
- A sweep (every `gateway.reply_sweep_ms`) reads, in one MGET, the final-result markers of the requests that have
  been quiet since the last sweep: a request whose result was written but never reached the reply stream (a writer
  that predates `reply_to`, a reply stream lost in a Valkey restart without persistence) is caught up from its own
  stream. A request counts as missed only when two sweeps in a row found its result written while nothing came
  for it, and never while the reader is behind (its last read was full): under a burst the result marker is set
  before the reader reaches the result's entry, and catching up thousands of requests at once would only contend
  for the pool.
- Catch-ups run at most `CATCH_UP_CONCURRENCY` at a time, and one that cannot get a connection (the pool is busy,
  Valkey restarts) is retried with backoff until the request's deadline rather than failing the stream.
- The reply stream expires (`gateway.reply_ttl_s`) unless its gateway refreshes it: a stopped gateway's stream goes
  away, and writers never re-create it (NOMKSTREAM). A crashed gateway loses no accepted request: its results stay
  readable by id (`GET /v1/results/{id}`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.backoff import ExponentialBackoff, Retrying
from pipeline.events import ResultEvent, TokenEvent
from pipeline.stats import stream_id_key
from streams import codec, keys
from streams.errors import DecodeError

log = logging.getLogger(__name__)

READ_COUNT = 2048
"""Entries per XREAD: one read drains a burst of every open request's tokens."""
BLOCK_MS = 1000
_HELLO = {b"gw": b"1"}
"""The entry that creates the reply stream (it is not an event; the reader skips it)."""
_BACKOFF = ExponentialBackoff(base=0.05, cap=2.0)
CATCH_UP_CONCURRENCY = 8
"""Catch-ups (XRANGE of a request's own stream) in flight at once: the rest wait, so admissions keep the pool."""

Output = TokenEvent | ResultEvent


@dataclass(slots=True)
class _Waiter:
    """One open request: its bounded queue of events from the reply stream."""

    queue: asyncio.Queue[Output | None]
    created: float
    quiet: bool = True
    """Nothing arrived since the last sweep (only quiet requests are checked for a missed result)."""
    lagging: bool = False
    """Events were dropped (full queue) or a missed result was found: catch up from the request's own stream."""
    dropped: int = 0
    marked: bool = False
    """The last sweep found its result written while nothing came for it (the next one confirms it missed)."""


@dataclass
class ReplyStats:
    """What the mux did since it started (reported by `/metrics` and `bench streams-capacity`)."""

    events: int = 0
    unknown: int = 0
    """Events for a request no longer open here (its client went away, or it timed out)."""
    dropped: int = 0
    """Events not queued because their request's queue was full (the request caught up from its stream)."""
    catch_ups: int = 0
    swept_missed: int = 0
    """Requests whose result the sweep found written but never delivered on the reply stream."""
    read_errors: int = 0
    catch_up_retries: int = 0
    """Catch-ups retried because no connection was to be had at once (a busy pool, a Valkey restart)."""
    reads: int = 0
    queue_max: int = field(default=0)


class ReplyMux:
    """The reply stream of one gateway process and its single reader (`start()` before the first request)."""

    def __init__(self, r: aioredis.Redis, queue_events: int = 256, sweep_ms: int = 1000, ttl_s: int = 120,
                 max_open_s: float = 3600.0, gateway_id: str | None = None) -> None:
        """`max_open_s`: a subscription nobody reads (its HTTP response never started) is dropped after this."""
        self.r = r
        self.max_open_s = max_open_s
        self.gateway_id = gateway_id or uuid.uuid4().hex[:16]
        self.key = keys.gateway_replies(self.gateway_id)
        self.queue_events = queue_events
        self.sweep_s = sweep_ms / 1000.0
        self.ttl_s = ttl_s
        self.stats = ReplyStats()
        self._waiters: dict[str, _Waiter] = {}
        self._last = "0-0"
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._behind = False
        """The reader's last read was full: more is waiting on the reply stream (no result counts as missed)."""
        self._catching = asyncio.Semaphore(CATCH_UP_CONCURRENCY)
        self.ready = False
        """The reply stream exists and its reader runs: requests may name it in `reply_to`."""

    # -- lifecycle -----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the reader (it creates the reply stream as soon as Valkey answers: a gateway starts without it,
        and until then `ready` is False and requests are read from their own streams)."""
        self._tasks = [asyncio.create_task(self._read_loop(), name="reply-reader"),
                       asyncio.create_task(self._sweep_loop(), name="reply-sweep")]

    async def close(self) -> None:
        self._closing = True
        pending = set(self._tasks)
        while pending:
            # a cancel can be lost in redis-py's connection handling (a blocking read that ends as the cancel
            # lands): the loops also stop on `_closing`, and a task still running is cancelled again
            for t in pending:
                t.cancel()
            _done, pending = await asyncio.wait(pending, timeout=1.0)
        self._tasks = []
        try:  # nothing reads it any more (results stay in rf:out:{id}): let it go soon
            await self.r.expire(self.key, 5)
        except RedisError as e:
            log.info("reply stream %s left to expire in %d s (%s)", self.key, self.ttl_s, e)

    async def _create(self) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.xadd(self.key, _HELLO, minid=f"{int(time.time() * 1000) - keys.GATEWAY_REPLIES_KEEP_MS}-0",  # type: ignore[arg-type]
                  approximate=True)
        pipe.expire(self.key, self.ttl_s)
        await pipe.execute()

    @property
    def open_requests(self) -> int:
        return len(self._waiters)

    def queued_events(self) -> int:
        return sum(w.queue.qsize() for w in self._waiters.values())

    # -- requests ------------------------------------------------------------------------------------------------
    def subscribe(self, request_id: str) -> None:
        """Open `request_id` here BEFORE it is admitted (nothing written for it can then be missed)."""
        self._waiters[request_id] = _Waiter(asyncio.Queue(self.queue_events), time.monotonic())

    def unsubscribe(self, request_id: str) -> None:
        self._waiters.pop(request_id, None)

    def subscribed(self, request_id: str) -> bool:
        return request_id in self._waiters

    async def outputs(self, request_id: str, timeout_s: float) -> AsyncGenerator[Output, None]:
        """Token chunks of a subscribed request as they arrive (each token once, in order), then its ResultEvent;
        TimeoutError when no result arrives within `timeout_s`. Unsubscribes when it ends or is closed."""
        w = self._waiters.get(request_id)
        if w is None:
            raise KeyError(f"request {request_id} is not subscribed on {self.key}")
        deadline = time.monotonic() + timeout_s
        next_index = 0
        try:
            while True:
                if w.lagging:
                    w.lagging = False
                    self.stats.catch_ups += 1
                    for ev in await self._catch_up_until(request_id, next_index, deadline):
                        if isinstance(ev, ResultEvent):
                            yield ev
                            return
                        next_index = ev.index + len(ev.token_ids)
                        yield ev
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no final result for request {request_id} in time")
                try:
                    ev = await asyncio.wait_for(w.queue.get(), remaining)
                except TimeoutError:
                    raise TimeoutError(f"no final result for request {request_id} in time") from None
                if ev is None:  # a wake-up: `lagging` was set
                    continue
                if isinstance(ev, ResultEvent):
                    if ev.out_tokens > next_index and not w.lagging:
                        # tokens of it went missing on the way (a dropped event): the request's stream has them all
                        w.lagging = True
                        continue
                    yield ev
                    return
                if ev.index > next_index:  # a gap: some chunk was dropped; the request's stream has it
                    w.lagging = True
                    continue
                out = _from(ev, next_index)
                if out is None:
                    continue
                next_index = out.index + len(out.token_ids)
                yield out
        finally:
            self.unsubscribe(request_id)

    async def _catch_up_until(self, request_id: str, next_index: int, deadline: float) -> list[Output]:
        """`_catch_up`, at most CATCH_UP_CONCURRENCY at once, retried on a connection failure until `deadline`."""
        retry = Retrying(_BACKOFF)
        while True:
            try:
                async with self._catching:
                    return await self._catch_up(request_id, next_index)
            except (RedisConnectionError, RedisTimeoutError, OSError):
                delay = retry.next_delay()
                if time.monotonic() + delay >= deadline:
                    raise
                self.stats.catch_up_retries += 1
                await asyncio.sleep(delay)

    async def _catch_up(self, request_id: str, next_index: int) -> list[Output]:
        """Everything of the request's own stream from token `next_index` on (its result last, if written)."""
        out: list[Output] = []
        for eid, fields in await self.r.xrange(keys.request_out(request_id)):
            try:
                ev = codec.decode(fields)
            except DecodeError as e:
                log.warning("request %s: undecodable output entry %s: %s", request_id, eid, e)
                continue
            if isinstance(ev, ResultEvent):
                out.append(ev)
                break
            if isinstance(ev, TokenEvent) and (tok := _from(ev, next_index)) is not None:
                next_index = tok.index + len(tok.token_ids)
                out.append(tok)
        return out

    # -- the reader ----------------------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        retry = Retrying(_BACKOFF)
        failed = False
        while not self._closing:
            try:
                if not self.ready:
                    await self._create()
                    self.ready = True
                    log.info("reply stream %s: one reader for every open request", self.key)
                elif failed:
                    await self._after_outage()
                failed = False
                resp = await self.r.xread({self.key: self._last}, count=READ_COUNT, block=BLOCK_MS)
                retry.reset()
            except asyncio.CancelledError:
                raise
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                failed = True
                self.stats.read_errors += 1
                delay = retry.next_delay()
                log.warning("reply stream %s: read failed (%s); retrying in %.2f s", self.key, e, delay)
                await asyncio.sleep(delay)
                continue
            except RedisError as e:
                failed = True
                self.stats.read_errors += 1
                delay = retry.next_delay()
                log.error("reply stream %s: read refused (%s); retrying in %.2f s", self.key, e, delay)
                await asyncio.sleep(delay)
                continue
            self.stats.reads += 1
            self._behind = sum(len(entries) for _key, entries in resp or []) >= READ_COUNT
            for _key, entries in resp or []:
                for eid, fields in entries:
                    self._last = eid.decode() if isinstance(eid, bytes) else eid
                    self._dispatch(fields)

    def _dispatch(self, fields: dict[bytes, bytes]) -> None:
        if b"t" not in fields:  # the stream's creation entry
            return
        try:
            ev = codec.decode(fields)
        except DecodeError as e:
            log.warning("reply stream %s: undecodable entry %s: %s", self.key, self._last, e)
            return
        if not isinstance(ev, TokenEvent | ResultEvent):
            return
        self.stats.events += 1
        w = self._waiters.get(ev.request_id)
        if w is None:
            self.stats.unknown += 1
            return
        w.quiet = False
        w.marked = False
        try:
            w.queue.put_nowait(ev)
        except asyncio.QueueFull:
            # a slow client: never grow its queue; it catches up from its own stream when it reads again
            w.lagging = True
            w.dropped += 1
            self.stats.dropped += 1
            return
        self.stats.queue_max = max(self.stats.queue_max, w.queue.qsize())

    async def _after_outage(self) -> None:
        """After a failed read: the reply stream may be gone (a Valkey restart without its data) and its ids may
        have started over. Re-create it, read from its start if its ids went backwards, and let every open request
        catch up from its own stream (events written while it was missing were not kept)."""
        try:
            info = await self.r.xinfo_stream(self.key)
            last = info.get("last-generated-id") or info.get(b"last-generated-id") or "0-0"
            last = last.decode() if isinstance(last, bytes) else str(last)
            if stream_id_key(last) < stream_id_key(self._last):
                self._last = "0-0"
                self._wake_all()
        except aioredis.ResponseError:  # no such key
            await self._create()
            self._last = "0-0"
            self._wake_all()

    def _wake_all(self) -> None:
        for w in self._waiters.values():
            w.lagging = True
            _wake(w)

    # -- the sweep -----------------------------------------------------------------------------------------------
    async def _sweep_loop(self) -> None:
        refresh_every = max(1.0, self.ttl_s / 4)
        refreshed = time.monotonic()
        while not self._closing:
            await asyncio.sleep(self.sweep_s)
            try:
                if time.monotonic() - refreshed >= refresh_every:
                    if not await self.r.expire(self.key, self.ttl_s):
                        await self._create()
                    refreshed = time.monotonic()
                await self._sweep()
            except asyncio.CancelledError:
                raise
            except RedisError as e:
                log.warning("reply stream %s: sweep failed (%s); next in %.1f s", self.key, e, self.sweep_s)

    async def _sweep(self) -> None:
        now = time.monotonic()
        for rid in [rid for rid, w in self._waiters.items() if now - w.created > self.max_open_s]:
            self.unsubscribe(rid)
        quiet = []
        behind = self._behind
        for rid, w in self._waiters.items():
            if behind:
                w.marked = False  # what the reader has not reached yet cannot be told from what never came
            elif w.quiet and not w.lagging:
                quiet.append(rid)
            w.quiet = True
        for i in range(0, len(quiet), 2000):  # every marker hashes to {rf:results}: one MGET, also on a cluster
            chunk = quiet[i:i + 2000]
            values = await self.r.mget([keys.result_done(rid) for rid in chunk])
            for rid, v in zip(chunk, values, strict=True):
                w = self._waiters.get(rid)
                if v is None or w is None or not w.quiet or self._behind:
                    continue
                if not w.marked:
                    w.marked = True  # written, nothing came yet: missed if the next sweep finds it so again
                    continue
                self.stats.swept_missed += 1
                w.marked = False
                w.lagging = True
                _wake(w)


def _wake(w: _Waiter) -> None:
    try:
        w.queue.put_nowait(None)
    except asyncio.QueueFull:
        pass  # a full queue wakes its reader anyway


def _from(ev: TokenEvent, next_index: int) -> TokenEvent | None:
    """`ev` without the tokens before `next_index` (a retried or moved sequence may resend some), None when it has
    nothing new."""
    if ev.index + len(ev.token_ids) <= next_index:
        return None
    if ev.index < next_index:
        cut = next_index - ev.index
        return TokenEvent(ev.request_id, ev.version, next_index, ev.token_ids[cut:], ev.texts[cut:], ev.ts_ms,
                          ev.node, ev.reply_to)
    return ev

