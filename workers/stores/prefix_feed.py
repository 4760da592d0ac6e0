"""The precise prefix index of a batcher or a router, kept from the nodes' block events.

Workers publish what their engines' prefix caches store and evict (BlockEvent) on `rf:rack:{R}:blocks`. A PrefixFeed
reads those streams from their start (so a process that restarts rebuilds its index from the history the streams
keep) and applies each event to a `BlockIndex` (pipeline/routing/prefix_index.py), the object the node policies and
the rack choice query. A batcher also takes the events it applied since its last window close, so that the close's
replay record carries them and replay rebuilds the same index. A malformed entry goes to the dead-letter stream with
its reason (once, whichever reader sees it first: every batcher and router reads these streams) and is skipped; it
only costs placement quality, never an answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from pipeline.events import BlockEvent
from pipeline.routing.prefix_index import BlockIndex, apply_block_event
from streams import codec, keys
from streams.errors import DecodeError
from streams.runner import dead_letter
from workers.shell.runtime import WALL

log = logging.getLogger(__name__)

DEAD_LETTER_ONCE_S = 86_400
"""How long the marker that a block entry was dead-lettered (by one of its readers) is kept."""
IDLE_BLOCK_MS = 1000
"""How long an idle feed's blocking read waits before it reads again (a stop is seen within this)."""
BLOCK_STREAM_MAXLEN = 200_000
"""Entries kept per rack's block stream (approximate trim): the history a restarted reader rebuilds from."""


class PrefixFeed:
    def __init__(self, r: aioredis.Redis, racks: Sequence[str], index: BlockIndex | None = None,
                 keep_log: bool = False, actor: str = "prefix-feed", retention_ms: int = 86_400_000) -> None:
        self.r = r
        self.actor = actor
        self.retention_ms = retention_ms
        self.dead_lettered = 0
        self.index = index if index is not None else BlockIndex()
        self.racks = tuple(racks)
        self._last = {keys.rack_blocks(rack): "0-0" for rack in self.racks}
        self.keep_log = keep_log
        self._log: list[BlockEvent] = []
        self.applied = 0

    def take_log(self) -> list[BlockEvent]:
        out, self._log = self._log, []
        return out

    async def poll(self, count: int = 1000) -> int:
        """Read and apply what is new; returns how many events were applied. One read per rack's stream (they live
        in other hash slots of a Valkey Cluster)."""
        resp = []
        for key, last in self._last.items():
            got = await self.r.xread({key: last}, count=count)
            resp.extend(got or [])
        return await self._apply(resp)

    async def wait_new(self, block_ms: int, count: int = 1000) -> int:
        """Block until a block event arrives on any of the streams (at most `block_ms`), and apply what came; returns
        how many were applied. One XREAD BLOCK over every stream on a single server. A cluster client cannot block
        on keys of several slots in one call: with more than one stream it reads each once, without blocking."""
        if len(self._last) > 1 and isinstance(self.r, RedisCluster):
            return await self.poll(count)
        got = await self.r.xread(dict(self._last), count=count, block=block_ms)
        return await self._apply(got or [])

    async def _apply(self, resp: list[Any]) -> int:
        n = 0
        for stream, entries in resp:
            name = stream.decode() if isinstance(stream, bytes) else stream
            for eid, fields in entries:
                self._last[name] = eid.decode() if isinstance(eid, bytes) else eid
                try:
                    ev = codec.decode(fields)
                except DecodeError as e:
                    await self._dead_letter(name, self._last[name], fields, str(e))
                    continue
                if not isinstance(ev, BlockEvent):
                    await self._dead_letter(name, self._last[name], fields,
                                            f"unexpected event type {ev.TYPE!r} on {name} (expected blocks)")
                    continue
                apply_block_event(self.index, ev)
                if self.keep_log:
                    self._log.append(ev)
                n += 1
        self.applied += n
        return n

    async def _dead_letter(self, stream: str, entry_id: str, fields: dict[Any, Any], reason: str) -> None:
        log.warning("%s %s: block event skipped: %s", stream, entry_id, reason)
        if await self.r.set(f"rf:dlq:once:{stream}:{entry_id}", "1", nx=True, ex=DEAD_LETTER_ONCE_S):
            await dead_letter(self.r, stream=stream, group="prefix-feed", consumer=self.actor, entry_id=entry_id,
                              fields=fields, reason=reason, now_ms=WALL.now_ms(), retention_ms=self.retention_ms)
            self.dead_lettered += 1

    async def run(self, stop: asyncio.Event) -> None:
        """Apply the streams' events as they come: a blocking read while nothing is new (an idle feed wakes every
        `IDLE_BLOCK_MS`, not 20 times a second), straight reads while they keep coming. On a cluster client with
        several streams, where a read cannot block on all of them, the pause between empty reads doubles from 50 ms
        up to `IDLE_BLOCK_MS`."""
        pause = 0.0  # 0: events are flowing, read again at once
        while not stop.is_set():
            try:
                blocking = len(self._last) == 1 or not isinstance(self.r, RedisCluster)
                got = await (self.wait_new(IDLE_BLOCK_MS) if pause and blocking else self.poll())
                if got:
                    pause = 0.0
                    continue
                if blocking:  # nothing new: the next read blocks until something is
                    pause = 0.05
                    continue
                pause = min(IDLE_BLOCK_MS / 1000.0, max(0.05, pause * 2))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a Valkey outage: the index keeps what it has and catches up after
                log.warning("prefix feed: %s", e)
                pause = 0.5
            try:
                await asyncio.wait_for(stop.wait(), timeout=pause)
            except TimeoutError:
                pass
