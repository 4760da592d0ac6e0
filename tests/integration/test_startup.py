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
