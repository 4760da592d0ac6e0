"""`rackflow bench streams|profile|route|pipeline|batching|kv|failover|gateway|streams-capacity|soak|idle|engines|
priority|fairness`: the
benchmarks (`workers/bench/`), medians and ratios measured side by side; `engines` re-runs itself in .venv-vllm;
`soak` starts its own durable services unless given `--redis-url` (then it cannot restart Valkey, and says so)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from workers.cli.common import add_subcommands, endpoints_or_none
from workers.local.cluster import DEFAULT_VLLM_CHECKPOINT


def _bench_engines(args: argparse.Namespace) -> int:
    import importlib.util
    import os

    from workers.local.launcher import vllm_python

    if importlib.util.find_spec("vllm") is None:  # vLLM lives in .venv-vllm: run there
        try:
            python = vllm_python()
        except RuntimeError as e:
            print(f"rackflow bench engines: {e}", file=sys.stderr)
            return 2
        os.execv(python, [python, "-m", "workers.cli", *sys.argv[1:]])
    from workers.bench.engines import bench_engines
    from workers.bench.micro import _print
    from workers.engines.checkpoint import write_tiny_checkpoint

    model_dir = Path(args.model_dir) if args.model_dir else write_tiny_checkpoint(DEFAULT_VLLM_CHECKPOINT)
    res = bench_engines(model_dir, repeats=args.repeats, tokens=args.bench_tokens, progress=not args.no_progress)
    _print(res, args.json)
    return 0


def _peer_list(text: str) -> list[str]:
    from workers.bench.peer import peer_names

    try:
        return peer_names(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def cmd_bench(args: argparse.Namespace) -> int:
    from workers.bench.micro import run_bench

    if args.what == "engines":
        return _bench_engines(args)
    if args.what == "soak":
        from workers.bench.micro import _print
        from workers.bench.soak import bench_soak

        # only servers named on the command line: the soak restarts Valkey, which it may do only to its own
        res = bench_soak(args.redis_url, args.etcd_url, minutes=args.minutes, progress=not args.no_progress)
        _print(res, args.json)
        # a soak that lost, doubled or failed a request, or whose roles died unasked, fails the command
        return 0 if res["lost"] == res["duplicates"] == res["client_errors"] == 0 and \
            not res["unexpected_exits"] else 1

    if args.what in ("priority", "fairness"):
        from workers.bench.micro import _print
        from workers.bench.priority import bench_fairness, bench_priority

        if args.what == "priority":
            res = bench_priority(args.redis_url, args.etcd_url, repeats=args.repeats, phase_s=args.phase_s,
                                 batch_yield=args.batch_yield, progress=not args.no_progress)
        else:
            res = bench_fairness(args.redis_url, args.etcd_url, repeats=args.repeats, fair_s=args.fair_s,
                                 fair=not args.no_fair, progress=not args.no_progress)
        _print(res, args.json)
        return 0 if res["lost"] == 0 else 1

    if args.what == "idle":
        from workers.bench.idle import bench_idle
        from workers.bench.micro import _print
        from workers.cli.common import config_of
        from workers.local.cluster import config_args

        res = bench_idle(config_of(args), config_args(args), seconds=args.idle_s,
                         progress=not args.no_progress)
        _print(res, args.json)
        return 0

    if args.what == "fuzz":
        from workers.bench.fuzz import bench_fuzz
        from workers.bench.micro import _print

        res = bench_fuzz(requests=args.fuzz_requests, streamed=args.streamed, concurrency=args.concurrency,
                         seed=args.seed, progress=not args.no_progress)
        _print(res, args.json)
        ok = res["status_5xx"] == res["transport_errors"] == res["roles_crashed"] == res["leaked_keys"] == 0
        return 0 if ok else 1

    return run_bench(args, endpoints_or_none(args))


def _flags() -> dict[str, dict[str, Any]]:
    """Every flag of `rackflow bench`, by name, with its add_argument keywords; each bench adds those it reads."""
    return {
    "--fuzz-requests": dict(type=int, default=10_000, help="requests sent, valid and hostile (default 10,000)"),
    "--streamed": dict(type=int, default=1_000, help="of which streaming, at least (default 1,000)"),
    "--concurrency": dict(type=int, default=32, help="requests in flight at once (default 32)"),
    "--seed": dict(type=int, default=0, help="the generator's seed: the same seed sends the same requests"),
    "--model-dir": dict(
        default=None,
        help="engines: the checkpoint both engines load (default: the tiny "
                 f"test checkpoint in {DEFAULT_VLLM_CHECKPOINT}, made if missing)"),
    "--bench-tokens": dict(
        type=int,
        default=64,
        help="engines: tokens per sequence"),
    "--repeats": dict(
        type=int,
        default=3,
        help="engines: throughput repeats (medians)"),
    "--requests": dict(
        type=int,
        default=20_000,
        help="pipeline: requests in the flood"),
    "--requests-batching": dict(
        type=int,
        default=1500,
        help="batching: trace requests per variant"),
    "--no-progress": dict(
        action="store_true"),
    "--json": dict(
        action="store_true"),
    "--entries": dict(
        type=int,
        default=20000,
        help="streams: entries per repeat"),
    "--tokenizer": dict(
        default=None,
        help="profile: count with this tokenizer.json (exact path)"),
    "--clients": dict(
        type=int,
        default=32,
        help="gateway: concurrent HTTP clients"),
    "--duration-s": dict(
        type=float,
        default=12.0,
        help="gateway: seconds per measured run (3 runs)"),
    "--peer": dict(
        type=_peer_list,
        default=None,
        help="gateway: also run these peer gateways, a comma list of smg and vllm-router (Rust gateways, "
                 "installed on first use into .venv-peers), and the bare HTTP endpoint, in the same run with the "
                 "same load generator; a peer that cannot be installed is reported and the rest still measured"),
    "--http-parser": dict(
        choices=["httptools", "h11"],
        default=None,
        help="gateway: uvicorn's HTTP parser for the gateway (default: gateway.http_parser, httptools)"),
    "--routing": dict(
        choices=["router", "inline"],
        default=None,
        help="gateway: who routes each request to its rack: the router process (rf:ingress) or the gateway itself "
                 "(default: gateway.routing, router)"),
    "--window-hold": dict(
        action="store_true",
        help="gateway: run the batcher with close_when_room off (the window holds requests a node could "
                 "start now until it closes), to measure what closing on room buys"),
    "--streams": dict(
        type=int,
        default=10_000,
        help="streams-capacity: concurrent streaming requests"),
    "--stream-tokens": dict(
        type=int,
        default=32,
        help="streams-capacity: max_tokens of each stream"),
    "--idle-s": dict(
        type=float,
        default=30.0,
        help="idle: seconds measured while nothing is sent (after 10 s of settling)"),
    "--phase-s": dict(
        type=float,
        default=45.0,
        help="priority: seconds of interactive load in each phase (alone, then with the batch backlog)"),
    "--batch-yield": dict(
        choices=["preempt", "hold"],
        default="preempt",
        help="priority: how batch work yields to interactive work (policies.batcher.batch_yield)"),
    "--fair-s": dict(
        type=float,
        default=130.0,
        help="fairness: seconds the two tenants send (the first 10 s, while the queues form, are not scored)"),
    "--no-fair": dict(
        action="store_true",
        help="fairness: the batchers' fair share off (the baseline: smallest memory first, whoever sent it)"),
    "--minutes": dict(
        type=float,
        default=20.0,
        help="soak: minutes of load at 80%% of capacity, a random "
                 "role killed every 30 s, Valkey and etcd restarted once each (exits 1 on a lost, doubled or failed "
                 "request)"),
    }


OUT = ["--json", "--no-progress"]
BENCHES: dict[str, tuple[str, list[str]]] = {
    "streams": ("the stream layer: msgpack encode/decode, pipelined XADD, the consumer-group runner end to end",
                ["--entries", *OUT]),
    "profile": ("the gateway's request profiling (tokens, memory, prefix hashes)", ["--tokenizer", *OUT]),
    "route": ("routing decisions per second, per policy", OUT),
    "pipeline": ("the Streams pipeline against a Celery-only baseline", ["--requests", *OUT]),
    "batching": ("window batching against fixed batches on a trace", ["--requests-batching", *OUT]),
    "kv": ("KV snapshots exported to and imported from the L1/L2 tiers", OUT),
    "failover": ("one worker of 8 killed mid-run: what the clients saw", OUT),
    "gateway": ("requests/s, CPU per request and added TTFT of the HTTP path, beside a peer gateway",
                ["--clients", "--duration-s", "--repeats", "--peer", "--http-parser", "--routing", "--window-hold",
                 *OUT]),
    "streams-capacity": ("concurrent streaming requests one gateway holds", ["--streams", "--stream-tokens", *OUT]),
    "soak": ("load through rackflow up with roles killed and servers restarted", ["--minutes", *OUT]),
    "priority": ("interactive P99 TTFT alone and beside a saturating batch backlog, and the idle capacity batch work "
                 "uses (medians over --repeats)", ["--repeats", "--phase-s", "--batch-yield", *OUT]),
    "fairness": ("two tenants at 3:1 demand: each one's share of the tokens served per minute",
                 ["--repeats", "--fair-s", "--no-fair", *OUT]),
    "idle": ("CPU of an idle `rackflow up` cluster (every role, Valkey, etcd; Celery and Flower apart)",
             ["--idle-s", *OUT]),
    "fuzz": ("rackflow up under malformed and hostile HTTP: 5xx, crashed roles and leaked keys counted",
             ["--fuzz-requests", "--streamed", "--concurrency", "--seed", *OUT]),
    "engines": ("the torch and vLLM engines' throughput on one checkpoint",
                ["--model-dir", "--bench-tokens", "--repeats", *OUT]),
}


def add_parser(sub: Any) -> None:
    s = sub.add_parser("bench", help="benchmarks (medians and ratios measured side by side)",
                       description="Benchmarks, medians and ratios measured side by side in one run. Each has its "
                       "own flags: rackflow bench NAME -h.")
    add_subcommands(s, "what", BENCHES, _flags(), cmd_bench)
