"""kill -9 a worker in the middle of its batches: another consumer of the node's stream claims its pending
entries (XAUTOCLAIM after claim_idle_ms) and finishes them; every request gets exactly one final result."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import pytest
import redis.asyncio as aioredis

from pipeline.events import BatchEvent
from pipeline.profiling import ProfileInput, profile_request
from streams import keys
from streams.runner import StreamProducer, connect
from tests.integration import harness
from workers.local.launcher import ClusterProcesses
from workers.shell.runtime import WALL

pytestmark = pytest.mark.integration

NODE = "r0-n0"


async def _put_batches(config, url: str, n_batches: int, per_batch: int) -> set[str]:  # type: ignore[no-untyped-def]
    r = connect(url)
    producer = StreamProducer(r, WALL.now_ms, 3_600_000)
    model = config.models["qwen2-7b"]
    ids: set[str] = set()
    items = []
    for _ in range(n_batches):
        reqs = tuple(
            profile_request(ProfileInput(str(uuid.uuid4()), "t", "u", "qwen2-7b", WALL.now_ms(), prompt_tokens=500,
                                         max_tokens=120), model, config.policies.profiling)
            for _ in range(per_batch)
        )
        ids.update(q.request_id for q in reqs)
        items.append((keys.node_batches(NODE), BatchEvent(
            batch_id=str(uuid.uuid4()), rack="r0", node=NODE, requests=reqs,
            mem_est_kb=sum(q.mem_est_kb for q in reqs), mem_budget_kb=config.node_mem_budget_kb(NODE),
            window_open_ms=WALL.now_ms(), created_ms=WALL.now_ms(),
        )))
    await producer.add_many(items)
    await r.aclose()
    return ids


async def _consumers(url: str) -> int:
    r = connect(url)
    try:
        return len(await r.xinfo_consumers(keys.node_batches(NODE), keys.GROUP_WORKER))
    except aioredis.ResponseError:
        return 0
    finally:
        await r.aclose()


async def _pending_of(url: str, consumer_prefix: str) -> int:
    r = connect(url)
    try:
        info = await r.xinfo_consumers(keys.node_batches(NODE), keys.GROUP_WORKER)
    except aioredis.ResponseError:
        info = []
    finally:
        await r.aclose()
    return sum(int(c["pending"]) for c in info if c["name"].decode().endswith(consumer_prefix))


def test_sigkill_worker_mid_batch_loses_nothing(clean_services, config_file, tmp_path):  # type: ignore[no-untyped-def]
    path = config_file(harness.SMALL_CLUSTER)
    config = harness.small_config(path)
    url = clean_services.redis_url
    procs = ClusterProcesses(config, url, clean_services.etcd_url, tmp_path / "logs", ["--config", str(path)],
                             log_level="INFO")
    victim = procs.start_worker(NODE)
    survivor = procs.start_worker(NODE)
    try:
        # both consumers must be in the group before the batches arrive, so both get some
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if asyncio.run(_consumers(url)) == 2:
                break
            time.sleep(0.2)
        ids = asyncio.run(_put_batches(config, url, n_batches=12, per_batch=4))
        vsuffix = f":{victim.proc.pid}"
        deadline = time.monotonic() + 20
        while asyncio.run(_pending_of(url, vsuffix)) == 0:
            assert time.monotonic() < deadline, "the victim never took a batch"
            time.sleep(0.05)
        held = asyncio.run(_pending_of(url, vsuffix))
        victim.proc.kill()  # SIGKILL: no drain, no ack, no lease revoke
        victim.proc.wait()
        got, counts = asyncio.run(harness.wait_results(url, ids, timeout_s=120))
        assert survivor.proc.poll() is None
    finally:
        procs.stop()
    assert held > 0
    assert ids <= set(got), f"{len(ids - set(got))} requests lost"
    assert all(counts[i] == 1 for i in ids), "a request got two final results"
    assert all(got[i].status == "ok" for i in ids)
    assert asyncio.run(_pending_of(url, vsuffix)) == 0, "the dead consumer still holds entries"
    log = survivor.log_path.read_text()
    assert "claimed" in log, "the survivor never claimed the victim's entries"
    assert os.path.exists(survivor.log_path)
