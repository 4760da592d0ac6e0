"""Integration tests for workers.local.services: real valkey-server and etcd processes, no mocks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from workers.local.etcd import EtcdProcess
from workers.local.services import ENV_ETCD_URL, ENV_REDIS_URL, EmbeddedServices, ServiceEndpoints, resolve_endpoints
from workers.local.supervise import ServiceError, free_port
from workers.local.valkey import ValkeyProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _server_children() -> dict[int, str]:
    """Live (non-zombie) child processes of this test process that are valkey-server or etcd."""
    found: dict[int, str] = {}
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == me and state != "Z" and ("valkey-server" in cmdline or "etcdbin/etcd" in cmdline):
            found[int(entry.name)] = cmdline.strip()
    return found


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    before = set(_server_children())
    yield
    leaked = {pid: cmd for pid, cmd in _server_children().items() if pid not in before}
    for pid in leaked:  # clean up so one failure does not cascade, then fail loudly
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert not leaked, f"processes left behind: {leaked}"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_REDIS_URL, raising=False)
    monkeypatch.delenv(ENV_ETCD_URL, raising=False)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def _etcd_health(url: str) -> dict[str, str]:
    with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
        body: dict[str, str] = json.loads(resp.read())
    return body


def _port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_embedded_services_lifecycle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    state_dir = tmp_path / "state"
    services = EmbeddedServices(state_dir)
    endpoints = services.start()
    try:
        assert endpoints.redis_url == f"redis://127.0.0.1:{_port_of(endpoints.redis_url)}/0"
        assert endpoints.etcd_url == f"http://127.0.0.1:{_port_of(endpoints.etcd_url)}"
        assert _port_of(endpoints.redis_url) != _port_of(endpoints.etcd_url)

        state = json.loads((state_dir / "services.json").read_text())
        assert set(state) == {"redis_url", "etcd_url", "valkey_pid", "etcd_pid", "started_at"}
        assert state["redis_url"] == endpoints.redis_url and state["etcd_url"] == endpoints.etcd_url
        assert (state_dir / "valkey" / "valkey.log").exists()
        assert (state_dir / "etcd" / "etcd-data").is_dir()

        status = services.status()
        assert status["running"] is True
        assert status["redis"] == {
            "url": endpoints.redis_url,
            "pid": state["valkey_pid"],
            "alive": True,
            "healthy": True,
        }
        assert status["etcd"] == {
            "url": endpoints.etcd_url,
            "pid": state["etcd_pid"],
            "alive": True,
            "healthy": True,
        }
        assert services.endpoints() == endpoints

        client = redis.Redis.from_url(endpoints.redis_url)
        assert client.ping() is True
        client.set("rackflow:test", "1")
        assert client.get("rackflow:test") == b"1"
        client.close()
        assert _etcd_health(endpoints.etcd_url)["health"] == "true"

        # a second start, from this or another instance, refuses while the PIDs live
        with pytest.raises(ServiceError, match="already running") as excinfo:
            EmbeddedServices(state_dir).start()
        assert endpoints.redis_url in str(excinfo.value)
        assert "rackflow services down" in str(excinfo.value)
        with pytest.raises(ServiceError, match="already running"):
            services.start()

        # resolve_endpoints: services.json < env < explicit, URL by URL
        assert resolve_endpoints(state_dir=state_dir) == endpoints
        with monkeypatch.context() as env:
            env.setenv(ENV_REDIS_URL, "redis://10.0.0.1:6379/0")
            assert resolve_endpoints(state_dir=state_dir) == ServiceEndpoints(
                "redis://10.0.0.1:6379/0", endpoints.etcd_url
            )
            assert resolve_endpoints(
                redis_url="redis://explicit:1/0", state_dir=state_dir
            ) == ServiceEndpoints("redis://explicit:1/0", endpoints.etcd_url)
            env.setenv(ENV_ETCD_URL, "http://10.0.0.2:2379")
            assert resolve_endpoints(state_dir=state_dir) == ServiceEndpoints(
                "redis://10.0.0.1:6379/0", "http://10.0.0.2:2379"
            )
    finally:
        # stop from a *different* instance, as `rackflow services down` would (PID-only path)
        stopped = EmbeddedServices(state_dir).stop(timeout_s=10)

    assert stopped is True
    assert _gone(state["valkey_pid"]) and _gone(state["etcd_pid"])
    assert not (state_dir / "services.json").exists()
    assert services.endpoints() is None
    assert services.status()["running"] is False
    assert resolve_endpoints(state_dir=state_dir) is None
    # idempotent, also on the instance that started them, once its own children have exited (a busy machine lets a
    # child that the other instance signalled linger a moment: stopping it then is a real stop)
    deadline = time.monotonic() + 10
    while any(h is not None and h.pid is not None for h in (services._valkey, services._etcd)):
        assert time.monotonic() < deadline, "a stopped server's process did not exit within 10 s"
        time.sleep(0.05)
    assert services.stop() is False
    assert EmbeddedServices(state_dir).stop() is False


def test_embedded_services_context_manager_and_restart(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    with EmbeddedServices(state_dir) as services:
        first = services.endpoints()
        assert first is not None
        pids = (services.status()["redis"]["pid"], services.status()["etcd"]["pid"])
        client = redis.Redis.from_url(first.redis_url)
        assert client.ping()
        client.close()
    assert all(_gone(pid) for pid in pids)
    assert not (state_dir / "services.json").exists()

    # the same state_dir can be started again (new ports, existing etcd data dir)
    with EmbeddedServices(state_dir) as services:
        assert services.status()["running"] is True
    assert not (state_dir / "services.json").exists()


def test_stale_state_file_is_replaced(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "services.json").write_text(
        json.dumps(
            {
                "redis_url": "redis://127.0.0.1:1/0",
                "etcd_url": "http://127.0.0.1:2",
                "valkey_pid": dead.pid,
                "etcd_pid": dead.pid,
                "started_at": "2000-01-01T00:00:00+00:00",
            }
        )
    )
    services = EmbeddedServices(state_dir)
    assert services.endpoints() is None
    assert services.status()["running"] is False
    try:
        endpoints = services.start()
        assert json.loads((state_dir / "services.json").read_text())["redis_url"] == endpoints.redis_url
    finally:
        assert services.stop() is True


def test_stop_does_not_kill_a_recycled_pid(tmp_path: Path) -> None:
    """services.json naming a live PID that is not valkey/etcd: stop leaves that process alone."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        state_dir = tmp_path / "state"
        state_dir.mkdir()
        (state_dir / "services.json").write_text(
            json.dumps(
                {
                    "redis_url": "redis://127.0.0.1:1/0",
                    "etcd_url": "http://127.0.0.1:2",
                    "valkey_pid": bystander.pid,
                    "etcd_pid": bystander.pid,
                    "started_at": "2000-01-01T00:00:00+00:00",
                }
            )
        )
        services = EmbeddedServices(state_dir)
        assert services.status()["redis"]["alive"] is False
        assert services.stop(timeout_s=1) is False
        assert bystander.poll() is None
        assert not (state_dir / "services.json").exists()
    finally:
        bystander.kill()
        bystander.wait()


def test_valkey_extra_args_and_password(tmp_path: Path) -> None:
    data_dir = tmp_path / "valkey"
    port = free_port()
    valkey = ValkeyProcess(
        data_dir,
        port=port,
        password="s3cr/t",
        extra_args=["--appendonly", "yes", "--appendfsync", "always"],
    )
    valkey.start()
    try:
        assert valkey.port == port
        assert valkey.url == f"redis://:s3cr%2Ft@127.0.0.1:{port}/0"
        assert valkey.pid is not None and valkey.healthy()
        client = redis.Redis.from_url(valkey.url)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
        client.set("durable", "yes")
        client.close()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, retry=Retry(NoBackoff(), 0)).ping()
        pid = valkey.pid
    finally:
        valkey.stop()
    assert valkey.pid is None and _gone(pid) and not valkey.healthy()
    valkey.stop()  # idempotent

    # the AOF survives a restart on the same data dir
    with ValkeyProcess(data_dir, port=port, password="s3cr/t", extra_args=["--appendonly", "yes"]) as again:
        client = redis.Redis.from_url(again.url)
        assert client.get("durable") == b"yes"
        client.close()
    assert again.pid is None


def test_valkey_retries_when_its_free_port_is_taken(tmp_path: Path) -> None:
    valkey = ValkeyProcess(tmp_path / "valkey")
    first_port = valkey.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", first_port))
        squatter.listen()
        with valkey:
            assert valkey.port != first_port
            assert valkey.healthy()
    assert "already in use" in (tmp_path / "valkey" / "valkey.log").read_text().lower()


def test_valkey_explicit_port_taken_raises(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        valkey = ValkeyProcess(tmp_path / "valkey", port=port)
        with pytest.raises(ServiceError, match="already in use"):
            valkey.start(timeout_s=10)
    assert valkey.pid is None


def test_valkey_bad_args_raise_with_log_tail(tmp_path: Path) -> None:
    valkey = ValkeyProcess(tmp_path / "valkey", extra_args=["--no-such-option", "1"])
    with pytest.raises(ServiceError) as excinfo:
        valkey.start(timeout_s=10)
    message = str(excinfo.value)
    assert message.startswith("valkey: ")
    assert "no-such-option" in message  # from the log tail
    assert valkey.pid is None


def test_etcd_process_start_stop(tmp_path: Path) -> None:
    etcd = EtcdProcess(tmp_path / "etcd", name="node-a")
    etcd.start()
    try:
        assert etcd.client_port != etcd.peer_port
        assert etcd.url == f"http://127.0.0.1:{etcd.client_port}"
        assert etcd.healthy()
        assert _etcd_health(etcd.url) == {"health": "true", "reason": ""}
        pid = etcd.pid
        assert pid is not None
        assert (tmp_path / "etcd" / "etcd.log").stat().st_size > 0
    finally:
        etcd.stop()
    assert etcd.pid is None and _gone(pid) and not etcd.healthy()
    etcd.stop()  # idempotent


def test_etcd_initial_cluster_override(tmp_path: Path) -> None:
    peer = free_port()
    etcd = EtcdProcess(
        tmp_path / "etcd",
        name="m1",
        peer_port=peer,
        extra_args=[
            "--initial-cluster",
            f"m1=http://127.0.0.1:{peer}",
            "--initial-cluster-token",
            "rackflow-test",
        ],
    )
    with etcd:
        pid = etcd.pid
        assert pid is not None
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert argv.count(b"--initial-cluster") == 1
        assert b"rackflow-test" in argv
        assert etcd.healthy()
    assert _gone(pid)


def test_etcd_start_failure_raises(tmp_path: Path) -> None:
    etcd = EtcdProcess(tmp_path / "etcd", extra_args=["--initial-cluster", "other=http://127.0.0.1:1"])
    with pytest.raises(ServiceError, match=r"^etcd: ") as excinfo:
        etcd.start(timeout_s=10)
    assert "etcd.log" in str(excinfo.value)
    assert etcd.pid is None


def test_resolve_endpoints_precedence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    empty = tmp_path / "nothing-here"
    assert resolve_endpoints(state_dir=empty) is None
    assert resolve_endpoints(redis_url="redis://a:1/0", state_dir=empty) is None

    monkeypatch.setenv(ENV_REDIS_URL, "redis://env:6379/0")
    monkeypatch.setenv(ENV_ETCD_URL, "http://env:2379")
    assert resolve_endpoints(state_dir=empty) == ServiceEndpoints("redis://env:6379/0", "http://env:2379")
    assert resolve_endpoints("redis://arg:1/0", state_dir=empty) == ServiceEndpoints(
        "redis://arg:1/0", "http://env:2379"
    )
    assert resolve_endpoints("redis://arg:1/0", "http://arg:2", state_dir=empty) == ServiceEndpoints(
        "redis://arg:1/0", "http://arg:2"
    )
    monkeypatch.setenv(ENV_ETCD_URL, "")  # empty counts as unset
    assert resolve_endpoints(state_dir=empty) is None


def test_start_is_quick(tmp_path: Path) -> None:
    """Guard the suite's runtime: both servers together come up in a few seconds."""
    began = time.monotonic()
    with EmbeddedServices(tmp_path / "state") as services:
        assert services.status()["running"]
    assert time.monotonic() - began < 15
