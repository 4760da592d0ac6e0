"""`rackflow sim experiment NAME`: the field report's questions, answered side by side in the simulator, each with
the seed's claim printed next to what we measure (our numbers may differ; they are reported as measured).

- roundrobin-vs-weighted: 8 H100 nodes (Qwen2-72B, TP8 each) on the Azure conversation trace, round robin against
  the seed's W-weighted random (and the default, work_aware), at a moderate load and at overload (capacity), with
  all nodes healthy and with one node throttled to 1.5x slower iterations (thermal throttling, a noisy neighbour).
- window-batching: where memory binds (long prompts on the 7B: the Mooncake trace above capacity), fixed batches of
  32 against the 100 ms memory-budget window (and 200 ms), with the seed's memory formula and with the shape estimate
  against the engines' real free KV, and the estimate's margin swept: KV utilisation at saturation and preemptions.
- scale-pareto: 64 to 1,024 GPUs at the seed's load (5 M requests/day = 208 k requests in the hour: the Azure trace
  superposed 11 times); cost per request against P95 latency, and the capacity ratio of 1,024 vs 512 GPUs, without
  and with the measured control-plane costs (`--control-plane`: routers, batchers, Valkey shards as stations).
- sizing: routers, batchers per rack and Valkey shards per 1,000 GPUs at 5 M and 50 M requests/day, from the
  measured per-process costs (`data/calibration/control-plane.json`) at a 70% utilisation cap; the per-request
  Valkey demand measured by a simulation; each station driven past one process's capacity in the simulator to
  show where its queue explodes.
- vidur: Microsoft's Vidur simulator (vidur==0.0.26, `make .venv-vidur`) and ours side by side on one H100 serving
  Llama-2-7B, the first 2,000 Azure conversation requests, the same batch cap, chunk and KV blocks
  (`workers/sim/vidur_peer.py`).
- priority: one rack of 2 H100 TP8 nodes (Qwen2-72B) serving the Azure conversation trace at 0.7 of its capacity,
  and a batch backlog (class `batch`, tenant `batch-job`) arriving at once a quarter of the way in, larger than the
  cluster serves in the rest of the trace: interactive alone, with the backlog under `batch_yield: preempt` and
  `hold`, and with the backlog given no priority (FCFS, as before classes): the interactive P99 TTFT against alone,
  and how much of the capacity interactive work leaves idle the backlog uses (`batch_idle_use`).
- fairness: the same rack, two tenants drawing from the Azure conversation trace at 3:1 (1.8x and 0.6x of the
  capacity: each above an equal share), `fair_share` on against off, with the gateway's admission and without it:
  each tenant's service per minute and its largest distance from an equal share (`max_share_error`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.config import RackflowConfig
from pipeline.priority import BATCH, INTERACTIVE
from pipeline.sim.control_plane import ControlPlaneCosts, Station, size_for
from pipeline.sim.report import equal_share_error, served_tokens, service_bins, ttft_percentile_bins
from pipeline.sim.simulator import SHED_REASON, Fault, SimParams, SimResult
from pipeline.sim.traces import TraceRequest, assign_users, parse_azure, parse_mooncake, scale_rate, superpose
from pipeline.stats import percentile
from workers.sim.harness import AZURE_CONV, REPO, format_table, plot_compare, run_once, sim_config
from workers.sim.matrix import _span_rate, flood_capacity

EXPERIMENTS = ("roundrobin-vs-weighted", "window-batching", "scale-pareto", "sizing", "vidur", "priority", "fairness")


def _cluster(racks: int, nodes_per_rack: int, gpu: str = "h100-80gb", tp: int = 8, model: str = "qwen2-72b"
             ) -> dict[str, Any]:
    return {"racks": [{"name": f"r{i}", "node_count": nodes_per_rack, "node": {"gpu": gpu, "tp": tp, "models": [model]}}
                      for i in range(racks)]}


def _config(args: argparse.Namespace, cluster: dict[str, Any], policy: str, seed: int,
            batcher: dict[str, Any] | None = None, profiling: dict[str, Any] | None = None) -> RackflowConfig:
    extra = {k: v for k, v in (("batcher", batcher), ("profiling", profiling)) if v} or None
    return sim_config(Path(args.config_dir), [Path(p) for p in args.config], None, policy, extra,
                      over={"cluster": cluster, "policies": {"seed": seed}})


def _azure(limit: int | None, rate: float, seed: int, users: int = 2000) -> list[TraceRequest]:
    with open(AZURE_CONV, newline="", encoding="utf-8") as fh:
        reqs = list(parse_azure(fh, limit))
    if rate != 1.0:
        reqs = list(scale_rate(reqs, rate))
    return assign_users(reqs, users, 1.1, random.Random(seed + 1))


def _pct(a: float, b: float) -> str:
    return f"{100 * (b - a) / a:+.0f}%" if a else "n/a"


def roundrobin_vs_weighted(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    seed = args.seed
    cluster = _cluster(1, 8)
    scenarios = {
        "moderate": (_azure(args.requests or 6000, args.rate_scale or 8.0, seed), []),
        "moderate+slow-node": (_azure(args.requests or 6000, args.rate_scale or 8.0, seed),
                               [Fault(0.0, "r0-n3", "slow", 1e12, 1.5)]),
        "overload": (_azure(args.requests or 6000, (args.rate_scale or 8.0) * 4, seed), []),
    }
    table: dict[str, dict[str, Any]] = {}
    results: dict[str, SimResult] = {}
    for scen, (reqs, faults) in scenarios.items():
        for pol in ("round_robin", "weighted", "work_aware"):
            cfg = _config(args, cluster, pol, seed)
            row, res = run_once(cfg, reqs, _params(), faults, "qwen2-72b", not args.no_progress,
                                label=f"{scen} {pol}")
            table[f"{scen}/{pol}"] = row
            if scen == "moderate+slow-node":
                results[pol] = res
    plot_compare(results, out / "roundrobin-vs-weighted.png", "8 H100 nodes, one throttled 1.5x")
    claims = []
    for scen in scenarios:
        rr, w, wa = table[f"{scen}/round_robin"], table[f"{scen}/weighted"], table[f"{scen}/work_aware"]
        claims.append({
            "scenario": scen,
            "node_p95_std_ms": {"round_robin": rr["node_p95_std_ms"], "weighted": w["node_p95_std_ms"],
                                "seed": "380 -> 42"},
            "throughput_rps": {"round_robin": rr["throughput_rps"], "weighted": w["throughput_rps"],
                               "change": _pct(rr["throughput_rps"], w["throughput_rps"]), "seed": "+27%"},
            "p99_ms": {"round_robin": rr["p99_ms"], "weighted": w["p99_ms"], "change": _pct(rr["p99_ms"], w["p99_ms"]),
                       "seed": "-41%", "work_aware": wa["p99_ms"],
                       "work_aware_change": _pct(rr["p99_ms"], wa["p99_ms"])},
            "ttft_p99_ms": {"round_robin": rr["ttft_p99_ms"], "weighted": w["ttft_p99_ms"],
                            "work_aware": wa["ttft_p99_ms"]},
        })
    return {"table": table, "claims": claims, "plot": str(out / "roundrobin-vs-weighted.png")}


MOONCAKE = REPO / "data" / "traces" / "mooncake-fast25" / "synthetic_trace.jsonl"


def _mooncake(limit: int | None, rate: float, seed: int, users: int = 2000) -> list[TraceRequest]:
    with open(MOONCAKE, encoding="utf-8") as fh:
        reqs = list(parse_mooncake(fh, limit))
    if rate != 1.0:
        reqs = list(scale_rate(reqs, rate))
    return assign_users(reqs, users, 1.1, random.Random(seed + 1))


SATURATION_RATE = 9.0
"""`window-batching`'s default rate, in multiples of the Mooncake trace's: above what the 8 nodes serve."""
SATURATED_OVER = 1.1
"""A variant ran at saturation when the offered rate is above this multiple of its steady throughput."""


def window_batching(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    # Where memory binds: 8 H100 nodes serving Qwen2-7B (TP1) on the Mooncake trace (15 k-token prompts) at 9x its
    # rate, above what the cluster serves. The seed's fixed batches of 32 against the memory-budget window, with the
    # seed's memory formula and with the shape estimate against the engines' real free KV (the default), and the
    # shape estimate's margin swept to calibrate it (below 1 the batcher overcommits and the engines preempt).
    # Each variant says whether it ran at saturation (`saturated`: offered above 1.1x its steady throughput). At 6x,
    # the rate until 2026-12-06, the oracle-free default served every request at the offered rate with a median TTFT
    # of 0.2-0.5 s, and its KV peak ranged 0.53-0.87 over four seeds: that was not where memory binds.
    seed = args.seed
    cluster = _cluster(1, 8, tp=1, model="qwen2-7b")
    reqs = _mooncake(args.requests, args.rate_scale or SATURATION_RATE, seed)
    span_s = (reqs[-1].arrival_ms - reqs[0].arrival_ms) / 1000.0 if len(reqs) > 1 else 0.0
    offered = len(reqs) / span_s if span_s > 0 else 0.0
    seed_est = {"estimator": "seed"}
    variants: dict[str, tuple[SimParams, dict[str, Any], dict[str, Any]]] = {
        "fixed32": (_params(batching="fixed", fixed_batch=32, max_num_seqs=32, admission=False),
                    {"window_ms": 100}, seed_est),
        "window100-seed": (_params(admission=False), {"window_ms": 100}, seed_est),
        "window100": (_params(admission=False), {"window_ms": 100}, {}),
        "window200": (_params(admission=False), {"window_ms": 200}, {}),
    }
    for m in (0.6, 0.8, 0.9, 1.1):
        variants[f"window100-margin{m}"] = (_params(admission=False), {"window_ms": 100}, {"shape_margin": m})
    table: dict[str, dict[str, Any]] = {}
    results: dict[str, SimResult] = {}
    for name, (params, batcher, profiling) in variants.items():
        cfg = _config(args, cluster, "work_aware", seed, batcher, profiling)
        table[name], results[name] = run_once(cfg, reqs, params, [], "qwen2-7b", not args.no_progress, label=name)
        table[name]["offered_rps"] = round(offered, 3)
        table[name]["saturated"] = offered > SATURATED_OVER * table[name]["steady_throughput_rps"]
    plot_compare({k: v for k, v in results.items() if "margin" not in k}, out / "window-batching.png",
                 f"fixed 32 vs memory-budget window (Mooncake, {args.rate_scale or SATURATION_RATE:g}x)")

    def col(key: str) -> dict[str, Any]:
        return {k: v[key] for k, v in table.items()}

    claims = [{
        "kv_util_peak": col("kv_util_peak") | {"seed": "memory utilisation 65% -> 89%"},
        "mean_kv_util": col("mean_kv_util"),
        "preempted_frac": col("preempted_frac"),
        "saturated": col("saturated"),
        "offered_rps": offered,
        "throughput_rps": col("throughput_rps"),
        "steady_throughput_rps": col("steady_throughput_rps"),
        "mean_batch_mem_util": col("mean_batch_mem_util"),
        "small_ttft_p95_ms": col("small_ttft_p95_ms") | {"seed": "small-request P95 < 85 ms (window)"},
        "p95_ms": col("p95_ms"),
    }]
    return {"table": table, "claims": claims, "plot": str(out / "window-batching.png")}


def scale_pareto(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    seed = args.seed
    base = _azure(None, 1.0, seed)
    copies = 11  # 11 x 19,366 = 213 k requests in 58 min: the seed's 5 M/day
    full = superpose(base, copies, random.Random(seed + 2))
    load = full[: args.requests] if args.requests else full
    sizes = [int(x) for x in (args.sizes or "64,128,256,512,1024").split(",")]
    table: dict[str, dict[str, Any]] = {}
    price = None
    cp = _costs(args)
    for gpus in sizes:
        nodes = gpus // 8
        racks = max(1, nodes // 8)
        cfg = _config(args, _cluster(racks, nodes // racks), "weighted", seed)
        price = cfg.gpus["h100-80gb"].price_per_hour
        row, _res = run_once(cfg, load, _params(control_plane=cp), [], "qwen2-72b", not args.no_progress,
                             label=f"{gpus} GPUs")
        hours = max(1e-9, row["simulated_s"] / 3600.0)
        row["cost_per_request_usd"] = round(gpus * price * hours / max(1, row["completed"]), 6)
        table[str(gpus)] = row
    # capacity: the same clusters flooded (80 k requests arriving 40x faster than the seed's load, above what either
    # size serves, for about a minute); completions per second in the steady middle half measure what each can do
    capacity: dict[str, float] = {}
    capacity_cp: dict[str, float] = {}
    stations: dict[str, Any] = {}
    flood = args.flood_requests or 80_000
    cap_sizes = [int(x) for x in args.capacity_sizes.split(",")] if args.capacity_sizes else [512, 1024]
    flood_scale = args.flood_scale or 40.0
    copies_now = copies
    # with the costs on, each cost alone and all together (`COST_VARIANTS`): what each one takes off the capacity
    by_cost: dict[str, dict[str, float]] = {name: {} for name in COST_VARIANTS} if cp is not None else {}
    counts: dict[str, dict[str, int]] = {}
    for gpus in cap_sizes:
        if gpus not in sizes and not args.capacity_sizes:
            continue
        nodes = gpus // 8
        cfg = _config(args, _cluster(nodes // 8, 8), "weighted", seed)
        # above 1,024 GPUs the flood grows with the cluster (requests and rate), so it overloads it as long
        k = max(1.0, gpus / 1024.0)
        n_flood = int(flood * k)
        if n_flood > len(full):  # more copies of the hour: each copy adds its rate, which the scale takes back
            copies_now = -(-n_flood // len(base))
            full = superpose(base, copies_now, random.Random(seed + 2))
        scale = flood_scale * k * copies / copies_now
        heavy = list(scale_rate(full[:n_flood], scale))  # the floods do not depend on --requests
        row, _ = run_once(cfg, heavy, _params(), [], "qwen2-72b", not args.no_progress, label=f"{gpus} overload")
        capacity[str(gpus)] = row["steady_throughput_rps"]
        variants: dict[str, ControlPlaneCosts] = {}
        if cp is not None:
            offered = len(heavy) * 1000.0 / max(1.0, heavy[-1].arrival_ms - heavy[0].arrival_ms)
            counts[str(gpus)] = sized_counts(cp, nodes, cfg.policies.worker.max_running, offered)
            variants = _cost_variants(cp, counts[str(gpus)])
        for name, c in variants.items():
            row, _ = run_once(cfg, heavy, _params(control_plane=c), [], "qwen2-72b", not args.no_progress,
                              label=f"{gpus} overload, control-plane costs: {name}")
            by_cost[name][str(gpus)] = row["steady_throughput_rps"]
            if name == "all_sized":
                capacity_cp[str(gpus)] = row["steady_throughput_rps"]
                stations[str(gpus)] = row.get("control_plane", {})
    _plot_pareto(table, out / "scale-pareto.png")
    if by_cost:
        plot_capacity(capacity, by_cost, out / "scale-capacity.png")
    both = "512" in capacity and "1024" in capacity
    claims = [{
        "throughput_1024_vs_512": (f"{_pct(capacity['512'], capacity['1024'])} (capacity at overload)"
                                   if both else "n/a"),
        "throughput_1024_vs_512_control_plane": (
            f"{_pct(capacity_cp['512'], capacity_cp['1024'])} (capacity at overload, measured control-plane costs)"
            if "512" in capacity_cp and "1024" in capacity_cp else "n/a (run with --control-plane)"),
        "seed": "+22% (1024 vs 512 GPUs), P95 +9%",
        "p95_ms": {k: v["p95_ms"] for k, v in table.items()},
        "cost_per_request_usd": {k: v["cost_per_request_usd"] for k, v in table.items()},
        "sim_wall_s_1024": table.get("1024", {}).get("sim_wall_s"),
        "requests_1024": table.get("1024", {}).get("requests"),
    }]
    shares = {name: {g: round((capacity[g] - v) / capacity[g], 4) for g, v in caps.items() if capacity.get(g)}
              for name, caps in by_cost.items()}
    return {"table": table, "capacity_rps": capacity, "capacity_rps_control_plane": capacity_cp,
            "capacity_rps_by_cost": by_cost, "capacity_share_taken_by_cost": shares, "sized_counts": counts,
            "gain_by_cost": {name: _gains(caps) for name, caps in {"none": capacity, **by_cost}.items()},
            "control_plane_stations_at_overload": stations, "flood_requests": flood, "flood_scale": flood_scale,
            "control_plane": _cp_settings(cp), "claims": claims, "plot": str(out / "scale-pareto.png"),
            "capacity_plot": str(out / "scale-capacity.png") if by_cost else None,
            "price_per_gpu_hour": price}


COST_VARIANTS = ("stations", "stations_sized", "fabric", "etcd_records", "all_sized")
"""The control-plane costs scale-pareto turns on one at a time, then together:
- `stations`: the router, the rack batchers, the Valkey shards and the etcd ownership moves, at the counts given
  (`--routers`, `--batchers-per-rack`, `--valkey-shards`: 1 each by default);
- `stations_sized`: the same with the counts the sizing rule gives for the cluster (`sized_counts`);
- `fabric` alone: the node links both ways, the racks' uplinks to the spine, host-tier loads sharing the inbound link;
- `etcd_records` alone: the workers' sequence records on etcd;
- `all_sized`: the sized stations, the fabric and the records together."""


def sized_counts(cp: ControlPlaneCosts, nodes: int, max_seqs: int, offered_rps: float, cap: float = 0.7
                 ) -> dict[str, int]:
    """Processes a cluster needs at `cap` utilisation (the `sizing` experiment's rule): routers for the offered
    rate; spread Valkey shards for the token flushes of every node's slots decoding at once (one XADD per sequence
    per `token_flush_ms`: the one cost that grows with the cluster rather than with the rate)."""
    routers = max(1, math.ceil(offered_rps * cp.router_ms / 1000.0 / cap))
    per_shard = cap * cp.token_flush_ms / cp.xadd_ms if cp.xadd_ms > 0 and cp.token_flush_ms > 0 else math.inf
    shards = max(1, math.ceil(nodes * max_seqs / per_shard)) if per_shard < math.inf else 1
    return {"routers": routers, "valkey_shards": shards}


def _cost_variants(cp: ControlPlaneCosts, sized: dict[str, int]) -> dict[str, ControlPlaneCosts]:
    none = {"router_ms": 0.0, "batcher_ms": 0.0, "xadd_ms": 0.0, "read_ms": 0.0}
    big = dataclasses.replace(cp, **sized)  # type: ignore[arg-type]
    return {"stations": dataclasses.replace(cp, fabric=False, record_flush_ms=0.0),
            "stations_sized": dataclasses.replace(big, fabric=False, record_flush_ms=0.0),
            "fabric": dataclasses.replace(cp, **none, record_flush_ms=0.0),  # type: ignore[arg-type]
            "etcd_records": dataclasses.replace(cp, **none, fabric=False),  # type: ignore[arg-type]
            "all_sized": big}


def _gains(caps: dict[str, float]) -> dict[str, str]:
    """Capacity gain from each size to the next (e.g. "512->1024": "+101%"), and per GPU."""
    sizes = sorted(caps, key=int)
    out = {}
    for a, b in itertools.pairwise(sizes):
        per_gpu = (caps[b] / int(b)) / (caps[a] / int(a)) if caps[a] else 0.0
        out[f"{a}->{b}"] = f"{_pct(caps[a], caps[b])} ({per_gpu:.3f}x per GPU)"
    return out


def _costs(args: argparse.Namespace) -> ControlPlaneCosts | None:
    from workers.sim.calibrate import control_plane_costs

    return control_plane_costs(args, _config(args, _cluster(1, 1), "weighted", args.seed))


def _cp_settings(cp: ControlPlaneCosts | None) -> dict[str, Any] | None:
    if cp is None:
        return None
    return dataclasses.asdict(cp)


DAY_S = 86_400.0
VOLUMES = {"5M/day": 5_000_000, "50M/day": 50_000_000}


def sizing(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Processes per 1,000 GPUs from the measured costs; the per-request Valkey demand and the saturation points
    measured in the simulator."""
    from workers.sim.calibrate import CALIBRATION, load_calibration

    seed = args.seed
    cal_path = Path(args.control_plane) if getattr(args, "control_plane", None) else CALIBRATION
    cal = load_calibration(cal_path)
    cfg0 = _config(args, _cluster(1, 8), "weighted", seed)
    c1 = ControlPlaneCosts.from_calibration(cal, token_flush_ms=float(cfg0.policies.worker.token_flush_ms))
    cap = 0.7
    # 1. per-request demand on each station, measured by a simulation at a moderate load: 8 H100 TP8 nodes
    #    (Qwen2-72B), the Azure conversation trace at 4x its rate (its decode times set the token flushes)
    reqs = _azure(args.requests or 3000, args.rate_scale or 4.0, seed)
    row, res = run_once(cfg0, reqs, _params(control_plane=c1), [], "qwen2-72b", not args.no_progress,
                        label="demand per request")
    st = row["control_plane"]
    done = max(1, row["completed"])
    demand = {
        "router_ms": c1.router_ms,
        "batcher_ms": c1.batcher_ms,
        "valkey_global_shard_ms": round(st["valkey_global_shard"]["busy_ms"] / done, 5),
        "valkey_spread_shard_ms": round(st["valkey_spread_shards"]["busy_ms"] / done, 5),
        "mean_batch_size": round(sum(res.batch_sizes) / max(1, len(res.batch_sizes)), 2),
    }
    per_process_rps = {k: round(cap * 1000.0 / v, 1) for k, v in demand.items() if k.endswith("_ms")}
    # 2. the table: per 1,000 GPUs (15.6 racks of 8 TP8 nodes), each volume at its mean rate
    racks_per_1000 = 1000.0 / 64.0
    table: dict[str, dict[str, Any]] = {}
    for label, vol in VOLUMES.items():
        rps = vol / DAY_S
        table[label] = {
            "mean_rps": round(rps, 1),
            "routers": max(1, math.ceil(rps * demand["router_ms"] / 1000.0 / cap)),
            "batchers_per_rack": max(1, math.ceil(rps / racks_per_1000 * demand["batcher_ms"] / 1000.0 / cap)),
            "valkey_shards": max(1, math.ceil(rps * demand["valkey_spread_shard_ms"] / 1000.0 / cap)),
            "global_shard_utilisation": round(rps * demand["valkey_global_shard_ms"] / 1000.0, 4),
            "router_utilisation_with_1": round(rps * demand["router_ms"] / 1000.0, 4),
            "batcher_utilisation_with_1": round(rps / racks_per_1000 * demand["batcher_ms"] / 1000.0, 4),
            "shard_utilisation_with_1": round(rps * demand["valkey_spread_shard_ms"] / 1000.0, 4),
        }
    # the token flushes bind on concurrency, not on the request rate: one XADD per decoding sequence per flush
    seqs_per_shard = cap * c1.token_flush_ms / c1.xadd_ms
    full = 1000 // 8 * cfg0.policies.worker.max_running  # 125 TP8 nodes x max_running sequences each
    concurrency = {
        "decoding_seqs_per_shard_at_70pct": round(seqs_per_shard),
        "seed_peak_20k": {"concurrency": 20_000, "valkey_shards": math.ceil(20_000 / seqs_per_shard)},
        "full_1000_gpus": {"concurrency": full, "valkey_shards": math.ceil(full / seqs_per_shard)},
    }
    # the closed-form sizing of pipeline.sim.control_plane (its own Valkey estimate) beside, as a check
    sized = size_for(c1, VOLUMES["50M/day"] / DAY_S, 16, decode_ms=row["p50_ms"], batch_size=demand["mean_batch_size"])
    # 3. saturation in the simulator: the router station driven at 0.5x, 0.9x, 1.2x and 1.5x of one router
    #    process's capacity (1 / router_ms), with one router and with the count sized for that rate; a 16-rack
    #    cluster of Qwen2-7B nodes, admission off (every request reaches the router), 2 s of arrivals
    one = 1000.0 / c1.router_ms
    base = _azure(None, 1.0, seed)
    base_rps = len(base) / max(1e-9, (base[-1].arrival_ms - base[0].arrival_ms) / 1000.0)
    sat: dict[str, dict[str, Any]] = {}
    results: dict[str, SimResult] = {}
    cfg7 = _config(args, _cluster(args.sat_racks or 16, 8, tp=1, model="qwen2-7b"), "round_robin", seed)
    for mult in (0.5, 0.9, 1.2, 1.5):
        rate = mult * one
        n = int(rate * (args.sat_seconds or 2.0))
        load = _azure(n, rate / base_rps, seed)
        need = max(1, math.ceil(rate * c1.router_ms / 1000.0 / cap))
        for routers in sorted({1, need}):
            cp = ControlPlaneCosts.from_calibration(cal, routers=routers, batchers_per_rack=1, valkey_shards=16,
                                                    token_flush_ms=c1.token_flush_ms)
            r, rr = run_once(cfg7, load, _params(control_plane=cp, admission=False), [], "qwen2-7b",
                             not args.no_progress, label=f"router x{routers} at {mult}x")
            key = f"{mult}x/{routers} router{'s' if routers > 1 else ''}"
            rs = r["control_plane"]["router"]
            sat[key] = {"offered_rps": round(rate, 1), "routers": routers,
                        "offered_utilisation": round(rate * c1.router_ms / 1000.0 / routers, 3),
                        "mean_wait_ms": rs["mean_wait_ms"], "max_wait_ms": rs["max_wait_ms"],
                        "backlog_ms": rs["backlog_ms"], "ttft_p50_ms": r["ttft_p50_ms"],
                        "ttft_p99_ms": r["ttft_p99_ms"], "requests": n, "sim_wall_s": r["sim_wall_s"]}
            if routers == 1:
                results[f"{mult}x, 1 router"] = rr
    # 4. a rack's batcher the same way: one rack of 32 Qwen2-7B nodes, every request to it, half as long
    bsat: dict[str, dict[str, Any]] = {}
    cfg_b = _config(args, _cluster(1, 32, tp=1, model="qwen2-7b"), "round_robin", seed)
    for mult in (0.5, 0.9, 1.2, 1.5):
        rate = mult * 1000.0 / c1.batcher_ms
        n = int(rate * (args.sat_seconds or 2.0) / 2)
        load = _azure(n, rate / base_rps, seed)
        need = max(1, math.ceil(rate * c1.batcher_ms / 1000.0 / cap))
        for k in sorted({1, need}):
            cp = ControlPlaneCosts.from_calibration(cal, routers=4, batchers_per_rack=k, valkey_shards=16,
                                                    token_flush_ms=c1.token_flush_ms)
            r, _rr = run_once(cfg_b, load, _params(control_plane=cp, admission=False), [], "qwen2-7b",
                              not args.no_progress, label=f"batcher x{k} at {mult}x")
            bs = r["control_plane"]["batcher_busiest_rack"]
            bsat[f"{mult}x/{k} batcher{'s' if k > 1 else ''}"] = {
                "offered_rps": round(rate, 1), "batchers": k,
                "offered_utilisation": round(rate * c1.batcher_ms / 1000.0 / k, 3),
                "mean_wait_ms": bs["mean_wait_ms"], "max_wait_ms": bs["max_wait_ms"], "ttft_p50_ms": r["ttft_p50_ms"],
                "requests": n, "sim_wall_s": r["sim_wall_s"]}
    # 5. a Valkey shard on the same Station code, replaying the trace's arrivals at multiples of one shard's
    #    capacity at the measured per-request demand (the simulator's clusters here do not decode enough
    #    sequences at once to load one)
    replay: dict[str, dict[str, Any]] = {}
    for name, svc in (("valkey_spread_shard", demand["valkey_spread_shard_ms"]),):
        for mult in (0.5, 0.9, 1.2, 1.5):
            rate = mult * 1000.0 / svc
            n = int(rate * 4.0)
            arr = _azure(n, rate / base_rps, seed)
            for k in sorted({1, max(1, math.ceil(rate * svc / 1000.0 / cap))}):
                s = Station(k)
                for q in arr:
                    s.serve(q.arrival_ms, svc)
                rep = s.report(arr[-1].arrival_ms - arr[0].arrival_ms)
                replay[f"{name} {mult}x/{k}"] = {"offered_rps": round(rate, 1), "servers": k,
                                                  "utilisation": rep["utilisation"],
                                                  "mean_wait_ms": rep["mean_wait_ms"],
                                                  "max_wait_ms": rep["max_wait_ms"]}
    _plot_sizing(sat, out / "sizing.png")
    claims = [{
        "per_process_rps_at_70pct": per_process_rps,
        "sizing_per_1000_gpus": {k: {x: v[x] for x in ("routers", "batchers_per_rack", "valkey_shards")}
                                 for k, v in table.items()},
        "closed_form_50M": {"routers": sized.routers, "batchers_per_rack": sized.batchers_per_rack,
                            "valkey_shards": sized.valkey_shards},
        "router_saturation": {k: v["mean_wait_ms"] for k, v in sat.items()},
        "batcher_saturation": {k: v["mean_wait_ms"] for k, v in bsat.items()},
        "seed": "not stated (the seed gives no process counts)",
    }]
    lines = ["per 1,000 GPUs (15.6 racks of 8 H100 TP8 nodes), at the mean rate, each station <= 70% utilised:",
             f"{'volume':<9} {'req/s':>7} {'routers':>8} {'batchers/rack':>14} {'valkey shards':>14} "
             f"{'1 router':>9} {'1 batcher':>10} {'1 shard':>8} {'global shard':>13}"]
    for label, v in table.items():
        lines.append(f"{label:<9} {v['mean_rps']:>7} {v['routers']:>8} {v['batchers_per_rack']:>14} "
                     f"{v['valkey_shards']:>14} {v['router_utilisation_with_1']:>9.1%} "
                     f"{v['batcher_utilisation_with_1']:>10.1%} {v['shard_utilisation_with_1']:>8.1%} "
                     f"{v['global_shard_utilisation']:>13.1%}")
    lines.append("one process carries at 70% (req/s): " + ", ".join(
        f"{k.removesuffix('_ms')} {v:,.0f}" for k, v in per_process_rps.items()) + " (batcher: per rack)")
    lines.append(f"token flushes: one spread shard carries {seqs_per_shard:,.0f} decoding sequences at 70% "
                 f"(one XADD each per {c1.token_flush_ms:.0f} ms); the seed's 20 k peak concurrency needs "
                 f"{concurrency['seed_peak_20k']['valkey_shards']}, 1,000 GPUs full ({full:,} sequences) "
                 f"{concurrency['full_1000_gpus']['valkey_shards']}")
    lines.append("router station in the simulator, 2 s of arrivals, admission off (mean / max wait ms; above capacity "
                 "the wait grows with the run's length):")
    for k, v in sat.items():
        lines.append(f"  {k:<18} {v['offered_rps']:>8} req/s  wait {v['mean_wait_ms']:>9} / {v['max_wait_ms']:>9} ms"
                     f"  offered {v['offered_utilisation']:.2f} of capacity  TTFT p50 {v['ttft_p50_ms']} ms")
    lines.append("a rack's batcher in the simulator, 1 rack x 32 nodes, 1 s of arrivals, admission off "
                 "(mean / max wait ms):")
    for k, v in bsat.items():
        lines.append(f"  {k:<18} {v['offered_rps']:>8} req/s  wait {v['mean_wait_ms']:>9} / {v['max_wait_ms']:>9} ms"
                     f"  offered {v['offered_utilisation']:.2f} of capacity  TTFT p50 {v['ttft_p50_ms']} ms")
    lines.append("a Valkey spread shard on the same Station code, trace arrivals (mean / max wait ms):")
    for k, v in replay.items():
        lines.append(f"  {k:<28} {v['offered_rps']:>8} req/s  wait {v['mean_wait_ms']:>9} / {v['max_wait_ms']:>9}")
    run = {k: row[k] for k in ("requests", "completed", "p50_ms", "throughput_rps")}
    return {"text": "\n".join(lines), "table": table, "demand_per_request_ms": demand, "concurrency": concurrency,
            "demand_run": run, "router_saturation_sim": sat, "batcher_saturation_sim": bsat,
            "station_replay": replay, "utilisation_cap": cap,
            "calibration": str(cal_path), "claims": claims, "plot": str(out / "sizing.png")}


def _plot_sizing(sat: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    by: dict[int, list[tuple[float, float]]] = {}
    for v in sat.values():
        by.setdefault(v["routers"], []).append((v["offered_rps"], max(1e-3, v["mean_wait_ms"])))
    for k, pts in sorted(by.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{k} router process{'es' if k > 1 else ''}")
    ax.set_yscale("log")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("mean wait for a router (ms, log)")
    ax.set_title("Router station in the simulator (measured per-decision cost)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_capacity(capacity: dict[str, float], by_cost: dict[str, dict[str, float]], path: Path) -> None:
    """Capacity per GPU against the cluster's size, without the control-plane costs and with each one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for name, caps in {"no costs": capacity, **by_cost}.items():
        sizes = sorted(caps, key=int)
        ax.plot([int(g) for g in sizes], [caps[g] / int(g) for g in sizes], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("capacity per GPU (req/s, steady middle half of the flood)")
    ax.set_title("What each control-plane cost takes off the capacity")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_pareto(table: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    xs = [v["p95_ms"] for v in table.values()]
    ys = [v["cost_per_request_usd"] * 1000 for v in table.values()]
    ax.plot(xs, ys, "o-")
    for label, x, y in zip(table, xs, ys, strict=True):
        ax.annotate(f"{label} GPUs", (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xlabel("P95 end-to-end latency (ms)")
    ax.set_ylabel("cost per 1,000 requests (USD)")
    ax.set_title("Cluster size: cost vs P95 at the seed's load (Qwen2-72B, H100 TP8)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def vidur(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from workers.sim.vidur_peer import compare

    result = compare(args.requests or 2000, out, progress=not args.no_progress)
    result["claims"] = []
    return result


# -- priority classes and fair shares (pipeline/priority.py) -----------------------------------------------------------
CLASS_MODEL = "qwen2-72b"
"""The model of `priority` and `fairness`: one rack of 2 H100 TP8 nodes serving it (`_class_rack`)."""
PRIORITY_LOAD = 0.7
"""`priority`: the interactive trace's mean load, a fraction of the cluster's capacity on it."""
PRIORITY_REQUESTS = 9000
"""`priority`: interactive requests by default (the first of the Azure conversation trace; ~10 simulated minutes)."""
BACKLOG_AT = 0.25
"""`priority`: the batch backlog arrives this far into the interactive trace's span."""
BACKLOG_OVER = 1.2
"""`priority`: the backlog holds this many times the requests the cluster completes at capacity in the rest of the
interactive trace: it outlasts the trace in every run, the saturated one included (`saturated` says whether it
did)."""
BATCH_TENANT = "batch-job"
BATCH_USERS = 64
BIN_MS = 30_000.0
"""`priority`'s plots: bins of 30 s (P99 TTFT by arrival time, tokens per second)."""
PRIORITY_TARGETS = {"interactive_p99_ttft_ratio": 1.10, "batch_idle_use": 0.90}
"""The issue's targets: interactive P99 TTFT with the backlog within 10% of alone, and the backlog using at least
90% of the capacity interactive work leaves idle."""
FAIR_DEMAND = (("tenant-a", 1.8), ("tenant-b", 0.6))
"""`fairness`: each tenant's demand, a multiple of the cluster's capacity: 3:1, each above an equal share (0.5)."""
FAIR_MINUTES = 6
"""`fairness`: minutes of arrivals by default (`--requests` sets the two tenants' requests instead)."""
FAIR_TARGET = 0.10
"""`fairness`: the issue's target, every minute's share within 10% of an equal one."""
FAIR_BIN_MS = 60_000.0
"""`fairness`: shares are scored per bin of this width (a minute; the tests use shorter ones)."""


def _class_rack() -> dict[str, Any]:
    return _cluster(1, 2, model=CLASS_MODEL)


def _capacity(args: argparse.Namespace, cfg: RackflowConfig, reqs: list[TraceRequest]) -> dict[str, float]:
    """The cluster's capacity on `reqs` as `rackflow sim matrix` measures it (`flood_capacity`: completions per
    second in the steady middle of a flood of them, admission off), with the experiment's config and node policy."""

    def steady(scale: float) -> float:
        row, _ = run_once(cfg, list(scale_rate(reqs, scale)), _params(admission=False), [], CLASS_MODEL,
                          not args.no_progress, label=f"capacity: flood x{scale:.1f}")
        return float(row["steady_throughput_rps"])

    return flood_capacity(reqs, steady)


def _scaled(reqs: list[TraceRequest], rps: float, tenant: str) -> list[TraceRequest]:
    """`reqs` from time 0, compressed to a mean rate of `rps`, as `tenant`'s (its users apart from any other
    tenant's)."""
    scaled = list(scale_rate(reqs, rps / _span_rate(reqs)))
    t0 = scaled[0].arrival_ms
    return [dataclasses.replace(r, arrival_ms=r.arrival_ms - t0, tenant=tenant, user_id=f"{tenant}/{r.user_id}")
            for r in scaled]


def priority(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    # 1. the interactive trace (the first --requests Azure conversation requests) at PRIORITY_LOAD of the rack's
    #    capacity on it, measured as the matrix does; 2. the backlog: requests drawn (with replacement) from the whole
    #    trace's lengths, all arriving at BACKLOG_AT of the span; 3. the backlog alone, run as interactive requests
    #    (every slot theirs), measures the rack's token capacity over the backlog period [arrival of the backlog,
    #    last interactive arrival]
    seed = args.seed
    cfg = _config(args, _class_rack(), "work_aware", seed)
    raw = _azure(args.requests or PRIORITY_REQUESTS, 1.0, seed)
    flood = _capacity(args, cfg, raw)
    cap = flood["capacity_rps"]
    inter = _scaled(raw, PRIORITY_LOAD * cap, "chat")
    end = inter[-1].arrival_ms
    at = round(BACKLOG_AT * end / 1000.0) * 1000.0
    count = math.ceil(BACKLOG_OVER * cap * (end - at) / 1000.0)
    drawn = random.Random(seed + 3).choices(_azure(None, 1.0, seed), k=count)

    def backlog(cls: int) -> list[TraceRequest]:
        return [TraceRequest(at, r.in_tokens, r.out_tokens, user_id=f"{BATCH_TENANT}/{k % BATCH_USERS}",
                             tenant=BATCH_TENANT, priority=cls) for k, r in enumerate(drawn)]

    def merged(cls: int) -> list[TraceRequest]:
        return sorted(inter + backlog(cls), key=lambda r: r.arrival_ms)  # stable: the trace's order at equal times

    runs: dict[str, tuple[list[TraceRequest], dict[str, Any]]] = {
        "saturated": (backlog(INTERACTIVE), {}),
        "alone": (inter, {}),
        "preempt": (merged(BATCH), {"batch_yield": "preempt"}),
        "hold": (merged(BATCH), {"batch_yield": "hold"}),
        "no-priority": (merged(INTERACTIVE), {}),
    }
    results: dict[str, SimResult] = {}
    table: dict[str, dict[str, Any]] = {}
    for name, (reqs, batcher) in runs.items():
        run_cfg = _config(args, _class_rack(), "work_aware", seed, batcher)
        row, results[name] = run_once(run_cfg, reqs, _params(), [], CLASS_MODEL, not args.no_progress, label=name)
        table[name] = {k: row[k] for k in ("requests", "shed", "sim_wall_s", "simulated_s")}
    cap_tokens = served_tokens(results["saturated"], range(count), at, end)
    for name, res in results.items():
        table[name] |= _priority_row(res, at, end, cap_tokens)
    alone = table["alone"]["interactive_p99_ttft_ms"]
    for row in table.values():
        p99 = row["interactive_p99_ttft_ms"]
        row["interactive_p99_ttft_ratio"] = round(p99 / alone, 3) if alone and p99 is not None else None
    plot = out / "priority.png"
    _plot_priority(results, at, end, plot)
    default = cfg.policies.batcher.batch_yield
    d = table[default]
    period_s = (end - at) / 1000.0
    setup = {
        "cluster": f"1 rack x 2 H100 TP8 nodes, {CLASS_MODEL}", "node_policy": "work_aware",
        "default_batch_yield": default, "headline": f"the top-level figures are the default's ({default})",
        "capacity_rps": cap, "capacity_flood": flood, "interactive_load": PRIORITY_LOAD,
        "interactive_requests": len(inter), "interactive_rps": round(len(inter) / (end / 1000.0), 3),
        "interactive_span_s": round(end / 1000.0, 1), "backlog_at_s": at / 1000.0, "backlog_requests": count,
        "backlog_period_s": round(period_s, 1),
        "token_capacity": round(cap_tokens), "token_capacity_per_s": round(cap_tokens / period_s, 1),
        "ttft_over": "interactive requests arriving in the backlog period (TTFT P99 and P50, TPOT P50 and P99); "
                     "`interactive_p99_ttft_all_ms`: every interactive request",
        "tokens": "prompt tokens when the first token comes, generated tokens spread evenly from first token to "
                  "finish, within the backlog period",
        "lost": "requests of either class with no result that admission did not shed (429s are `shed`, apart)",
    }
    return {
        "setup": setup, "table": table, "plot": str(plot),
        "interactive_p99_ttft_ms": d["interactive_p99_ttft_ms"], "interactive_alone_p99_ttft_ms": alone,
        "interactive_p99_ttft_ratio": d["interactive_p99_ttft_ratio"], "batch_idle_use": d["batch_idle_use"],
        "lost": d["interactive_lost"] + d["batch_lost"], "shed": d["interactive_shed"] + d["batch_shed"],
        "targets": PRIORITY_TARGETS, "meets": _meets(d),
        "by_yield": {y: {k: table[y][k] for k in ("interactive_p99_ttft_ms", "interactive_p99_ttft_ratio",
                                                  "batch_idle_use", "interactive_lost", "batch_lost",
                                                  "interactive_shed", "batch_shed")} | {"meets": _meets(table[y])}
                     for y in ("preempt", "hold")},
        "text": _priority_text(setup, table),
        "claims": [],
    }


def _meets(row: dict[str, Any]) -> dict[str, bool]:
    return {"interactive_p99_ttft_ratio": (row["interactive_p99_ttft_ratio"] or math.inf)
            <= PRIORITY_TARGETS["interactive_p99_ttft_ratio"],
            "batch_idle_use": (row["batch_idle_use"] or 0.0) >= PRIORITY_TARGETS["batch_idle_use"]}


def _split(res: SimResult) -> tuple[list[int], list[int]]:
    """(interactive requests, the backlog's), by tenant: the backlog keeps its tenant when it runs as interactive."""
    batch = [i for i, t in enumerate(res.tenant) if t == BATCH_TENANT]
    return [i for i, t in enumerate(res.tenant) if t != BATCH_TENANT], batch


def _fates(res: SimResult, ids: list[int]) -> tuple[int, int, int]:
    """(completed, shed by admission, lost: no result otherwise) of the requests `ids`."""
    done = sum(1 for i in ids if res.finish[i] >= 0 and not res.dropped[i])
    shed = sum(1 for i in ids if res.drop_reason[i] == SHED_REASON)
    return done, shed, len(ids) - done - shed


def _latencies(res: SimResult, ids: Sequence[int]) -> tuple[list[float], list[float]]:
    """TTFT and TPOT ((finish - first token) / (output tokens - 1)), in ms, of the requests `ids` that completed;
    TPOT of those with more than one output token."""
    done = [i for i in ids if res.finish[i] >= 0 and res.first_token[i] >= 0 and not res.dropped[i]]
    return ([res.first_token[i] - res.arrival[i] for i in done],
            [(res.finish[i] - res.first_token[i]) / (res.out_tokens[i] - 1) for i in done if res.out_tokens[i] > 1])


def _ms(values: list[float], q: float) -> float | None:
    return round(percentile(values, q), 1) if values else None


def _priority_row(res: SimResult, at: float, end: float, cap_tokens: float) -> dict[str, Any]:
    inter, batch = _split(res)
    ttft, tpot = _latencies(res, [i for i in inter if at <= res.arrival[i] < end])
    every, _ = _latencies(res, inter)
    i_done, i_shed, i_lost = _fates(res, inter)
    b_done, b_shed, b_lost = _fates(res, batch)
    i_tok = served_tokens(res, inter, at, end)
    b_tok = served_tokens(res, batch, at, end)
    idle = cap_tokens - i_tok
    return {
        "interactive_p99_ttft_ms": _ms(ttft, 99), "interactive_p50_ttft_ms": _ms(ttft, 50),
        "interactive_p99_ttft_all_ms": _ms(every, 99),
        "interactive_p50_tpot_ms": _ms(tpot, 50), "interactive_p99_tpot_ms": _ms(tpot, 99),
        "interactive_completed": i_done, "interactive_shed": i_shed, "interactive_lost": i_lost,
        "interactive_tokens": round(i_tok), "idle_tokens": round(idle),
        "idle_share": round(idle / cap_tokens, 4) if cap_tokens > 0 else None,
        "batch_tokens": round(b_tok), "batch_tokens_per_s": round(b_tok * 1000.0 / (end - at), 1),
        "batch_idle_use": round(b_tok / idle, 4) if batch and idle > 0 else None,
        "batch_completed": b_done, "batch_shed": b_shed, "batch_lost": b_lost,
        "batch_completed_in_period": sum(1 for i in batch if at <= res.finish[i] < end and not res.dropped[i]),
        "saturated": any(res.finish[i] >= end for i in batch) if batch else None,
        "preemptions": res.preemptions, "priority_preemptions": res.priority_preemptions,
    }


PRIORITY_KEYS = ("interactive_p99_ttft_ms", "interactive_p99_ttft_ratio", "interactive_p50_ttft_ms",
                 "interactive_p99_ttft_all_ms", "interactive_p50_tpot_ms", "interactive_p99_tpot_ms",
                 "interactive_shed", "interactive_lost", "interactive_tokens", "idle_share", "batch_tokens",
                 "batch_tokens_per_s", "batch_idle_use", "batch_completed", "batch_completed_in_period", "batch_shed",
                 "batch_lost", "saturated", "preemptions", "priority_preemptions", "sim_wall_s")


def _priority_text(setup: dict[str, Any], table: dict[str, dict[str, Any]]) -> str:
    head = (f"{setup['cluster']}; capacity {setup['capacity_rps']} req/s (flood); interactive: "
            f"{setup['interactive_requests']} requests at {setup['interactive_rps']} req/s over "
            f"{setup['interactive_span_s']} s; backlog: {setup['backlog_requests']} batch requests at "
            f"{setup['backlog_at_s']:.0f} s; token capacity {setup['token_capacity_per_s']:,} tokens/s (saturated "
            f"run) over the {setup['backlog_period_s']} s backlog period")
    return head + "\n" + format_table(table, PRIORITY_KEYS)


def _plot_priority(results: dict[str, SimResult], at: float, end: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = max(r.end_ms for r in results.values())
    bins = max(1, math.ceil(last / BIN_MS))
    mids = [(k + 0.5) * BIN_MS / 1000.0 for k in range(bins)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, res in results.items():
        inter, batch = _split(res)
        if inter:
            p99 = ttft_percentile_bins(res, inter, 0.0, BIN_MS, bins)
            ax1.plot([m for m, v in zip(mids, p99, strict=True) if v is not None],
                     [v for v in p99 if v is not None], label=name)
        if batch:
            tok = service_bins(res, batch, 0.0, BIN_MS, bins)
            ax2.plot(mids, [t * 1000.0 / BIN_MS for t in tok], label=name, linestyle="--" if not inter else "-")
    if "saturated" in results and "alone" in results:  # what the backlog could use: capacity less interactive work
        full = service_bins(results["saturated"], range(len(results["saturated"].arrival)), 0.0, BIN_MS, bins)
        alone = service_bins(results["alone"], range(len(results["alone"].arrival)), 0.0, BIN_MS, bins)
        idle = [(m, max(0.0, c - a) * 1000.0 / BIN_MS) for m, c, a in zip(mids, full, alone, strict=True)
                if at / 1000.0 <= m <= end / 1000.0]
        ax2.plot([m for m, _ in idle], [v for _, v in idle], color="k", linewidth=2.5, alpha=0.4,
                 label="idle capacity (saturated less interactive alone)")
    for ax in (ax1, ax2):
        ax.axvline(at / 1000.0, color="k", linestyle=":", label="backlog arrives")
        ax.axvline(end / 1000.0, color="grey", linestyle=":", label="last interactive arrival")
        ax.set_xlabel("simulated time (s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_yscale("log")
    ax1.set_ylabel("interactive P99 TTFT (ms, log), by arrival")
    ax1.set_title(f"Interactive P99 TTFT per {BIN_MS / 1000:.0f} s")
    ax2.set_ylabel("backlog tokens served per second")
    ax2.set_title("Batch throughput (prompt + generated tokens)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fairness(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    # two tenants drawing disjoint stretches of the Azure conversation trace, each compressed to its demand
    # (FAIR_DEMAND x the capacity, measured as in `priority`), over FAIR_MINUTES of arrivals; fair_share on and off,
    # with the gateway's admission (the default) and without (every request queues); and the same demand as batch
    # class (whose queue is always in tenant order), with and without admission
    seed = args.seed
    cfg = _config(args, _class_rack(), "work_aware", seed)
    pool = _azure(None, 1.0, seed)
    flood = _capacity(args, cfg, pool[:min(PRIORITY_REQUESTS, args.requests or PRIORITY_REQUESTS)])
    cap = flood["capacity_rps"]
    total = sum(d for _, d in FAIR_DEMAND)
    minutes = args.requests / (total * cap * 60.0) if args.requests else float(FAIR_MINUTES)
    tenants: list[TraceRequest] = []
    start = 0
    for tenant, demand in FAIR_DEMAND:
        n = max(2, round(demand * cap * minutes * 60.0)) + 1
        if start + n > len(pool):
            raise SystemExit(f"rackflow sim experiment fairness: {minutes:.1f} minutes need {start + n} requests; "
                             f"the trace has {len(pool)}")
        tenants += _scaled(pool[start:start + n], demand * cap, tenant)
        start += n
    tenants.sort(key=lambda r: r.arrival_ms)
    as_batch = [dataclasses.replace(r, priority=BATCH) for r in tenants]
    runs: dict[str, tuple[list[TraceRequest], bool, dict[str, Any]]] = {
        "fair": (tenants, True, {"fair_share": True}),
        "unfair": (tenants, True, {"fair_share": False}),
        "fair, no admission": (tenants, False, {"fair_share": True}),
        "unfair, no admission": (tenants, False, {"fair_share": False}),
        "batch class": (as_batch, True, {}),
        "batch class, no admission": (as_batch, False, {}),
    }
    bins = math.floor(minutes * 60_000.0 / FAIR_BIN_MS)
    table: dict[str, dict[str, Any]] = {}
    service: dict[str, dict[str, list[float]]] = {}
    for name, (reqs, admission, batcher) in runs.items():
        run_cfg = _config(args, _class_rack(), "work_aware", seed, batcher)
        row, res = run_once(run_cfg, reqs, _params(admission=admission), [], CLASS_MODEL, not args.no_progress,
                            label=name)
        service[name], table[name] = _fair_row(res, bins, run_cfg.policies.batcher.vtc_out_weight)
        table[name] = {"admission": admission, **batcher, **table[name], "sim_wall_s": row["sim_wall_s"],
                       "simulated_s": row["simulated_s"]}
    plot = out / "fairness.png"
    _plot_fairness(service, plot)
    setup = {"cluster": f"1 rack x 2 H100 TP8 nodes, {CLASS_MODEL}", "node_policy": "work_aware",
             "capacity_rps": cap, "capacity_flood": flood,
             "demand": {t: {"x_capacity": d, "rps": round(d * cap, 3)} for t, d in FAIR_DEMAND},
             "minutes": round(minutes, 2), "full_minutes_scored": bins,
             "service": "per tenant and minute, prompt tokens when the first token comes and generated tokens spread "
                        "evenly from first token to finish (tokens served in the minute, whether or not the "
                        "request completed in it)"}
    return {"setup": setup, "table": table, "plot": str(plot), "max_share_error": table["fair"]["max_share_error"],
            "max_share_error_unfair": table["unfair"]["max_share_error"], "target": FAIR_TARGET,
            "meets": table["fair"]["max_share_error"] <= FAIR_TARGET, "text": _fairness_text(setup, table),
            "claims": []}


def _fair_row(res: SimResult, bins: int, w_out: float) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Each tenant's service per bin, and the run's figures: the largest distance from an equal share, in tokens
    and in the virtual token counter's weighted tokens (a generated token `w_out`), and per tenant its fates, P99
    TTFT, service and share per bin."""
    by = {t: [i for i, x in enumerate(res.tenant) if x == t] for t, _ in FAIR_DEMAND}
    service = {t: service_bins(res, ids, 0.0, FAIR_BIN_MS, bins) for t, ids in by.items()}
    shares, err = equal_share_error(service)
    _, err_w = equal_share_error({t: service_bins(res, ids, 0.0, FAIR_BIN_MS, bins, w_out) for t, ids in by.items()})
    per: dict[str, Any] = {}
    for t, ids in by.items():
        done, shed, lost = _fates(res, ids)
        per[t] = {"requests": len(ids), "completed": done, "shed": shed, "lost": lost,
                  "p99_ttft_ms": _ms(_latencies(res, ids)[0], 99),
                  "tokens_per_minute": [round(x) for x in service[t]],
                  "share_per_minute": [round(s.get(t, 0.0), 4) for s in shares]}
    return service, {"max_share_error": round(err, 4), "max_share_error_vtc_weighted": round(err_w, 4),
                     "tenants": per}


def _fairness_text(setup: dict[str, Any], table: dict[str, dict[str, Any]]) -> str:
    lines = [f"{setup['cluster']}; capacity {setup['capacity_rps']} req/s; demand "
             + ", ".join(f"{t} {d['x_capacity']}x ({d['rps']} req/s)" for t, d in setup["demand"].items())
             + f"; {setup['minutes']} minutes; share of each minute's tokens served",
             f"{'run':<22} {'max_share_error':>15}  per tenant: share per minute | requests, shed (429), lost, "
             "P99 TTFT ms"]
    for name, row in table.items():
        lines.append(f"{name:<22} {row['max_share_error']:>15}")
        for t, v in row["tenants"].items():
            shares = " ".join(f"{s:.2f}" for s in v["share_per_minute"])
            lines.append(f"    {t:<10} {shares} | {v['requests']}, {v['shed']}, {v['lost']}, {v['p99_ttft_ms']}")
    return "\n".join(lines)


def _plot_fairness(service: dict[str, dict[str, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = math.ceil(len(service) / 2)
    fig, axes = plt.subplots(2, cols, figsize=(4.2 * cols, 7.5), sharey=True, squeeze=False)
    for ax, (name, per) in zip(axes.flat, service.items(), strict=False):
        for t, v in per.items():
            ax.plot(range(1, len(v) + 1), [x / 1e6 for x in v], "o-", label=t)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(f"bin of {FAIR_BIN_MS / 1000:.0f} s")
        ax.grid(True, alpha=0.3)
    for row in axes:
        row[0].set_ylabel("tokens served (millions)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Service per tenant and minute (demand 3:1, each above an equal share)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


ORACLE = False
"""`--oracle`: every simulation of the experiment hands the control plane the true output lengths and the engines'
exact speed (`SimParams.oracle`); the JSON says so."""


def _params(**kw: Any) -> SimParams:
    return SimParams(oracle=ORACLE, **kw)


def run_experiment(args: argparse.Namespace) -> int:
    global ORACLE
    ORACLE = bool(getattr(args, "oracle", False))
    name = args.name
    if name not in EXPERIMENTS:
        print(f"rackflow sim experiment: unknown experiment {name!r}; available: {', '.join(EXPERIMENTS)}",
              file=sys.stderr)
        return 2
    out = Path(args.out or f"report/sim-{name}")
    out.mkdir(parents=True, exist_ok=True)
    fn = {"roundrobin-vs-weighted": roundrobin_vs_weighted, "window-batching": window_batching,
          "scale-pareto": scale_pareto, "sizing": sizing, "vidur": vidur, "priority": priority,
          "fairness": fairness}[name]
    result = fn(args, out)
    result["oracle"] = ORACLE
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(result["text"] if "text" in result else format_table(result["table"]))
        if result["claims"]:
            print("\nseed's claims next to ours:")
        for c in result["claims"]:
            print(json.dumps(c, sort_keys=True))
        print(f"\nplot: {result['plot']}")
    return 0
