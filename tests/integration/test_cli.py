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
    assert "policies.router.policy" in res.stderr and "rack_affinity" in res.stderr


def test_up_serves_requests_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    """`rackflow up` starts services + all roles; requests flow; Ctrl-C (SIGINT) stops every process it started."""
    import asyncio
    import re
    import signal
    import time

    from tests.integration import harness

    override = tmp_path / "small.yaml"
    import yaml

    override.write_text(yaml.safe_dump(harness.SMALL_CLUSTER))
    e = {k: v for k, v in os.environ.items() if not k.startswith("RACKFLOW_")}
    from workers.local.supervise import free_port

    port, flower = free_port(), free_port()
    # started with SIGINT ignored, as a shell starts a background job (`rackflow up &`, a CI script): the Ctrl-C
    # below must stop it all the same
    proc = subprocess.Popen([*RF, "--config", str(override), "--log-level", "WARNING", "up", "--gateway-port",
                             str(port), "--flower-port", str(flower)],
                            cwd=tmp_path, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"redis (\S+) etcd (\S+)", line)
        assert m, line + (proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        redis_url = m.group(1)
        gw_line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/v1" in gw_line and "auth: OFF" in gw_line, gw_line
        assert f"http://127.0.0.1:{flower}/" in proc.stdout.readline()
        config = harness.small_config(override)
        items = harness.inputs(40, seed=7)
        deadline = time.monotonic() + 60
        # the roles need a moment to register; requests sent before are held by the router, not lost
        sent = asyncio.run(harness.submit(config, redis_url, items))
        got, counts = asyncio.run(harness.wait_results(redis_url, {r.request_id for r in sent}, timeout_s=90))
        assert time.monotonic() < deadline + 90
        assert len(got) == 40 and all(c == 1 for c in counts.values())
        # the README's curl: a streaming chat completion through the gateway, tokens as SSE events
        body = json.dumps({"model": "qwen2-7b", "stream": True, "max_tokens": 12,
                           "messages": [{"role": "user", "content": "hello rackflow"}]})
        curl = ["curl", "-sN", "--max-time", "60", "--retry", "20", "--retry-connrefused", "--retry-delay", "1",
                "-H", "Content-Type: application/json", "-d", body, f"http://127.0.0.1:{port}/v1/chat/completions"]
        out = subprocess.run(curl, capture_output=True, text=True, timeout=90).stdout
        events = [ln[6:] for ln in out.splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", out[-500:]
        chunks = [json.loads(ev) for ev in events[:-1]]
        assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert len(text.split()) == 12, text
        rid = chunks[0]["id"].removeprefix("chatcmpl-")
        decided = [f for _e, f in asyncio.run(harness.read_stream(redis_url, "rf:decisions"))
                   if rid.encode() in f[b"d"]]
        assert len(decided) >= 2, "route and dispatch decisions of the curl request are in rf:decisions"
        # failover roles: Flower's API (unauthenticated for local use) sees the Celery worker that runs drains
        workers: dict[str, object] = {}
        for _ in range(60):
            api = subprocess.run(["curl", "-s", "--max-time", "10", f"http://127.0.0.1:{flower}/api/workers?refresh=1"],
                                 capture_output=True, text=True, timeout=30).stdout
            workers = json.loads(api) if api.startswith("{") else {}
            if workers:
                break
            time.sleep(1)
        assert workers, "Flower lists no Celery worker"
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        servers = json.loads((tmp_path / ".rackflow" / "up" / "services.json").read_text())
        # workers + agents, batchers, router, gateway, monitor, celery worker, flower (services: own session)
        assert len(children) >= 2 * 4 + 2 + 1 + 1 + 3
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
    time.sleep(0.5)
    assert not any(_alive(p) for p in children), "a role process survived Ctrl-C"
    assert not _alive(servers["valkey_pid"]) and not _alive(servers["etcd_pid"])
