"""`rackflow bench idle` (workers/bench/idle.py): a real idle cluster, every role `rackflow up` starts (here 2 racks
of 1 node, for time) on embedded Valkey and etcd, measured by /proc; the figures are shares of one core, the
Celery worker and Flower apart, and every process is in the breakdown."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.config import DEFAULT_CONFIG_DIR
from workers.bench.idle import APART, bench_idle, tree_cpu_s
from workers.local.launcher import config_overlay_file

pytestmark = pytest.mark.integration


def test_tree_cpu_counts_the_children() -> None:
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\nprint('burnt', flush=True)\n"
                              "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "burnt"  # 0.3 s of CPU, now asleep
        mine = time.process_time()
        assert tree_cpu_s(os.getpid()) - mine >= 0.25
    finally:
        child.kill()
        child.wait()


def test_an_idle_cluster_is_measured_role_by_role(tmp_path: Path) -> None:
    over = {"cluster": {"racks": [{"name": "r0", "node_count": 1,
                                   "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}},
                                  {"name": "r1", "node_count": 1,
                                   "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}}]}}
    path = tmp_path / "idle.yaml"
    config = config_overlay_file(path, over)
    res = bench_idle(config, ["--config-dir", str(DEFAULT_CONFIG_DIR), "--config", str(path)], seconds=3.0,
                     settle_s=1.0, progress=False)
    assert res["cluster"].startswith("2 racks x 1 nodes: ")
    roles = set(res["per_role_pct"])
    assert {"worker", "batcher", "router", "gateway", "agent", "monitor", "valkey", "etcd", *APART} <= roles
    assert {"worker-r0-n0", "worker-r1-n0", "valkey", "etcd", "flower", "celery-worker"} <= set(res["per_process_pct"])
    assert res["idle_cpu_pct"] > 0  # the roles heartbeat: an idle cluster is never free
    total = sum(v for r, v in res["per_role_pct"].items() if r not in APART)
    assert abs(total - res["idle_cpu_pct"]) < 0.05
    assert res["apart_cpu_pct"] == pytest.approx(sum(res["per_role_pct"][r] for r in APART), abs=0.05)
