"""`rackflow sim matrix`: every node policy on every cell of (trace x load x cluster state), at the same offered rate
per cell, as the anchors' A/B tests compare routers, scored on goodput within each trace's SLO.

- Traces (`TRACES`): each with its format, its split and its SLO. `tuning` traces are those the policies' constants
  were tuned on (the Azure conv and code traces, Mooncake's synthetic trace); `test` traces are held out (Mooncake's
  conversation and tool&agent traces, an hour of DeepSeek-R1 requests drawn from ServeGen's client data, and any
  `--traces` file not in the table). A table trace whose file is absent is left out of the default matrix. Each has
  a default request limit (the first N requests; `--requests N` sets every trace's) so that the default matrix runs
  in under 30 minutes on 2 cores with `--jobs 2`.
- Capacity of a trace on the cluster (`capacity_rps`) is round robin's steady-state throughput under a flood: the
  trace compressed until it offers at least twice what the cluster completes, admission off; completions per second
  between the 25th and 75th percentile of finish times.
- A cell's load is a fraction of that capacity: the trace is time-compressed to offer load x capacity_rps, and every
  policy gets exactly those arrivals.
- Cluster states: `healthy`; `slow` (one node's iterations 1.5x longer for the whole run); `death` (that node dies
  halfway through the trace; its sequences migrate).
- Per policy, every offered request counts: `goodput_rps` = requests that completed within the cell's SLO (TTFT <=
  slo.ttft_ms and time per output token, (finish - first token) / (output tokens - 1), <= slo.tpot_ms) over the
  span of the offered arrivals; `shed_frac` = the share of the offered requests that did not complete (shed by the
  gateway's admission, dropped, or never finished; `shed_429_frac` is admission's share alone). P99 TTFT and
  end-to-end latency are over the requests that completed, so next to them the shed share says what they leave out;
  throughput = completions over the span of the offered arrivals (the steady-state figure is reported too, but on a
  trace whose rate is not flat the middle half of the finishes measures the trace's busiest stretch, not the
  policy); prefix hit rate (tokens not prefilled), KV utilisation at saturation (the fullest 10 s bin of cluster KV
  use), the share of requests preempted; `rack_imbalance` (the most loaded rack's work per node over the cluster's
  mean, `pipeline.sim.report.rack_imbalance`) and `rack_work_per_node`; the median error of the control plane's
  belief of node speeds (`belief_error_median`, null where the simulator reports none). With `--repeats K` each
  cell runs K times with other user draws and seeds, and the figures are pooled.
- Best per cell (`best_of`): goodput first (`best["goodput_rps"]`); P99 TTFT only among the policies whose shed share
  is within 0.01 of the cell's lowest (a policy that sheds its slowest requests scores a lower P99 over what it
  kept); P99 end-to-end and throughput over all.
- Next to each cell: the trace's ideal prefix hit rate (an unbounded cache: the best any cluster could do).
- `--oracle` (where the CLI has it) hands the control plane what no live one has (`SimParams.oracle`); the JSON's
  top-level `oracle` says which ran.
Writes `matrix.json`, `matrix.txt`, `matrix-ttft.png` (a P99 TTFT bar chart per cell), `matrix-goodput.png` (a goodput
bar chart per cell) and `matrix-pareto.png` (throughput against P99 end-to-end latency) under --out (default
report/sim-matrix/).

SLOs (fixed per trace from the public sources below, never derived from a policy's results):

- DistServe (Zhong et al., OSDI'24; the artifact's plotting script, evaluation/ae-scripts/e2e/_plot.py) scores
  goodput at 90% attainment with per-application SLOs: chatbot on ShareGPT TTFT 0.25 s / TPOT 0.1 s (OPT-13B),
  0.4 s / 0.1 s (OPT-66B), 4.0 s / 0.2 s (OPT-175B); code completion on HumanEval TTFT 0.125 s / TPOT 0.2 s
  (OPT-66B); summarization on LongBench TTFT 15 s / TPOT 0.15 s (OPT-66B).
- Mooncake (Qin et al., FAST'25, section 5.1) counts a request effective when TTFT <= 30 s and TBT (the mean of its
  longest 10% of token intervals) <= 100, 200 or 300 ms by scenario, for LLaMA3-70B on 8 x A800 prefill nodes;
  its P/D-ratio study on the synthetic workload (section 5.4) uses TTFT 10 s and TBT 100 ms. Its Table 2: mean
  prompt 12,035 tokens (conversation), 8,596 (tool&agent), 15,325 (synthetic).

Scaled to this cluster (8 x H100, Qwen2-7B, TP1: the cost model prefills ~38 k tokens/s per node, an 8,192-token
chunk in 216 ms, and decodes a token in ~9 ms) and to each trace's prompts:

- azure-conv (tuning): TTFT 250 ms, TPOT 100 ms. A chatbot: DistServe's chatbot SLO for its smallest model
  (OPT-13B). Our node prefills Azure conv's P99 prompt (4.1 k tokens) in ~0.1 s, about what OPT-13B on an A100
  needs for ShareGPT's shorter prompts, so the same user-facing figure holds; TPOT 100 ms is reading speed.
- azure-code (tuning): TTFT 1,250 ms, TPOT 200 ms. Code completion: DistServe's TPOT 0.2 s; its TTFT 0.125 s is for
  HumanEval's prompts of a few hundred tokens, Azure code's average 2,048 (P99 7.4 k), ~10x longer: 10x the TTFT.
- mooncake-fast25, the synthetic trace (tuning): TTFT 10 s, TPOT 100 ms. Mooncake's own thresholds for this workload
  (section 5.4); also its 30 s TTFT scaled by our ~3-4x faster prefill per instance (LLaMA3-70B on 8 x A800 at
  ~10 k tokens/s at our MFU, against Qwen2-7B on one H100 at 38 k).
- conversation (test): TTFT 8 s, TPOT 100 ms. That 10 s for the synthetic trace's 15.3 k-token mean prompt, in
  proportion to this trace's 12.0 k.
- toolagent (test): TTFT 6 s, TPOT 100 ms. The same for its 8.6 k-token mean prompt.
- servegen-deepseek-r1 (test; DeepSeek-R1 on Alibaba Cloud Model Studio, drawn from ServeGen's client data: short
  prompts, long reasoning answers): TTFT 500 ms, TPOT 100 ms. The rule below for its 700-token mean prompt (0.46 s),
  rounded up; TPOT 100 ms as for every streamed answer here (ServeGen publishes no latency targets).
- any other `--traces` file (test unless given): TTFT 0.65 ms per token of its mean prompt (the rule of the last
  three), within [250 ms, 10 s], TPOT 100 ms (`default_slo`).

TPOT is 100 ms for every Mooncake trace: Mooncake's strictest TBT threshold, and our TPOT, a mean over all of a
request's intervals, is never above its longest-10% TBT, so it is the lenient side of Mooncake's 200 ms middle
threshold; our decode (~9 ms a token alone) is as fast as Mooncake's, and what exceeds the SLO is chunked prefill
sharing the iterations, which the routing decides.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from pipeline.config import ALL_NODE_POLICIES, RackflowConfig
from pipeline.kv.prefix_cache import ideal_hit_rate
from pipeline.sim.report import (
    completed_latencies,
    kv_util_peak,
    rack_imbalance,
    rack_work_per_node,
    slo_met,
)
from pipeline.sim.simulator import Fault, SimParams
from pipeline.sim.traces import TraceRequest, assign_users, scale_rate
from pipeline.stats import percentile
from workers.sim.harness import REPO, load_trace, run_once, sim_config

SPLITS = ("tuning", "test")
"""`tuning`: a trace the policies' constants were tuned on; `test`: held out."""


@dataclass(frozen=True)
class TraceSpec:
    """One trace of the matrix: its file, format, split, SLO and default request limit."""

    path: str
    fmt: str
    split: str = "test"
    slo: tuple[float, float] | None = None
    """(TTFT ms, TPOT ms); None: `default_slo` of the trace's requests."""
    limit: int | None = None
    """The first N requests by default (None: all); `--requests` overrides it."""


def _repo(rel: str) -> str:
    return str(REPO / rel)


TRACES: tuple[TraceSpec, ...] = (
    TraceSpec(_repo("data/traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv"), "azure", "tuning",
              (250.0, 100.0), 10_000),
    TraceSpec(_repo("data/traces/azure-llm-2023/AzureLLMInferenceTrace_code.csv"), "azure", "tuning",
              (1250.0, 200.0), None),
    TraceSpec(_repo("data/traces/mooncake-fast25/synthetic_trace.jsonl"), "mooncake", "tuning",
              (10_000.0, 100.0), None),
    TraceSpec(_repo("data/traces/mooncake-fast25/conversation_trace.jsonl"), "mooncake", "test",
              (8000.0, 100.0), 8000),
    TraceSpec(_repo("data/traces/mooncake-fast25/toolagent_trace.jsonl"), "mooncake", "test",
              (6000.0, 100.0), 8000),
    TraceSpec(_repo("data/traces/servegen/deepseek-r1-busiest-hour.jsonl"), "mooncake", "test",
              (500.0, 100.0), None),
)
"""The traces of the default matrix (those whose file exists), with their SLOs (see the module docstring) and
request limits (measured: see docs/SIMULATOR.md, "The decision matrix")."""

DEFAULT_TPOT_MS = 100.0
TTFT_MS_PER_PROMPT_TOKEN = 10_000.0 / 15_325.0
"""A user trace's TTFT SLO per token of its mean prompt: Mooncake's scaled 10 s over the synthetic trace's mean."""
TTFT_MS_BOUNDS = (250.0, 10_000.0)
DEFAULT_LOADS = (0.5, 0.8, 1.0, 1.5)
STATES = ("healthy", "slow", "death")
SLOW_FACTOR = 1.5
FLOOD_OVER_CAPACITY = 2.0
"""A capacity run offers at least this many times what it completes."""
SHED_PEER_MARGIN = 0.01
"""P99 TTFT is compared among the policies whose shed share is at most the cell's lowest plus this."""
WITHIN = 1.03
"""The summary counts a cell where the default's ratio to the best is at most this."""
TTFT_MAX_LOAD = 1.0
"""The summary counts P99 TTFT in the cells up to this load (above it: goodput only)."""
METRICS = ("goodput_rps", "shed_frac", "shed_429_frac", "p99_ttft_ms", "p99_ms", "throughput_rps", "prefix_hit_rate",
           "kv_util_peak", "preempted_frac", "p50_ttft_ms", "p50_ms", "steady_throughput_rps", "rack_imbalance",
           "rack_work_per_node", "belief_error_median", "slo_met", "completed", "requests")


def default_traces() -> list[TraceSpec]:
    """The table's traces whose file exists."""
    return [t for t in TRACES if Path(t.path).exists()]


def default_slo(reqs: Sequence[TraceRequest]) -> tuple[float, float]:
    """The SLO of a trace not in the table: TTFT `TTFT_MS_PER_PROMPT_TOKEN` x its mean prompt tokens (to 10 ms),
    within `TTFT_MS_BOUNDS`; TPOT `DEFAULT_TPOT_MS`."""
    mean = statistics.fmean(r.in_tokens for r in reqs) if reqs else 0.0
    lo, hi = TTFT_MS_BOUNDS
    return (min(hi, max(lo, round(TTFT_MS_PER_PROMPT_TOKEN * mean, -1))), DEFAULT_TPOT_MS)


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
    oracle: bool = False
    prefix_shares_kv: bool = False


def _known(path: str) -> TraceSpec | None:
    p = Path(path).resolve()
    return next((t for t in TRACES if Path(t.path).resolve() == p), None)


def parse_traces(spec: str | None) -> list[TraceSpec]:
    """`PATH:FORMAT[:SPLIT],...` (None: `default_traces()`). A path in the table keeps its SLO, limit and split (the
    split unless given); any other has split `test` unless given, no limit, and `default_slo`."""
    from workers.sim.harness import TRACE_FORMATS

    if not spec:
        out = default_traces()
        if not out:
            raise SystemExit("rackflow sim matrix: none of the default traces is present under data/traces/")
        return out
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        bits = part.rsplit(":", 2)
        split: str | None = None
        if len(bits) == 3 and bits[2] in SPLITS:
            path, fmt, split = bits
        else:
            path, _, fmt = part.rpartition(":")
        if not path or fmt not in TRACE_FORMATS:
            raise SystemExit(f"rackflow sim matrix: bad trace {part!r}; use PATH:FORMAT[:SPLIT] with FORMAT one of "
                             f"{', '.join(TRACE_FORMATS)} (mooncake: Mooncake's JSONL, optionally with user_id: also "
                             f"the multi-turn trace) and SPLIT one of {', '.join(SPLITS)}")
        if not Path(path).exists():
            raise SystemExit(f"rackflow sim matrix: trace file {path} not found")
        known = _known(path)
        if known is not None and known.fmt == fmt:
            out.append(TraceSpec(path, fmt, split or known.split, known.slo, known.limit))
        else:
            out.append(TraceSpec(path, fmt, split or "test", None, None))
    return out


@functools.lru_cache(maxsize=16)
def _trace(path: str, fmt: str, limit: int | None, users: int, seed: int) -> tuple[TraceRequest, ...]:
    reqs = load_trace(path, fmt, limit, seed)
    return tuple(assign_users(reqs, users, 1.1, random.Random(seed + 1)))


@functools.lru_cache(maxsize=64)
def _config(config_dir: str, overrides: tuple[str, ...], cluster: str | None, policy: str, seed: int
            ) -> RackflowConfig:
    cfg = sim_config(Path(config_dir), [Path(p) for p in overrides], cluster, policy)
    return cfg.model_copy(update={"policies": cfg.policies.model_copy(update={"seed": seed})})


def job_requests(job: Job) -> list[TraceRequest]:
    """The requests a job offers: its trace (first `limit` requests, users drawn with its seed), time-compressed
    by its rate scale. Every policy of a cell (same trace, load, state and seed) gets exactly these."""
    return list(scale_rate(_trace(job.trace, job.fmt, job.limit, job.users, job.seed), job.rate_scale))


def rack_of_node(cfg: RackflowConfig) -> dict[str, str]:
    """Node name -> rack name, from the config's cluster."""
    return {n.name: rack.name for rack in cfg.cluster.racks for n in rack.expanded()}


def run_job(job: Job) -> dict[str, Any]:
    """Run one simulation; returns its summary plus the raw per-request figures (to pool repeats and score SLOs)."""
    cfg = _config(job.config_dir, job.overrides, job.cluster, job.policy, job.seed)
    reqs = job_requests(job)
    params = SimParams(admission=job.admission, oracle=job.oracle, prefix_shares_kv=job.prefix_shares_kv)
    out, res = run_once(cfg, reqs, params, list(job.faults), None, False)
    lat = completed_latencies(res)
    done = [i for i in range(len(res.arrival)) if res.finish[i] >= 0 and not res.dropped[i]]
    out["_lat"] = lat
    out["_ttft"] = [t for t, _ in lat if math.isfinite(t)]
    out["_e2e"] = [res.finish[i] - res.arrival[i] for i in done]
    out["_prompt"] = res.prompt_tokens
    out["_cached"] = res.cached_tokens
    span_s = (max(r.arrival_ms for r in reqs) - min(r.arrival_ms for r in reqs)) / 1000.0 if reqs else 0.0
    out["_span_s"] = span_s
    out["kv_util_peak"] = round(kv_util_peak(res), 4)
    out["served_rps"] = round(len(done) / span_s, 3) if span_s > 0 else 0.0
    n = len(res.arrival)
    out["shed_429_frac"] = round(res.shed / n, 5) if n else 0.0
    out["shed_frac"] = round((n - len(done)) / n, 5) if n else 0.0
    racks = rack_of_node(cfg)
    out["rack_imbalance"] = round(rack_imbalance(res, racks), 4)
    out["rack_work_per_node"] = {k: round(v, 1) for k, v in rack_work_per_node(res, racks).items()}
    out["belief_error_median"] = out.get("belief_error_median")
    return out


def goodput_rps(runs: Sequence[Mapping[str, Any]], slo: tuple[float, float]) -> float:
    """Requests that completed within `slo` (TTFT ms, TPOT ms) over the span of the offered arrivals, the mean over
    `runs` (each with `_lat` and `_span_s`, as `run_job` returns them)."""
    rates = [slo_met(r["_lat"], *slo) / r["_span_s"] if r["_span_s"] > 0 else 0.0 for r in runs]
    return round(sum(rates) / len(rates), 3) if rates else 0.0


def pooled(runs: Sequence[Mapping[str, Any]], slo: tuple[float, float]) -> dict[str, Any]:
    """The figures of one policy in one cell, over its repeats."""
    ttft = [x for r in runs for x in r["_ttft"]]
    e2e = [x for r in runs for x in r["_e2e"]]
    prompt = sum(r["_prompt"] for r in runs)
    n = len(runs)
    racks = sorted({k for r in runs for k in r["rack_work_per_node"]})
    beliefs = [r["belief_error_median"] for r in runs if r.get("belief_error_median") is not None]
    return {
        "goodput_rps": goodput_rps(runs, slo),
        "slo_met": sum(slo_met(r["_lat"], *slo) for r in runs),
        "p99_ttft_ms": round(percentile(ttft, 99), 1),
        "p50_ttft_ms": round(percentile(ttft, 50), 1),
        "p99_ms": round(percentile(e2e, 99), 1),
        "p50_ms": round(percentile(e2e, 50), 1),
        "throughput_rps": round(sum(r["served_rps"] for r in runs) / n, 3),
        "steady_throughput_rps": round(sum(r["steady_throughput_rps"] for r in runs) / n, 3),
        "prefix_hit_rate": round(sum(r["_cached"] for r in runs) / prompt, 4) if prompt else 0.0,
        "kv_util_peak": round(max(r["kv_util_peak"] for r in runs), 4),
        "preempted_frac": round(sum(r["preempted_frac"] for r in runs) / n, 5),
        "shed_frac": round(sum(r["shed_frac"] for r in runs) / n, 5),
        "shed_429_frac": round(sum(r["shed_429_frac"] for r in runs) / n, 5),
        "rack_imbalance": round(sum(r["rack_imbalance"] for r in runs) / n, 4),
        "rack_work_per_node": {k: round(sum(r["rack_work_per_node"].get(k, 0.0) for r in runs) / n, 1)
                               for k in racks},
        "belief_error_median": round(sum(beliefs) / len(beliefs), 4) if beliefs else None,
        "completed": sum(r["completed"] for r in runs),
        "requests": sum(r["requests"] for r in runs),
    }


def low_shed_peers(pols: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The policies whose shed share is at most the lowest of the cell plus `SHED_PEER_MARGIN`."""
    low = min(p["shed_frac"] for p in pols.values())
    return [k for k, p in pols.items() if p["shed_frac"] <= low + SHED_PEER_MARGIN]


def best_of(pols: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """The best policy of a cell per figure: highest goodput; lowest P99 TTFT among `low_shed_peers`; lowest P99
    end-to-end and highest throughput among all (ties: the first in `pols`' order)."""
    peers = low_shed_peers(pols)
    return {
        "goodput_rps": max(pols, key=lambda p: pols[p]["goodput_rps"]),
        "p99_ttft_ms": min(peers, key=lambda p: pols[p]["p99_ttft_ms"]),
        "p99_ms": min(pols, key=lambda p: pols[p]["p99_ms"]),
        "throughput_rps": max(pols, key=lambda p: pols[p]["throughput_rps"]),
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


def measure_capacity(common: Mapping[str, Any], path: str, fmt: str, limit: int | None, seed: int,
                     oracle: bool = False) -> dict[str, float]:
    """Round robin's steady-state throughput under a flood of the trace (admission off), compressed until the flood
    offers at least `FLOOD_OVER_CAPACITY` x what it completes (at most 4 runs): `capacity_rps`, the flood's
    `flood_offered_rps` and its `flood_scale`."""
    return flood_capacity(_trace(path, fmt, limit, common["users"], seed), lambda scale: run_job(
        Job(**common, trace=path, fmt=fmt, limit=limit, seed=seed, policy="round_robin", rate_scale=scale, faults=(),
            admission=False, oracle=oracle))["steady_throughput_rps"])


def flood_capacity(reqs: Sequence[TraceRequest], steady_rps: Callable[[float], float], scale: float = 50.0
                   ) -> dict[str, float]:
    """A cluster's capacity on `reqs`: `steady_rps(scale)` runs the flood of `reqs` at `scale` x their rate (admission
    off) and returns its steady-state throughput; the flood is compressed until it offers at least
    `FLOOD_OVER_CAPACITY` x what it completes (at most 4 runs). Returns `capacity_rps`, the flood's
    `flood_offered_rps` and its `flood_scale`."""
    native = _span_rate(reqs)
    cap = 0.0
    for _ in range(4):
        cap = steady_rps(scale)
        if native * scale >= FLOOD_OVER_CAPACITY * cap:
            break
        scale = FLOOD_OVER_CAPACITY * 2 * cap / native
    return {"capacity_rps": round(cap, 3), "flood_offered_rps": round(native * scale, 3), "flood_scale": scale}


class TracePlan(NamedTuple):
    """A trace as the cells use it: its spec, request limit, capacity, native rate and span."""

    spec: TraceSpec
    limit: int | None
    capacity_rps: float
    native_rps: float
    span_ms: float


CellKey = tuple[str, float, str, str]
"""(trace path, load, state, policy)"""


def build_jobs(common: Mapping[str, Any], plans: Sequence[TracePlan], loads: Sequence[float], states: Sequence[str],
               policies: Sequence[str], seeds: Sequence[int], node: str, oracle: bool = False
               ) -> tuple[list[Job], list[CellKey]]:
    """Every cell's jobs (every policy, every repeat) and their keys: the jobs of a cell differ only in policy and
    seed, so every policy gets the same arrivals."""
    jobs: list[Job] = []
    keys: list[CellKey] = []
    for plan in plans:
        path, fmt = plan.spec.path, plan.spec.fmt
        for load in loads:
            scale = load * plan.capacity_rps / plan.native_rps
            for state in states:
                faults = cell_faults(state, node, plan.span_ms / scale)
                for pol in policies:
                    for seed in seeds:
                        jobs.append(Job(**common, trace=path, fmt=fmt, limit=plan.limit, seed=seed, policy=pol,
                                        rate_scale=scale, faults=faults, oracle=oracle))
                        keys.append((path, load, state, pol))
    return jobs, keys


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
    oracle = bool(getattr(args, "oracle", False))
    base = sim_config(Path(args.config_dir), [Path(p) for p in args.config], args.cluster, None)
    default = base.policies.node_selection.policy
    if default not in policies:
        policies.append(default)
    node = fault_node(base)
    workers = args.jobs or max(1, min(os.cpu_count() or 1, 8))
    seeds = [args.seed + 1000 * k for k in range(max(1, args.repeats))]
    t0 = time.perf_counter()
    common = {"config_dir": str(args.config_dir), "overrides": tuple(args.config), "cluster": args.cluster,
              "users": args.users, "prefix_shares_kv": bool(getattr(args, "prefix_shares_kv", False))}
    total = len(traces) * (1 + len(loads) * len(states) * len(policies) * len(seeds))
    bar = tqdm(total=total, desc="sim matrix", unit="run", disable=args.no_progress, file=sys.stderr,
               dynamic_ncols=True, mininterval=1.0)
    # 1. capacity per trace: round robin under a flood (admission off), until the flood offers 2x what it completes
    plans: list[TracePlan] = []
    floods: dict[str, dict[str, float]] = {}
    slos: dict[str, tuple[float, float]] = {}
    ideal: dict[str, float] = {}
    block = base.policies.profiling.prefix_block_tokens
    for spec in traces:
        limit = args.requests or spec.limit
        reqs = _trace(spec.path, spec.fmt, limit, args.users, args.seed)
        slos[spec.path] = spec.slo or default_slo(reqs)
        ideal[spec.path] = round(ideal_hit_rate([(r.in_tokens, r.prefix_hashes) for r in reqs], block), 4)
        floods[spec.path] = measure_capacity(common, spec.path, spec.fmt, limit, args.seed, oracle)
        plans.append(TracePlan(spec, limit, floods[spec.path]["capacity_rps"], _span_rate(reqs),
                               (reqs[-1].arrival_ms - reqs[0].arrival_ms) if len(reqs) > 1 else 0.0))
        bar.update(1)
    # 2. every cell, every policy, every repeat
    jobs, keys = build_jobs(common, plans, loads, states, policies, seeds, node, oracle)
    results = _map(jobs, workers, bar)
    bar.close()
    grouped: dict[CellKey, list[dict[str, Any]]] = {}
    for k, r in zip(keys, results, strict=True):
        grouped.setdefault(k, []).append(r)
    cells = []
    for plan in plans:
        path = plan.spec.path
        ttft_ms, tpot_ms = slos[path]
        n_req = len(_trace(path, plan.spec.fmt, plan.limit, args.users, args.seed))
        for load in loads:
            for state in states:
                pols = {pol: pooled(grouped[(path, load, state, pol)], slos[path]) for pol in policies}
                cells.append({
                    "trace": path, "split": plan.spec.split, "slo": {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms},
                    "load": load, "state": state, "requests": n_req, "ideal_prefix_hit_rate": ideal[path],
                    "capacity_rps": plan.capacity_rps, "flood_offered_rps": floods[path]["flood_offered_rps"],
                    "offered_rps": round(load * plan.capacity_rps, 3), "best": best_of(pols), "policies": pols,
                })
    d: dict[str, Any] = {
        "default": default, "policies": policies, "loads": loads, "states": states, "repeats": len(seeds),
        "oracle": oracle, "prefix_shares_kv": common["prefix_shares_kv"],
        "splits": {p.spec.path: p.spec.split for p in plans},
        "slos": {p: {"ttft_ms": s[0], "tpot_ms": s[1]} for p, s in slos.items()},
        "limits": {p.spec.path: p.limit for p in plans},
        "fault_node": node, "slow_factor": SLOW_FACTOR, "seed": args.seed,
        "cluster": {"racks": len(base.cluster.racks), "nodes": len(base.nodes()),
                    "gpus": sum(n.tp for n in base.nodes()), "models": sorted({n.models[0] for n in base.nodes()})},
        "wall_s": round(time.perf_counter() - t0, 1), "cells": cells,
    }
    d["summary"] = summary(d)
    return d


def trace_label(path: str) -> str:
    """A short name of a trace file for tables and plots: `azure-conv`, `azure-code`, `mooncake-fast25`, ..."""
    p = Path(path)
    if p.stem.startswith("AzureLLMInferenceTrace_"):
        return "azure-" + p.stem.removeprefix("AzureLLMInferenceTrace_")
    if p.stem in ("synthetic_trace", "trace", "data"):
        return p.parent.name
    if p.parent.name == "servegen":
        return "servegen-" + p.stem.removesuffix("-busiest-hour")
    return p.stem.removesuffix("_trace")


class Ratios(NamedTuple):
    """A policy's figures against a cell's best: each >= 1 where the policy is behind."""

    goodput: float
    """Best goodput over the policy's."""
    ttft: float
    """The policy's P99 TTFT over the best among the low-shed peers."""
    e2e: float
    """The policy's P99 end-to-end over the best."""
    throughput: float
    """Best throughput over the policy's."""
    low_shed: bool
    """Whether the policy is one of the cell's low-shed peers."""


def worst_ratio(cell: Mapping[str, Any], policy: str) -> Ratios:
    """The policy's figures against the cell's best (see `Ratios`)."""
    pols = cell["policies"]
    me = pols[policy]
    peers = low_shed_peers(pols)
    bg = max(p["goodput_rps"] for p in pols.values())
    bt = min(pols[p]["p99_ttft_ms"] for p in peers)
    be = min(p["p99_ms"] for p in pols.values())
    bp = max(p["throughput_rps"] for p in pols.values())
    return Ratios(bg / max(me["goodput_rps"], 1e-9), me["p99_ttft_ms"] / max(bt, 1e-9), me["p99_ms"] / max(be, 1e-9),
                  bp / max(me["throughput_rps"], 1e-9), policy in peers)


def summary(d: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Per split: the cells, those where the default is within `WITHIN` of the best goodput (every load), and those up
    to `TTFT_MAX_LOAD` where it is a low-shed peer within `WITHIN` of the peers' best P99 TTFT."""
    out: dict[str, dict[str, int]] = {}
    for c in d["cells"]:
        s = out.setdefault(c.get("split", "test"), {"cells": 0, "goodput_within": 0, "ttft_cells": 0,
                                                    "ttft_within": 0})
        r = worst_ratio(c, d["default"])
        s["cells"] += 1
        s["goodput_within"] += r.goodput <= WITHIN
        if c["load"] <= TTFT_MAX_LOAD:
            s["ttft_cells"] += 1
            s["ttft_within"] += r.low_shed and r.ttft <= WITHIN
    return dict(sorted(out.items()))


def format_matrix(d: Mapping[str, Any]) -> str:
    dflt = d["default"]
    head = (f"{'trace':<20}{'split':<7}{'load':>5} {'state':<8}{'cap rps':>8} {'SLO ms':>12}  "
            f"{'best goodput':<24}{'default':>8}  {'shed dflt/low':>13}  {'best P99 TTFT (low shed)':<24}"
            f"{'default':>9}  {'best P99 e2e':<24}{'default':>8}  {'best tput':<22}{'default':>8}  {'hit/ideal':>10}")
    lines = [f"default policy: {dflt}; oracle {'on' if d.get('oracle') else 'off'}; ratios are the default's figure "
             "over the best (goodput, throughput: best over the default); P99 TTFT is compared among the policies "
             f"that shed at most {SHED_PEER_MARGIN:.2f} above the cell's lowest share ('!': the default sheds more)",
             head]
    for c in d["cells"]:
        pols = c["policies"]
        me = pols[dflt]
        r = worst_ratio(c, dflt)
        b = c["best"]
        low = min(p["shed_frac"] for p in pols.values())
        slo = c.get("slo", {})
        lines.append(
            f"{trace_label(c['trace'])[:19]:<20}{c.get('split', '')[:6]:<7}{c['load']:>5.1f} {c['state']:<8}"
            f"{c['capacity_rps']:>8.1f} {slo.get('ttft_ms', 0):>6.0f}/{slo.get('tpot_ms', 0):<5.0f}  "
            f"{b['goodput_rps'][:14]:<14}{pols[b['goodput_rps']]['goodput_rps']:>8.2f}  x{r.goodput:>5.2f}  "
            f"{me['shed_frac']:>6.3f}/{low:<6.3f}  "
            f"{b['p99_ttft_ms'][:14]:<14}{pols[b['p99_ttft_ms']]['p99_ttft_ms']:>8.0f}  x{r.ttft:>5.2f}"
            f"{' ' if r.low_shed else '!'}  "
            f"{b['p99_ms'][:14]:<14}{pols[b['p99_ms']]['p99_ms']:>8.0f}  x{r.e2e:>5.2f}  "
            f"{b['throughput_rps'][:14]:<14}{pols[b['throughput_rps']]['throughput_rps']:>6.2f}  x{r.throughput:>5.3f}"
            f"  {me['prefix_hit_rate']:.2f}/{c['ideal_prefix_hit_rate']:.2f}")
    for split, s in (d.get("summary") or summary(d)).items():
        lines.append(f"{split}: the default is within {100 * (WITHIN - 1):.0f}% of the best goodput in "
                     f"{s['goodput_within']}/{s['cells']} cells (every load), and of the best P99 TTFT among the "
                     f"low-shed policies in {s['ttft_within']}/{s['ttft_cells']} cells (loads <= {TTFT_MAX_LOAD})")
    return "\n".join(lines)


def _bar_chart(d: Mapping[str, Any], path: Path, metric: str, scale: float, ylabel: str, title: str) -> None:
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
        vals = [c["policies"][p][metric] * scale for p in pols]
        colors = ["tab:red" if p == dflt else "tab:gray" for p in pols]
        ax.bar(range(len(pols)), vals, color=colors)
        ax.set_title(f"{trace_label(c['trace'])[:22]} ({c.get('split', '')})\n{c['load']}x, {c['state']}",
                     fontsize=7)
        ax.set_xticks(range(len(pols)), pols, rotation=90, fontsize=5)
        ax.tick_params(axis="y", labelsize=6)
        ax.set_ylabel(ylabel, fontsize=6)
    for k in range(len(cells), rows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.suptitle(f"{title} per policy and cell (default {dflt} in red)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_matrix(d: Mapping[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dflt = d["default"]
    cells = d["cells"]
    pols = d["policies"]
    p1 = out / "matrix-ttft.png"
    _bar_chart(d, p1, "p99_ttft_ms", 1 / 1000.0, "P99 TTFT (s)", "P99 TTFT")
    p3 = out / "matrix-goodput.png"
    _bar_chart(d, p3, "goodput_rps", 1.0, "goodput (req/s)", "Goodput within the cell's SLO")
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
    return [str(p1), str(p3), str(p2)]


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


__all__ = ["TRACES", "Job", "TraceSpec", "best_of", "build_jobs", "cmd_matrix", "default_slo", "default_traces",
           "flood_capacity", "goodput_rps", "job_requests", "measure_capacity", "parse_traces", "pooled", "run_job",
           "run_matrix", "summary", "worst_ratio"]
