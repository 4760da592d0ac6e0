"""Failover under a steady load through the live pipeline (real processes, real Valkey and etcd, sim engines):
kill -9 a GPU worker mid-generation, stall one (SIGSTOP) past its heartbeat window, inject an Xid fault, kill the
router, kill a Celery worker during migrations, restart etcd. Every accepted request ends with exactly one final
result, its client stream (as the gateway reads it) has every token exactly once and in order, and no request ends
in an error. Faults are injected on a state (the victim holds sequences mid-stream), not after a sleep."""

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

from pipeline.config import RackflowConfig
from pipeline.events import ResultEvent, TokenEvent
from pipeline.profiling import ProfileInput
from streams.runner import connect
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
        _wait_failover_ready(procs)
        yield Cluster(config, procs, clean_services.redis_url, clean_services.etcd_url, path)
    finally:
        procs.stop()


def _wait_failover_ready(procs: ClusterProcesses, timeout_s: float = 120.0) -> None:
    """Until a monitor leads and the Celery worker takes tasks (wait_cluster_ready covers the request path only: on
    a loaded machine the Celery worker came up seconds after the workers, and a fault injected before it was handled
    only after the load had ended)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        logs = {p.role: p.log_path.read_text() for p in procs.procs if p.role in ("monitor", "celery")}
        if "is the leader" in logs.get("monitor", "") and " ready." in logs.get("celery", ""):
            return
        time.sleep(0.1)
    raise TimeoutError("no monitor leader or no ready Celery worker")


def _load(n: int, user_rack: str | None = None, seed: int = 1) -> list[ProfileInput]:
    from pipeline.routing.hashring import HashRing

    rng = random.Random(seed)
    ring = HashRing(["r0", "r1"], 160)
    users = [f"user-{i}" for i in range(2000) if user_rack is None or ring.primary(f"user-{i}") == user_rack]
    return [ProfileInput(str(uuid.uuid4()), "t1", rng.choice(users[:40]), "qwen2-7b", WALL.now_ms(),
                         prompt_tokens=rng.randint(100, 1500), max_tokens=rng.randint(60, 160)) for _ in range(n)]


async def _submit_spread(c: Cluster, items: list[ProfileInput], seconds: float,
                         ids: list[str] | None = None) -> list[str]:
    """Submit `items` evenly over `seconds`; their ids are appended to `ids` as they go (a fault waits on them)."""
    r = connect(c.redis_url)
    gw = Gateway(c.config, r)
    ids = [] if ids is None else ids
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
    r = connect(c.redis_url)
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
    from workers.health import faults

    r = connect(c.redis_url)
    try:
        await faults.inject(r, node, kind, now_ms=WALL.now_ms())
    finally:
        await r.aclose()


def _migrations(c: Cluster) -> int:
    return sum(p.log_path.read_text().count(" resumed at v") for p in c.procs.procs if p.role == "worker")


async def _until_mid_stream(c: Cluster, ids: list[str], node: str, at_least: int = 2, timeout_s: float = 60) -> None:
    """Until `node` holds `at_least` of the submitted requests mid-stream (tokens out, no result yet)."""
    import time

    deadline = time.monotonic() + timeout_s
    while len(await _mid_stream_on(c, list(ids), node)) < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"{node} never had {at_least} sequences mid-stream")
        await asyncio.sleep(0.05)


async def _verdicts(c: Cluster, node: str) -> list[tuple[float, str]]:
    """(ts, verdict) of the monitor's decisions about `node`, oldest first."""
    from pipeline.events import DecisionEvent
    from streams import codec, keys

    r = connect(c.redis_url)
    try:
        evs = [codec.decode(f) for _e, f in await r.xrange(keys.DECISIONS)]
    finally:
        await r.aclose()
    return [(e.ts_ms, e.choice.split(":", 1)[1]) for e in evs
            if isinstance(e, DecisionEvent) and e.kind == "failover" and e.choice.startswith(f"{node}:")]


def test_sigkill_worker_mid_generation(cluster: Cluster) -> None:
    """kill -9 of a worker holding live sequences: its heartbeats stop, the monitor takes it for dead well before
    its lease would expire (and revokes the lease), and its sequences continue on the other nodes."""
    items = _load(60, "r0")
    ids: list[str] = []
    killed_ms: list[float] = []

    async def run() -> None:
        task = asyncio.create_task(_submit_spread(cluster, items, 6.0, ids))
        await _until_mid_stream(cluster, ids, "r0-n0")
        victim = cluster.proc("worker-r0-n0")
        killed_ms.append(WALL.now_ms())
        os.kill(victim.proc.pid, signal.SIGKILL)
        await task

    asyncio.run(run())
    _check_all(cluster, ids)
    assert _migrations(cluster) > 0, "no sequence was moved off the dead worker"
    monitor = cluster.proc("monitor").log_path.read_text()
    assert "node r0-n0 marked dead (no heartbeat for" in monitor, "the death was not seen on the heartbeats"
    dead = [ts for ts, v in asyncio.run(_verdicts(cluster, "r0-n0")) if v == "dead"]
    lease_ms = cluster.config.policies.worker.lease_ttl_s * 1000
    assert dead and dead[0] - killed_ms[0] < lease_ms, \
        f"marked dead {dead[0] - killed_ms[0]:.0f} ms after the kill, not before the {lease_ms} ms lease"


def test_stalled_worker_is_fenced_its_sequences_move_and_it_comes_back(cluster: Cluster) -> None:
    """SIGSTOP of a worker holding live sequences, past its heartbeat window (but not its lease): the monitor takes
    it for dead and revokes its lease, its sequences move. Then SIGCONT: the stalled process wakes up still holding
    them (and writes what it had in flight), finds its lease gone, registers again, and the movers' releases stop
    its copies (the version rule). Nothing is lost, duplicated or repeated in a client stream, and the node is back
    in service once its heartbeats flow again."""
    items = _load(60, "r0", seed=4)
    ids: list[str] = []

    async def run() -> None:
        task = asyncio.create_task(_submit_spread(cluster, items, 6.0, ids))
        await _until_mid_stream(cluster, ids, "r0-n1")
        victim = cluster.proc("worker-r0-n1")
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:  # stalled until its sequences are resumed elsewhere: the state, not a duration
            for _ in range(1200):
                if any(" from r0-n1" in p.log_path.read_text() for p in cluster.procs.procs
                       if p.role == "worker" and p.name != "worker-r0-n1"):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("no sequence of the stalled r0-n1 was resumed elsewhere")
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
        await task

    asyncio.run(run())
    _check_all(cluster, ids)
    victim = cluster.proc("worker-r0-n1")  # still alive: the stall did not kill it
    log = victim.log_path.read_text()
    assert "registering again" in log, "the stalled worker did not notice its lease was revoked"
    assert "released to" in log, "the stalled worker's copies were not stopped by the movers' releases"
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if [v for _ts, v in asyncio.run(_verdicts(cluster, "r0-n1"))][-1:] == ["active"]:
            break
        time.sleep(0.2)
    verdicts = [v for _ts, v in asyncio.run(_verdicts(cluster, "r0-n1"))]
    assert "dead" in verdicts and verdicts[-1] == "active", verdicts


def test_xid_fault_drains_node_and_moves_live_sequences_with_their_kv(cluster: Cluster) -> None:
    items = _load(50, "r0", seed=2)
    ids: list[str] = []

    async def run() -> None:
        task = asyncio.create_task(_submit_spread(cluster, items, 5.0, ids))
        await _until_mid_stream(cluster, ids, "r0-n1")
        await _inject(cluster, "r0-n1", "xid")  # in-process: a cold CLI start would land after the load
        await task

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
        task = asyncio.create_task(_submit_spread(cluster, items, 6.0, ids))
        await _until_mid_stream(cluster, ids, "r1-n0", at_least=1)  # the load is flowing through the router
        # the router dies; its supervisor (systemd, Kubernetes) starts a new one, which claims what it left pending
        os.kill(cluster.proc("router").proc.pid, signal.SIGKILL)
        await asyncio.sleep(0.5)  # the router's outage
        cluster.procs._spawn("router", "router-2", [])
        await _until_mid_stream(cluster, ids, "r1-n0", at_least=2)
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
        await task

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
            task = asyncio.create_task(_submit_spread(c, _load(50, None, seed=5), 5.0, ids))
            for _ in range(1200):  # etcd goes down under load: once sequences are mid-stream on some node
                if any([await _mid_stream_on(c, list(ids), n.name) for n in config.nodes()]):
                    break
                await asyncio.sleep(0.05)
            await asyncio.to_thread(etcd.stop)
            await asyncio.sleep(1.0)  # the outage
            nonlocal second
            second = EtcdProcess(tmp_path / "etcd", client_port=etcd.client_port, peer_port=etcd.peer_port)
            await asyncio.to_thread(second.start)
            await task

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
        task = asyncio.create_task(_submit_spread(cluster, items, 4.0, ids))
        await _until_mid_stream(cluster, ids, "r0-n2")
        await _inject(cluster, "r0-n2", "xid")  # in-process: a cold CLI start would land after the load
        await task

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
            r = connect(c.redis_url)
            gw = Gateway(c.config, r)
            try:
                for it in items:
                    sent.append(await gw.submit(it))
            finally:
                await r.aclose()
            # kill a node once at least two of its sequences are mid-stream (tokens out, no result yet): whichever
            # node the batcher placed them on (a window's batch may go to either node, or all to one)
            victim = ""
            for _ in range(600):
                for node in ("r0-n0", "r0-n1"):
                    if len(await _mid_stream_on(c, [s.request_id for s in sent], node)) >= 2:
                        victim = node
                        break
                if victim:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError(f"no node ever had two sequences mid-stream: {await _where(c, sent)}")
            os.kill(c.proc(f"worker-{victim}").proc.pid, signal.SIGKILL)

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

    r = connect(c.redis_url)
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

    r = connect(c.redis_url)
    out: dict[str, Any] = {}
    try:
        for s in sent:
            evs = [codec.decode(f) for _e, f in await r.xrange(keys.request_out(s.request_id))]
            out[s.request_id[:6]] = [(type(e).__name__[0], getattr(e, "node", ""), getattr(e, "index", -1))
                                     for e in evs][-3:]
    finally:
        await r.aclose()
    return out


def _seq_request(rid: str, rack: str = "r0") -> Any:
    from pipeline.events import RequestEvent

    return RequestEvent(request_id=rid, version=1, tenant="t", user_id="u", model="qwen2-7b", in_tokens=100,
                        out_tokens=40, max_tokens=40, mem_est_kb=1000.0, arrival_ms=WALL.now_ms(), rack=rack)


def test_a_drain_killed_between_the_owner_change_and_the_handover_is_completed_by_the_next(
        clean_services, config_file, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The Celery worker dies inside a drain: the etcd transaction moved every sequence to its target, the
    ResumeEvents were never sent. The next drain of the node (the monitor re-sends it while the node holds work)
    finds those moves by their unclaimed records and tells the targets; sequences that had finished meanwhile are
    not resumed, and the records the move wrote for them are removed. One etcd transaction decides each sequence on
    its own: one whose record changed under the plan does not fail the others."""
    from pipeline.events import BatchEvent, ResumeEvent
    from streams import codec, keys
    from workers.control import failover as fo
    from workers.stores.etcd import MoveOutcome, PlannedMove, SeqRecord

    config = harness.small_config(config_file(harness.SMALL_CLUSTER))
    src, dst = "r0-n1", "r0-n0"

    async def run() -> None:
        ctx = fo.FailoverContext.open(config, clean_services.redis_url, clean_services.etcd_url)
        try:
            reqs = [_seq_request(f"seq-{i}") for i in range(5)]
            now = WALL.now_ms()
            entry = (await ctx.r.xadd(keys.node_batches(src), codec.encode(BatchEvent(  # type: ignore[arg-type]
                "b1", "r0", src, tuple(reqs), 5000.0, 1e6, now, now)))).decode()
            for q in reqs:
                await ctx.r.xadd(keys.request_out(q.request_id), codec.encode(TokenEvent(  # type: ignore[arg-type]
                    q.request_id, 1, 0, (7, 8, 9), ("a", "b", "c"), now, src)))
            await ctx.seqs.apply([SeqRecord(q.request_id, src, 1, "r0", now, entry) for q in reqs], [])
            recs = await ctx.seqs.records()
            # seq-4 changes under the plan: another mover took it (v2 on r1-n0)
            await ctx.seqs.apply([SeqRecord("seq-4", "r1-n0", 2, "r0", now, "")], [])
            planned = [PlannedMove(r.seq_id, 1, src, dst, r.mod_revision, r.rack, r.entry) for r in recs.values()]
            results, alive = await ctx.seqs.move_many(planned, now, probe=src)
            outcome = {res.move.seq_id: res.outcome for res in results}
            assert alive is False  # the source is not registered: taken for dead
            assert outcome == {"seq-0": MoveOutcome.MOVED, "seq-1": MoveOutcome.MOVED, "seq-2": MoveOutcome.MOVED,
                               "seq-3": MoveOutcome.MOVED, "seq-4": MoveOutcome.ALREADY}, outcome
            # ... and the mover died here. seq-3 finishes meanwhile (its result was already on its way).
            await ctx.r.set(keys.result_done("seq-3"), b"1")
            assert await fo.remaining_work(ctx.seqs, ctx.r, src) == (0, 0)  # not yet taken for an untold move
            monkeypatch.setattr(fo, "UNTOLD_AFTER_MS", 0.0)
            assert (await fo.remaining_work(ctx.seqs, ctx.r, src))[0] == 4  # the monitor re-sends the drain
            report = await fo.drain(ctx, src)
            moved = sorted(m.seq_id for m in report.moves if m.outcome == "moved")
            assert moved == ["seq-0", "seq-1", "seq-2"], report
            assert [m.outcome for m in report.moves if m.seq_id == "seq-3"] == ["finished"]
            resumes = [codec.decode(f) for _e, f in await ctx.r.xrange(keys.node_batches(dst))]
            assert sorted(e.request.request_id for e in resumes if isinstance(e, ResumeEvent)) == moved
            assert all(e.generated == (7, 8, 9) and e.request.version == 2 for e in resumes)
            left = await ctx.seqs.records()
            assert "seq-3" not in left, "the record written for a finished sequence was left behind"
            assert left["seq-4"].owner == "r1-n0"  # the other mover's move stands
            # the dead source is fenced too: a stalled process that wakes up stops its copies
            fences = [codec.decode(f) for _e, f in await ctx.r.xrange(keys.node_control(src))]
            assert sorted(f.seq_id for f in fences) == moved
            # told once: a drain soon after finds nothing more to do (a target claims its sequence in milliseconds)
            monkeypatch.setattr(fo, "UNTOLD_AFTER_MS", 2000.0)
            again = await fo.drain(ctx, src)
            assert not [m for m in again.moves if m.outcome == "moved"], again
        finally:
            await ctx.close()

    asyncio.run(run())


def test_a_migrate_task_redelivered_after_the_owner_change_tells_the_target(clean_services, config_file) -> None:  # type: ignore[no-untyped-def]
    """`migrate_sequence` killed after its transaction (acks_late: Celery runs it again): the repeat finds the record
    it wrote, still unclaimed by the target, and sends the ResumeEvent it never sent; once the target has claimed
    the sequence, a repeat changes nothing."""
    from pipeline.events import BatchEvent, ResumeEvent
    from streams import codec, keys
    from workers.control import failover as fo
    from workers.stores.etcd import PlannedMove, SeqRecord

    config = harness.small_config(config_file(harness.SMALL_CLUSTER))
    src, dst = "r0-n1", "r0-n0"

    async def run() -> None:
        ctx = fo.FailoverContext.open(config, clean_services.redis_url, clean_services.etcd_url)
        try:
            q = _seq_request("seq-m")
            now = WALL.now_ms()
            entry = (await ctx.r.xadd(keys.node_batches(src), codec.encode(BatchEvent(  # type: ignore[arg-type]
                "b1", "r0", src, (q,), 1000.0, 1e6, now, now)))).decode()
            await ctx.r.xadd(keys.request_out(q.request_id), codec.encode(TokenEvent(  # type: ignore[arg-type]
                q.request_id, 1, 0, (4, 5), ("d", "e"), now, src)))
            await ctx.seqs.apply([SeqRecord(q.request_id, src, 1, "r0", now, entry)], [])
            rec = (await ctx.seqs.records())[q.request_id]
            await ctx.seqs.move_many([PlannedMove(q.request_id, 1, src, dst, rec.mod_revision, "r0", entry)], now)
            # ... killed here; the task runs again with its original arguments
            rep = await fo.migrate_sequence(ctx, q.request_id, 1, src, dst, rec.mod_revision, entry, "r0")
            assert rep.outcome == "moved" and rep.version == 2, rep
            resumes = [codec.decode(f) for _e, f in await ctx.r.xrange(keys.node_batches(dst))]
            assert [(e.request.request_id, e.generated) for e in resumes if isinstance(e, ResumeEvent)] == \
                [(q.request_id, (4, 5))]
            # the target claims it (its record now names its own entry): a third run is `already`
            await ctx.seqs.apply([SeqRecord(q.request_id, dst, 2, "r0", WALL.now_ms(), "1-0")], [])
            again = await fo.migrate_sequence(ctx, q.request_id, 1, src, dst, rec.mod_revision, entry, "r0")
            assert again.outcome == "already", again
            assert len(await ctx.r.xrange(keys.node_batches(dst))) == 1
        finally:
            await ctx.close()

    asyncio.run(run())
