"""A whole local cluster in one call: the embedded Valkey and etcd (unless URLs are given) plus every role process
of the config (`workers/local/launcher.py`), started together and stopped in reverse order. `rackflow up` and
`rackflow demo` run on it; so do the tests that need a real cluster."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from pipeline.config import load_config
from workers.gateway.auth import gateway_auth_available
from workers.local.services import STATE_DIR

log = logging.getLogger(__name__)


def port_free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def flower_port(requested: int | None) -> int:
    """Flower's port: the one asked for (it must be free), else 5555, else any free port (said in the log)."""
    from workers.local.supervise import free_port

    if requested is not None:
        if not port_free(requested):
            raise SystemExit(f"rackflow up: --flower-port {requested} is in use; pick another port or "
                             "leave it out (5555 or any free port)")
        return requested
    if port_free(5555):
        return 5555
    port = free_port()
    log.info("port 5555 is in use: Flower listens on %d", port)
    return port


DEFAULT_VLLM_CHECKPOINT = Path(".cache") / "tiny-qwen2-vllm"


def add_vllm_overlay(args: argparse.Namespace, state_dir: Path) -> None:
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


def config_args(args: argparse.Namespace) -> list[str]:
    """The --config-dir/--config flags that give every role process this process's configuration."""
    out = ["--config-dir", str(Path(args.config_dir).resolve())]
    for p in args.config:
        out += ["--config", str(Path(p).resolve())]
    return out


STOP_BUDGET_S = 8.0
"""How long stopping a local cluster's roles may take (Ctrl-C on `rackflow up`, the demo's end): workers get a
quarter of it to finish live sequences, every stage at most a third, then SIGKILL; the services stop after."""


class LocalCluster:
    """Services (unless URLs are given) + role processes, stopped in reverse order."""

    def __init__(self, args: argparse.Namespace, state_dir: Path, with_gateway: bool = False,
                 with_failover: bool = False) -> None:
        from workers.local.services import EmbeddedServices, resolve_endpoints

        self.args = args
        if getattr(args, "engine", None) == "vllm":
            add_vllm_overlay(args, state_dir)
        self.config = load_config(Path(args.config_dir), [Path(p) for p in args.config])
        flower = flower_port(getattr(args, "flower_port", None)) if with_failover else None  # before any start
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
            self.config, self.redis_url, self.etcd_url, state_dir / "logs", config_args(args),
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
            worker_grace_s=STOP_BUDGET_S / 4,
        )

    def start(self) -> None:
        try:
            self.procs.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        try:
            self.procs.stop(budget_s=STOP_BUDGET_S)
        finally:
            if self.services is not None:
                self.services.stop()
