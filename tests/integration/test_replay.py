"""Incident replay end to end on a live cluster (real processes, Valkey, etcd): 1,000 requests with a health change
in the middle (an Xid fault drains a node), `replay export` -> `replay import` into a scratch Valkey -> `replay run`
reproduces every recorded routing and dispatch decision; a what-if with another node policy reports differences;
`replay report` writes the HTML page and its PNGs."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration import harness
from workers.local.launcher import ClusterProcesses, wait_cluster_ready
from workers.local.valkey import ValkeyProcess

pytestmark = pytest.mark.integration

CLUSTER = {
    "cluster": {"racks": [
        {"name": "r0", "node_count": 3, "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}},
        {"name": "r1", "node_count": 2, "node": {"gpu": "a100-80gb", "tp": 1, "models": ["qwen2-7b"]}},
    ]},
    "policies": {"streams": {"claim_idle_ms": 2000}, "node_selection": {"policy": "weighted", "stale_ms": 2000}},
}


def _cli(path: Path, redis_url: str, etcd_url: str, *args: str,
         timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "workers.cli", "--config", str(path), "--redis-url", redis_url,
                           "--etcd-url", etcd_url, *args], capture_output=True, text=True, timeout=timeout)


def test_export_import_replay_reproduces_a_live_run_and_what_if_differs(  # type: ignore[no-untyped-def]
    clean_services, config_file, tmp_path
) -> None:
    override = json.loads(json.dumps(CLUSTER))
    override["policies"]["kv"] = {"l1_dir": str(tmp_path / "l1")}
    path = config_file(override)
    config = harness.small_config(path)
    redis_url, etcd_url = clean_services.redis_url, clean_services.etcd_url
    procs = ClusterProcesses(config, redis_url, etcd_url, tmp_path / "logs", ["--config", str(path)],
                             log_level="INFO", with_failover=True)
    procs.start()
    try:
        asyncio.run(wait_cluster_ready(config, redis_url, etcd_url, 120))
        since = time.time() * 1000.0

        async def load() -> set[str]:
            ids: set[str] = set()
            items = harness.inputs(1000, seed=5, max_out=12)
            for k in range(0, 1000, 50):
                ids |= {r.request_id for r in await harness.submit(config, redis_url, items[k:k + 50])}
                if k == 500:  # the health change in the middle
                    res = _cli(path, redis_url, etcd_url, "fault", "inject", "--node", "r0-n1", "--kind", "xid")
                    assert res.returncode == 0, res.stderr
                await asyncio.sleep(0.6)
            return ids

        ids = asyncio.run(load())
        got, counts = asyncio.run(harness.wait_results(redis_url, ids, timeout_s=180))
        assert set(got) == ids and all(counts[i] == 1 for i in ids)
        time.sleep(1.0)  # the last window records and health samples
        logs = "".join(p.log_path.read_text() for p in procs.procs if p.role == "monitor")
        assert "marked draining" in logs, "the Xid fault did not drain r0-n1"
    finally:
        procs.stop()

    rfr = tmp_path / "incident.rfr"
    res = _cli(path, redis_url, etcd_url, "replay", "export", "--since", f"{since:.0f}", "-o", str(rfr), "--json",
               "--no-progress")
    assert res.returncode == 0, res.stderr
    exported = json.loads(res.stdout)
    assert exported["entries"] > 3000

    # import refuses a server that holds live rackflow streams, and loads into a scratch one
    res = _cli(path, redis_url, etcd_url, "replay", "import", str(rfr))
    assert res.returncode == 2 and "already holds rackflow streams" in res.stderr
    with ValkeyProcess(tmp_path / "scratch") as scratch:
        res = _cli(path, redis_url, etcd_url, "replay", "import", str(rfr), "--redis-url", scratch.url, "--json",
                   "--no-progress")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["entries"] == exported["entries"]
        # a recording exported from the scratch server replays the same
        rfr2 = tmp_path / "again.rfr"
        res = subprocess.run([sys.executable, "-m", "workers.cli", "--redis-url", scratch.url, "--etcd-url", etcd_url,
                              "replay", "export", "--since", f"{since:.0f}", "-o", str(rfr2), "--no-progress"],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr

    for f in (rfr, rfr2):
        res = _cli(path, redis_url, etcd_url, "replay", "run", str(f), "--json", "--no-progress")
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        assert out["route_decisions"] >= 1000 and out["dispatch_decisions"] > 0
        assert out["match_rate"] == 1.0, out
        assert out["requests_same_node"] == out["requests_dispatched"] >= 1000

    res = _cli(path, redis_url, etcd_url, "replay", "run", str(rfr), "--policy", "least_outstanding", "--json",
               "--no-progress", "--differences", str(tmp_path / "diff.jsonl"))
    assert res.returncode == 0, res.stderr
    what_if = json.loads(res.stdout)
    assert what_if["what_if"] and what_if["dispatch_differences"] > 0 and what_if["match_rate"] < 1.0
    assert len((tmp_path / "diff.jsonl").read_text().splitlines()) == what_if["differences"]

    report = tmp_path / "report"
    res = _cli(path, redis_url, etcd_url, "replay", "report", str(rfr), "-o", str(report), "--json", "--no-progress")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["requests"] == 1000 and rep["results"] >= 1000 and rep["replay"]["match_rate"] == 1.0
    for png in ("latency.png", "load.png", "health.png"):
        assert (report / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (report / "index.html").read_text()
    assert "latency.png" in page and "Replay" in page
    summary_txt = (report / "summary.txt").read_text()
    assert "draining" in summary_txt
    # wall-clock times, not offsets: the window's bounds and each drain at its time of day
    assert re.search(r"from \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", summary_txt), summary_txt
    assert re.search(r"health: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+ r0-n1 draining", summary_txt), summary_txt
