"""One role process per command: `rackflow router|batcher|worker|agent|monitor|celery-worker|gateway`. Each sets up
its process shell (`workers/shell/observe.py`) and runs the role (`workers/roles/`, `workers/gateway/`,
`workers/control/`) until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipeline.config import RackflowConfig
from workers.cli.common import config_of, endpoints
from workers.shell.observe import celery_metrics, observe
from workers.shell.runtime import json_logs_requested, run_until_signalled


def rack_of(config: RackflowConfig, node: str) -> str | None:
    try:
        return config.rack_of(node)
    except KeyError:
        return None  # the role reports the unknown node itself


def cmd_router(args: argparse.Namespace) -> int:
    from workers.roles.router import Router

    config = config_of(args)
    redis_url, etcd_url = endpoints(args)
    from streams import keys

    observe(args, config, "router", redis_url, [keys.INGRESS])
    return run_until_signalled(lambda stop: Router(config, redis_url, etcd_url).run(stop))


def cmd_batcher(args: argparse.Namespace) -> int:
    from workers.roles.batcher import Batcher

    config = config_of(args)
    redis_url, etcd_url = endpoints(args)
    from streams import keys

    observe(args, config, f"batcher-{args.rack}", redis_url, [keys.rack_requests(args.rack)], rack=args.rack)
    return run_until_signalled(lambda stop: Batcher(config, args.rack, redis_url, etcd_url).run(stop))


def cmd_worker(args: argparse.Namespace) -> int:
    from workers.roles.worker import Worker

    config = config_of(args)
    redis_url, etcd_url = endpoints(args)
    from streams import keys

    observe(args, config, f"worker-{args.node}", redis_url, [keys.node_batches(args.node),
             keys.node_control(args.node)], node=args.node, rack=rack_of(config, args.node))
    engine = args.engine or config.policies.worker.engine
    return run_until_signalled(
        lambda stop: Worker(config, args.node, engine, redis_url, etcd_url, grace_s=args.grace).run(stop)
    )


def cmd_agent(args: argparse.Namespace) -> int:
    from workers.roles.agent import HealthAgent

    gpus: list[int] | None = None
    if args.gpus is not None:
        try:
            gpus = [int(x) for x in args.gpus.split(",") if x.strip()]
        except ValueError:
            gpus = []
        if not gpus or any(i < 0 for i in gpus):
            print(f"rackflow agent: --gpus {args.gpus!r}: expected NVML indices like 0,1,2,3", file=sys.stderr)
            return 2
    config = config_of(args)
    redis_url, etcd_url = endpoints(args)
    observe(args, config, f"agent-{args.node}", redis_url, node=args.node, rack=rack_of(config, args.node))
    try:
        agent = HealthAgent(config, args.node, args.source, redis_url, etcd_url, gpu_indices=gpus,
                            revoke_on_stop=not args.keep_heartbeat)
    except (KeyError, ValueError) as e:  # unknown node, --gpus with --source sim
        print(f"rackflow agent: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    return run_until_signalled(agent.run)


def cmd_gateway(args: argparse.Namespace) -> int:
    from workers.gateway.http import serve

    config = config_of(args)
    redis_url, etcd_url = endpoints(args)
    observe(args, config, "gateway", redis_url)  # its /metrics is on its own HTTP port
    return serve(config, redis_url, etcd_url, host=args.host, port=args.port, no_auth=args.no_auth,
                 engine=args.engine or config.policies.worker.engine)


def cmd_monitor(args: argparse.Namespace) -> int:
    from workers.roles.monitor import Monitor

    config = config_of(args)
    redis_url, etcd_url = endpoints(args)
    from streams import keys

    observe(args, config, "monitor", redis_url, [keys.HEALTH, keys.DLQ])
    return run_until_signalled(lambda stop: Monitor(config, redis_url, etcd_url).run(stop))


def cmd_celery_worker(args: argparse.Namespace) -> int:
    from workers.control.app import worker_main

    config = config_of(args)
    redis_url, etcd_url = endpoints(args)
    observe(args, config, "celery", redis_url, serve_metrics=False)
    if args.metrics_port is not None:
        celery_metrics(args.metrics_port)
    if args.log_json or config.policies.observability.log_json or json_logs_requested():
        from workers.control.app import app

        app.conf.worker_hijack_root_logger = False  # keep the JSON handler (Celery would install its own)
    return worker_main(config, redis_url, etcd_url, args.concurrency, args.queues, args.log_level, args.pool)


def add_parser(sub: Any) -> None:
    s = sub.add_parser("router", help="run the router (consumer group 'router' on rf:ingress)")
    s.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics (0: any free port)")
    s.set_defaults(fn=cmd_router)

    s = sub.add_parser("batcher", help="run the windowing batcher of one rack")
    s.add_argument("--rack", required=True)
    s.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics (0: any free port)")
    s.set_defaults(fn=cmd_batcher)

    s = sub.add_parser("worker", help="run the GPU worker of one node")
    s.add_argument("--node", required=True)
    s.add_argument("--engine", choices=["sim", "torch", "vllm"], default=None)
    s.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics (0: any free port)")
    s.add_argument("--grace", type=float, default=30.0, help="seconds to finish live sequences on SIGTERM")
    s.set_defaults(fn=cmd_worker)

    s = sub.add_parser("agent", help="run the health agent of one node (GPU samples to rf:health, etcd heartbeat)")
    s.add_argument("--node", required=True)
    s.add_argument("--source", choices=["nvml", "sim"], default="nvml",
                   help="nvml: the host's GPUs; sim: a model of the node (load + injected faults)")
    s.add_argument("--gpus", default=None, metavar="0,1,...",
                   help="NVML indices of the node's GPUs (default: every GPU of the host)")
    s.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics (0: any free port)")
    s.add_argument("--keep-heartbeat", action="store_true",
                   help="on SIGTERM let the heartbeat lease run out instead of revoking it (a supervised restart: "
                        "a successor takes the heartbeat over without a gap)")
    s.set_defaults(fn=cmd_agent)

    s = sub.add_parser("monitor", help="run a failover monitor (one leader at a time through etcd)")
    s.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics (0: any free port)")
    s.set_defaults(fn=cmd_monitor)

    s = sub.add_parser("celery-worker", help="run a Celery worker for the control tasks (and async jobs)")
    s.add_argument("--concurrency", type=int, default=2)
    s.add_argument("--queues", default="control,jobs")
    s.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics of the worker and "
                   "its pool processes (0: any free port)")
    s.add_argument("--pool", choices=["prefork", "threads"], default="prefork",
                   help="threads: for a worker of the `jobs` queue alone (a job task mostly waits for its result, "
                        "so one process waits for many with a high --concurrency)")
    s.set_defaults(fn=cmd_celery_worker)

    s = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway")
    s.add_argument("--host", default=None, help="bind address (default: gateway.host in config)")
    s.add_argument("--port", type=int, default=None, help="port (default: gateway.port; 0 = any free port)")
    s.add_argument("--no-auth", action="store_true", help="accept requests without a JWT (local runs only)")
    s.add_argument("--engine", choices=["sim", "torch", "vllm"], default=None,
                   help="the engine the workers run (default: policies.worker.engine): which OpenAI sampling "
                        "parameters are honoured, the rest answered with a 400 that names them")
    s.set_defaults(fn=cmd_gateway)
