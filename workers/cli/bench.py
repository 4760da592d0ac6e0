"""`rackflow bench streams|profile|route|pipeline|batching|kv|failover|gateway|streams-capacity|soak|engines`: the
benchmarks (`workers/bench/`), medians and ratios measured side by side; `engines` re-runs itself in .venv-vllm;
`soak` starts its own durable services unless given `--redis-url` (then it cannot restart Valkey, and says so)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from workers.cli.common import endpoints_or_none
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


def cmd_bench(args: argparse.Namespace) -> int:
    from workers.bench.micro import run_bench

    if args.what == "engines":
        return _bench_engines(args)
    if args.what == "soak":
        from workers.bench.micro import _print
        from workers.bench.soak import bench_soak

        # only servers named on the command line: the soak restarts Valkey, which it may do only to its own
        _print(bench_soak(args.redis_url, args.etcd_url, minutes=args.minutes, progress=not args.no_progress),
               args.json)
        return 0

    return run_bench(args, endpoints_or_none(args))


def add_parser(sub: Any) -> None:
    s = sub.add_parser("bench", help="benchmarks (medians and ratios measured side by side)")
    s.add_argument("what", choices=["streams", "profile", "route", "pipeline", "batching", "kv", "failover", "gateway",
                                    "streams-capacity", "soak", "engines"])
    s.add_argument("--model-dir", default=None, help="engines: the checkpoint both engines load (default: the tiny "
                   f"test checkpoint in {DEFAULT_VLLM_CHECKPOINT}, made if missing)")
    s.add_argument("--bench-tokens", type=int, default=64, help="engines: tokens per sequence")
    s.add_argument("--repeats", type=int, default=3, help="engines: throughput repeats (medians)")
    s.add_argument("--requests", type=int, default=20_000, help="pipeline: requests in the flood")
    s.add_argument("--requests-batching", type=int, default=1500, help="batching: trace requests per variant")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--json", action="store_true")
    s.add_argument("--entries", type=int, default=20000, help="streams: entries per repeat")
    s.add_argument("--tokenizer", default=None, help="profile: count with this tokenizer.json (exact path)")
    s.add_argument("--clients", type=int, default=32, help="gateway: concurrent HTTP clients")
    s.add_argument("--duration-s", type=float, default=12.0, help="gateway: seconds per measured run (3 runs)")
    s.add_argument("--peer", choices=["smg"], default=None,
                   help="gateway: also run this peer gateway (SMG, a Rust gateway, installed on first use into "
                        ".venv-peers) and the bare HTTP endpoint, in the same run with the same load generator")
    s.add_argument("--http-parser", choices=["httptools", "h11"], default=None,
                   help="gateway: uvicorn's HTTP parser for the gateway (default: gateway.http_parser, httptools)")
    s.add_argument("--window-hold", action="store_true",
                   help="gateway: run the batcher with close_when_room off (the window holds requests a node could "
                        "start now until it closes), to measure what closing on room buys")
    s.add_argument("--streams", type=int, default=10_000, help="streams-capacity: concurrent streaming requests")
    s.add_argument("--stream-tokens", type=int, default=32, help="streams-capacity: max_tokens of each stream")
    s.add_argument("--minutes", type=float, default=20.0, help="soak: minutes of load at 80%% of capacity, a random "
                   "role killed every 30 s, Valkey restarted once")
    s.set_defaults(fn=cmd_bench)
