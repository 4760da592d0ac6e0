"""Failover under a steady load through the live pipeline (real processes, real Valkey and etcd, sim engines):
kill -9 a GPU worker mid-generation, inject an Xid fault, kill the router, kill a Celery worker during migrations,
restart etcd. Every accepted request ends with exactly one final result, its client stream (as the gateway reads
it) has every token exactly once and in order, and no request ends in an error."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from pipeline.config import RackflowConfig
from pipeline.events import ResultEvent, TokenEvent
from pipeline.profiling import ProfileInput
from tests.integration import harness
from workers.local.launcher import ClusterProcesses, RoleProcess, wait_cluster_ready
from workers.shell.runtime import WALL
from workers.stores.ingress import Gateway

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

FAILOVER_CLUSTER = {
    "cluster": {"racks": [
        {"name": "r0", "node_count": 3, "node": {"gpu": "a100-80gb", "tp": 1, "models": ["qwen2-7b"]}},
        {"name": "r1", "node_count": 2, "node": {"gpu": "a100-80gb", "tp": 1, "models": ["qwen2-7b"]}},
    ]},
    "policies": {
        "streams": {"claim_idle_ms": 2000},
        "worker": {"token_flush_ms": 20},
        "node_selection": {"policy": "least_outstanding", "stale_ms": 2000},
    },
}


@dataclass
class Cluster:
    config: RackflowConfig
    procs: ClusterProcesses
    redis_url: str
    etcd_url: str
    path: Path

    def proc(self, name: str) -> RoleProcess:
        return next(p for p in self.procs.procs if p.name == name and p.proc.poll() is None)


@pytest.fixture
def cluster(clean_services, config_file, tmp_path) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    override = json.loads(json.dumps(FAILOVER_CLUSTER))
    override["policies"]["kv"] = {"l1_dir": str(tmp_path / "l1")}
    path = config_file(override)
    config = harness.small_config(path)
    procs = ClusterProcesses(config, clean_services.redis_url, clean_services.etcd_url, tmp_path / "logs",
                             ["--config", str(path)], log_level="INFO", with_failover=True)
    procs.start()
    try:
        asyncio.run(wait_cluster_ready(config, clean_services.redis_url, clean_services.etcd_url, 120))
        yield Cluster(config, procs, clean_services.redis_url, clean_services.etcd_url, path)
    finally:
        procs.stop()


def _load(n: int, user_rack: str | None = None, seed: int = 1) -> list[ProfileInput]:
    from pipeline.routing.hashring import HashRing

    rng = random.Random(seed)
    ring = HashRing(["r0", "r1"], 160)
    users = [f"user-{i}" for i in range(2000) if user_rack is None or ring.primary(f"user-{i}") == user_rack]
    return [ProfileInput(str(uuid.uuid4()), "t1", rng.choice(users[:40]), "qwen2-7b", WALL.now_ms(),
                         prompt_tokens=rng.randint(100, 1500), max_tokens=rng.randint(60, 160)) for _ in range(n)]


async def _submit_spread(c: Cluster, items: list[ProfileInput], seconds: float) -> list[str]:
    r = aioredis.Redis.from_url(c.redis_url)
    gw = Gateway(c.config, r)
    ids = []
    try:
        step = seconds / max(1, len(items))
        for it in items:
            req = await gw.submit(it)
            ids.append(req.request_id)
            await asyncio.sleep(step)
    finally:
        await r.aclose()
    return ids


async def _client_view(c: Cluster, rid: str) -> tuple[list[TokenEvent], ResultEvent | None]:
    """What an HTTP client streams: the gateway's reader (tokens deduplicated by index, up to the result)."""
    r = aioredis.Redis.from_url(c.redis_url)
    gw = Gateway(c.config, r)
    toks: list[TokenEvent] = []
    final = None
    try:
        async for ev in gw.outputs(rid, timeout_s=5):
            if isinstance(ev, TokenEvent):
                toks.append(ev)
            else:
                final = ev
    except TimeoutError:
        pass
    finally:
        await r.aclose()
    return toks, final


def _check_all(c: Cluster, ids: list[str], timeout_s: float = 180) -> dict[str, ResultEvent]:
    got, counts = asyncio.run(harness.wait_results(c.redis_url, set(ids), timeout_s=timeout_s))
    missing = set(ids) - set(got)
    assert not missing, f"{len(missing)} requests lost, e.g. {sorted(missing)[:3]}"
    assert all(counts[i] == 1 for i in ids), "a request got two final results"
    errors = [(i, got[i].error) for i in ids if got[i].status != "ok"]
    assert not errors, f"client-visible errors: {errors[:3]}"
    for rid in ids:
        toks, final = asyncio.run(_client_view(c, rid))
        assert final is not None and final.request_id == rid
        indices = [t.index + k for t in toks for k in range(len(t.token_ids))]
        assert indices == list(range(len(indices))), f"{rid}: token indices {indices[:10]}... not 0..n-1 once"
        assert len(indices) == final.out_tokens, f"{rid}: {len(indices)} tokens streamed, {final.out_tokens} in result"
        assert "".join(t.text for t in toks) == final.text
    return got


async def _inject(c: Cluster, node: str, kind: str) -> None:
    """What `rackflow fault inject` does (its CLI is tested in test_agent), without a process start's delay. Through
    the roles' own client (`connect`: timeouts retried with backoff, as `rackflow fault` does): two vLLM workers
    decoding on 2 cores can keep Valkey from answering one read in time (a clean-clone CI run timed out here),
    and injecting a fault twice is injecting it once."""
    from streams.runner import connect
    from workers.health import faults

    r = connect(c.redis_url)
    try:
        await faults.inject(r, node, kind, now_ms=WALL.now_ms())
    finally:
        await r.aclose()


def _migrations(c: Cluster) -> int:
    return sum(p.log_path.read_text().count(" resumed at v") for p in c.procs.procs if p.role == "worker")


def test_sigkill_worker_mid_generation(cluster: Cluster) -> None:
    items = _load(60, "r0")
    ids: list[str] = []

    async def run() -> None:
        task = asyncio.create_task(_submit_spread(cluster, items, 6.0))
        await asyncio.sleep(3.0)  # sequences are mid-generation on every node of r0
        victim = cluster.proc("worker-r0-n0")
        os.kill(victim.proc.pid, signal.SIGKILL)
        ids.extend(await task)

    asyncio.run(run())
    _check_all(cluster, ids)
    assert _migrations(cluster) > 0, "no sequence was moved off the dead worker"


def test_xid_fault_drains_node_and_moves_live_sequences_with_their_kv(cluster: Cluster) -> None:
    items = _load(50, "r0", seed=2)
    ids: list[str] = []

    async def run() -> None:
        task = asyncio.create_task(_submit_spread(cluster, items, 5.0))
        await asyncio.sleep(2.5)
        await _inject(cluster, "r0-n1", "xid")  # in-process: a cold CLI start would land after the load
        ids.extend(await task)

    asyncio.run(run())
    _check_all(cluster, ids)
    logs = "".join(p.log_path.read_text() for p in cluster.procs.procs if p.role in ("worker", "monitor"))
    assert "marked draining" in logs and "released to" in logs, "the Xid fault did not drain r0-n1"
    assert _migrations(cluster) > 0
    # the node was alive: it exported each sequence's KV at the new version, and the new owner imported it
    assert "(KV snapshot)" in logs, "no moved sequence was resumed from its exported KV"


def test_sigkill_router_and_celery_worker(cluster: Cluster) -> None:
    items = _load(60, None, seed=3)
    ids: list[str] = []

    async def run() -> None:
        task = asyncio.create_task(_submit_spread(cluster, items, 6.0))
        await asyncio.sleep(1.5)
        # the router dies; its supervisor (systemd, Kubernetes) starts a new one, which claims what it left pending
        os.kill(cluster.proc("router").proc.pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
        cluster.procs._spawn("router", "router-2", [])
        await asyncio.sleep(1.0)
        # a GPU worker dies, and the whole Celery worker (main process and pool) dies as soon as it has taken the
        # drain task: the task is lost with it (the broker would give it back only after its visibility timeout);
        # the monitor re-sends the drain of a node that still holds work, and a new Celery worker runs it
        os.kill(cluster.proc("worker-r1-n0").proc.pid, signal.SIGKILL)
        celery = cluster.proc("celery-worker")
        for _ in range(1500):
            if "rackflow.drain_node[" in celery.log_path.read_text():
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the drain of r1-n0 never reached the Celery worker")
        os.killpg(celery.proc.pid, signal.SIGKILL)
        celery.proc.wait()
        cluster.procs.start_celery_worker("celery-worker-2")
        ids.extend(await task)

    asyncio.run(run())
    _check_all(cluster, ids)
    drains = [ln for p in cluster.procs.procs if p.role == "celery" for ln in p.log_path.read_text().splitlines()
              if "drain_node" in ln and "succeeded" in ln]
    assert drains, "no drain of r1-n0 ever completed"


def test_etcd_restart_under_load(clean_services, config_file, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """etcd (the registry, the leases, the monitor's election) goes down for a second and comes back on the same
    ports and data, as an operator's restart does: the pipeline rides through."""
    from workers.local.etcd import EtcdProcess

    etcd = EtcdProcess(tmp_path / "etcd")
    etcd.start()
    override = json.loads(json.dumps(FAILOVER_CLUSTER))
    override["policies"]["kv"] = {"l1_dir": str(tmp_path / "l1")}
    path = config_file(override)
    config = harness.small_config(path)
    procs = ClusterProcesses(config, clean_services.redis_url, etcd.url, tmp_path / "logs", ["--config", str(path)],
                             log_level="INFO", with_failover=True)
    procs.start()
    second = None
    try:
        asyncio.run(wait_cluster_ready(config, clean_services.redis_url, etcd.url, 120))
        c = Cluster(config, procs, clean_services.redis_url, etcd.url, path)
        ids: list[str] = []

        async def run() -> None:
            task = asyncio.create_task(_submit_spread(c, _load(50, None, seed=5), 5.0))
            await asyncio.sleep(1.5)
            await asyncio.to_thread(etcd.stop)
            await asyncio.sleep(1.0)
            nonlocal second
            second = EtcdProcess(tmp_path / "etcd", client_port=etcd.client_port, peer_port=etcd.peer_port)
            await asyncio.to_thread(second.start)
            ids.extend(await task)

        asyncio.run(run())
        _check_all(c, ids)
        assert all(p.proc.poll() is None for p in procs.procs if p.role in ("worker", "router", "batcher")), \
            "a role process died when etcd restarted"
    finally:
        procs.stop()
        if second is not None:
            second.stop()
        etcd.stop()


async def _leader(etcd_url: str) -> str | None:
    from streams import keys
    from workers.stores.etcd import etcd_client

    client = etcd_client(etcd_url)
    try:
        got = await client.get(keys.ETCD_MONITOR_LEADER.encode())
        return None if got is None else got.value.decode()
    finally:
        await client.close()


def test_two_monitors_kill_the_leader_the_other_takes_over_and_handles_a_fault(cluster: Cluster) -> None:
    """Run two monitors; SIGKILL the leader; the standby holds the leadership within the lease TTL (3 s) and is
    the one that drains the node of a later Xid fault, with nothing lost."""
    import time

    standby = cluster.procs.start_monitor("monitor-2")
    monitors = {p.proc.pid: p for p in cluster.procs.procs if p.role == "monitor"}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "started" not in standby.log_path.read_text():
        time.sleep(0.2)
    leader = asyncio.run(_leader(cluster.etcd_url))
    assert leader is not None and int(leader.rsplit(":", 1)[1]) in monitors, leader
    old = monitors[int(leader.rsplit(":", 1)[1])]
    other = next(p for pid, p in monitors.items() if p is not old)
    time.sleep(4.0)  # the standby has waited longer than a lease TTL: it must still be able to take over
    os.kill(old.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    new = None
    while time.monotonic() - killed < 10:
        new = asyncio.run(_leader(cluster.etcd_url))
        if new is not None and new != leader:
            break
        time.sleep(0.1)
    took = time.monotonic() - killed
    assert new is not None and new.endswith(f":{other.proc.pid}"), f"leader after the kill: {new}"
    assert took < 3.0 + 1.5, f"takeover took {took:.1f} s (lease TTL 3 s + one 0.5 s candidate poll + slack)"

    items = _load(40, "r0", seed=7)
    ids: list[str] = []

    async def run() -> None:
        task = asyncio.create_task(_submit_spread(cluster, items, 4.0))
        await asyncio.sleep(2.0)
        await _inject(cluster, "r0-n2", "xid")  # in-process: a cold CLI start would land after the load
        ids.extend(await task)

    asyncio.run(run())
    _check_all(cluster, ids)
    assert "node r0-n2 marked draining" in other.log_path.read_text(), "the new leader did not drain r0-n2"


@pytest.mark.slow
def test_sigkill_torch_worker_mid_generation_streams_continue_with_the_uninterrupted_tokens(
        clean_services, config_file, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The same kill with the `torch` engine (a real transformer on CPU): the moved sequences are re-prefilled on
    the other node from prompt + the tokens already streamed, and every request's token ids equal what one
    uninterrupted greedy run of the same requests gives."""
    from pipeline.events import RequestEvent
    from workers.engines import build_engine

    override = {
        "cluster": {"racks": [{"name": "r0", "node_count": 2,
                               "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}}]},
        "policies": {"worker": {"engine": "torch", "token_flush_ms": 20}, "streams": {"claim_idle_ms": 2000},
                     "kv": {"l1_dir": str(tmp_path / "l1")}},
    }
    path = config_file(override)
    config = harness.small_config(path)
    procs = ClusterProcesses(config, clean_services.redis_url, clean_services.etcd_url, tmp_path / "logs",
                             ["--config", str(path)], engine="torch", log_level="INFO", with_failover=True)
    procs.start()
    c = Cluster(config, procs, clean_services.redis_url, clean_services.etcd_url, path)
    sent: list[RequestEvent] = []
    try:
        asyncio.run(wait_cluster_ready(config, clean_services.redis_url, clean_services.etcd_url, 180))
        items = [ProfileInput(str(uuid.uuid4()), "t1", f"user-{i % 7}", "qwen2-7b", WALL.now_ms(),
                              prompt=f"Node {i} of rack seven reports: temperature nominal, queue {i * 3}.",
                              max_tokens=480) for i in range(16)]

        async def run() -> None:
            r = aioredis.Redis.from_url(c.redis_url)
            gw = Gateway(c.config, r)
            try:
                for it in items:
                    sent.append(await gw.submit(it))
            finally:
                await r.aclose()
            # kill r0-n0 once at least two of its sequences are mid-stream (tokens out, no result yet)
            for _ in range(600):
                if len(await _mid_stream_on(c, [s.request_id for s in sent], "r0-n0")) >= 2:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError(f"r0-n0 never had two sequences mid-stream: {await _where(c, sent)}")
            os.kill(c.proc("worker-r0-n0").proc.pid, signal.SIGKILL)

        asyncio.run(run())
        got = _check_all(c, [s.request_id for s in sent], timeout_s=300)
        assert _migrations(c) > 0, "no sequence was moved off the killed torch worker"
    finally:
        procs.stop()

    async def reference() -> dict[str, list[int]]:
        eng = build_engine(config, "r0-n1", "torch")
        await eng.start()
        out: dict[str, list[int]] = {s.request_id: [] for s in sent}
        try:
            for s in sent:
                eng.submit(s)
            while eng.has_work():
                step = await eng.step()
                for t in step.tokens:
                    out[t.request_id].append(t.token_id)
        finally:
            await eng.stop()
        return out

    want = asyncio.run(reference())
    for s in sent:
        toks, _final = asyncio.run(_client_view(c, s.request_id))
        ids = [tid for t in toks for tid in t.token_ids]
        assert ids == want[s.request_id], f"{s.request_id}: streamed ids differ from the uninterrupted run"
        assert got[s.request_id].out_tokens == len(ids)


async def _mid_stream_on(c: Cluster, ids: list[str], node: str) -> list[str]:
    """Requests whose latest tokens came from `node` and that have no final result yet."""
    from streams import codec, keys

    r = aioredis.Redis.from_url(c.redis_url)
    out = []
    try:
        for rid in ids:
            evs = [codec.decode(f) for _e, f in await r.xrange(keys.request_out(rid))]
            toks = [e for e in evs if isinstance(e, TokenEvent)]
            if toks and toks[-1].node == node and not any(isinstance(e, ResultEvent) for e in evs):
                out.append(rid)
    finally:
        await r.aclose()
    return out


async def _where(c: Cluster, sent: list[Any]) -> dict[str, Any]:
    from streams import codec, keys

    r = aioredis.Redis.from_url(c.redis_url)
    out: dict[str, Any] = {}
    try:
        for s in sent:
            evs = [codec.decode(f) for _e, f in await r.xrange(keys.request_out(s.request_id))]
            out[s.request_id[:6]] = [(type(e).__name__[0], getattr(e, "node", ""), getattr(e, "index", -1))
                                     for e in evs][-3:]
    finally:
        await r.aclose()
    return out
