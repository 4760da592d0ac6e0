"""The prefix feed (workers/stores/prefix_feed.py) on real Valkey: idle, it blocks on the racks' block streams instead
of polling (one XREAD BLOCK over every stream); an event written while it blocks is applied, and a stop ends it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from pipeline.events import BlockEvent
from streams import codec, keys
from streams.runner import connect
from workers.local.services import ServiceEndpoints
from workers.stores.prefix_feed import IDLE_BLOCK_MS, PrefixFeed

pytestmark = pytest.mark.integration


def test_an_idle_feed_blocks_and_applies_what_arrives(clean_services: ServiceEndpoints) -> None:
    async def go() -> tuple[int, int, dict[str, int]]:
        r = connect(clean_services.redis_url)
        feed = PrefixFeed(r, ["r0", "r1"])
        reads = 0
        real = r.xread

        async def counted(*a: Any, **k: Any) -> Any:
            nonlocal reads
            reads += 1
            return await real(*a, **k)

        r.xread = counted  # type: ignore[method-assign]
        stop = asyncio.Event()
        task = asyncio.create_task(feed.run(stop))
        try:
            # idle for 2 s: a poll every 50 ms would read 2 streams 40 times; a blocking read returns at most once a
            # block (IDLE_BLOCK_MS), however slow the machine (a slower one reads less, never more)
            t0 = time.monotonic()
            before = reads
            await asyncio.sleep(2.0)
            idle_reads = reads - before
            window = time.monotonic() - t0
            ev = BlockEvent(node="r1-n0", rack="r1", ts_ms=1.0, stored=(11, 22))
            await r.xadd(keys.rack_blocks("r1"), codec.encode(ev))  # type: ignore[arg-type]
            deadline = time.monotonic() + 30.0
            while not feed.index.matches([11, 22]) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            stop.set()
            await asyncio.wait_for(task, timeout=IDLE_BLOCK_MS / 1000.0 + 10.0)
            return idle_reads, int(window * 1000 / IDLE_BLOCK_MS) + 3, feed.index.matches([11, 22])
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await r.aclose()

    idle_reads, bound, matched = asyncio.run(go())
    assert idle_reads <= bound, f"{idle_reads} reads while idle (bound {bound}): the feed polls"
    assert matched == {"r1-n0": 2}
