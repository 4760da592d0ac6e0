"""`rackflow sim matrix`: every node policy on every cell of (trace x load x cluster state), at the same offered rate
per cell, as the anchors' A/B tests compare routers.

- Capacity of a trace on the cluster (`capacity_rps`) is round robin's steady-state throughput under a flood: the
  trace compressed until it offers at least twice what the cluster completes, admission off; completions per second
  between the 25th and 75th percentile of finish times.
- A cell's load is a fraction of that capacity: the trace is time-compressed to offer load x capacity_rps, and every
  policy gets exactly those arrivals.
- Cluster states: `healthy`; `slow` (one node's iterations 1.5x longer for the whole run); `death` (that node dies
  halfway through the trace; its sequences migrate).
- Per policy: P99 TTFT and end-to-end latency over the requests that completed; throughput = requests completed
  over the span of the offered arrivals (every policy serves the same arrivals, so below capacity all score the
  offered rate, and above it what each actually served; the steady-state figure is reported too, but on a trace
  whose rate is not flat, such as the multi-turn one, the middle half of the finishes measures the trace's busiest
  stretch, not the policy); prefix hit rate (tokens not prefilled), KV utilisation at saturation (the fullest 10 s
  bin of cluster KV use), the share of requests preempted and the share shed by the gateway's admission. With
  `--repeats K` each cell runs K times with other user draws and seeds, and the latencies are pooled.
- Next to each cell: the trace's ideal prefix hit rate (an unbounded cache: the best any cluster could do).
Writes `matrix.json`, `matrix.txt`, `matrix-ttft.png` (a P99 TTFT bar chart per cell) and `matrix-pareto.png`
(throughput against P99 end-to-end latency) under --out (default report/sim-matrix/).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import ALL_NODE_POLICIES, RackflowConfig
from pipeline.kv.prefix_cache import ideal_hit_rate
from pipeline.sim.report import kv_util_peak
from pipeline.sim.simulator import Fault, SimParams
from pipeline.sim.traces import TraceRequest, assign_users, scale_rate
from pipeline.stats import percentile
from workers.sim.harness import REPO, load_trace, run_once, sim_config

DEFAULT_TRACES = (
    f"{REPO / 'data/traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv'}:azure",
    f"{REPO / 'data/traces/azure-llm-2023/AzureLLMInferenceTrace_code.csv'}:azure",
    f"{REPO / 'data/traces/mooncake-fast25/synthetic_trace.jsonl'}:mooncake",
)
DEFAULT_LOADS = (0.5, 0.8, 1.0, 1.5)
STATES = ("healthy", "slow", "death")
SLOW_FACTOR = 1.5
FLOOD_OVER_CAPACITY = 2.0
"""A capacity run offers at least this many times what it completes."""
METRICS = ("p99_ttft_ms", "p99_ms", "throughput_rps", "prefix_hit_rate", "kv_util_peak", "preempted_frac",
           "shed_frac", "p50_ttft_ms", "p50_ms", "steady_throughput_rps")


@dataclass(frozen=True)
class Job:
    """One simulation, self-contained so a worker process can run it."""

    config_dir: str
    overrides: tuple[str, ...]
    cluster: str | None
    trace: str
    fmt: str
    limit: int | None
    users: int
    seed: int
    policy: str
    rate_scale: float
    faults: tuple[Fault, ...]
    admission: bool = True


def parse_traces(spec: str | None) -> list[tuple[str, str]]:
    out = []
    for part in (spec.split(",") if spec else DEFAULT_TRACES):
        part = part.strip()
        if not part:
            continue
        path, sep, fmt = part.rpartition(":")
        if not sep or fmt not in ("azure", "mooncake"):
            raise SystemExit(f"rackflow sim matrix: bad trace {part!r}; use PATH:FORMAT with FORMAT azure or mooncake "
                             "(Mooncake's JSONL, optionally with user_id: also the multi-turn trace)")
        if not Path(path).exists():
            raise SystemExit(f"rackflow sim matrix: trace file {path} not found")
        out.append((path, fmt))
    return out


@functools.lru_cache(maxsize=8)
def _trace(path: str, fmt: str, limit: int | None, users: int, seed: int) -> tuple[TraceRequest, ...]:
    reqs = load_trace(path, fmt, limit, seed)
    return tuple(assign_users(reqs, users, 1.1, random.Random(seed + 1)))


@functools.lru_cache(maxsize=8)
def _config(config_dir: str, overrides: tuple[str, ...], cluster: str | None, policy: str, seed: int
            ) -> RackflowConfig:
    cfg = sim_config(Path(config_dir), [Path(p) for p in overrides], cluster, policy)
    return cfg.model_copy(update={"policies": cfg.policies.model_copy(update={"seed": seed})})


def run_job(job: Job) -> dict[str, Any]:
    """Run one simulation; returns its summary plus the raw latencies (to pool repeats)."""
    cfg = _config(job.config_dir, job.overrides, job.cluster, job.policy, job.seed)
    reqs = list(scale_rate(_trace(job.trace, job.fmt, job.limit, job.users, job.seed), job.rate_scale))
    out, res = run_once(cfg, reqs, SimParams(admission=job.admission), list(job.faults), None, False)
    done = [i for i in range(len(res.arrival)) if res.finish[i] >= 0 and not res.dropped[i]]
    out["_ttft"] = [res.first_token[i] - res.arrival[i] for i in done if res.first_token[i] >= 0]
    out["_e2e"] = [res.finish[i] - res.arrival[i] for i in done]
    out["_prompt"] = res.prompt_tokens
    out["_cached"] = res.cached_tokens
    out["kv_util_peak"] = round(kv_util_peak(res), 4)
    span_s = (max(r.arrival_ms for r in reqs) - min(r.arrival_ms for r in reqs)) / 1000.0 if reqs else 0.0
    out["goodput_rps"] = round(len(done) / span_s, 3) if span_s > 0 else 0.0
    return out


def pooled(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one policy in one cell, over its repeats."""
    ttft = [x for r in runs for x in r["_ttft"]]
    e2e = [x for r in runs for x in r["_e2e"]]
    prompt = sum(r["_prompt"] for r in runs)
    n = len(runs)
    return {
        "p99_ttft_ms": round(percentile(ttft, 99), 1),
        "p50_ttft_ms": round(percentile(ttft, 50), 1),
        "p99_ms": round(percentile(e2e, 99), 1),
        "p50_ms": round(percentile(e2e, 50), 1),
        "throughput_rps": round(sum(r["goodput_rps"] for r in runs) / n, 3),
        "steady_throughput_rps": round(sum(r["steady_throughput_rps"] for r in runs) / n, 3),
        "prefix_hit_rate": round(sum(r["_cached"] for r in runs) / prompt, 4) if prompt else 0.0,
        "kv_util_peak": round(max(r["kv_util_peak"] for r in runs), 4),
        "preempted_frac": round(sum(r["preempted_frac"] for r in runs) / n, 5),
        "shed_frac": round(sum(r["shed_frac"] for r in runs) / n, 5),
        "completed": sum(r["completed"] for r in runs),
        "requests": sum(r["requests"] for r in runs),
    }


def _span_rate(reqs: Sequence[TraceRequest]) -> float:
    span_s = (reqs[-1].arrival_ms - reqs[0].arrival_ms) / 1000.0 if len(reqs) > 1 else 0.0
    return (len(reqs) - 1) / span_s if span_s > 0 else float(len(reqs))


def _map(jobs: list[Job], workers: int, bar: Any) -> list[dict[str, Any]]:
    if workers <= 1:
        out = []
        for j in jobs:
            out.append(run_job(j))
            bar.update(1)
        return out
    with ProcessPoolExecutor(workers) as ex:
        results = []
        for r in ex.map(run_job, jobs):
            results.append(r)
            bar.update(1)
        return results


def fault_node(cfg: RackflowConfig) -> str:
    """The node that is slowed or killed: the second node of the first rack (the first when it has one)."""
    nodes = cfg.cluster.racks[0].expanded()
    return nodes[1].name if len(nodes) > 1 else nodes[0].name


def cell_faults(state: str, node: str, span_ms: float) -> tuple[Fault, ...]:
    if state == "healthy":
        return ()
    if state == "slow":
        return (Fault(0.0, node, "slow", 1e15, SLOW_FACTOR),)
    if state == "death":
        return (Fault(span_ms / 2.0, node, "death"),)
    raise SystemExit(f"rackflow sim matrix: unknown state {state!r}; allowed: {', '.join(STATES)}")


def run_matrix(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    traces = parse_traces(args.traces)
    loads = [float(x) for x in (args.loads.split(",") if args.loads else DEFAULT_LOADS)]
    states = [s.strip() for s in (args.states.split(",") if args.states else STATES) if s.strip()]
    for s in states:
        cell_faults(s, "x", 1.0)  # a clear error for an unknown state before anything runs
    policies = [p.strip() for p in (args.policies.split(",") if args.policies else ALL_NODE_POLICIES) if p.strip()]
    unknown = sorted(set(policies) - set(ALL_NODE_POLICIES))
    if unknown:
        raise SystemExit(f"rackflow sim matrix: unknown policies {unknown}; allowed: {', '.join(ALL_NODE_POLICIES)}")
    base = sim_config(Path(args.config_dir), [Path(p) for p in args.config], args.cluster, None)
    default = base.policies.node_selection.policy
    if default not in policies:
        policies.append(default)
    node = fault_node(base)
    workers = args.jobs or max(1, min(os.cpu_count() or 1, 8))
    seeds = [args.seed + 1000 * k for k in range(max(1, args.repeats))]
    t0 = time.perf_counter()
    common = {"config_dir": str(args.config_dir), "overrides": tuple(args.config), "cluster": args.cluster,
              "limit": args.requests, "users": args.users}
    total = len(traces) * (1 + len(loads) * len(states) * len(policies) * len(seeds))
    bar = tqdm(total=total, desc="sim matrix", unit="run", disable=args.no_progress, file=sys.stderr,
               dynamic_ncols=True, mininterval=1.0)
    # 1. capacity per trace: round robin under a flood (admission off), until the flood offers 2x what it completes
    caps: dict[str, float] = {}
    native: dict[str, float] = {}
    spans: dict[str, float] = {}
    ideal: dict[str, float] = {}
    block = base.policies.profiling.prefix_block_tokens
    for path, fmt in traces:
        reqs = _trace(path, fmt, args.requests, args.users, args.seed)
        native[path] = _span_rate(reqs)
        spans[path] = (reqs[-1].arrival_ms - reqs[0].arrival_ms) if len(reqs) > 1 else 0.0
        ideal[path] = round(ideal_hit_rate([(r.in_tokens, r.prefix_hashes) for r in reqs], block), 4)
        scale = 50.0
        cap = 0.0
        for _ in range(4):
            r = run_job(Job(**common, trace=path, fmt=fmt, seed=args.seed, policy="round_robin",  # type: ignore[arg-type]
                            rate_scale=scale, faults=(), admission=False))
            cap = r["steady_throughput_rps"]
            if native[path] * scale >= FLOOD_OVER_CAPACITY * cap:
                break
            scale = FLOOD_OVER_CAPACITY * 2 * cap / native[path]
        caps[path] = round(cap, 3)
        bar.update(1)
    # 2. every cell, every policy, every repeat
    jobs: list[Job] = []
    keys: list[tuple[str, float, str, str]] = []
    for path, fmt in traces:
        for load in loads:
            scale = load * caps[path] / native[path]
            for state in states:
                faults = cell_faults(state, node, spans[path] / scale)
                for pol in policies:
                    for seed in seeds:
                        jobs.append(Job(**common, trace=path, fmt=fmt, seed=seed, policy=pol,  # type: ignore[arg-type]
                                        rate_scale=scale, faults=faults))
                        keys.append((path, load, state, pol))
    results = _map(jobs, workers, bar)
    bar.close()
    grouped: dict[tuple[str, float, str, str], list[dict[str, Any]]] = {}
    for k, r in zip(keys, results, strict=True):
        grouped.setdefault(k, []).append(r)
    cells = []
    for path, _fmt in traces:
        for load in loads:
            for state in states:
                pols = {pol: pooled(grouped[(path, load, state, pol)]) for pol in policies}
                cells.append({
                    "trace": path, "load": load, "state": state, "ideal_prefix_hit_rate": ideal[path],
                    "capacity_rps": caps[path], "offered_rps": round(load * caps[path], 3),
                    "best": {m: (min if m != "throughput_rps" else max)(pols, key=lambda p, m=m: pols[p][m])
                             for m in ("p99_ttft_ms", "p99_ms", "throughput_rps")},
                    "policies": pols,
                })
    return {
        "default": default, "policies": policies, "loads": loads, "states": states, "repeats": len(seeds),
        "fault_node": node, "slow_factor": SLOW_FACTOR, "seed": args.seed,
        "cluster": {"racks": len(base.cluster.racks), "nodes": len(base.nodes()),
                    "gpus": sum(n.tp for n in base.nodes()), "models": sorted({n.models[0] for n in base.nodes()})},
        "wall_s": round(time.perf_counter() - t0, 1), "cells": cells,
    }


def trace_label(path: str) -> str:
    """A short name of a trace file for tables and plots: `azure-conv`, `azure-code`, `mooncake-fast25`, ..."""
    p = Path(path)
    if p.stem.startswith("AzureLLMInferenceTrace_"):
        return "azure-" + p.stem.removeprefix("AzureLLMInferenceTrace_")
    if p.stem in ("synthetic_trace", "trace", "data"):
        return p.parent.name
    return p.stem


def worst_ratio(cell: dict[str, Any], policy: str) -> tuple[float, float, float]:
    """The policy's P99 TTFT and end-to-end latency over the cell's best, and the best throughput over its own."""
    pols = cell["policies"]
    me = pols[policy]
    bt = min(p["p99_ttft_ms"] for p in pols.values())
    be = min(p["p99_ms"] for p in pols.values())
    bp = max(p["throughput_rps"] for p in pols.values())
    return (me["p99_ttft_ms"] / max(bt, 1e-9), me["p99_ms"] / max(be, 1e-9), bp / max(me["throughput_rps"], 1e-9))


def format_matrix(d: dict[str, Any]) -> str:
    dflt = d["default"]
    head = (f"{'trace':<26}{'load':>5} {'state':<8}{'cap rps':>8}  {'best P99 TTFT':<26}{'default':>9}"
            f"  {'best P99 e2e':<26}{'default':>9}  {'best tput':<24}{'default':>9}  {'hit/ideal':>10}")
    lines = [f"default policy: {dflt}; ratios are the default's figure over the best (throughput: best over the "
             "default)", head]
    for c in d["cells"]:
        pols = c["policies"]
        me = pols[dflt]
        r = worst_ratio(c, dflt)
        b = c["best"]
        lines.append(
            f"{trace_label(c['trace'])[:25]:<26}{c['load']:>5.1f} {c['state']:<8}{c['capacity_rps']:>8.1f}  "
            f"{b['p99_ttft_ms'][:14]:<14}{pols[b['p99_ttft_ms']]['p99_ttft_ms']:>10.0f}  x{r[0]:>6.2f}  "
            f"{b['p99_ms'][:14]:<14}{pols[b['p99_ms']]['p99_ms']:>10.0f}  x{r[1]:>6.2f}  "
            f"{b['throughput_rps'][:14]:<14}{pols[b['throughput_rps']]['throughput_rps']:>8.2f}  x{r[2]:>6.3f}  "
            f"{me['prefix_hit_rate']:.2f}/{c['ideal_prefix_hit_rate']:.2f}")
    return "\n".join(lines)


def plot_matrix(d: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dflt = d["default"]
    cells = d["cells"]
    pols = d["policies"]
    cols = max(1, len(d["states"]) * len(d["loads"]))
    rows = math.ceil(len(cells) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.6 * rows), squeeze=False)
    for k, c in enumerate(cells):
        ax = axes[k // cols][k % cols]
        vals = [c["policies"][p]["p99_ttft_ms"] / 1000.0 for p in pols]
        colors = ["tab:red" if p == dflt else "tab:gray" for p in pols]
        ax.bar(range(len(pols)), vals, color=colors)
        ax.set_title(f"{trace_label(c['trace'])[:22]}\n{c['load']}x, {c['state']}", fontsize=7)
        ax.set_xticks(range(len(pols)), pols, rotation=90, fontsize=5)
        ax.tick_params(axis="y", labelsize=6)
        ax.set_ylabel("P99 TTFT (s)", fontsize=6)
    for k in range(len(cells), rows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.suptitle(f"P99 TTFT per policy and cell (default {dflt} in red)", fontsize=10)
    fig.tight_layout()
    p1 = out / "matrix-ttft.png"
    fig.savefig(p1, dpi=100)
    plt.close(fig)
    traces = sorted({c["trace"] for c in cells}, key=[c["trace"] for c in cells].index)
    fig, axes = plt.subplots(1, len(traces), figsize=(5.5 * len(traces), 4.6), squeeze=False)
    markers = "o^sv<>Dph*+x"
    for t, tr in enumerate(traces):
        ax = axes[0][t]
        for i, p in enumerate(pols):
            pts = [(c["policies"][p]["throughput_rps"], c["policies"][p]["p99_ms"] / 1000.0)
                   for c in cells if c["trace"] == tr and c["state"] == "healthy"]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker=markers[i % len(markers)],
                    linewidth=2.2 if p == dflt else 0.8, color="tab:red" if p == dflt else None, label=p)
        ax.set_xlabel("throughput: completed over the arrival span (req/s)")
        ax.set_ylabel("P99 end-to-end (s)")
        ax.set_yscale("log")
        ax.set_title(f"{trace_label(tr)[:30]} (healthy, loads {', '.join(str(x) for x in d['loads'])})", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    p2 = out / "matrix-pareto.png"
    fig.savefig(p2, dpi=100)
    plt.close(fig)
    return [str(p1), str(p2)]


def cmd_matrix(args: argparse.Namespace) -> int:
    d = run_matrix(args)
    out = Path(args.out or "report/sim-matrix")
    out.mkdir(parents=True, exist_ok=True)
    d["plots"] = plot_matrix(d, out)
    (out / "matrix.json").write_text(json.dumps(d, indent=1, sort_keys=True))
    table = format_matrix(d)
    (out / "matrix.txt").write_text(table + "\n")
    if args.json:
        print(json.dumps(d, sort_keys=True))
    else:
        print(table)
        print(f"\nwrote {out / 'matrix.json'}, {out / 'matrix.txt'}, {', '.join(d['plots'])} in {d['wall_s']} s")
    return 0


__all__ = ["DEFAULT_TRACES", "Job", "cmd_matrix", "pooled", "run_job", "run_matrix", "worst_ratio"]
