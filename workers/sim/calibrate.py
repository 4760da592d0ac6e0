"""`rackflow sim calibrate-control-plane`: measure the control plane's per-operation costs on this machine and write
them, with their provenance, to `data/calibration/control-plane.json` (what `pipeline.sim.control_plane` reads).

What it runs (short versions of the benches; every figure in the file is one of their medians or derived from one):
- `bench streams` (real Valkey): Valkey's own CPU per XADD and per entry read + acknowledged (INFO cpu around the
  phases): one shard's service time per stream operation;
- `bench route`: the router's decision (prefix lookup, rack choice, prefix-cache rule) and the node choice;
- `bench pipeline` (gateway -> router -> batcher -> 2 zero-time workers, real processes on a real Valkey and etcd):
  the CPU per request of the router process and of the batcher process during the floods (their service times);
- `bench etcd-txn` (`workers/bench/etcd_txn.py`) on a 3-member etcd cluster on loopback: the ownership
  compare-and-swap of a migration at 1, 8 and 32 concurrent clients;
- the fabric: Vidur's measured send/recv of the largest message between two H100 DGX nodes and within one
  (`data/profiles/vidur/network/h100_dgx/send_recv.csv`), beside the seed's 25 GB/s InfiniBand HDR and 900 GB/s
  NVLink; a migration's KV moves node to node at min(measured inter-node, the seed's HDR link).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.config import RackflowConfig
from pipeline.sim.control_plane import ControlPlaneCosts
from workers.sim.harness import REPO

CALIBRATION = REPO / "data" / "calibration" / "control-plane.json"
VIDUR_NET = REPO / "data" / "profiles" / "vidur" / "network" / "h100_dgx" / "send_recv.csv"
SEED_IB_HDR_GBPS = 25.0
SEED_NVLINK_GBPS = 900.0


def vidur_send_recv(path: Path = VIDUR_NET) -> dict[str, Any]:
    """Largest-message median send/recv time, across nodes (devices_per_node 1) and within one (2); GB/s = bytes
    over the median (the project reads Vidur's `size` as bytes and its times as ms: `pipeline/costmodel`)."""
    best: dict[int, tuple[float, float]] = {}
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            size, dpn = float(row["size"]), int(row["devices_per_node"])
            med = float(row["time_stats.send_recv.median"])
            if dpn not in best or size > best[dpn][0]:
                best[dpn] = (size, med)
    out: dict[str, Any] = {"file": str(path.relative_to(REPO))}
    for dpn, key in ((1, "inter_node"), (2, "intra_node")):
        if dpn in best:
            size, med = best[dpn]
            out[key] = {"size_bytes": size, "median_ms": med, "gbps": round(size / (med * 1e6), 2)}
    return out


def _machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "platform": platform.platform(),
            "python": platform.python_version()}


def _git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def calibrate(entries: int = 5000, route_iterations: int = 5000, pipeline_requests: int = 6000,
              etcd_levels: tuple[int, ...] = (1, 8, 32), etcd_duration_s: float = 4.0,
              progress: bool = False) -> dict[str, Any]:
    from workers.bench.etcd_txn import bench_etcd_txn
    from workers.bench.micro import _bench_streams, bench_route
    from workers.bench.pipeline import bench_pipeline
    from workers.local.etcd_cluster import EtcdCluster  # the 3-member cluster the etcd failover tests start
    from workers.local.services import EmbeddedServices

    t0 = time.perf_counter()
    raw: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rackflow-calibrate-") as tmp:
        services = EmbeddedServices(Path(tmp) / "svc")
        ep = services.start()
        try:
            print("calibrate: bench streams", file=sys.stderr)
            raw["streams"] = asyncio.run(_bench_streams(ep.redis_url, entries))
            print("calibrate: bench route", file=sys.stderr)
            raw["route"] = bench_route(iterations=route_iterations)
            print("calibrate: bench pipeline", file=sys.stderr)
            raw["pipeline"] = bench_pipeline(ep.redis_url, ep.etcd_url, requests=pipeline_requests,
                                             progress=progress)
        finally:
            services.stop()
        print("calibrate: etcd transactions on a 3-member cluster", file=sys.stderr)
        with EtcdCluster(Path(tmp) / "etcd3", members=3) as cluster:
            raw["etcd"] = asyncio.run(bench_etcd_txn(cluster.url, etcd_levels, etcd_duration_s))
    raw["network"] = vidur_send_recv()
    raw["network"]["seed"] = {"infiniband_hdr_gbps": SEED_IB_HDR_GBPS, "nvlink_gbps": SEED_NVLINK_GBPS}
    cpu = raw["pipeline"]["cpu_ms_per_request"]
    top = str(max(etcd_levels))
    inter = raw["network"].get("inter_node", {}).get("gbps", SEED_IB_HDR_GBPS)
    derived = {
        "router_ms_per_decision": cpu["router"],
        "router_decision_only_ms": round(raw["route"]["router_rack_p50_us"] / 1000.0, 5),
        "batcher_ms_per_request": cpu["batcher"],
        "valkey_xadd_ms": round(raw["streams"]["valkey_cpu_us_per_xadd"] / 1000.0, 6),
        "valkey_read_ack_ms": round(raw["streams"]["valkey_cpu_us_per_read_ack"] / 1000.0, 6),
        "etcd_txn_ms": raw["etcd"]["levels"][top]["p50_ms"],
        "etcd_concurrency": int(top),
        "etcd_moves_per_s": raw["etcd"]["levels"][top]["moves_per_s"],
        "node_link_gbps": min(float(inter), SEED_IB_HDR_GBPS),
    }
    derived["how"] = {
        "router_ms_per_decision": "bench pipeline: router process CPU ms per request (median of the floods)",
        "router_decision_only_ms": "bench route: p50 of the router's part of a decision (default policy)",
        "batcher_ms_per_request": "bench pipeline: batcher process CPU ms per request (median of the floods)",
        "valkey_xadd_ms": "bench streams: Valkey INFO cpu per pipelined XADD (median of repeats)",
        "valkey_read_ack_ms": "bench streams: Valkey INFO cpu per entry read + XACK by a consumer group",
        "etcd_txn_ms": f"etcd-txn: p50 of a migration's compare-and-swap at {top} concurrent clients, 3 members",
        "node_link_gbps": "min(Vidur h100_dgx inter-node send/recv of the largest message, seed's IB HDR 25 GB/s)",
    }
    return {
        "provenance": {
            "command": "rackflow sim calibrate-control-plane " + " ".join(sys.argv[3:]),
            "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": _machine(),
            "git_head": _git_head(),
            "wall_s": round(time.perf_counter() - t0, 1),
            "settings": {"entries": entries, "route_iterations": route_iterations,
                         "pipeline_requests": pipeline_requests, "etcd_levels": list(etcd_levels),
                         "etcd_duration_s": etcd_duration_s},
        },
        "derived": derived,
        "raw": raw,
    }


def load_calibration(path: Path | None = None) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((path or CALIBRATION).read_text(encoding="utf-8"))
    return data


def control_plane_costs(args: argparse.Namespace, cfg: RackflowConfig) -> ControlPlaneCosts | None:
    """The measured control-plane costs (`--control-plane [FILE]`) with the counts given, or None."""
    if getattr(args, "control_plane", None) is None:
        return None
    path = Path(args.control_plane) if args.control_plane else CALIBRATION
    return ControlPlaneCosts.from_calibration(
        load_calibration(path), routers=args.routers, batchers_per_rack=args.batchers_per_rack,
        valkey_shards=args.valkey_shards, token_flush_ms=float(cfg.policies.worker.token_flush_ms),
        spine_oversubscription=float(getattr(args, "spine_oversubscription", 1.0)),
        record_flush_ms=float(getattr(args, "record_flush_ms", 20.0)))


def cmd_calibrate(args: argparse.Namespace) -> int:
    res = calibrate(pipeline_requests=args.requests or 6000, progress=not args.no_progress)
    path = Path(args.out) / CALIBRATION.name if args.out else CALIBRATION
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    d = {k: v for k, v in res["derived"].items() if k != "how"}
    print(json.dumps(d, sort_keys=True) if args.json else "\n".join(f"{k:<26} {v}" for k, v in d.items()))
    print(f"wrote {path}", file=sys.stderr)
    return 0
