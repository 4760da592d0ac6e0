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
