"""`rackflow` command line: services, the role processes, the whole local cluster, the demo.

Connection URLs come from --redis-url/--etcd-url, else RACKFLOW_REDIS_URL/RACKFLOW_ETCD_URL, else the embedded
services started by `rackflow services up` (`.rackflow/services.json`). Everything else comes from configs/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.config import DEFAULT_CONFIG_DIR, ConfigError, RackflowConfig, load_config
from workers.shell.runtime import json_logs_requested, run_until_signalled, setup_logging

log = logging.getLogger("rackflow")

STATE_DIR = Path(".rackflow")


def _config(args: argparse.Namespace) -> RackflowConfig:
    return load_config(Path(args.config_dir), [Path(p) for p in args.config])


def _config_args(args: argparse.Namespace) -> list[str]:
    out = ["--config-dir", str(Path(args.config_dir).resolve())]
    for p in args.config:
        out += ["--config", str(Path(p).resolve())]
    return out


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _redact(url: str) -> str:
    """`url` with its password (if any) shown as ***."""
    return re.sub(r"(//[^:/@]*:)[^@/]+@", r"\1***@", url)


def _endpoints(args: argparse.Namespace) -> tuple[str, str]:
    from workers.local.services import resolve_endpoints

    ep = resolve_endpoints(args.redis_url, args.etcd_url, STATE_DIR)
    if ep is None:
        raise SystemExit(
            "rackflow: no Redis/etcd to use. Start the embedded ones with `rackflow services up`, or pass "
            "--redis-url/--etcd-url (or set RACKFLOW_REDIS_URL/RACKFLOW_ETCD_URL)."
        )
    return ep.redis_url, ep.etcd_url


# -- services ------------------------------------------------------------------------------------------------------
def cmd_services(args: argparse.Namespace) -> int:

    from workers.local.services import EmbeddedServices, ServiceError

    svc = EmbeddedServices(STATE_DIR, durable=getattr(args, "durable", None), secure=getattr(args, "secure", False))
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
                url = _redact(str(s.get("url")))  # --secure: no password shown
                print(f"{'valkey' if name == 'redis' else 'etcd':<7} {state:<10} {url}  pid {s.get('pid')}")
    healthy = bool(st.get("running")) and all((st.get(n) or {}).get("healthy") for n in ("redis", "etcd"))
    return 0 if healthy else 1


# -- roles ---------------------------------------------------------------------------------------------------------
def _observe(args: argparse.Namespace, config: RackflowConfig, role: str, redis_url: str,
             streams: list[str] | None = None, node: str | None = None, rack: str | None = None,
             serve_metrics: bool = True) -> None:
    """What every role process sets up first: logging (text or JSON, with its node/rack on every line), tracing
    (when configured) and, with --metrics-port, Prometheus /metrics including its own streams' lengths and
    consumer-group state."""
    obs = config.policies.observability
    setup_logging(args.log_level, role, json_logs=args.log_json or obs.log_json, node=node, rack=rack)
    kind = role.split("-", 1)[0]
    from workers.shell import tracing

    tracing.init_tracing(obs.tracing, service=kind)
    if serve_metrics and getattr(args, "metrics_port", None) is not None:
        from workers.shell import metrics

        if streams:
            metrics.watch_streams(redis_url, streams)
        metrics.ROLE_INFO.labels(kind, node or "", rack or "").set(1)
        metrics.serve(args.metrics_port)


def _rack_of(config: RackflowConfig, node: str) -> str | None:
    try:
        return config.rack_of(node)
    except KeyError:
        return None  # the role reports the unknown node itself


def cmd_router(args: argparse.Namespace) -> int:
    from workers.roles.router import Router

    config = _config(args)
    redis_url, etcd_url = _endpoints(args)
    from streams import keys

    _observe(args, config, "router", redis_url, [keys.INGRESS])
    return run_until_signalled(lambda stop: Router(config, redis_url, etcd_url).run(stop))


def cmd_batcher(args: argparse.Namespace) -> int:
    from workers.roles.batcher import Batcher

    config = _config(args)
    redis_url, etcd_url = _endpoints(args)
    from streams import keys

    _observe(args, config, f"batcher-{args.rack}", redis_url, [keys.rack_requests(args.rack)], rack=args.rack)
    return run_until_signalled(lambda stop: Batcher(config, args.rack, redis_url, etcd_url).run(stop))


def cmd_worker(args: argparse.Namespace) -> int:
    from workers.roles.worker import Worker

    config = _config(args)
    redis_url, etcd_url = _endpoints(args)
    from streams import keys

    _observe(args, config, f"worker-{args.node}", redis_url, [keys.node_batches(args.node),
             keys.node_control(args.node)], node=args.node, rack=_rack_of(config, args.node))
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
    config = _config(args)
    redis_url, etcd_url = _endpoints(args)
    _observe(args, config, f"agent-{args.node}", redis_url, node=args.node, rack=_rack_of(config, args.node))
    try:
        agent = HealthAgent(config, args.node, args.source, redis_url, etcd_url, gpu_indices=gpus,
                            revoke_on_stop=not args.keep_heartbeat)
    except (KeyError, ValueError) as e:  # unknown node, --gpus with --source sim
        print(f"rackflow agent: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    return run_until_signalled(agent.run)


def cmd_fault(args: argparse.Namespace) -> int:
    from streams.runner import connect
    from workers.health import faults
    from workers.shell.runtime import WALL

    config = _config(args)
    redis_url, _etcd_url = _endpoints(args)
    if args.action == "play":
        if not args.schedule:
            print("rackflow fault play: --schedule FILE required", file=sys.stderr)
            return 2
    elif not args.node:
        print(f"rackflow fault {args.action}: --node required", file=sys.stderr)
        return 2
    if args.action == "inject" and not args.kind:
        print(f"rackflow fault inject: --kind required ({', '.join(faults.KINDS)})", file=sys.stderr)
        return 2
    try:
        schedule = faults.load_schedule(Path(args.schedule)) if args.action == "play" else []
        for n in [args.node] if args.node else [s.node for s in schedule]:
            config.node(n)
        if args.action == "inject":
            faults.check(args.kind, args.duration, faults.DEFAULT_FACTOR.get(args.kind, 1.0)
                         if args.factor is None else args.factor)
    except KeyError as e:
        print(f"rackflow fault: {e.args[0]}", file=sys.stderr)
        return 2
    except faults.FaultError as e:
        print(f"rackflow fault: {e}", file=sys.stderr)
        return 2

    async def go() -> int:
        r = connect(redis_url)
        try:
            if args.action == "inject":
                f = await faults.inject(r, args.node, args.kind, args.duration, args.factor, now_ms=WALL.now_ms())
                print(json.dumps({"node": args.node, **f.to_dict()}, sort_keys=True))
            elif args.action == "clear":
                print(f"cleared {await faults.clear(r, args.node)} faults of {args.node}")
            elif args.action == "list":
                now = WALL.now_ms()
                for f in sorted((await faults.listing(r, args.node)).values(), key=lambda f: f.kind):
                    state = "active" if f.active_at(now) else "expired"
                    print(json.dumps({"node": args.node, **f.to_dict(), "state": state}, sort_keys=True))
            else:
                stop = asyncio.Event()
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, stop.set)
                n = await faults.play_schedule(r, schedule, stop, WALL.now_ms)
                print(f"injected {n} of {len(schedule)} scheduled faults")
        finally:
            await r.aclose()
        return 0

    from redis.exceptions import RedisError

    try:
        return asyncio.run(go())
    except RedisError as e:
        print(f"rackflow fault: Redis/Valkey at {redis_url} failed: {e}", file=sys.stderr)
        return 1


def cmd_gateway(args: argparse.Namespace) -> int:
    from workers.gateway.http import serve

    config = _config(args)
    redis_url, etcd_url = _endpoints(args)
    _observe(args, config, "gateway", redis_url)  # its /metrics is on its own HTTP port
    return serve(config, redis_url, etcd_url, host=args.host, port=args.port, no_auth=args.no_auth)


def cmd_token(args: argparse.Namespace) -> int:
    from workers.gateway.auth import AuthError, mint_token

    config = _config(args)
    try:
        print(mint_token(config.gateway.auth, tenant=args.tenant, sub=args.sub, models=args.model or None,
                         default_model=args.default_model, ttl_s=args.ttl))
    except AuthError as e:
        print(f"rackflow token: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_tokens(args: argparse.Namespace) -> int:
    """Fit the fast estimator's rates to a real tokenizer over a corpus and print them for models.yaml."""
    from tokenizers import Tokenizer

    from pipeline.config import TokenRates
    from pipeline.tokens import estimate_tokens, fit_rates

    tok = Tokenizer.from_file(args.tokenizer)
    samples: list[tuple[str, int]] = []
    for path in args.corpus:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        for part in (p for p in text.split("\n\n") if p.strip()):
            samples.append((part, len(tok.encode(part, add_special_tokens=False).ids)))
    if len(samples) < 4:
        print("rackflow tokens calibrate: need at least 4 paragraphs (blank-line separated) in the corpus",
              file=sys.stderr)
        return 2
    train, test = samples[::2], samples[1::2]
    before, after = TokenRates(), fit_rates(train)

    def mape(rates: TokenRates) -> float:
        return 100 * sum(abs(estimate_tokens(t, rates) - n) / max(1, n) for t, n in test) / len(test)

    print(f"# {len(samples)} paragraphs; held-out mean abs error: default rates {mape(before):.1f}%, "
          f"fitted {mape(after):.1f}%")
    print(f"token_rates: {{cjk: {after.cjk:.3f}, latin: {after.latin:.3f}, code: {after.code:.3f}}}")
    return 0


def gateway_auth_available(config: RackflowConfig) -> bool:
    import os

    auth = config.gateway.auth
    if auth.mode == "hs256":
        return bool(os.environ.get(auth.secret_env))
    if auth.mode == "rs256":
        return bool(auth.public_key_file and Path(auth.public_key_file).exists())
    return False


def cmd_monitor(args: argparse.Namespace) -> int:
    from workers.roles.monitor import Monitor

    config = _config(args)
    redis_url, etcd_url = _endpoints(args)
    from streams import keys

    _observe(args, config, "monitor", redis_url, [keys.HEALTH, keys.DLQ])
    return run_until_signalled(lambda stop: Monitor(config, redis_url, etcd_url).run(stop))


def _celery_metrics(port: int) -> None:
    """/metrics of a Celery worker and its pool processes (tasks run in forked children): prometheus_client's
    multiprocess mode, in a directory of this run (removed at exit)."""
    import atexit
    import os
    import shutil
    import tempfile

    if "prometheus_client" in sys.modules:
        log.warning("celery worker: prometheus_client imported before its multiprocess directory was set; "
                    "the pool's task metrics may be missing")
    directory = tempfile.mkdtemp(prefix="rackflow-celery-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    atexit.register(shutil.rmtree, directory, True)
    from workers.shell import metrics

    for outcome in metrics.MIGRATION_OUTCOMES:  # the series exist before the first task (multiprocess mode
        metrics.FAILOVER_MIGRATIONS.labels(outcome)  # exports only values some process has created)
    for outcome in metrics.REQUEUE_OUTCOMES:
        metrics.FAILOVER_REQUEUES.labels(outcome)
    metrics.ROLE_INFO.labels("celery", "", "").set(1)
    metrics.serve_multiprocess(port, directory)


def cmd_celery_worker(args: argparse.Namespace) -> int:
    from workers.control.app import worker_main

    config = _config(args)
    redis_url, etcd_url = _endpoints(args)
    _observe(args, config, "celery", redis_url, serve_metrics=False)
    if args.metrics_port is not None:
        _celery_metrics(args.metrics_port)
    if args.log_json or config.policies.observability.log_json or json_logs_requested():
        from workers.control.app import app

        app.conf.worker_hijack_root_logger = False  # keep the JSON handler (Celery would install its own)
    return worker_main(config, redis_url, etcd_url, args.concurrency, args.queues, args.log_level, args.pool)


def cmd_jobs(args: argparse.Namespace) -> int:
    from workers.cli.jobs import cmd_jobs as run

    config = _config(args)
    redis_url, etcd_url = _endpoints(args)
    setup_logging("WARNING" if args.log_level.upper() == "INFO" else args.log_level, "jobs")
    return run(args, config, redis_url, etcd_url)


def _port_free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _flower_port(requested: int | None) -> int:
    """Flower's port: the one asked for (it must be free), else 5555, else any free port (said in the log)."""
    from workers.local.services import free_port

    if requested is not None:
        if not _port_free(requested):
            raise SystemExit(f"rackflow up: --flower-port {requested} is in use; pick another port or "
                             "leave it out (5555 or any free port)")
        return requested
    if _port_free(5555):
        return 5555
    port = free_port()
    log.info("port 5555 is in use: Flower listens on %d", port)
    return port


DEFAULT_VLLM_CHECKPOINT = Path(".cache") / "tiny-qwen2-vllm"


def _add_vllm_overlay(args: argparse.Namespace, state_dir: Path) -> None:
    """`--engine vllm`: serve `--model-dir` (default: the tiny test checkpoint, made here if missing) under its
    directory's name, through a config overlay every role reads. Without `--config`, the cluster is one rack of
    `--nodes` vLLM workers (2 by default: a CPU-only host runs vLLM's CPU build)."""
    from workers.engines.checkpoint import served_name, vllm_overlay, write_tiny_checkpoint

    model_dir = Path(args.model_dir) if getattr(args, "model_dir", None) else None
    if model_dir is None:
        model_dir = DEFAULT_VLLM_CHECKPOINT
        if not (model_dir / "config.json").exists():
            print(f"rackflow up: no --model-dir: writing the tiny random-weight test checkpoint to {model_dir}",
                  flush=True)
            write_tiny_checkpoint(model_dir)
    if not (model_dir / "config.json").exists():
        raise SystemExit(f"rackflow up: --model-dir {model_dir} has no config.json (a Hugging Face checkpoint "
                         "directory is needed; nothing is downloaded)")
    name = getattr(args, "served_model_name", None) or served_name(model_dir)
    racks = None
    if not args.config or getattr(args, "nodes", None):
        racks = [{"name": "r0", "node_count": getattr(args, "nodes", None) or 2,
                  "node": {"gpu": "h100-80gb", "tp": 1}}]
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / "vllm-overlay.yaml"
    import shutil

    import yaml

    overlay = vllm_overlay(model_dir, name, racks)
    if shutil.which("nvidia-smi") is None:
        # a CPU-only host: vLLM's CPU build shares the cores with the health agents and the workers' own etcd
        # leases, which expire at 2-3 s while the workers load or decode (the monitor would drain healthy nodes)
        overlay["policies"]["health"] = {"agent_heartbeat_ttl_s": 15}  # type: ignore[index]
        overlay["policies"]["worker"]["lease_ttl_s"] = 15  # type: ignore[index]
    path.write_text(yaml.safe_dump(overlay))
    args.config = [*args.config, str(path)]
    print(f"rackflow up: vllm serves {model_dir.resolve()} as model {name!r} (overlay {path})", flush=True)


class _LocalCluster:
    """Services (unless URLs are given) + role processes, stopped in reverse order."""

    def __init__(self, args: argparse.Namespace, state_dir: Path, with_gateway: bool = False,
                 with_failover: bool = False) -> None:
        from workers.local.services import EmbeddedServices, resolve_endpoints

        self.args = args
        if getattr(args, "engine", None) == "vllm":
            _add_vllm_overlay(args, state_dir)
        self.config = _config(args)
        flower = _flower_port(getattr(args, "flower_port", None)) if with_failover else None  # before any start
        self.services: EmbeddedServices | None = None
        ep = resolve_endpoints(args.redis_url, args.etcd_url, STATE_DIR)
        role_urls = None
        if ep is None:
            self.services = EmbeddedServices(state_dir)
            ep = self.services.start()
        else:
            # on `rackflow services up --secure`'s Valkey, each role logs in as its own ACL user
            embedded = EmbeddedServices(STATE_DIR)
            running = embedded.endpoints()
            if running is not None and running.redis_url == ep.redis_url:  # not pointed elsewhere by a URL
                role_urls = embedded.running_role_urls()
        self.redis_url, self.etcd_url = ep.redis_url, ep.etcd_url
        from workers.local.launcher import ClusterProcesses

        self.procs = ClusterProcesses(
            self.config, self.redis_url, self.etcd_url, state_dir / "logs", _config_args(args),
            engine=getattr(args, "engine", None) or self.config.policies.worker.engine, log_level=args.log_level,
            gateway_port=getattr(args, "gateway_port", None),
            gateway_no_auth=getattr(args, "no_auth", False) or not gateway_auth_available(self.config),
            with_gateway=with_gateway,
            with_failover=with_failover,
            agent_source=getattr(args, "agent_source", "sim"),
            flower_port=flower,
            metrics=getattr(args, "metrics", False),
            routers=getattr(args, "routers", 1),
            batchers_per_rack=getattr(args, "batchers_per_rack", None),
            gateways=getattr(args, "gateways", 1),
            role_urls=role_urls,
        )

    def start(self) -> None:
        try:
            self.procs.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        try:
            self.procs.stop()
        finally:
            if self.services is not None:
                self.services.stop()


def _gateway_url(gw: Any, host: str, wait_s: float = 20.0) -> str:
    """Where a gateway listens: its fixed port, or (port 0: a free one it picked) the URL its log announces."""
    if gw.metrics_port:
        return f"http://{host}:{gw.metrics_port}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and gw.proc.poll() is None:
        try:
            found = re.search(r"gateway listening on (http://\S+)", gw.log_path.read_text())
        except OSError:
            found = None
        if found:
            return found.group(1)
        time.sleep(0.2)
    return f"http://{host}:? (not listening yet: see {gw.log_path})"


def cmd_up(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, "up")
    cluster = _LocalCluster(args, STATE_DIR / "up", with_gateway=True, with_failover=not args.no_failover)
    interrupted = []
    # both set here, as the roles do: a shell starts a background job (`rackflow up &`, CI scripts) with SIGINT
    # ignored, and Python then never turns SIGINT into KeyboardInterrupt, so `kill -INT` would stop nothing
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: interrupted.append(1))
    try:
        cluster.start()
        n = len(cluster.procs.procs)
        fo = "" if args.no_failover else (f", {len(cluster.config.nodes())} health agents, monitor, celery worker"
                                          ", flower")
        routers = sum(p.role == "router" for p in cluster.procs.procs)
        batchers = sum(p.role == "batcher" for p in cluster.procs.procs)
        gateways = sum(p.role == "gateway" for p in cluster.procs.procs)
        print(f"rackflow up: {n} processes ({routers} router(s), {batchers} batchers for "
              f"{len(cluster.config.rack_names())} racks, {len(cluster.config.nodes())} workers, {gateways} "
              f"gateway(s){fo}); redis {_redact(cluster.redis_url)} etcd {cluster.etcd_url}")
        if cluster.procs.role_urls is not None:
            print("redis   ACL users per role (`services up --secure`): each role logs in as rf-<role>", flush=True)
        procs = cluster.procs
        auth = "OFF (local run: set RACKFLOW_JWT_SECRET to require JWTs)" if procs.gateway_no_auth else "JWT"
        for gw in [p for p in procs.procs if p.role == "gateway"]:
            print(f"gateway {_gateway_url(gw, cluster.config.gateway.host)}/v1  auth: {auth}", flush=True)
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


def cmd_model(args: argparse.Namespace) -> int:
    from workers.engines.checkpoint import model_spec, served_name, write_tiny_checkpoint

    if args.action == "tiny":
        print(write_tiny_checkpoint(Path(args.out)))
        return 0
    if not args.dir:
        print("rackflow model spec: give the checkpoint directory: rackflow model spec DIR", file=sys.stderr)
        return 2
    try:
        spec = model_spec(Path(args.dir))
    except (FileNotFoundError, KeyError, ValueError) as e:
        print(f"rackflow model spec: {e}", file=sys.stderr)
        return 2
    import yaml

    print(yaml.safe_dump({served_name(Path(args.dir)): spec}, sort_keys=False), end="")
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
    cluster = _LocalCluster(args, state)
    report: dict[str, Any]
    try:
        cluster.start()
        print(f"rackflow demo: {len(cluster.procs.procs)} processes starting; redis {_redact(cluster.redis_url)}",
              file=sys.stderr)
        run = DemoRun(
            cluster.config, cluster.redis_url, cluster.etcd_url, trace, args.requests, args.speedup,
            args.model, cluster.config.policies.seed, progress=not args.no_progress,
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
    from workers.local.demo import public

    (Path(args.out) / "demo.json").write_text(json.dumps(public(report), indent=2, sort_keys=True))
    print(dump_json(report) if args.json else format_report(report))
    ok = report["completed"] == report["submitted"] and report["lost"] == 0 and report["duplicates"] == 0
    return 0 if ok else 1


def cmd_config(args: argparse.Namespace) -> int:
    config = _config(args)
    nodes = config.nodes()
    print(f"config OK: {len(config.cluster.racks)} racks, {len(nodes)} nodes, models {', '.join(config.models)}")
    for r in config.cluster.racks:
        for n in r.expanded():
            print(f"  {r.name}/{n.name}: {n.gpu} x{n.tp} serving {', '.join(n.models)}; batch budget "
                  f"{config.node_mem_budget_kb(n.name) / 1e6:.1f} GB")
    return 0


def cmd_perf(args: argparse.Namespace) -> int:
    """`rackflow perf ...`: iteration times from the calibrated cost model; `perf calibrate [--check]` refits it."""
    from workers.sim import perf

    config = _config(args)
    if args.action == "calibrate":
        try:
            doc, profiles, cal = perf.fresh_document(config.gpus)
        except (OSError, ValueError) as e:  # unreadable profiles, CalibrationError
            print(f"rackflow perf calibrate: {e}", file=sys.stderr)
            return 2
        ops, iters = perf.error_tables(profiles, cal)
        print(perf.format_fit(cal), perf.format_operator_errors(ops), perf.format_iteration_errors(iters),
              perf.format_all_reduce_errors(perf.all_reduce_errors(profiles, cal)), sep="\n\n")
        target = Path(args.config_dir) / "calibration.json"
        text = perf.render(doc)
        if args.check:
            current = target.read_text(encoding="utf-8") if target.exists() else ""
            if current != text:
                print(f"rackflow: {target} is out of date with the profiles, configs/gpus.yaml or the fit; "
                      "regenerate it with `rackflow perf calibrate`", file=sys.stderr)
                return 1
            print(f"\n{target} is up to date")
            return 0
        target.write_text(text, encoding="utf-8")
        print(f"\nwrote {target}")
        return 0
    missing = [f"--{n.replace('_', '-')}" for n in ("model", "gpu", "prompt_tokens") if getattr(args, n) is None]
    if missing:
        print(f"rackflow perf: {', '.join(missing)} required (or `rackflow perf calibrate`)", file=sys.stderr)
        return 2
    try:
        cal = perf.load_calibration(perf.calibration_path(Path(args.config_dir)))
        numbers = perf.perf_numbers(config, args.model, args.gpu, args.tp, args.prompt_tokens, args.batch, cal)
    except ValueError as e:  # DoesNotFit, CalibrationError, a bad --tp/--batch/--prompt-tokens
        print(f"rackflow perf: {e}", file=sys.stderr)
        return 2
    print(json.dumps(numbers) if args.json else perf.format_perf(numbers))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from workers.bench.micro import run_bench

    if args.what == "engines":
        return _bench_engines(args)

    return run_bench(args, _endpoints_or_none(args))


def cmd_replay(args: argparse.Namespace) -> int:
    from workers.cli.replay import cmd_replay as run

    return run(args, lambda: _config(args), lambda: _endpoints(args))


def _endpoints_or_none(args: argparse.Namespace) -> tuple[str, str] | None:
    from workers.local.services import resolve_endpoints

    ep = resolve_endpoints(args.redis_url, args.etcd_url, STATE_DIR)
    return (ep.redis_url, ep.etcd_url) if ep else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rackflow", description=__doc__.split("\n")[0])
    p.add_argument("--config-dir", default=str(DEFAULT_CONFIG_DIR), help="directory of gpus/models/cluster/"
                   "policies.yaml (default: the repository's configs/)")
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML merged over the config directory (keys gpus, models, cluster, policies); repeatable")
    p.add_argument("--redis-url", default=None, help="existing Redis/Valkey (default: env RACKFLOW_REDIS_URL, "
                   "else the embedded services)")
    p.add_argument("--etcd-url", default=None, help="existing etcd, http://HOST:PORT, or the members of one "
                   "cluster comma-separated, http://H1:P1,http://H2:P2,... (default: env RACKFLOW_ETCD_URL, else "
                   "the embedded services)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-json", action="store_true", help="log one JSON object per line (also "
                   "RACKFLOW_LOG_JSON=1 or policies.observability.log_json); role processes started by this "
                   "command log JSON too")
    sub = p.add_subparsers(dest="cmd", required=True)

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
    s = sub.add_parser("fault", help="inject, list or clear faults of a simulated node (the sim agent acts on them)")
    s.add_argument("action", choices=["inject", "clear", "list", "play"])
    s.add_argument("--node", default=None)
    s.add_argument("--kind", choices=["xid", "overheat", "nvlink-crc", "slow", "kill"], default=None)
    s.add_argument("--duration", type=float, default=30.0, help="seconds the fault lasts (default 30)")
    s.add_argument("--factor", type=float, default=None, help="slow: times slower (default 3); nvlink-crc: "
                   "x 500 errors per sample (default 1)")
    s.add_argument("--schedule", default=None, metavar="FILE",
                   help="play: YAML list of {at_s, node, kind, duration_s, factor}")
    s.set_defaults(fn=cmd_fault)

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

    from workers.cli.jobs import add_parser as add_jobs_parser

    add_jobs_parser(sub, cmd_jobs)

    s = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway")
    s.add_argument("--host", default=None, help="bind address (default: gateway.host in config)")
    s.add_argument("--port", type=int, default=None, help="port (default: gateway.port; 0 = any free port)")
    s.add_argument("--no-auth", action="store_true", help="accept requests without a JWT (local runs only)")
    s.set_defaults(fn=cmd_gateway)

    s = sub.add_parser("token", help="mint an HS256 JWT for the gateway (secret from gateway.auth.secret_env)")
    s.add_argument("--tenant", required=True)
    s.add_argument("--sub", required=True, help="user id")
    s.add_argument("--model", action="append", default=[], help="allowed model (repeatable; default: all)")
    s.add_argument("--default-model", default=None)
    s.add_argument("--ttl", type=int, default=3600, help="seconds until exp")
    s.set_defaults(fn=cmd_token)

    s = sub.add_parser("tokens", help="calibrate the fast token estimator against a real tokenizer.json")
    s.add_argument("action", choices=["calibrate"])
    s.add_argument("--tokenizer", required=True, help="path of the model's tokenizer.json")
    s.add_argument("--corpus", nargs="+", required=True, help="text files (blank-line separated paragraphs)")
    s.set_defaults(fn=cmd_tokens)

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
    s.add_argument("--routers", type=_positive, default=1, help="router processes (one consumer group; default 1)")
    s.add_argument("--batchers-per-rack", type=_positive, default=None,
                   help="batcher processes per rack (default: policies.batcher.consumers_per_rack)")
    s.add_argument("--gateways", type=_positive, default=1,
                   help="HTTP gateways, on --gateway-port, +1, ... (default 1)")
    s.add_argument("--model-dir", default=None, help="--engine vllm: a local Hugging Face checkpoint to serve "
                   f"(default: the tiny test checkpoint in {DEFAULT_VLLM_CHECKPOINT}, made if missing)")
    s.add_argument("--served-model-name", default=None, help="--engine vllm: the model name clients ask for "
                   "(default: the directory's name)")
    s.add_argument("--nodes", type=_positive, default=None, help="--engine vllm: vLLM workers in one rack "
                   "(default 2 without --config; with --config, its cluster)")
    s.set_defaults(fn=cmd_up)

    s = sub.add_parser("model", help="`model tiny --out DIR`: write the tiny random-weight Qwen2 test checkpoint; "
                                     "`model spec DIR`: print a checkpoint's models.yaml entry")
    s.add_argument("action", choices=["tiny", "spec"])
    s.add_argument("dir", nargs="?", default=None, help="spec: the checkpoint directory")
    s.add_argument("--out", default=str(DEFAULT_VLLM_CHECKPOINT), help="tiny: where to write it")
    s.set_defaults(fn=cmd_model)

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
    s.set_defaults(fn=cmd_demo)

    from workers.cli.sim import add_parser as add_sim_parser

    add_sim_parser(sub)

    from workers.cli.replay import add_parser as add_replay_parser

    add_replay_parser(sub, cmd_replay)

    s = sub.add_parser("config", help="validate and summarise the configuration")
    s.add_argument("action", choices=["check"])
    s.set_defaults(fn=cmd_config)

    s = sub.add_parser("perf", help="iteration times from the calibrated cost model; `perf calibrate` refits it")
    s.add_argument("action", nargs="?", choices=["calibrate"], help="refit on data/profiles/vidur and write "
                   "configs/calibration.json (with --check: only verify it is up to date)")
    s.add_argument("--check", action="store_true", help="calibrate: exit 1 if configs/calibration.json is stale")
    s.add_argument("--model", default=None, help="model name (configs/models.yaml)")
    s.add_argument("--gpu", default=None, help="GPU type (configs/gpus.yaml)")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    s.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (and decode context)")
    s.add_argument("--batch", type=int, default=1, help="prompts prefilled together / sequences decoding")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_perf)

    s = sub.add_parser("bench", help="benchmarks (medians and ratios measured side by side)")
    s.add_argument("what", choices=["streams", "profile", "route", "pipeline", "batching", "kv", "failover", "gateway",
                                    "engines"])
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
    s.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.log_json:
        import os

        os.environ["RACKFLOW_LOG_JSON"] = "1"  # the role processes `up`/`demo` start inherit it
    try:
        return int(args.fn(args) or 0)
    except ConfigError as e:
        print(f"rackflow: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
