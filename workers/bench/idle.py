"""`rackflow bench idle`: what an idle cluster costs. The cluster `rackflow up` starts (the default 2 racks x 4 nodes
of configs/cluster.yaml, the `sim` engine): every worker, batcher, router, the HTTP gateway, a health agent per node,
the monitor, the Celery worker and Flower, on their own embedded Valkey and etcd. Once it is ready and has settled,
nothing is sent for `seconds`, and the CPU time (user + system) of every process is read before and after, each
process with its children (Celery's pool), Valkey and etcd by their pids.

Reported: `idle_cpu_pct`, the share of one core that every role `rackflow up` starts plus Valkey and etcd used, in
all; `apart_cpu_pct`, the Celery worker and Flower (the async job path and its dashboard, reported apart); and the
share per role (`per_role_pct`, processes of one role summed) and per process (`per_process_pct`), so that the one
that polls shows itself."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pipeline.config import RackflowConfig
from workers.bench.gateway import process_cpu_s, wait_http_ready

APART = ("celery", "celery-jobs", "flower")
"""Roles reported apart from `idle_cpu_pct`: the Celery workers (control; jobs and batches) and Flower."""


def _process_tree() -> dict[int, list[int]]:
    """Each live process's children (Linux /proc), read once."""
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(stat.parent.name))
    return kids


def tree_cpu_s(pid: int, kids: dict[int, list[int]] | None = None) -> float:
    """CPU seconds used so far by `pid` and its live descendants (a child that exited since is not counted);
    `kids`: a `_process_tree()` to reuse across several pids."""
    kids = _process_tree() if kids is None else kids
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += process_cpu_s(p) or 0.0
        todo += kids.get(p, [])
    return total


def _cpu_snapshot(pids: dict[str, tuple[str, int]]) -> dict[str, float]:
    kids = _process_tree()
    return {n: tree_cpu_s(pid, kids) for n, (_r, pid) in pids.items()}


def bench_idle(config: RackflowConfig, role_args: list[str], seconds: float = 30.0, settle_s: float = 10.0,
               progress: bool = True) -> dict[str, Any]:
    """`config` is the cluster's (the `--config-dir` / `--config` the roles get as `role_args`)."""
    from workers.local.launcher import ClusterProcesses, wait_cluster_ready
    from workers.local.services import EmbeddedServices
    from workers.local.supervise import free_port

    with tempfile.TemporaryDirectory(prefix="rackflow-bench-idle-") as tmp:
        services = EmbeddedServices(Path(tmp) / "services")
        ep = services.start()
        procs = ClusterProcesses(config, ep.redis_url, ep.etcd_url, Path(tmp) / "logs", role_args, log_level="WARNING",
                                 with_gateway=True, with_failover=True, flower_port=free_port(),
                                 gateway_no_auth=True, gateway_port=free_port())
        try:
            procs.start()
            asyncio.run(wait_cluster_ready(config, ep.redis_url, ep.etcd_url))
            asyncio.run(wait_http_ready(f"http://127.0.0.1:{procs.gateway_port}"))
            st = services.status()
            pids = {p.name: (p.role, p.proc.pid) for p in procs.procs}
            pids["valkey"] = ("valkey", int(st["redis"]["pid"]))
            pids["etcd"] = ("etcd", int(st["etcd"]["pid"]))
            bar = tqdm(total=round(settle_s + seconds), desc="bench idle", unit="s", disable=not progress,
                       file=sys.stderr)
            for _ in range(round(settle_s)):  # the roles' start-up work (compiles, first reads) settles
                time.sleep(1.0)
                bar.update(1)
            bar.set_postfix_str("measuring", refresh=False)
            cpu0 = _cpu_snapshot(pids)
            t0 = time.monotonic()
            for _ in range(round(seconds)):
                time.sleep(1.0)
                bar.update(1)
            cpu1 = _cpu_snapshot(pids)
            window = time.monotonic() - t0
            bar.close()
            dead = [p.name for p in procs.dead()]
        finally:
            procs.stop(budget_s=8.0)
            services.stop()
    if dead:
        raise RuntimeError(f"role processes died while idle: {', '.join(dead)}")
    per_proc = {n: round(max(0.0, cpu1[n] - cpu0[n]) / window * 100.0, 3) for n in pids}
    per_role: dict[str, float] = {}
    for n, (role, _pid) in pids.items():
        per_role[role] = per_role.get(role, 0.0) + per_proc[n]
    counts = Counter(role for role, _pid in pids.values())
    per_rack = sorted({len(r.expanded()) for r in config.cluster.racks})
    shape = (f"{len(config.rack_names())} racks x {per_rack[0]} nodes" if len(per_rack) == 1 else
             f"{len(config.rack_names())} racks of {' to '.join(map(str, (per_rack[0], per_rack[-1])))} nodes")
    cluster = f"{shape}: " + ", ".join(f"{counts[r]} {r}" for r in sorted(counts))
    return {
        "idle_cpu_pct": round(sum(v for r, v in per_role.items() if r not in APART), 2),
        "apart_cpu_pct": round(sum(v for r, v in per_role.items() if r in APART), 2),
        "per_role_pct": {r: round(v, 3) for r, v in sorted(per_role.items())},
        "per_process_pct": dict(sorted(per_proc.items(), key=lambda kv: -kv[1])),
        "cluster": cluster,
        "seconds": round(window, 1),
        "settle_s": settle_s,
        "what": "CPU of every role `rackflow up` starts plus Valkey and etcd, in % of one core, while nothing is "
                "sent (Celery and Flower apart)",
    }
