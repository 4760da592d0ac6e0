"""Startup that fails loudly: a port in use makes `rackflow gateway` and `rackflow up` exit non-zero within seconds,
with a message that names the port and the way out, and no other server is announced as ours."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from workers.local.services import ServiceEndpoints

pytestmark = pytest.mark.integration

RF = [sys.executable, "-m", "workers.cli"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RACKFLOW_")}


def _occupied() -> tuple[socket.socket, int]:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s, s.getsockname()[1]


def test_the_gateway_exits_at_once_on_a_port_in_use(services: ServiceEndpoints) -> None:
    holder, port = _occupied()
    try:
        t0 = time.monotonic()
        run = subprocess.run([*RF, "--redis-url", services.redis_url, "--etcd-url", services.etcd_url, "gateway",
                              "--port", str(port), "--no-auth"], cwd=REPO, env=_env(), capture_output=True,
                             text=True, timeout=60)
        took = time.monotonic() - t0
    finally:
        holder.close()
    assert run.returncode == 2, (run.returncode, run.stderr[-1500:])
    assert f"127.0.0.1:{port}" in run.stderr and "--port" in run.stderr, run.stderr[-1500:]
    assert "listening" not in run.stdout
    # bounded by the run's timeout (it hung for good before), not by a time this machine must beat when busy
    assert took < 60, took


def test_rackflow_up_exits_on_a_port_in_use_and_names_it(tmp_path: Path) -> None:
    holder, port = _occupied()
    try:
        t0 = time.monotonic()
        run = subprocess.run([*RF, "--log-level", "WARNING", "up", "--no-failover", "--gateway-port", str(port)],
                             cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180)
        took = time.monotonic() - t0
    finally:
        holder.close()
    assert run.returncode == 2, (run.returncode, run.stdout[-800:], run.stderr[-1500:])
    assert f"port {port}" in run.stderr and "--gateway-port" in run.stderr, run.stderr[-1500:]
    assert "gateway http" not in run.stdout, "no gateway is announced when none of ours listens"
    assert took < 150, took  # it starts Valkey and etcd first; a hang is what this catches


def test_ctrl_c_stops_rackflow_up_under_load_within_its_budget(tmp_path: Path) -> None:
    """Ctrl-C with streams open: the roles get `STOP_BUDGET_S` (8 s) in all, workers a quarter of it to finish
    their sequences, then SIGKILL; Valkey and etcd stop after. Nothing of the run is left behind."""
    import re
    import threading

    import httpx

    from workers.local.cluster import STOP_BUDGET_S

    up = subprocess.Popen([*RF, "--log-level", "WARNING", "up", "--no-failover", "--gateway-port", "0"],
                          cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = None
        assert up.stdout is not None
        for line in up.stdout:
            m = re.match(r"gateway (http://\S+)/v1", line)
            if m:
                url = m.group(1)
                break
        assert url, "rackflow up announced no gateway"
        started = threading.Semaphore(0)

        def stream() -> None:  # a long answer, read until the gateway goes away
            body = {"model": "qwen2-7b", "prompt": "a long answer", "max_tokens": 4000, "stream": True}
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            started.release()
            except httpx.HTTPError:
                pass

        clients = [threading.Thread(target=stream, daemon=True) for _ in range(6)]
        for c in clients:
            c.start()
        for _ in clients:  # every stream has its first token: sequences are live on the workers
            assert started.acquire(timeout=120)
        children = subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) >= 5, children  # Valkey, etcd, router, batcher, workers, gateway
        t0 = time.monotonic()
        up.send_signal(2)  # SIGINT, as Ctrl-C
        code = up.wait(timeout=120)
        took = time.monotonic() - t0
    finally:
        if up.poll() is None:
            up.kill()
    assert code == 0
    # the roles' budget, then Valkey's and etcd's own stop and the interpreter's exit (measured: 6.6 s; 41.6 s
    # before the budget, the gateway's 10 s stream grace and the workers' 30 s drain one after the other)
    print(f"\nstopped in {took:.1f} s")
    assert took < STOP_BUDGET_S + 12, took
    left = [pid for pid in children if Path(f"/proc/{pid}").exists()]
    assert not left, f"processes of the run left behind: {left}"
