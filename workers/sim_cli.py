"""`rackflow sim run|compare|experiment`: the simulator's shell — reads traces and config files, shows progress,
prints JSON/tables, draws PNGs. The simulation itself is `pipeline.sim` (pure)."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pipeline.config import NodeSpec, RackflowConfig, parse_config, raw_config
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

REPO = Path(__file__).resolve().parent.parent
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
               extra: dict[str, Any] | None = None) -> RackflowConfig:
    raw = raw_config(config_dir, [*overrides, *([Path(cluster)] if cluster else [])])
    if policy:
        raw.setdefault("policies", {}).setdefault("node_selection", {})["policy"] = policy
    for section, values in (extra or {}).items():
        node = raw.setdefault("policies", {}).setdefault(section, {})
        node.update(values)
    return parse_config(raw, source="simulation config")


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

    def tick(now_ms: float, arrived: int, completed: int) -> None:
        bar.n = completed
        bar.set_postfix(sim_s=f"{now_ms / 1000:.0f}", arrived=arrived, refresh=False)
        bar.refresh()

    t = time.perf_counter()
    sim = Simulator(config, reqs, cost_factory(config), params=params, faults=faults, default_model=model,
                    progress=tick if progress else None)
    res = sim.run()
    wall = time.perf_counter() - t
    bar.close()
    out = summarize(res)
    out["sim_wall_s"] = round(wall, 2)
    out["requests_per_wall_s"] = round(len(reqs) / wall) if wall > 0 else 0
    out["gpus"] = sum(config.node(n).tp for n in res.node_names)
    return out, res


def prepare_requests(args: argparse.Namespace, seed: int) -> list[TraceRequest]:
    reqs = load_trace(args.trace, args.format, None if args.superpose > 1 else args.requests, seed)
    if args.rate_scale not in (None, 1.0):
        reqs = list(scale_rate(reqs, args.rate_scale))
    reqs = assign_users(reqs, args.users, args.zipf, random.Random(seed + 1), args.shared_prefix_blocks)
    if args.superpose > 1:
        reqs = superpose(reqs, args.superpose, random.Random(seed + 2))
        if args.requests:
            reqs = reqs[: args.requests]
    return reqs


def _common(args: argparse.Namespace, policy: str | None) -> tuple[RackflowConfig, SimParams]:
    cfg = sim_config(Path(args.config_dir), [Path(p) for p in args.config], args.cluster, policy,
                     {"batcher": {"window_ms": args.window_ms}} if args.window_ms else None)
    params = SimParams(batching=args.batching, fixed_batch=args.fixed_batch, prefix_cache=not args.no_prefix_cache)
    return cfg, params


def cmd_sim(args: argparse.Namespace) -> int:
    default_trace(args)
    seed = args.seed
    if args.action == "run":
        cfg, params = _common(args, args.policy)
        cfg = _with_seed(cfg, seed)
        reqs = prepare_requests(args, seed)
        out, res = run_once(cfg, reqs, params, parse_faults(args.faults), args.model, not args.no_progress)
        out["policy"] = cfg.policies.node_selection.policy
        out["trace"] = args.trace or "synthetic"
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            plot_compare({out["policy"]: res}, Path(args.out) / "sim.png", "simulation")
            (Path(args.out) / "sim.json").write_text(json.dumps(out, indent=2, sort_keys=True))
        _emit(out, args.json)
        return 0 if out["completed"] + out["dropped"] == out["requests"] else 1
    if args.action == "matrix":
        from workers.sim_matrix import cmd_matrix

        return cmd_matrix(args)
    if args.action == "trace":
        return cmd_trace(args)
    if args.action == "compare":
        policies = [p.strip() for p in (args.policies or COMPARE_POLICIES).split(",") if p.strip()]
        reqs = prepare_requests(args, seed)
        rows: dict[str, dict[str, Any]] = {}
        results: dict[str, SimResult] = {}
        for pol in policies:
            cfg, params = _common(args, pol)
            cfg = _with_seed(cfg, seed)
            rows[pol], results[pol] = run_once(cfg, reqs, params, parse_faults(args.faults), args.model,
                                               not args.no_progress, label=pol)
        out_dir = Path(args.out or "report/sim-compare")
        out_dir.mkdir(parents=True, exist_ok=True)
        plot_compare(results, out_dir / "compare.png", f"{len(reqs)} requests")
        (out_dir / "compare.json").write_text(json.dumps(rows, indent=2, sort_keys=True))
        if args.json:
            print(json.dumps(rows, sort_keys=True))
        else:
            print(format_table(rows))
            print(f"plots: {out_dir / 'compare.png'}")
        return 0
    from workers.sim_experiments import run_experiment

    return run_experiment(args)


COMPARE_POLICIES = "round_robin,weighted,least_outstanding,kv_aware,work_aware"
MULTITURN = REPO / "data" / "traces" / "synthetic" / "multiturn.jsonl"


def cmd_trace(args: argparse.Namespace) -> int:
    """`rackflow sim trace multiturn [--out PATH]`: write the multi-turn synthetic trace (Mooncake JSONL + user_id)."""
    from pipeline.sim.traces import MultiTurnSpec, multiturn, to_jsonl
    from pipeline.tokens import prefix_hashes_from_ids

    if args.name != "multiturn":
        print(f"rackflow sim trace: unknown trace {args.name!r}; available: multiturn", file=sys.stderr)
        return 2
    cfg = sim_config(Path(args.config_dir), [Path(p) for p in args.config], args.cluster, None)
    spec = MultiTurnSpec(block_tokens=cfg.policies.profiling.prefix_block_tokens)
    if args.requests:
        spec = MultiTurnSpec(conversations=max(1, args.requests // 4), block_tokens=spec.block_tokens)
    reqs = multiturn(spec, random.Random(args.seed), prefix_hashes_from_ids)
    path = Path(args.out or MULTITURN)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for r in reqs:
            fh.write(to_jsonl(r) + "\n")
    print(f"wrote {len(reqs)} requests over {reqs[-1].arrival_ms / 1000:.0f} s to {path}" if reqs else "no requests")
    return 0


def _with_seed(cfg: RackflowConfig, seed: int) -> RackflowConfig:
    return cfg.model_copy(update={"policies": cfg.policies.model_copy(update={"seed": seed})})


def _emit(out: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(out, sort_keys=True))
        return
    for k, v in out.items():
        print(f"{k:<22} {v}")


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


def add_parser(sub: Any) -> None:
    s = sub.add_parser("sim", help="discrete-event simulation of the cluster with the live policies")
    s.add_argument("action", choices=["run", "compare", "matrix", "experiment", "trace"])
    s.add_argument("name", nargs="?", help="experiment: roundrobin-vs-weighted | window-batching | scale-pareto; "
                                           "trace: multiturn")
    s.add_argument("--trace", default=None, help=f"trace file (default for azure: {AZURE_CONV.relative_to(REPO)})")
    s.add_argument("--format", default="azure", choices=["azure", "mooncake", "synthetic"])
    s.add_argument("--cluster", default=None, help="YAML with a `cluster:` (and optionally other sections) "
                                                   "merged over configs/")
    s.add_argument("--policy", default=None, help="node policy (default: node_selection.policy)")
    s.add_argument("--policies", default=None,
                   help=f"compare: comma-separated node policies (default {COMPARE_POLICIES}); matrix: default all")
    s.add_argument("--traces", default=None, help="matrix: PATH:FORMAT,... (FORMAT azure|mooncake; default the Azure "
                                                  "conv and code traces and the Mooncake trace)")
    s.add_argument("--loads", default=None, help="matrix: fractions of capacity (default 0.5,0.8,1.0,1.5)")
    s.add_argument("--states", default=None, help="matrix: healthy,slow,death (default all three)")
    s.add_argument("--repeats", type=int, default=1, help="matrix: runs per cell with other user draws and seeds, "
                                                          "latencies pooled")
    s.add_argument("--jobs", type=int, default=None, help="matrix: worker processes (default: the CPU count)")
    s.add_argument("--model", default=None, help="model of the trace's requests (default: the first served)")
    s.add_argument("--rate-scale", type=float, default=None, help="multiply the request rate (default 1; "
                                                                  "experiments pick their own)")
    s.add_argument("--sizes", default=None, help="scale-pareto: GPU counts, e.g. 64,128,256,512,1024")
    s.add_argument("--requests", type=int, default=None, help="use the first N requests")
    s.add_argument("--superpose", type=int, default=1, help="K independent copies of the trace over the same hour "
                                                            "(K x the load; 11 x Azure conv = the seed's 5 M/day)")
    s.add_argument("--users", type=int, default=2000, help="users drawn (Zipf) for requests without one")
    s.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of user popularity")
    s.add_argument("--shared-prefix-blocks", type=int, default=0,
                   help="requests of one user share this many 512-token prefix blocks (system prompt)")
    s.add_argument("--batching", choices=["window", "fixed"], default="window")
    s.add_argument("--fixed-batch", type=int, default=32)
    s.add_argument("--window-ms", type=int, default=None)
    s.add_argument("--no-prefix-cache", action="store_true")
    s.add_argument("--faults", default=None, help="NODE@SECONDS:KIND[:DURATION_S[:FACTOR]],... "
                                                  "KIND death|xid|slow")
    s.add_argument("--seed", type=int, default=20231116)
    s.add_argument("--out", default=None, help="directory for JSON and PNG output")
    s.add_argument("--json", action="store_true")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(fn=cmd_sim)


def default_trace(args: argparse.Namespace) -> None:
    if args.trace is None and args.format == "azure":
        args.trace = str(AZURE_CONV)
