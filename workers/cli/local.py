"""`rackflow services up|down|status`, `rackflow up` and `rackflow demo`: the embedded servers, the whole local
cluster (`workers/local/cluster.py`) and the demo on the Azure trace."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.sim.world import ClientModel
from workers.cli.common import positive, redact
from workers.local.cluster import DEFAULT_VLLM_CHECKPOINT, LocalCluster
from workers.local.services import STATE_DIR
from workers.shell.runtime import setup_logging


# -- services ------------------------------------------------------------------------------------------------------
def cmd_services(args: argparse.Namespace) -> int:

    from workers.local.services import EmbeddedServices
    from workers.local.supervise import ServiceError

    svc = EmbeddedServices(STATE_DIR, durable=getattr(args, "durable", None), secure=getattr(args, "secure", False),
                           detach=True)  # `services up` returns: its servers stay
    if args.action == "up":
        try:
            ep = svc.start()
        except ServiceError as e:
            print(f"rackflow services up: {e}", file=sys.stderr)
            return 1
        print(f"valkey  {ep.redis_url}\netcd    {ep.etcd_url}\nstate   {STATE_DIR / 'services.json'}")
        if svc.durable:
            print(f"durable valkey: append-only file, appendfsync {svc.durable}, in {STATE_DIR / 'valkey'} "
                  "(kept: the next `services up --durable` reloads it)")
        if svc.secure:
            print(f"secure valkey: ACL users per role, default user off; ACL file {STATE_DIR / 'users.acl'}, each "
                  f"role's URL (with its password) under role_urls in {STATE_DIR / 'services.json'} (both mode 0600): "
                  f"{', '.join(sorted(svc.role_urls))}")
        print(f"export RACKFLOW_REDIS_URL={ep.redis_url} RACKFLOW_ETCD_URL={ep.etcd_url}")
        return 0
    if args.action == "down":
        stopped = svc.stop()
        print("stopped valkey and etcd" if stopped else "no embedded services were running")
        return 0
    st = svc.status()
    if args.json:
        print(json.dumps(st, sort_keys=True))
    else:
        if not st.get("running"):
            print("embedded services: not running (start them with `rackflow services up`)")
        for name in ("redis", "etcd"):
            s = st.get(name) or {}
            if s.get("url"):
                state = "healthy" if s.get("healthy") else ("alive, not answering" if s.get("alive") else "down")
                url = redact(str(s.get("url")))  # --secure: no password shown
                print(f"{'valkey' if name == 'redis' else 'etcd':<7} {state:<10} {url}  pid {s.get('pid')}")
    healthy = bool(st.get("running")) and all((st.get(n) or {}).get("healthy") for n in ("redis", "etcd"))
    return 0 if healthy else 1


def _gateway_url(gw: Any, wait_s: float = 60.0) -> str:
    """The URL a gateway announces once its socket listens ("gateway listening on URL" in its log). Raises
    RuntimeError, with the reason from its log, when it exits first or says nothing within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            text = gw.log_path.read_text(errors="replace")
        except OSError:
            text = ""
        found = re.search(r"gateway listening on (http://\S+)", text)
        if found:
            return found.group(1)
        if gw.proc.poll() is not None:
            why = next((ln for ln in reversed(text.splitlines()) if "cannot listen" in ln or "Error" in ln), "")
            raise RuntimeError(f"{gw.name} exited with {gw.proc.returncode} at start"
                               + (f": {why.strip()}" if why else "") + f" (log: {gw.log_path})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{gw.name} is not listening after {wait_s:g} s (log: {gw.log_path})")
        time.sleep(0.1)


def _ports_in_use(host: str, first: int | None, count: int) -> list[int]:
    """The gateway ports (first, first + 1, ...) another process already listens on; port 0 or None: none."""
    import socket

    if not first:
        return []
    taken = []
    for port in range(first, first + max(1, count)):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                taken.append(port)
    return taken


def cmd_up(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, "up")
    cluster = LocalCluster(args, STATE_DIR / "up", with_gateway=True, with_failover=not args.no_failover)
    interrupted = []
    # both set here, as the roles do: a shell starts a background job (`rackflow up &`, CI scripts) with SIGINT
    # ignored, and Python then never turns SIGINT into KeyboardInterrupt, so `kill -INT` would stop nothing
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: interrupted.append(1))
    host = cluster.config.gateway.host
    port = args.gateway_port if getattr(args, "gateway_port", None) is not None else cluster.config.gateway.port
    taken = _ports_in_use(host, port, getattr(args, "gateways", 1))
    if taken:  # before a process starts: a clash fails in a second, and no other server answers in our name
        print(f"rackflow up: port {', '.join(map(str, taken))} on {host} is in use by another process; pass "
              f"--gateway-port N (0: any free port) or stop that process", file=sys.stderr)
        cluster.stop()
        return 2
    try:
        cluster.start()
        try:  # every gateway listening, or the one that could not, by name, with its log
            urls = [_gateway_url(gw) for gw in cluster.procs.procs if gw.role == "gateway"]
        except RuntimeError as e:
            print(f"rackflow up: {e}", file=sys.stderr)
            return 1
        n = len(cluster.procs.procs)
        fo = "" if args.no_failover else (f", {len(cluster.config.nodes())} health agents, monitor, celery worker"
                                          ", flower")
        routers = sum(p.role == "router" for p in cluster.procs.procs)
        batchers = sum(p.role == "batcher" for p in cluster.procs.procs)
        gateways = sum(p.role == "gateway" for p in cluster.procs.procs)
        print(f"rackflow up: {n} processes ({routers} router(s), {batchers} batchers for "
              f"{len(cluster.config.rack_names())} racks, {len(cluster.config.nodes())} workers, {gateways} "
              f"gateway(s){fo}); redis {redact(cluster.redis_url)} etcd {cluster.etcd_url}")
        if cluster.procs.role_urls is not None:
            print("redis   ACL users per role (`services up --secure`): each role logs in as rf-<role>", flush=True)
        procs = cluster.procs
        auth = "OFF (local run: set RACKFLOW_JWT_SECRET to require JWTs)" if procs.gateway_no_auth else "JWT"
        for url in urls:
            print(f"gateway {url}/v1  auth: {auth}", flush=True)
        if procs.flower_port is not None:
            print(f"flower  http://127.0.0.1:{procs.flower_port}/  (API enabled for local use)", flush=True)
        if args.metrics:
            targets = STATE_DIR / "up" / "prometheus-targets.json"
            targets.write_text(json.dumps(procs.metrics_targets(), indent=2))
            print(f"metrics /metrics of every role; Prometheus file_sd targets in {targets}", flush=True)
        print(f"logs in {STATE_DIR / 'up' / 'logs'}; Ctrl-C stops everything")
        while not interrupted:
            dead = cluster.procs.dead()
            if dead:
                print(f"rackflow up: {dead[0].name} exited with {dead[0].proc.returncode}; see {dead[0].log_path}",
                      file=sys.stderr)
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        print("rackflow up: stopping", file=sys.stderr)
        cluster.stop()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from workers.local.demo import DemoRun, dump_json, format_report, write_plot

    setup_logging("WARNING" if args.json else args.log_level, "demo")
    trace = Path(args.trace)
    if not trace.exists():
        print(f"rackflow demo: trace file {trace} not found; pass --trace PATH to an Azure-format CSV",
              file=sys.stderr)
        return 2
    state = STATE_DIR / "demo"
    cluster = LocalCluster(args, state)
    report: dict[str, Any]
    try:
        cluster.start()
        print(f"rackflow demo: {len(cluster.procs.procs)} processes starting; redis {redact(cluster.redis_url)}",
              file=sys.stderr)
        run = DemoRun(
            cluster.config, cluster.redis_url, cluster.etcd_url, trace, args.requests, args.speedup,
            args.model, cluster.config.policies.seed, progress=not args.no_progress,
            # the clients send what clients send (a round cap or none); the sim engines alone learn the true length
            client=None if args.oracle else ClientModel(),
        )
        asyncio.run(run.wait_ready())
        t0 = time.time() * 1000.0
        report = asyncio.run(run.run())
        if args.record:
            from streams.replay_file import DEFAULT_GROUPS
            from workers.cli.replay import export_window

            time.sleep(0.5)  # the last window records and health samples
            h = asyncio.run(export_window(cluster.redis_url, Path(args.record), t0, time.time() * 1000.0, 0.0,
                                          DEFAULT_GROUPS, lambda: cluster.config, quiet=args.no_progress))
            print(f"rackflow demo: recorded {h.total} stream entries to {args.record} (`rackflow replay run|report "
                  f"{args.record}`)", file=sys.stderr)
    finally:
        cluster.stop()
    plot = Path(args.out) / "demo.png"
    write_plot(report, plot)
    report["plot"] = str(plot)
    report["oracle"] = bool(args.oracle)
    from workers.local.demo import public

    (Path(args.out) / "demo.json").write_text(json.dumps(public(report), indent=2, sort_keys=True))
    print(dump_json(report) if args.json else format_report(report))
    ok = report["completed"] == report["submitted"] and report["lost"] == 0 and report["duplicates"] == 0
    return 0 if ok else 1


def cmd_status(args: argparse.Namespace) -> int:
    from aetcd.exceptions import ClientError as EtcdError
    from redis.exceptions import RedisError

    from workers.cli.common import config_of, endpoints
    from workers.local.status import cluster_status, format_status
    from workers.shell.runtime import WALL

    config = config_of(args)
    redis_url, etcd_url = endpoints(args)
    while True:
        try:
            st = asyncio.run(cluster_status(config, redis_url, etcd_url, WALL.now_ms()))
        except (RedisError, EtcdError, OSError) as e:
            print(f"rackflow status: cannot read the cluster's state from {redact(redis_url)} / {etcd_url}: {e}",
                  file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(st, sort_keys=True), flush=True)
        else:
            if args.watch is not None:
                print("\033[2J\033[H", end="")  # clear the terminal between refreshes
            print(format_status(st), flush=True)
        if args.watch is None:
            return 0
        time.sleep(args.watch)


def add_parser(sub: Any) -> None:
    s = sub.add_parser("status", help="the running cluster: nodes (state, health, load, last fault), roles, drains",
                       description="The running cluster as its roles publish it: each node's state (the monitor's "
                       "verdict), health score, sequences, KV use and last fault; the roles and whether they are "
                       "alive; the last drains, recoveries and migrations, with wall-clock times.")
    s.add_argument("--json", action="store_true", help="one JSON object (times in epoch ms)")
    s.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C")
    s.set_defaults(fn=cmd_status)

    s = sub.add_parser("services", help="embedded Valkey + etcd on free loopback ports")
    s.add_argument("action", choices=["up", "down", "status"])
    s.add_argument("--json", action="store_true")
    s.add_argument("--durable", nargs="?", const="always", default=None, choices=["always", "everysec"],
                   help="up: Valkey with its append-only file on and this fsync policy (default always), data kept "
                   "in .rackflow/valkey and reloaded on the next durable start. always: no acknowledged write is "
                   "lost in a crash, each write waits for the disk; everysec: as fast as memory-only, a crash can "
                   "lose the last ~1-2 s of acknowledged writes (accepted requests, result markers)")
    s.add_argument("--secure", action="store_true",
                   help="up: Valkey with one ACL user per role (rules of deploy/valkey/users.acl.example), a random "
                   "password each, the default user off; per-role URLs go to .rackflow/services.json (role_urls)")
    s.set_defaults(fn=cmd_services)

    s = sub.add_parser("up", help="services + router + a batcher per rack + a worker per node + the gateway; "
                                  "Ctrl-C stops")
    s.add_argument("--engine", choices=["sim", "torch", "vllm"], default=None)
    s.add_argument("--gateway-port", type=int, default=None, help="default: gateway.port in config")
    s.add_argument("--no-auth", action="store_true", help="run the gateway without JWT auth")
    s.add_argument("--no-failover", action="store_true", help="no health agents, monitor, Celery worker, Flower")
    s.add_argument("--agent-source", choices=["sim", "nvml"], default="sim",
                   help="health agents read NVML (GPU nodes) or model the node (default, laptops)")
    s.add_argument("--flower-port", type=int, default=None,
                   help="Flower's port (its API is enabled); default 5555, or a free port when 5555 is taken")
    s.add_argument("--metrics", action="store_true", help="every role serves Prometheus /metrics on a free port; "
                   "the targets are written to .rackflow/up/prometheus-targets.json (file_sd format)")
    s.add_argument("--routers", type=positive, default=1, help="router processes (one consumer group; default 1)")
    s.add_argument("--batchers-per-rack", type=positive, default=None,
                   help="batcher processes per rack (default: policies.batcher.consumers_per_rack)")
    s.add_argument("--gateways", type=positive, default=1,
                   help="HTTP gateways, on --gateway-port, +1, ... (default 1)")
    s.add_argument("--model-dir", default=None, help="--engine vllm: a local Hugging Face checkpoint to serve "
                   f"(default: the tiny test checkpoint in {DEFAULT_VLLM_CHECKPOINT}, made if missing)")
    s.add_argument("--served-model-name", default=None, help="--engine vllm: the model name clients ask for "
                   "(default: the directory's name)")
    s.add_argument("--nodes", type=positive, default=None, help="--engine vllm: vLLM workers in one rack "
                   "(default 2 without --config; with --config, its cluster)")
    s.set_defaults(fn=cmd_up)

    s = sub.add_parser("demo", help="run the local cluster on the Azure conversation trace and report")
    s.add_argument("--trace", default=str(Path(__file__).resolve().parents[2] / "data" / "traces" /
                                          "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"))
    s.add_argument("--requests", type=int, default=2000)
    s.add_argument("--speedup", type=float, default=10.0, help="time compression of the trace's arrivals")
    s.add_argument("--model", default="qwen2-7b")
    s.add_argument("--out", default="report", help="directory for demo.png and demo.json")
    s.add_argument("--record", default=None, metavar="FILE", help="also export the run's streams to FILE (an "
                   "incident recording for `rackflow replay`)")
    s.add_argument("--json", action="store_true", help="print the report as one JSON object")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--engine", choices=["sim", "torch"], default=None)
    s.add_argument("--oracle", action="store_true", help="send each request's true output length as max_tokens (the "
                   "demo before the oracle-free clients: the control plane then knows every length)")
    s.set_defaults(fn=cmd_demo)
