"""The simulation harness the CLI, the experiments and the matrix share: load a trace (Azure CSV, Mooncake JSONL,
synthetic), build a config for a cluster/policy, build the cost model, run one `pipeline.sim.Simulator` run, and
format or plot the results. `workers/cli/sim.py` is only argument parsing and output around it."""

from __future__ import annotations

import argparse
import contextlib
import gc
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pipeline.config import NodeSpec, RackflowConfig, overlay, parse_config, raw_config
from pipeline.sim.node import StepCost
from pipeline.sim.report import latencies, per_node_load, summarize
from pipeline.sim.simulator import Fault, SimParams, SimResult, Simulator
from pipeline.sim.traces import (
    SyntheticSpec,
    TraceRequest,
    assign_users,
    parse_azure,
    parse_mooncake,
    scale_rate,
    superpose,
    synthetic,
)

REPO = Path(__file__).resolve().parents[2]


TRACE_FORMATS = ("azure", "mooncake")
"""Trace file formats `load_trace` reads (a PATH:FORMAT of `rackflow sim matrix --traces`)."""

AZURE_CONV = REPO / "data" / "traces" / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"


def cost_factory(config: RackflowConfig) -> Callable[[NodeSpec], StepCost]:
    from pipeline.costmodel import CalibratedCostModel

    cache: dict[tuple[str, str, int], StepCost] = {}

    def make(spec: NodeSpec) -> StepCost:
        key = (spec.gpu, spec.models[0], spec.tp)
        if key not in cache:
            cache[key] = CalibratedCostModel.for_node(config, spec)
        return cache[key]

    return make


def load_trace(path: str | None, fmt: str, limit: int | None, seed: int, synthetic_spec: SyntheticSpec | None = None
               ) -> list[TraceRequest]:
    if fmt == "synthetic":
        spec = synthetic_spec or SyntheticSpec(requests=limit or 10_000)
        return list(synthetic(spec, random.Random(seed)))
    if path is None:
        raise SystemExit("rackflow sim: --trace PATH is required for --format azure|mooncake")
    p = Path(path)
    if not p.exists():
        raise SystemExit(f"rackflow sim: trace file {p} not found")
    with open(p, newline="", encoding="utf-8") as fh:
        if fmt == "azure":
            return list(parse_azure(fh, limit))
        if fmt == "mooncake":
            return list(parse_mooncake(fh, limit))
    raise SystemExit(f"rackflow sim: unknown trace format {fmt!r}; allowed: azure, mooncake, synthetic")


def sim_config(config_dir: Path, overrides: Sequence[Path], cluster: str | None, policy: str | None,
               extra: dict[str, Any] | None = None, over: dict[str, Any] | None = None) -> RackflowConfig:
    """The config of a simulation: the directory and override files, then `cluster` (a YAML file), then `over`
    (plain data, see pipeline.config.overlay), the node policy and `extra` policy sections on top."""
    raw = raw_config(config_dir, [*overrides, *([Path(cluster)] if cluster else [])])
    raw = overlay(raw, over or {}, source="simulation overlay")
    policies: dict[str, Any] = dict(extra or {})
    if policy:
        policies["node_selection"] = {"policy": policy}
    return parse_config(overlay(raw, {"policies": policies}), source="simulation config")


def parse_faults(spec: str | None) -> list[Fault]:
    """`NODE@SECONDS:KIND[:DURATION_S[:FACTOR]]`, comma separated, e.g. `r0-n1@600:death,r1-n0@900:xid:60`."""
    out: list[Fault] = []
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            node, rest = part.split("@", 1)
            bits = rest.split(":")
            at_s, kind = float(bits[0]), bits[1]
            dur = float(bits[2]) * 1000.0 if len(bits) > 2 else 0.0
            factor = float(bits[3]) if len(bits) > 3 else 1.0
        except (ValueError, IndexError):
            raise SystemExit(f"rackflow sim: bad fault {part!r}; use NODE@SECONDS:KIND[:DURATION_S[:FACTOR]] "
                             "with KIND death|xid|slow") from None
        out.append(Fault(at_s * 1000.0, node, kind, dur, factor))
    return out


def run_once(config: RackflowConfig, reqs: list[TraceRequest], params: SimParams, faults: Sequence[Fault],
             model: str | None, progress: bool, label: str = "simulating") -> tuple[dict[str, Any], SimResult]:
    bar = tqdm(total=len(reqs), desc=label, unit="req", disable=not progress, file=sys.stderr, dynamic_ncols=True,
               mininterval=0.5)

    def tick(now_ms: float, arrived: int, settled: int) -> None:
        bar.n = settled  # completed or shed: the bar reaches 100% when every request has its outcome
        bar.set_postfix(sim_s=f"{now_ms / 1000:.0f}", arrived=arrived, refresh=False)
        bar.refresh()

    t = time.perf_counter()
    with quiet_gc():  # the setup and the report too: millions of objects that make no cycles (see quiet_gc)
        sim = Simulator(config, reqs, cost_factory(config), params=params, faults=faults, default_model=model,
                        progress=tick if progress else None)
        res = sim.run()
        wall = time.perf_counter() - t
        bar.close()
        out = summarize(res)
    out["sim_wall_s"] = round(wall, 2)
    out["requests_per_wall_s"] = round(len(reqs) / wall) if wall > 0 else 0
    out["gpus"] = sum(config.node(n).tp for n in res.node_names)
    out["sim_compiled"] = is_compiled()
    out["peak_rss_mb"] = peak_rss_mb()
    return out, res


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (trace loading, superposing and the run included), MB: Linux
    reports `ru_maxrss` in KiB, macOS in bytes."""
    import resource

    peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return round(peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0, 1)


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """The cyclic garbage collector off for a run (on again after it). Its scans took 17-24% of the 10 k GPU
    hour (py-spy; gc.callbacks: 93 s of 380 s), and a run makes no reference cycles per request
    (tests/integration/test_sim_compiled.py counts what is left for the collector, compiled and pure), so
    reference counting frees everything as it goes. Results are unchanged: no decision depends on when memory is
    freed."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def is_compiled() -> bool:
    """Whether the simulator's modules in this process are the compiled ones (workers.sim.compiled)."""
    import pipeline.sim.simulator as mod

    return not str(mod.__file__).endswith(".py")


def result_digest(res: SimResult) -> str:
    """sha256 of every request's timings, node and fate, and the run's counters: two runs with the same digest
    made the same decisions (the compiled and the pure-Python simulator are compared on it)."""
    import hashlib

    key = (res.first_token, res.finish, res.node_of, res.dropped, res.migrations, res.events, res.preemptions,
           res.cached_tokens, res.batch_sizes, res.shed, res.host_hit_tokens, res.control_plane)
    return hashlib.sha256(repr(key).encode()).hexdigest()


def prepare_requests(args: argparse.Namespace, seed: int) -> list[TraceRequest]:
    """The run's requests: the trace, rate-scaled, with users, superposed. With the cyclic collector off
    (`quiet_gc`): building the 10 k GPU hour's 2 M requests took 2.5 s with it, 0.7 s without."""
    with quiet_gc():
        return _prepare_requests(args, seed)


def _prepare_requests(args: argparse.Namespace, seed: int) -> list[TraceRequest]:
    reqs = load_trace(args.trace, args.format, None if args.superpose > 1 else args.requests, seed)
    if args.rate_scale not in (None, 1.0):
        reqs = list(scale_rate(reqs, args.rate_scale))
    reqs = assign_users(reqs, args.users, args.zipf, random.Random(seed + 1), args.shared_prefix_blocks)
    if args.superpose > 1:
        reqs = superpose(reqs, args.superpose, random.Random(seed + 2))
        if args.requests:
            reqs = reqs[: args.requests]
    return reqs


TABLE_KEYS = ("completed", "dropped", "p50_ms", "p95_ms", "p99_ms", "ttft_p99_ms", "small_ttft_p95_ms",
              "throughput_rps", "node_p95_std_ms", "mean_gpu_mem_util", "mean_kv_util", "kv_util_peak",
              "mean_concurrency", "preemptions", "preempted_frac", "migrations", "prefix_hit_rate", "shed",
              "sim_wall_s")


def format_table(rows: dict[str, dict[str, Any]], keys: Sequence[str] = TABLE_KEYS) -> str:
    names = list(rows)
    w = max(12, *(len(n) for n in names))
    lines = ["metric".ljust(20) + "".join(n.rjust(w + 2) for n in names)]
    for k in keys:
        lines.append(k.ljust(20) + "".join(str(rows[n].get(k, "")).rjust(w + 2) for n in names))
    return "\n".join(lines)


def plot_compare(results: dict[str, SimResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, res in results.items():
        e2e, _ttft = latencies(res)
        s = sorted(e2e)
        if s:
            ax1.plot(s, [(i + 1) / len(s) for i in range(len(s))], label=name)
    ax1.set_xscale("log")
    ax1.set_xlabel("end-to-end latency (ms)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title(f"Latency CDF ({title})")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(loc="lower right", fontsize=8)
    width = 0.8 / max(1, len(results))
    for k, (name, res) in enumerate(results.items()):
        load = per_node_load(res)
        nodes = list(load)
        ax2.bar([i + k * width for i in range(len(nodes))], [load[n] for n in nodes], width=width, label=name)
    first = next(iter(results.values()))
    names = list(per_node_load(first))
    if len(names) <= 32:
        ax2.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=60, ha="right", fontsize=7)
    ax2.set_title("Requests per node")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
