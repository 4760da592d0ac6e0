"""`rackflow sim run|compare|experiment`: the simulator's shell — reads traces and config files, shows progress,
prints JSON/tables, draws PNGs. The simulation itself is `pipeline.sim` (pure)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from pipeline.config import RackflowConfig
from pipeline.sim.simulator import SimParams, SimResult
from workers.cli.common import add_subcommands
from workers.sim.calibrate import control_plane_costs
from workers.sim.harness import (
    AZURE_CONV,
    REPO,
    format_table,
    parse_faults,
    plot_compare,
    prepare_requests,
    result_digest,
    run_once,
    sim_config,
)


def _common(args: argparse.Namespace, policy: str | None) -> tuple[RackflowConfig, SimParams]:
    cfg = sim_config(Path(args.config_dir), [Path(p) for p in args.config], args.cluster, policy,
                     {"batcher": {"window_ms": args.window_ms}} if args.window_ms else None)
    params = SimParams(batching=args.batching, fixed_batch=args.fixed_batch, prefix_cache=not args.no_prefix_cache,
                       control_plane=control_plane_costs(args, cfg), oracle=args.oracle,
                       prefix_shares_kv=args.prefix_shares_kv)
    return cfg, params


def cmd_sim(args: argparse.Namespace) -> int:
    if args.action == "validate":
        return cmd_validate(args)
    if args.action == "calibrate-control-plane":
        from workers.sim.calibrate import cmd_calibrate

        return cmd_calibrate(args)
    default_trace(args)
    seed = args.seed
    if args.action == "run":
        cfg, params = _common(args, args.policy)
        cfg = _with_seed(cfg, seed)
        reqs = prepare_requests(args, seed)
        out, res = run_once(cfg, reqs, params, parse_faults(args.faults), args.model, not args.no_progress)
        out["policy"] = cfg.policies.node_selection.policy
        out["trace"] = args.trace or "synthetic"
        out["prefix_shares_kv"] = params.prefix_shares_kv
        if args.digest:
            out["digest"] = result_digest(res)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            plot_compare({out["policy"]: res}, Path(args.out) / "sim.png", "simulation")
            (Path(args.out) / "sim.json").write_text(json.dumps(out, indent=2, sort_keys=True))
        _emit(out, args.json)
        return 0 if out["completed"] + out["dropped"] == out["requests"] else 1
    if args.action == "matrix":
        from workers.sim.matrix import cmd_matrix

        return cmd_matrix(args)
    if args.action == "trace":
        return cmd_trace(args)
    if args.action == "compare":
        policies = [p.strip() for p in (args.policies or COMPARE_POLICIES).split(",") if p.strip()]
        reqs = prepare_requests(args, seed)
        rows: dict[str, Any] = {}
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
            print(f"oracle: {'on' if args.oracle else 'off'}; plots: {out_dir / 'compare.png'}")
        return 0
    from workers.sim.experiments import run_experiment

    return run_experiment(args)


COMPARE_POLICIES = "round_robin,weighted,least_outstanding,kv_aware,work_aware"
MULTITURN = REPO / "data" / "traces" / "synthetic" / "multiturn.jsonl"


SERVEGEN_R1 = REPO / "data" / "traces" / "servegen" / "deepseek-r1-busiest-hour.jsonl"


def cmd_trace_servegen(args: argparse.Namespace) -> int:
    """`rackflow sim trace servegen --data DIR [--hour H] [--keep P] [--out PATH]`: draw an hour of requests from
    ServeGen's client data for one model (workers/sim/servegen.py; Mooncake JSONL + user_id, no prefix hashes)."""
    from pipeline.sim.traces import TraceError, to_jsonl
    from workers.sim.servegen import busiest_hour, draw, load_clients, summary

    if not args.data:
        print("rackflow sim trace servegen: give --data DIR, a model's directory of ServeGen data (e.g. "
              "ServeGen/data/reason/deepseek-r1: its chunk-N-trace.csv and chunk-N-dataset.json files)",
              file=sys.stderr)
        return 2
    try:
        clients = load_clients(Path(args.data))
        hour = busiest_hour(clients) if args.hour is None else args.hour
        if not 0 <= hour <= 23:
            raise ValueError("--hour must be 0-23")
        reqs = draw(clients, hour * 3600, 3600, args.seed, args.keep)
    except (TraceError, ValueError, OSError) as e:
        print(f"rackflow sim trace servegen: {e}", file=sys.stderr)
        return 2
    path = Path(args.out or SERVEGEN_R1)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for r in reqs:
            fh.write(to_jsonl(r) + "\n")
    print(json.dumps({"path": str(path), "clients": len(clients), "hour": hour, "keep": args.keep, "seed": args.seed,
                      **summary(reqs)}))
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    """`rackflow sim trace multiturn [--out PATH]`: write the multi-turn synthetic trace (Mooncake JSONL + user_id);
    `rackflow sim trace servegen --data DIR`: an hour drawn from ServeGen's client data."""
    from pipeline.sim.traces import MultiTurnSpec, multiturn, to_jsonl
    from pipeline.tokens import prefix_hashes_from_ids

    if args.name == "servegen":
        return cmd_trace_servegen(args)
    if args.name != "multiturn":
        print(f"rackflow sim trace: unknown trace {args.name!r}; available: multiturn, servegen", file=sys.stderr)
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


def _flags() -> dict[str, dict[str, Any]]:
    """Every flag of `rackflow sim`, by name, with its add_argument keywords; each subcommand adds those it reads
    (SUBCOMMANDS)."""
    return {
    "--control-plane": dict(
        nargs="?",
        const="",
        default=None,
        metavar="FILE",
        help="model routers, batchers, Valkey shards, etcd and node links as stations with the measured "
                 "costs of FILE (default data/calibration/control-plane.json); off without this flag"),
    "--routers": dict(
        type=int,
        default=1,
        help="with --control-plane: router processes"),
    "--batchers-per-rack": dict(
        type=int,
        default=1,
        help="with --control-plane: batcher processes per rack"),
    "--spine-oversubscription": dict(
        type=float,
        default=1.0,
        help="with --control-plane: a rack's uplink to the spine carries its nodes' links / this (1: "
                 "non-blocking; 4: 4:1; 0: no spine modelled)"),
    "--record-flush-ms": dict(
        type=float,
        default=20.0,
        help="with --control-plane: the workers' sequence records on etcd, coalesced this long per node, one "
                 "transaction in flight per node (the live SeqRecorder's 20 ms; 0: not modelled)"),
    "--valkey-shards": dict(
        type=int,
        default=1,
        help="with --control-plane: shards the per-rack/node/request streams spread over"),
    "--trace": dict(
        default=None,
        help=f"trace file (default for azure: {AZURE_CONV.relative_to(REPO)})"),
    "--format": dict(
        default="azure",
        choices=["azure", "mooncake", "synthetic"]),
    "--cluster": dict(
        default=None,
        help="YAML with a `cluster:` (and optionally other sections) "
                 "merged over configs/"),
    "--policy": dict(
        default=None,
        help="node policy (default: node_selection.policy)"),
    "--policies": dict(
        default=None,
        help=f"compare: comma-separated node policies (default {COMPARE_POLICIES}); matrix: default all"),
    "--traces": dict(
        default=None,
        help="matrix: PATH:FORMAT,... (FORMAT azure|mooncake; default the Azure "
                 "conv and code traces and the Mooncake trace)"),
    "--loads": dict(
        default=None,
        help="matrix: fractions of capacity (default 0.5,0.8,1.0,1.5)"),
    "--states": dict(
        default=None,
        help="matrix: healthy,slow,death (default all three)"),
    "--repeats": dict(
        type=int,
        default=1,
        help="matrix: runs per cell with other user draws and seeds, "
                 "latencies pooled"),
    "--jobs": dict(
        type=int,
        default=None,
        help="matrix: worker processes (default: the CPU count)"),
    "--model": dict(
        default=None,
        help="model of the trace's requests (default: the first served)"),
    "--rate-scale": dict(
        type=float,
        default=None,
        help="multiply the request rate (default 1; "
                 "experiments pick their own)"),
    "--sizes": dict(
        default=None,
        help="scale-pareto: GPU counts, e.g. 64,128,256,512,1024"),
    "--requests": dict(
        type=int,
        default=None,
        help="use the first N requests"),
    "--flood-requests": dict(
        type=int,
        default=None,
        help="scale-pareto: requests of the capacity floods (default 80,000)"),
    "--capacity-sizes": dict(
        default=None,
        help="scale-pareto: GPU counts whose capacity is measured (default 512,1024 where in --sizes)"),
    "--flood-scale": dict(
        type=float,
        default=None,
        help="scale-pareto: the floods arrive this many times faster than the seed's load (default 40)"),
    "--sat-racks": dict(
        type=int,
        default=None,
        help="sizing: racks of the router-saturation cluster (16)"),
    "--sat-seconds": dict(
        type=float,
        default=None,
        help="sizing: seconds of arrivals per saturation run"),
    "--superpose": dict(
        type=int,
        default=1,
        help="K independent copies of the trace over the same hour "
                 "(K x the load; 11 x Azure conv = the seed's 5 M/day)"),
    "--users": dict(
        type=int,
        default=2000,
        help="users drawn (Zipf) for requests without one"),
    "--zipf": dict(
        type=float,
        default=1.1,
        help="Zipf exponent of user popularity"),
    "--shared-prefix-blocks": dict(
        type=int,
        default=0,
        help="requests of one user share this many 512-token prefix blocks (system prompt)"),
    "--batching": dict(
        choices=["window", "fixed"],
        default="window"),
    "--fixed-batch": dict(
        type=int,
        default=32),
    "--window-ms": dict(
        type=int,
        default=None),
    "--no-prefix-cache": dict(
        action="store_true"),
    "--prefix-shares-kv": dict(
        action="store_true",
        help="each engine's cached prefix blocks live in the KV pool its running sequences use, as vLLM's do "
             "(room for them: what the sequences leave free); default: a cache of the node's whole KV capacity "
             "besides them (docs/SIMULATOR.md, Known limits). The JSON says which ran (`prefix_shares_kv`)"),
    "--faults": dict(
        default=None,
        help="NODE@SECONDS:KIND[:DURATION_S[:FACTOR]],... "
                 "KIND death|xid|slow"),
    "--seed": dict(
        type=int,
        default=20231116),
    "--data": dict(
        default=None,
        help="trace servegen: a model's directory of ServeGen client data"),
    "--hour": dict(
        type=int,
        default=None,
        help="trace servegen: the hour of ServeGen's day to draw "
                 "(default: the busiest)"),
    "--keep": dict(
        type=float,
        default=0.1,
        help="trace servegen: share of the hour's requests kept "
                 "(default 0.1)"),
    "--live": dict(
        choices=["auto", "on", "off"],
        default="auto",
        help="validate: also run a trace through the live pipeline on vLLM's CPU engine and through the "
                 "simulator fitted to it (auto: when .venv-vllm exists; on: fail without it)"),
    "--live-runs": dict(
        type=int,
        default=3,
        help="validate: how many times the live part runs, each on a fresh cluster with its own profile "
                 "(every run is reported; the worst P99 error is `live_p99_error`)"),
    "--live-requests": dict(
        type=int,
        default=300,
        help="validate: requests of the live-vs-sim run"),
    "--live-load": dict(
        type=float,
        default=0.35,
        help="validate: the live run's load, a fraction of the "
                 "node's simulated capacity"),
    "--out": dict(
        default=None,
        help="directory for JSON and PNG output"),
    "--json": dict(
        action="store_true"),
    "--oracle": dict(
        action="store_true",
        help="hand the control plane what no live one has (each request's true output length, each "
                 "node's exact speed): the behaviour before the oracle-free simulator, for comparison; every "
                 "JSON says which ran (`oracle`)"),
    "--no-progress": dict(
        action="store_true"),
    "--digest": dict(
        action="store_true",
        help="run: add `digest`, a sha256 of every request's timings and placement (equal digests: the "
                 "same decisions)"),
    }


TRACE_FLAGS = ["--trace", "--format", "--requests", "--model", "--rate-scale", "--superpose", "--users", "--zipf",
               "--shared-prefix-blocks", "--seed"]
CLUSTER_FLAGS = ["--cluster", "--policy", "--batching", "--fixed-batch", "--window-ms", "--no-prefix-cache",
                 "--prefix-shares-kv", "--faults"]
CONTROL_PLANE_FLAGS = ["--control-plane", "--routers", "--batchers-per-rack", "--valkey-shards",
                       "--spine-oversubscription", "--record-flush-ms"]
OUTPUT_FLAGS = ["--out", "--json", "--no-progress", "--oracle"]
SUBCOMMANDS: dict[str, tuple[str, list[str]]] = {
    "run": ("simulate one policy on a trace", TRACE_FLAGS + CLUSTER_FLAGS + CONTROL_PLANE_FLAGS + OUTPUT_FLAGS
            + ["--digest"]),
    "compare": ("every node policy on the same requests, side by side, with a plot",
                TRACE_FLAGS + [f for f in CLUSTER_FLAGS if f != "--policy"] + CONTROL_PLANE_FLAGS + OUTPUT_FLAGS
                + ["--policies"]),
    "matrix": ("every node policy on every trace x cluster state x load, scored per cell",
               ["--traces", "--loads", "--states", "--policies", "--repeats", "--jobs", "--requests", "--users",
                "--seed", "--cluster", "--prefix-shares-kv", *OUTPUT_FLAGS]),
    "experiment": ("a named experiment (its JSON and plot under report/sim-NAME)",
                   TRACE_FLAGS + CONTROL_PLANE_FLAGS + OUTPUT_FLAGS
                   + ["--cluster", "--sizes", "--flood-requests", "--capacity-sizes", "--flood-scale", "--sat-racks",
                      "--sat-seconds"]),
    "trace": ("write a trace file: the multi-turn synthetic one, or an hour drawn from ServeGen's data",
              ["--data", "--hour", "--keep", "--requests", "--seed", "--out", "--cluster"]),
    "validate": ("the cost model's held-out error, and the simulator against a live vLLM CPU engine",
                 ["--live", "--live-runs", "--live-requests", "--live-load", "--out", "--json", "--no-progress"]),
    "calibrate-control-plane": ("measure the control plane's stations (router, batcher, Valkey, etcd) for "
                                "--control-plane",
                                ["--requests", "--out", "--json", "--no-progress", *CONTROL_PLANE_FLAGS]),
}
"""Each subcommand: its help, and the flags it reads (its own parser takes those alone; the others keep their
defaults, so the code behind every subcommand reads one namespace)."""


EXPERIMENT_NAMES = ("roundrobin-vs-weighted", "window-batching", "scale-pareto", "sizing", "vidur", "priority",
                    "fairness")
"""workers.sim.experiments.EXPERIMENTS, named here so that building the parser imports no experiment code."""


def add_parser(sub: Any) -> None:
    s = sub.add_parser("sim", help="discrete-event simulation of the cluster with the live policies",
                       description="The cluster simulated with the live control plane's own policy code, shown only "
                       "what a live one would see. Each subcommand has its own flags: rackflow sim SUBCOMMAND -h.")
    add_subcommands(s, "action", SUBCOMMANDS, _flags(), cmd_sim, {
        "experiment": ("name", EXPERIMENT_NAMES, "the experiment"),
        "trace": ("name", ["multiturn", "servegen"], "the trace to write"),
    })


def cmd_validate(args: argparse.Namespace) -> int:
    """`rackflow sim validate`: the cost model's held-out error (fitted on the calibration's profiled models, scored on
    profiled models it never saw), then the live check."""
    from pipeline.config import load_config
    from workers.sim.perf import validate_report

    out = validate_report(load_config(Path(args.config_dir)).gpus)
    live = _live_check(args)
    out["oracle"] = False
    if live is not None:
        out["live_vs_sim"] = live
        if "skipped" in live:  # --live auto without .venv-vllm: said, and not a pass
            out["live_skipped"] = live["skipped"]
            out["ok"] = False
            print(f"rackflow sim validate: the live part was SKIPPED ({live['skipped']}); without it nothing checks "
                  "the simulator against a real engine, so this is not a pass (--live off skips it on purpose)",
                  file=sys.stderr)
        else:
            # the live run sends each request's true length as max_tokens (ignore_eos), so its simulated twin runs
            # with the lengths known and the engines timed by their fitted profile at the speed they ran in the run
            # (their workers' speed beliefs: `in_run_speed`); the profile alone is reported too (`profile_only`)
            out["oracle"] = True
            runs = live["runs"]
            out["live_runs"] = [{"run": k + 1, "p99_error": r["live_p99_error"], "p50_error": r["live_p50_error"],
                                 "figures": r["figures"], "contention": r.get("contention"),
                                 "profile_contention": r.get("profile_contention"), "isolation": r.get("cpus"),
                                 "machine_contention": r.get("machine_contention"), "disturbed": r.get("disturbed"),
                                 "attempts": r.get("attempts"), "quiet_wait": r.get("quiet_wait"),
                                 "step_cost": r["step_cost"], "in_run_steps": r["in_run_steps"],
                                 "in_run_speed": r["in_run_speed"], "profile_only": r["profile_only"],
                                 "dispatch_latency_ms": r["dispatch_latency_ms"], "span_s": r["span_s"],
                                 "work_dir": r["work_dir"], "plot": r["plot"]} for k, r in enumerate(runs)]
            p99s = [r["live_p99_error"] for r in runs]
            out["live_p99_error"] = max(p99s)
            out["live_p99_error_median"] = statistics.median(p99s)
            out["live_p50_error"] = max(r["live_p50_error"] for r in runs)
            out["live_profile_only_p99_error"] = max(r["profile_only"]["p99_error"] for r in runs)
            out["live_error_target"] = LIVE_ERROR_TARGET
            out["live_between_runs"] = live["between_runs"]
            out["ok"] = bool(out["ok"] and out["live_p99_error"] <= LIVE_ERROR_TARGET)
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print(f"the cost model as it ships, fitted on {', '.join(out['fitted_models'])}; scored on models it was never "
              f"fitted on ({', '.join(out['held_out_models'])})")
        for d in out["per_operator"]:
            for arch, a in d["archs"].items():
                print(f"fit {' + '.join(d['fit_models'])} -> test {d['test_model']} [{arch}]")
                for op, v in a["operators"].items():
                    med = "n/a (not measured)" if v["median"] is None else f"{v['median']:.1%} (p90 {v['p90']:.1%})"
                    print(f"  {op:<26} {med}")
        print(f"median_op_error         {out['median_op_error']:.1%} (target {out['op_error_target']:.0%})")
        print(f"p90_op_error            {out['p90_op_error']:.1%} (target {out['p90_op_error_target']:.0%}; every "
              "held-out operator point, pooled)")
        for cls, v in out["per_class"].items():
            print(f"  {cls:<22} median {v['median']:.1%}, p90 {v['p90']:.1%}, worst {v['worst']:.1%} "
                  f"({v['rows']} points)")
        dec = out["decode_per_token_error"]
        print(f"decode_per_token_error  median {dec['median']:.1%}, p90 {dec['p90']:.1%}, max {dec['max']:.1%}, "
              f"{dec['within_target']:.0%} of {dec['points']} points within {dec['target']:.0%}")
        for m, v in out["per_test_model"].items():
            o, d = v["operator_points"], v["decode_step"]
            print(f"  {m:<26} operators median {o['median']:.1%}, p90 {o['p90']:.1%}; decode step median "
                  f"{d['median']:.1%}, p90 {d['p90']:.1%}")
        one = out["one_model_fits"]
        print(f"fitted on one Llama-2 model, scored on the other (both ways): median_op_error "
              f"{one['median_op_error']:.1%}, p90_op_error {one['p90_op_error']:.1%}, decode_p90_error "
              f"{one['decode_p90_error']:.1%}")
        if live is not None and "runs" in live:
            for k, r in enumerate(live["runs"]):
                c = r.get("contention") or {}
                print(f"live vs sim, run {k + 1} of {len(live['runs'])} (vLLM CPU engine, {r['requests']} requests at "
                      f"{r['load']:.0%} load; the engine's cores: engine {c.get('engine_share', 0):.0%}, "
                      f"foreign {c.get('foreign_share', 0):.0%}, stolen {c.get('steal_share', 0):.0%}):")
                sp = r["in_run_speed"]
                print(f"  the engine ran at {sp['decode']:.3f}x its profile's decode time and {sp['prefill']:.3f}x "
                      "its prefill time (its speed belief); simulated at that speed, and on the profile alone:")
                rs = r["profile_only"]["figures"]
                for name, v in r["figures"].items():
                    print(f"  {name:<9} live {v['live_ms']:>9.1f} ms  sim {v['sim_ms']:>9.1f} ms  "
                          f"error {v['error']:.1%}   profile alone {rs[name]['sim_ms']:>9.1f} ms  "
                          f"error {rs[name]['error']:.1%}")
            print(f"live_p99_error          worst {out['live_p99_error']:.1%}, median "
                  f"{out['live_p99_error_median']:.1%} over {len(live['runs'])} runs (target {LIVE_ERROR_TARGET:.0%} "
                  "in every run)")
            for key, v in live["between_runs"].items():
                print(f"  between runs: {key:<28} {v}")
        elif live is not None:
            print(f"live vs sim: SKIPPED ({live['skipped']}): not a pass")
    return 0 if out["ok"] else 1


LIVE_ERROR_TARGET = 0.15


def _live_check(args: argparse.Namespace) -> dict[str, Any] | None:
    """The engine-vs-sim run of `rackflow sim validate` (workers/sim/live_check.py), or why it did not run."""
    if args.live == "off":
        return None
    from workers.local.launcher import vllm_python

    try:
        vllm_python()
    except RuntimeError as e:
        if args.live == "on":
            raise SystemExit(f"rackflow sim validate --live on: {e}") from None
        return {"skipped": str(e)}
    from workers.sim.live_check import live_runs

    return live_runs(args.live_runs, args.live_requests, args.live_load, progress=not args.no_progress,
                     keep_dir=Path(args.out) if args.out else None)


def default_trace(args: argparse.Namespace) -> None:
    if args.trace is None and args.format == "azure":
        args.trace = str(AZURE_CONV)
