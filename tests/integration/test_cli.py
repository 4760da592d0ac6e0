"""The `rackflow` CLI as a user runs it: services up/status/down, config check, bad config errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

RF = [sys.executable, "-m", "workers.cli"]


def rf(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("RACKFLOW_")}
    e.update(env or {})
    return subprocess.run([*RF, *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_services_up_status_down(tmp_path: Path) -> None:
    up = rf("services", "up", cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    assert "redis://127.0.0.1:" in up.stdout and "http://127.0.0.1:" in up.stdout
    try:
        st = rf("services", "status", "--json", cwd=tmp_path)
        assert st.returncode == 0, st.stdout + st.stderr
        status = json.loads(st.stdout)
        assert status["redis"]["healthy"] and status["etcd"]["healthy"]
        pids = [status["redis"]["pid"], status["etcd"]["pid"]]
        assert all(_alive(p) for p in pids)
        human = rf("services", "status", cwd=tmp_path)
        assert "healthy" in human.stdout and status["redis"]["url"] in human.stdout
        again = rf("services", "up", cwd=tmp_path)
        assert again.returncode == 1 and "already running" in again.stderr
    finally:
        down = rf("services", "down", cwd=tmp_path)
    assert down.returncode == 0
    assert not any(_alive(p) for p in pids)
    st = rf("services", "status", cwd=tmp_path)
    assert st.returncode == 1 and "not running" in st.stdout


def test_role_without_servers_says_what_to_do(tmp_path: Path) -> None:
    res = rf("router", cwd=tmp_path)
    assert res.returncode != 0
    assert "rackflow services up" in res.stderr and "--redis-url" in res.stderr


def test_config_check_and_bad_config(tmp_path: Path) -> None:
    ok = rf("config", "check", cwd=tmp_path)
    assert ok.returncode == 0 and "8 nodes" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("policies:\n  batcher:\n    window_ms: -5\n  router:\n    policy: round-robbin\n")
    res = rf("--config", str(bad), "config", "check", cwd=tmp_path)
    assert res.returncode == 2
    assert "policies.batcher.window_ms" in res.stderr and "greater than or equal to 1" in res.stderr
    assert "policies.router.policy" in res.stderr and "rack-affinity" in res.stderr
