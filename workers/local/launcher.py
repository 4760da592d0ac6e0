"""Starts and stops the role processes of a local cluster: a router, a batcher per rack, a worker per node (more
routers, batchers per rack and gateways on request: each set shares one consumer group).

Each role is its own OS process (`python -m workers.cli <role> ...`) with its log under `<state>/logs/`. Stopping
sends SIGTERM in pipeline order (router, batchers, workers), waits for a clean exit, then SIGKILLs stragglers.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import DEFAULT_CONFIG_DIR, RackflowConfig, overlay, parse_config, raw_config
from workers.shell.runtime import die_with_parent

log = logging.getLogger(__name__)


def gateway_url(procs: ClusterProcesses, wait_s: float = 60.0) -> str:
    """The URL the first gateway of `procs` announced in its log ("gateway listening on URL": port 0 picks one)."""
    import re

    gw = next(p for p in procs.procs if p.role == "gateway")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        found = re.search(r"gateway listening on (http://\S+)", gw.log_path.read_text(errors="replace"))
        if found:
            return found.group(1)
        time.sleep(0.2)
    raise RuntimeError(f"the gateway did not announce its URL within {wait_s:g}s: see {gw.log_path}")


def vllm_python() -> str:
    """The interpreter a `vllm` worker runs in: this one when it has vLLM, else the project's `.venv-vllm` (built
    by `make .venv-vllm`: vLLM pins versions that the main environment does not share), else a clear error."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    env = os.environ.get("RACKFLOW_VLLM_PYTHON")
    if env:  # an explicit setting is the only candidate: a wrong path is an error, not a silent fallback
        if Path(env).exists():
            return env
        raise RuntimeError(f"RACKFLOW_VLLM_PYTHON={env} does not exist: point it at an interpreter with vLLM, or "
                           "unset it to use .venv-vllm")
    c = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    if c.exists():
        return str(c)
    raise RuntimeError(
        "the vllm engine needs vLLM, and neither this Python nor .venv-vllm has it: run `make .venv-vllm` (vLLM's "
        "CPU build), or set RACKFLOW_VLLM_PYTHON to an interpreter with vLLM"
    )


def vllm_cpu_cores(nodes: list[str], node: str) -> str | None:
    """The cores (vLLM's `VLLM_CPU_OMP_THREADS_BIND` list, "0-3") that the vLLM worker of `node` binds its compute
    threads to, when every node of `nodes` runs on this host: a disjoint share of the cores this process may use, in
    node order; None where the operator set the variable, and for a single worker (vLLM's own binding then keeps a
    core for the rest of the host). On a GPU vLLM ignores it.

    vLLM's CPU build binds each worker by itself (`auto`): every one of them took the same first core of the NUMA
    node (measured: two workers, both pinned to CPU 0, while CPU 1 ran the rest), so two engines decoded on one core
    and each stalled the other for seconds."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or node not in nodes or len(nodes) < 2:
        return None
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    share = max(1, len(cores) // len(nodes))
    start = (nodes.index(node) * share) % len(cores)
    mine = cores[start:start + share]
    return f"{mine[0]}-{mine[-1]}" if len(mine) > 1 and mine[-1] - mine[0] == len(mine) - 1 else \
        ",".join(str(c) for c in mine)


JOBS_CONCURRENCY = 16
"""Tasks the local cluster's `jobs` worker runs at once (threads: a job or a batch's run mostly waits)."""


@dataclass
class RoleProcess:
    role: str
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    metrics_port: int | None = None
    """Where its Prometheus /metrics answers (the gateway: its HTTP port), when the cluster runs with metrics."""


@dataclass
class ClusterProcesses:
    config: RackflowConfig
    redis_url: str
    etcd_url: str
    log_dir: Path
    config_args: list[str] = field(default_factory=list)
    engine: str = "sim"
    log_level: str = "INFO"
    gateway_port: int | None = None
    """None: config gateway.port."""
    gateway_no_auth: bool = False
    with_gateway: bool = False
    """start() also starts the HTTP gateway (`rackflow up` does; the demo submits in-process)."""
    with_failover: bool = False
    """start() also starts a health agent per node, the monitor and a Celery worker (failover)."""
    agent_source: str = "sim"
    flower_port: int | None = None
    """When set (and with_failover), start Flower on this port."""
    metrics: bool = False
    """Every role serves Prometheus /metrics on a free port of its own (RoleProcess.metrics_port)."""
    routers: int = 1
    """Router processes (one consumer group on rf:ingress: each request goes to one of them)."""
    batchers_per_rack: int | None = None
    """Batcher processes per rack (one consumer group per rack); None: policies.batcher.consumers_per_rack."""
    gateways: int = 1
    """HTTP gateways (with_gateway): gateway k listens on gateway_port + k (every one on a free port when 0)."""
    role_urls: dict[str, str] | None = None
    """Per-role Redis/Valkey URLs (`rackflow services up --secure`: one ACL user per role, services.json's
    role_urls): each role logs in as its own user (router, batcher, worker, agent, monitor, gateway, celery, flower)
    instead of `redis_url`. The URL, with its password, reaches the child in its environment, not its command line
    (which `ps` shows to every local user)."""
    worker_grace_s: float | None = None
    """Seconds a worker gets to finish its live sequences on SIGTERM (`worker --grace`); None: the role's default
    (30 s, for a supervisor's rolling restart). `rackflow up` and the demo stop in seconds."""
    procs: list[RoleProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.gateway_port is None:
            self.gateway_port = self.config.gateway.port

    def _spawn(self, role: str, name: str, extra: list[str], port: int | None = None,
               env_extra: dict[str, str] | None = None) -> RoleProcess:
        """Start `python -m workers.cli <role> ...`; the celery role runs `celery-worker`. `port`: a gateway's."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        metrics_port = None
        if self.metrics and role != "gateway":
            from workers.local.supervise import free_port

            metrics_port = free_port()
            extra = [*extra, "--metrics-port", str(metrics_port)]
        elif role == "gateway":
            # 0: a free port the gateway picks (printed in its log)
            metrics_port = (self.gateway_port if port is None else port) or None
        redis_args, env = self._redis_for("celery" if role == "celery-jobs" else role)  # one ACL user for both
        if env_extra:
            env = {**(env if env is not None else os.environ), **env_extra}
        python = vllm_python() if role == "worker" and self.engine == "vllm" else sys.executable
        cmd = [
            python, "-m", "workers.cli", *self.config_args,
            *redis_args, "--etcd-url", self.etcd_url, "--log-level", self.log_level,
            "celery-worker" if role in ("celery", "celery-jobs") else role, *extra,
        ]
        fh = open(log_path, "ab")  # noqa: SIM115 - the child owns it
        try:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=env,
                                    preexec_fn=die_with_parent())
        finally:
            fh.close()
        rp = RoleProcess(role, name, proc, log_path, metrics_port)
        self.procs.append(rp)
        return rp

    def redis_url_for(self, role: str) -> str:
        """The URL `role` connects with: its own user's under role_urls, else the shared `redis_url`."""
        if self.role_urls is None:
            return self.redis_url
        try:
            return self.role_urls[role]
        except KeyError:
            raise ValueError(f"no Redis URL for role {role!r} in role_urls (has: {', '.join(sorted(self.role_urls))})"
                             ) from None

    def _redis_for(self, role: str) -> tuple[list[str], dict[str, str] | None]:
        """(command-line arguments, environment) that give a child process its Redis URL."""
        if self.role_urls is None:
            return ["--redis-url", self.redis_url], None
        from workers.local.services import ENV_REDIS_URL

        return [], {**os.environ, ENV_REDIS_URL: self.redis_url_for(role)}

    def metrics_targets(self) -> list[dict[str, object]]:
        """The roles' /metrics endpoints as Prometheus file_sd targets (`file_sd_configs`)."""
        return [
            {"targets": [f"127.0.0.1:{p.metrics_port}"], "labels": {"job": "rackflow", "role": p.role,
                                                                    "process": p.name}}
            for p in self.procs if p.metrics_port is not None and (self.metrics or p.role == "gateway")
        ]

    def start(self) -> None:
        for node in self.config.nodes():
            self.start_worker(node.name)
        per_rack = self.batchers_per_rack or self.config.policies.batcher.consumers_per_rack
        for rack in self.config.rack_names():
            for k in range(per_rack):
                self._spawn("batcher", f"batcher-{rack}" + (f"-{k}" if k else ""), ["--rack", rack])
        for k in range(max(1, self.routers)):
            self._spawn("router", "router" + (f"-{k}" if k else ""), [])
        if self.with_failover:
            self.start_failover()
        if self.with_gateway:
            for k in range(max(1, self.gateways)):
                port = self.gateway_port + k if self.gateway_port else self.gateway_port
                self.start_gateway("gateway" + (f"-{k}" if k else ""), port)

    def start_failover(self) -> None:
        for node in self.config.nodes():
            self.start_agent(node.name)
        self.start_monitor()
        self.start_celery_worker(queues="control")
        self.start_jobs_worker()
        if self.flower_port is not None:
            self.start_flower(self.flower_port)

    def start_agent(self, node: str) -> RoleProcess:
        return self._spawn("agent", f"agent-{node}", ["--node", node, "--source", self.agent_source])

    def start_monitor(self, name: str = "monitor") -> RoleProcess:
        return self._spawn("monitor", name, [])

    def start_celery_worker(self, name: str = "celery-worker", concurrency: int = 2,
                            queues: str | None = None) -> RoleProcess:
        """A Celery worker for the control tasks (drains, migrations, requeues), prefork; `queues` None: the
        command's default (`control,jobs`: it runs async jobs and batches too)."""
        extra = ["--concurrency", str(concurrency)] + (["--queues", queues] if queues is not None else [])
        return self._spawn("celery", name, extra)

    def start_jobs_worker(self, name: str = "celery-jobs", concurrency: int = JOBS_CONCURRENCY) -> RoleProcess:
        """A Celery worker for queue `jobs` alone (async jobs and the Batch API's runs): threads, since each task
        mostly waits on the cluster, and apart from the control worker, so that a batch that runs for minutes never
        holds a slot a drain needs."""
        return self._spawn("celery-jobs", name, ["--concurrency", str(concurrency), "--queues", "jobs",
                                                 "--pool", "threads"])

    def start_flower(self, port: int) -> RoleProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / "flower.log"
        from workers.control.app import broker_url

        # the broker URL (with the flower user's password under role_urls) goes in the environment, not argv
        cmd = [sys.executable, "-m", "celery", "-A", "workers.control.app", "flower",
               f"--port={port}", "--address=127.0.0.1"]
        env = {**os.environ, "FLOWER_UNAUTHENTICATED_API": "true",
               "CELERY_BROKER_URL": broker_url(self.redis_url_for("flower"))}
        fh = open(log_path, "ab")  # noqa: SIM115 - the child owns it
        try:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=env,
                                    preexec_fn=die_with_parent())
        finally:
            fh.close()
        rp = RoleProcess("flower", "flower", proc, log_path)
        self.procs.append(rp)
        return rp

    def start_gateway(self, name: str = "gateway", port: int | None = None) -> RoleProcess:
        """An HTTP gateway on `port` (default: gateway_port); several may run, each on its own port."""
        port = self.gateway_port if port is None else port
        extra = ["--port", str(port), "--engine", self.engine]
        if self.gateway_no_auth:
            extra.append("--no-auth")
        return self._spawn("gateway", name, extra, port=port)

    def start_worker(self, node: str) -> RoleProcess:
        env = None
        if self.engine == "vllm":
            cores = vllm_cpu_cores([n.name for n in self.config.nodes()], node)
            if cores is not None:
                env = {"VLLM_CPU_OMP_THREADS_BIND": cores}
        grace = ["--grace", f"{self.worker_grace_s:g}"] if self.worker_grace_s is not None else []
        return self._spawn("worker", f"worker-{node}", ["--node", node, "--engine", self.engine, *grace],
                           env_extra=env)

    def dead(self) -> list[RoleProcess]:
        return [p for p in self.procs if p.proc.poll() is not None]

    def stop(self, timeout_s: float = 40.0, budget_s: float | None = None) -> None:
        """SIGTERM the roles stage by stage (gateways first, so that nothing new comes in; workers after the roles
        that feed them), each stage given `timeout_s` before SIGKILL. `budget_s`: the whole stop takes about this
        long at most (`rackflow up`'s Ctrl-C): a stage gets at most a third of it, and what is left of it."""
        order = {"gateway": 0, "monitor": 1, "router": 2, "batcher": 3, "worker": 4, "agent": 5, "celery": 6,
                 "celery-jobs": 6,
                 "flower": 7}
        end = time.monotonic() + budget_s if budget_s is not None else None
        cap = min(timeout_s, budget_s / 3) if budget_s is not None else timeout_s
        for stage in sorted({order.get(p.role, 8) for p in self.procs}):
            group = [p for p in self.procs if order.get(p.role, 8) == stage and p.proc.poll() is None]
            for p in group:
                try:
                    p.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + cap
            if end is not None:
                deadline = max(time.monotonic() + 0.2, min(deadline, end))
            for p in group:
                try:
                    p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop within %.1fs; killing it", p.name, cap)
                    try:
                        os.killpg(p.proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    p.proc.wait()
        self.procs.clear()

    def kill(self, name: str) -> None:
        for p in self.procs:
            if p.name == name and p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()


async def wait_cluster_ready(config: RackflowConfig, redis_url: str, etcd_url: str, timeout_s: float = 90.0) -> None:
    """Until every node is registered in etcd and publishes its status, and the router and every rack's batcher
    have joined their consumer groups; TimeoutError naming what is missing otherwise."""
    import asyncio

    from streams import keys
    from streams.runner import connect
    from workers.stores.etcd import NodeRegistry

    r = connect(redis_url)
    registry = NodeRegistry(etcd_url)
    want = {n.name for n in config.nodes()}
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            registered = set(await registry.nodes())
            pipe = r.pipeline(transaction=False)
            for n in sorted(want):
                pipe.exists(keys.node_status(n))
            have = {n for n, e in zip(sorted(want), await pipe.execute(), strict=True) if e}
            groups = 0
            for stream, group in [(keys.INGRESS, keys.GROUP_ROUTER)] + [
                (keys.rack_requests(rk), keys.GROUP_BATCHER) for rk in config.rack_names()
            ]:
                try:
                    infos = await r.xinfo_groups(stream)
                except Exception:
                    infos = []
                groups += any(g.get("name") in (group, group.encode()) and g.get("consumers") for g in infos)
            if want <= registered and want <= have and groups == 1 + len(config.rack_names()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"cluster not ready after {timeout_s:.0f}s: nodes registered {len(registered & want)}/"
                    f"{len(want)}, with status {len(have)}/{len(want)}, consumer groups {groups}"
                )
            await asyncio.sleep(0.2)
    finally:
        await registry.close(revoke=False)
        await r.aclose()


def config_overlay_file(path: Path, over: dict[str, Any], config_dir: Path = DEFAULT_CONFIG_DIR) -> RackflowConfig:
    """A variant of the config for a cluster of role processes: `over` (pipeline.config.overlay) is validated
    over `config_dir` first, so a bad value fails here with its field path before any process starts, then written
    to `path`, the `--config` file every role process reads. Returns the config those processes will load."""
    import yaml

    config = parse_config(overlay(raw_config(config_dir), over), source=f"overlay {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(over))
    return config
