"""A worker started again after a kill -9 (a supervisor's restart) tells its rack's batchers that every batch entry
delivered before it started is settled: the entries went to the earlier incarnation, and then to the failover drain.

Before this, a restarted worker reported `last_batch_entry` "" in its status, the batchers' reservation ledger kept
every batch dispatched to the dead incarnation after its last status as in flight, forever (their requests counted
as waiting, their memory as taken), and the batcher never dispatched to the node again: a 20-minute soak lost a
quarter of its capacity at the first worker kill."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from pipeline.batching.ledger import ReservationLedger
from pipeline.events import BatchEvent, HealthEvent
from pipeline.profiling import ProfileInput, profile_request
from streams import codec, keys
from streams.runner import StreamProducer, connect, ensure_group
from tests.integration import harness
from tests.unit.builders import node_view
from workers.local.launcher import ClusterProcesses
from workers.shell.runtime import WALL

pytestmark = pytest.mark.integration

NODE = "r0-n0"


async def _delivered_to_a_dead_incarnation(config, url: str, n: int) -> list[str]:  # type: ignore[no-untyped-def]
    """n batch entries for NODE, read by a consumer that then dies, and acknowledged by the failover drain."""
    r = connect(url)
    try:
        stream = keys.node_batches(NODE)
        await ensure_group(r, stream, keys.GROUP_WORKER)
        model = config.models["qwen2-7b"]
        producer = StreamProducer(r, WALL.now_ms, 3_600_000)
        items = []
        for _ in range(n):
            req = profile_request(ProfileInput(str(uuid.uuid4()), "t", "u", "qwen2-7b", WALL.now_ms(),
                                               prompt_tokens=100, max_tokens=8), model, config.policies.profiling)
            items.append((stream, BatchEvent(batch_id=str(uuid.uuid4()), rack="r0", node=NODE, requests=(req,),
                                             mem_est_kb=req.mem_est_kb, mem_budget_kb=config.node_mem_budget_kb(NODE),
                                             window_open_ms=WALL.now_ms(), created_ms=WALL.now_ms())))
        await producer.add_many(items)
        got = await r.xreadgroup(keys.GROUP_WORKER, "worker-r0-n0@gone:1", {stream: ">"}, count=n)
        ids = [eid.decode() for _s, entries in got for eid, _f in entries]
        await r.xack(stream, keys.GROUP_WORKER, *ids)
        return ids
    finally:
        await r.aclose()


async def _worker_status(url: str) -> HealthEvent | None:
    r = connect(url)
    try:
        fields = await r.hgetall(keys.node_status(NODE))
    finally:
        await r.aclose()
    if not fields:
        return None
    ev = codec.decode(fields)
    return ev if isinstance(ev, HealthEvent) and ev.source == "worker" else None


def test_a_restarted_worker_settles_what_its_earlier_incarnation_was_sent(  # type: ignore[no-untyped-def]
        clean_services, config_file, tmp_path) -> None:
    path = config_file(harness.SMALL_CLUSTER)
    config = harness.small_config(path)
    url = clean_services.redis_url
    ids = asyncio.run(_delivered_to_a_dead_incarnation(config, url, 3))
    assert len(ids) == 3
    # the rack's batcher dispatched those three and holds them as reservations until the node reports them admitted
    ledger = ReservationLedger()
    for eid in ids:
        ledger.record(NODE, eid, 1000.0, 1, 100)
    procs = ClusterProcesses(config, url, clean_services.etcd_url, tmp_path / "logs", ["--config", str(path)],
                             log_level="INFO")
    procs.start_worker(NODE)
    try:
        deadline = time.monotonic() + 60
        status = None
        while status is None:
            assert time.monotonic() < deadline, "the worker published no status"
            time.sleep(0.2)
            status = asyncio.run(_worker_status(url))
    finally:
        procs.stop()
    assert status.last_batch_entry == ids[-1]
    view = node_view(NODE)
    assert ledger.apply(view, status.last_batch_entry) == view, "the earlier incarnation's batches stay reserved"
    assert ledger.reserved_kb(NODE) == 0.0
