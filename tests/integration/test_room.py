"""The window closes on room as soon as a node has it: a worker that finishes sequences rewrites its status hash
(`worker.room_status_ms`), and a batcher holding requests re-reads its rack's statuses (`room_refresh_ms`),
instead of both waiting for their slow schedules (the heartbeat, the full view refresh)."""

from __future__ import annotations

import asyncio
import time

import pytest

from pipeline.events import ResultEvent
from streams import keys
from tests.integration import harness
from workers.roles.batcher import Batcher
from workers.roles.router import Router
from workers.roles.worker import Worker

pytestmark = pytest.mark.integration

# one node that runs ONE sequence at a time; heartbeats and full view refreshes 5 s / 60 s apart: without the room
# signal every request after the first waits for the next heartbeat (>= 5 s each, >= 45 s for the ten)
SLOW_SCHEDULES = {
    "cluster": {"racks": [{"name": "r0", "node_count": 1,
                           "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}}]},
    "policies": {
        "streams": {"claim_idle_ms": 1500},
        "worker": {"zero_time": True, "max_running": 1, "status_interval_ms": 5000, "lease_ttl_s": 30},
        "health": {"worker_heartbeat_timeout_ms": 0},
        "node_selection": {"refresh_ms": 60_000},
    },
}


@pytest.mark.timeout(120)
def test_a_full_node_takes_the_next_request_as_soon_as_it_has_room(clean_services, config_file):  # type: ignore[no-untyped-def]
    config = harness.small_config(config_file(SLOW_SCHEDULES))
    redis_url, etcd_url = clean_services.redis_url, clean_services.etcd_url
    items = harness.inputs(10, max_out=2)

    async def main() -> tuple[dict[str, ResultEvent], float]:
        stop = asyncio.Event()
        worker = Worker(config, "r0-n0", "sim", redis_url, etcd_url, grace_s=5.0)
        tasks = [asyncio.create_task(worker.run(stop))]
        for _ in range(600):  # the batcher's first (and, here, only) full refresh must see the node
            await asyncio.sleep(0.05)
            if worker.completed == 0 and await worker.r.exists(keys.node_status("r0-n0")):
                break
        tasks += [asyncio.create_task(role.run(stop)) for role in (Batcher(config, "r0", redis_url, etcd_url),
                                                                    Router(config, redis_url, etcd_url))]
        try:
            await asyncio.sleep(1.0)  # the roles join their groups
            t0 = time.monotonic()
            reqs = await harness.submit(config, redis_url, items)
            got, _counts = await harness.wait_results(redis_url, {q.request_id for q in reqs}, timeout_s=40)
            return got, time.monotonic() - t0
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)

    got, took = asyncio.run(main())
    assert len(got) == 10 and all(e.status == "ok" for e in got.values()), got
    # one at a time through one slot: with the room signal well under a second of control-plane hops each
    assert took < 30, f"10 requests through one slot took {took:.1f} s (the room signal did not reach the batcher)"


# the batcher's own poll of its rack's statuses 30 s apart: the second of ten requests through one slot would wait
# for it, and the ten could not finish inside 40 s; the worker's announcement on the rack's room channel
# (`keys.rack_room`) wakes the batcher at once instead
SLOW_POLL = {**SLOW_SCHEDULES, "policies": {**SLOW_SCHEDULES["policies"],
                                            "node_selection": {"refresh_ms": 60_000, "room_refresh_ms": 30_000}}}


@pytest.mark.timeout(120)
def test_the_workers_room_announcement_wakes_the_batcher_between_its_polls(clean_services, config_file):  # type: ignore[no-untyped-def]
    config = harness.small_config(config_file(SLOW_POLL))
    redis_url, etcd_url = clean_services.redis_url, clean_services.etcd_url
    items = harness.inputs(10, max_out=2)

    async def main() -> tuple[dict[str, ResultEvent], float, int]:
        stop = asyncio.Event()
        worker = Worker(config, "r0-n0", "sim", redis_url, etcd_url, grace_s=5.0)
        tasks = [asyncio.create_task(worker.run(stop))]
        for _ in range(600):
            await asyncio.sleep(0.05)
            if worker.completed == 0 and await worker.r.exists(keys.node_status("r0-n0")):
                break
        listener = worker.r.pubsub()  # what the worker announces, seen as a batcher sees it
        await listener.subscribe(keys.rack_room("r0"))
        tasks += [asyncio.create_task(role.run(stop)) for role in (Batcher(config, "r0", redis_url, etcd_url),
                                                                    Router(config, redis_url, etcd_url))]
        try:
            await asyncio.sleep(1.0)
            t0 = time.monotonic()
            reqs = await harness.submit(config, redis_url, items)
            got, _counts = await harness.wait_results(redis_url, {q.request_id for q in reqs}, timeout_s=40)
            took = time.monotonic() - t0
            heard = 0
            for _ in range(200):  # what arrived (None also for the subscription's own confirmation: read on)
                m = await listener.get_message(ignore_subscribe_messages=True, timeout=0.01)
                if m is not None:
                    assert m["data"] in (b"r0-n0", "r0-n0"), m
                    heard += 1
            await listener.aclose()
            return got, took, heard
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)

    got, took, heard = asyncio.run(main())
    assert len(got) == 10 and all(e.status == "ok" for e in got.values()), f"{len(got)} of 10 in 40 s"
    assert heard >= 1, "the worker announced no room on its rack's channel"
    # polled alone, the nine after the first waited 30 s for the batcher's next read of the node's status
    assert took < 30, f"10 requests through one slot took {took:.1f} s: the batcher waited for its poll"
