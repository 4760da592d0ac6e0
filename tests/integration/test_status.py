"""`rackflow status`: the operator's view of a running cluster (workers, health agents, monitor, router, batchers
as processes on real Valkey and etcd). An injected xid fault drains its node: status shows the node draining with the
monitor's reason and its health score, the fault with wall-clock times, the drain among the
recent events, and every role alive; `--json` carries the same for scripts."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration import harness
from workers.local.launcher import ClusterProcesses, wait_cluster_ready
from workers.local.services import ServiceEndpoints

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLUSTER = {
    "cluster": {"racks": [{"name": "r0", "node_count": 2,
                           "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}}]},
    "policies": {"streams": {"claim_idle_ms": 2000}},
}


def _cli(path: Path, ep: ServiceEndpoints, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "workers.cli", "--config", str(path), "--redis-url", ep.redis_url,
                           "--etcd-url", ep.etcd_url, *args], capture_output=True, text=True, timeout=120)


def test_status_shows_a_drained_node_its_fault_and_the_roles(clean_services: ServiceEndpoints, config_file,  # type: ignore[no-untyped-def]
                                                             tmp_path: Path) -> None:
    override = json.loads(json.dumps(CLUSTER))
    override["policies"]["kv"] = {"l1_dir": str(tmp_path / "l1")}
    path = config_file(override)
    config = harness.small_config(path)
    procs = ClusterProcesses(config, clean_services.redis_url, clean_services.etcd_url, tmp_path / "logs",
                             ["--config", str(path)], log_level="INFO", with_failover=True)
    procs.start()
    try:
        asyncio.run(wait_cluster_ready(config, clean_services.redis_url, clean_services.etcd_url, 120))
        res = _cli(path, clean_services, "status", "--json")
        assert res.returncode == 0, res.stderr
        before = json.loads(res.stdout)
        assert [n["state"] for n in before["nodes"]] == ["active", "active"], before["nodes"]
        assert all(n["worker"] == "registered" for n in before["nodes"])

        res = _cli(path, clean_services, "fault", "inject", "--node", "r0-n1", "--kind", "xid", "--duration", "120")
        assert res.returncode == 0 and "injected xid on r0-n1" in res.stdout, res.stdout + res.stderr
        deadline = time.monotonic() + 90
        while True:  # the agent samples the fault, the monitor scores it and drains the node
            st = json.loads(_cli(path, clean_services, "status", "--json").stdout)
            n1 = next(n for n in st["nodes"] if n["node"] == "r0-n1")
            if n1["state"] == "draining" and st["events"]:
                break
            assert time.monotonic() < deadline, st
            time.sleep(1.0)
        # the score is the scorer's over the latest sample: an xid counts once, so it may have recovered already
        # while the node stays drained until `recover_samples` clean samples; the reason keeps the cause
        assert n1["health_score"] is not None and 0.0 <= n1["health_score"] <= 1.0
        assert "xid" in n1["reason"], n1
        assert n1["last_fault"]["kind"] == "xid" and n1["last_fault"]["active"]
        assert any(e["kind"] == "failover" and "r0-n1 -> draining" in e["what"] for e in st["events"])
        n0 = next(n for n in st["nodes"] if n["node"] == "r0-n0")
        assert n0["state"] == "active" and n0["agent_heartbeat"]
        roles = {r["role"] for r in st["roles"] if r["alive"]}
        assert {"monitor", "router", "batcher"} <= roles, st["roles"]

        text = _cli(path, clean_services, "status")
        assert text.returncode == 0, text.stderr
        row = next(ln for ln in text.stdout.splitlines() if ln.startswith("r0-n1 "))
        assert "draining" in row and "xid" in row and "(active)" in row, text.stdout
        assert "r0-n1 -> draining" in text.stdout and "recent drains" in text.stdout
        assert not procs.dead(), [p.log_path.read_text()[-1500:] for p in procs.dead()]
    finally:
        procs.stop()


def test_status_with_etcd_unreachable_says_so_without_a_traceback(clean_services: ServiceEndpoints,  # type: ignore[no-untyped-def]
                                                                   config_file) -> None:
    path = config_file(CLUSTER)
    down = ServiceEndpoints(clean_services.redis_url, "http://127.0.0.1:1")
    res = _cli(path, down, "status")
    assert res.returncode == 1, res.stdout
    assert "cannot read the cluster's state" in res.stderr and "127.0.0.1:1" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
