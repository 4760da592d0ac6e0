"""`rackflow services up --secure`: one Valkey ACL user per role (rules of deploy/valkey/users.acl.example), a
random password each, the default user off. A role user is refused what its rules do not grant and allowed its own
stream writes; nothing gets in without a login; the files holding the secrets are 0600."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from workers.local.services import EmbeddedServices
from workers.local.valkey import ACL_FILE, ADMIN_USER, acl_role_rules

pytestmark = [pytest.mark.integration, pytest.mark.hardening, pytest.mark.timeout(60)]


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=2, retry=Retry(NoBackoff(), 0))


@pytest.fixture
def secure(tmp_path: Path) -> Iterator[tuple[EmbeddedServices, dict[str, object]]]:
    svc = EmbeddedServices(tmp_path / "state", secure=True)
    svc.start()
    try:
        yield svc, json.loads(svc.state_file.read_text())
    finally:
        svc.stop()


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_secure_services_files_and_users(secure: tuple[EmbeddedServices, dict[str, object]]) -> None:
    svc, state = secure
    acl = svc.state_dir / ACL_FILE
    assert _mode(acl) == 0o600 and _mode(svc.state_file) == 0o600
    role_urls = state["role_urls"]
    assert isinstance(role_urls, dict)
    assert set(role_urls) == {u.removeprefix("rf-") for u in acl_role_rules()}
    assert "router" in role_urls and "worker" in role_urls and "gateway" in role_urls
    text = acl.read_text()
    for url in role_urls.values():
        password = url.split("@", 1)[0].rsplit(":", 1)[1]
        assert password not in text, "the ACL file must hold password hashes, not passwords"
    assert len({u.split("@", 1)[0] for u in role_urls.values()}) == len(role_urls), "one password per role"
    # services.json's redis_url is the admin user: status and the test fixtures keep working
    assert str(state["redis_url"]).startswith(f"redis://{ADMIN_USER}:")
    assert svc.status()["redis"]["healthy"] is True
    admin = _client(str(state["redis_url"]))
    try:
        assert admin.acl_whoami() == ADMIN_USER
        assert set(admin.acl_users()) >= {"default", ADMIN_USER, "rf-router", "rf-worker"}
    finally:
        admin.close()


def test_no_access_without_login(secure: tuple[EmbeddedServices, dict[str, object]]) -> None:
    _svc, state = secure
    port = str(state["redis_url"]).rsplit(":", 1)[1].split("/")[0]
    anon = _client(f"redis://127.0.0.1:{port}/0")
    try:
        with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
            anon.ping()
        with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
            anon.xadd("rf:ingress", {"v": "1"})
    finally:
        anon.close()
    router = str(state["role_urls"]["router"])  # type: ignore[index]
    wrong = _client(router.replace("rf-router:", "rf-router:x", 1))
    try:
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
    finally:
        wrong.close()


def test_router_user_is_confined_to_its_rules(secure: tuple[EmbeddedServices, dict[str, object]]) -> None:
    _svc, state = secure
    r = _client(str(state["role_urls"]["router"]))  # type: ignore[index]
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.acl_whoami()  # not even ACL introspection
        # its own work: read ingress as the router group, write a rack's request stream and the decisions log
        r.xgroup_create("rf:ingress", "router", id="0", mkstream=True)
        assert r.xadd("rf:rack:{r0}:req", {"v": "1"})
        assert r.xadd("rf:decisions", {"v": "1"})
        assert r.xreadgroup("router", "c1", {"rf:ingress": ">"}, count=1) is not None
        # keys outside its rules: it cannot forge a final result or an exactly-once marker, nor touch KV/jobs
        for denied_key in ("rf:results", "{rf:results}:done:x", "rf:out:{x}", "rf:kv:{s}:1", "rf:job:x"):
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.xadd(denied_key, {"v": "1"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.set("{rf:results}:done:x", "1")
        # node keys are read-only to it: it reads node status, it cannot hand a node a batch past the batchers
        assert r.hgetall("rf:node:{n0}:status") == {}
        for denied_key in ("rf:node:{n0}:batch", "rf:node:{n0}:ctl"):
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.xadd(denied_key, {"v": "1"})
        # commands outside its rules
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.flushall()
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.config_get("*")
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.hset("rf:node:{n0}:status", "x", "1")  # hset is not one of the router's commands
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.eval("return 1", 0)
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.keys("*")
    finally:
        r.close()
    # the worker user, by contrast, writes final results (its rules grant rf:results)
    w = _client(str(state["role_urls"]["worker"]))  # type: ignore[index]
    try:
        assert w.xadd("rf:results", {"v": "1"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            w.xadd("rf:ingress", {"v": "1"})
    finally:
        w.close()


def test_gateway_without_queue_read_rights_fails_loudly(secure: tuple[EmbeddedServices, dict[str, object]],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """An ACL that denies the gateway its queue reads must not silently turn load shedding off (a denial is an
    error reply like "no such stream", which the gateway takes as an empty queue)."""
    from pipeline.config import load_config
    from workers.stores.ingress import Gateway

    _svc, state = secure
    admin = _client(str(state["redis_url"]))
    try:
        admin.acl_setuser("rf-gw-narrow", enabled=True, passwords=["+narrow-pw"], commands=["+@all"],
                          keys=["rf:ingress", "rf:results"])
    finally:
        admin.close()
    url = str(state["redis_url"]).replace(f"{ADMIN_USER}:", "rf-gw-narrow:", 1)
    url = url.split("@", 1)[0].rsplit(":", 1)[0] + ":narrow-pw@" + url.split("@", 1)[1]

    async def read() -> None:
        r = aioredis.Redis.from_url(url)
        try:
            await Gateway(load_config(), r).rack_queues()
        finally:
            await r.aclose()

    with pytest.raises(redis.exceptions.NoPermissionError) as denied:
        asyncio.run(read())
    assert "may not run xinfo|groups on rf:rack:" in caplog.text
    # what the HTTP client then gets: a 503 that says it is the ACL, not an outage
    from workers.gateway.http import _store_down

    err = _store_down(denied.value)
    assert (err.status, err.code) == (503, "store_forbidden") and "permission" in str(err)


def test_rackflow_up_logs_each_role_in_as_its_user_on_a_secure_valkey(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`rackflow up` (its LocalCluster) finds `services up --secure`'s role URLs in .rackflow/services.json and
    hands them to the launcher; pointed at another server by --redis-url, it uses that URL for every role."""
    import argparse

    from pipeline.config import DEFAULT_CONFIG_DIR
    from workers.local.cluster import LocalCluster

    monkeypatch.chdir(tmp_path)
    for var in ("RACKFLOW_REDIS_URL", "RACKFLOW_ETCD_URL"):
        monkeypatch.delenv(var, raising=False)
    svc = EmbeddedServices(Path(".rackflow"), secure=True)
    ep = svc.start()
    try:
        def args(**kw: Any) -> argparse.Namespace:
            base = {"config_dir": str(DEFAULT_CONFIG_DIR), "config": [], "redis_url": None, "etcd_url": None,
                    "log_level": "WARNING"}
            return argparse.Namespace(**(base | kw))

        cluster = LocalCluster(args(), tmp_path / "up", with_gateway=True)
        assert cluster.services is None, "it must use the running services, not start its own"
        assert cluster.redis_url == ep.redis_url
        assert cluster.procs.role_urls == svc.role_urls and "router" in svc.role_urls
        redis_args, env = cluster.procs._redis_for("router")
        assert redis_args == [] and env is not None and env["RACKFLOW_REDIS_URL"] == svc.role_urls["router"]

        elsewhere = LocalCluster(args(redis_url="redis://127.0.0.1:1/0", etcd_url=ep.etcd_url), tmp_path / "up2")
        assert elsewhere.procs.role_urls is None
        assert elsewhere.procs._redis_for("router") == (["--redis-url", "redis://127.0.0.1:1/0"], None)
    finally:
        svc.stop()


# -- the whole cluster, every role as its own user ----------------------------------------------------------------
ACL_CLUSTER = {
    "cluster": {"racks": [
        {"name": "r0", "node_count": 2, "node": {"gpu": "a100-80gb", "tp": 1, "models": ["qwen2-7b"]}},
    ]},
    "policies": {"streams": {"claim_idle_ms": 2000}, "worker": {"token_flush_ms": 20}},
}


def _until(what: str, check: Callable[[], Any], timeout_s: float, every_s: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = check()
        except httpx.TransportError:  # not listening yet
            got = None
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)


async def _http_load(base: str, n: int, max_tokens: int = 8) -> list[tuple[int, str]]:
    """`n` completions through the gateway, every other one streamed: (status, text) each."""
    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str]:
        body: dict[str, Any] = {"model": "qwen2-7b", "max_tokens": max_tokens, "user": f"user-{i % 5}"}
        if i % 2:
            body |= {"stream": True, "messages": [{"role": "user", "content": f"request {i}"}]}
            parts = []
            async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        ev = json.loads(line.removeprefix("data: "))
                        assert "error" not in ev, ev
                        parts += [ch["delta"].get("content", "") for ch in ev.get("choices", [])]
                return resp.status_code, "".join(parts)
        body["prompt"] = f"request {i}: tell me about racks"
        resp = await client.post(f"{base}/v1/completions", json=body)
        return resp.status_code, resp.json()["choices"][0]["text"] if resp.status_code == 200 else resp.text

    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(one(client, i) for i in range(n)))


LONG_TOKENS = 400


@pytest.mark.timeout(240)
def test_every_role_runs_as_its_own_acl_user(tmp_path: Path, config_file: Callable[..., Path]) -> None:
    """`rackflow services up --secure` + the cluster's roles, each logged in as its own user (what `rackflow up`
    does on a secure Valkey): completions (streamed and not), an async job through Celery, an Xid fault mid-stream
    drained by the monitor and Celery (live sequences moved), Flower's API, the fault CLI as rf-ops -- and not
    one ACL denial."""
    from tests.integration import harness
    from workers.local.launcher import ClusterProcesses, wait_cluster_ready
    from workers.local.supervise import free_port

    svc = EmbeddedServices(tmp_path / "state", secure=True)
    ep = svc.start()
    path = config_file(ACL_CLUSTER)
    config = harness.small_config(path)
    gateway_port, flower_port = free_port(), free_port()
    procs = ClusterProcesses(config, ep.redis_url, ep.etcd_url, tmp_path / "logs", ["--config", str(path)],
                             log_level="INFO", with_gateway=True, gateway_no_auth=True, gateway_port=gateway_port,
                             with_failover=True, flower_port=flower_port, role_urls=svc.role_urls)
    admin = _client(ep.redis_url)
    try:
        admin.acl_log_reset()
        procs.start()
        for p in procs.procs:  # the password is in the child's environment, never on its command line
            assert not any("rf-" in a and "@" in a for a in p.proc.args), p.proc.args  # type: ignore[union-attr]
        asyncio.run(wait_cluster_ready(config, ep.redis_url, ep.etcd_url, 120))
        base = f"http://127.0.0.1:{gateway_port}"
        _until("the gateway", lambda: httpx.get(f"{base}/healthz", timeout=2).status_code == 200, 60)

        answers = asyncio.run(_http_load(base, 16))
        assert [s for s, _ in answers] == [200] * 16, answers
        assert all(len(text.split()) == 8 for _, text in answers), answers

        job = httpx.post(f"{base}/v1/jobs", json={"prompt": "hello", "model": "qwen2-7b", "max_tokens": 5},
                         timeout=30)
        assert job.status_code == 202, job.text
        done = _until("the job", lambda: (s := httpx.get(f"{base}/v1/jobs/{job.json()['id']}", timeout=10).json())
                      .get("status") in ("succeeded", "failed") and s, 60)
        assert done["status"] == "succeeded", done

        # an Xid fault on r0-n1 while long streams run on both nodes, injected as rf-ops (what `rackflow fault
        # inject` does, in-process so that it lands mid-stream): the monitor drains the node and Celery moves its
        # live sequences, KV included (rf:seq:*, rf:kv:*), to r0-n0
        async def fault_under_load() -> list[tuple[int, str]]:
            from pipeline.events import HealthEvent
            from streams import codec, keys
            from workers.health import faults
            from workers.shell.runtime import WALL

            load = asyncio.create_task(_http_load(base, 8, max_tokens=LONG_TOKENS))
            ops = aioredis.Redis.from_url(svc.role_urls["ops"])
            try:
                # the precondition is a state, not a delay: r0-n1's worker reports live sequences (each one runs
                # for >= 1.8 s of engine steps, long enough for the monitor and Celery to move it)
                deadline = time.monotonic() + 60
                while True:
                    raw = admin.hgetall(keys.node_status("r0-n1"))
                    ev = codec.decode(raw) if raw else None
                    if isinstance(ev, HealthEvent) and ev.running > 0:
                        break
                    assert not load.done() and time.monotonic() < deadline, "no sequence ever ran on r0-n1"
                    await asyncio.sleep(0.05)
                await faults.inject(ops, "r0-n1", "xid", now_ms=WALL.now_ms())
            finally:
                await ops.aclose()
            return await load

        answers = asyncio.run(fault_under_load())
        assert [s for s, _ in answers] == [200] * 8, answers
        assert all(len(text.split()) == LONG_TOKENS for _, text in answers), [len(t.split()) for _, t in answers]
        logs = "".join(p.log_path.read_text() for p in procs.procs if p.role in ("monitor", "worker"))
        assert "marked draining" in logs, "the monitor did not drain r0-n1"
        assert " resumed at v" in logs, "no live sequence was moved off r0-n1"
        assert "(KV snapshot)" in logs and "KV export on release failed" not in logs, "KV did not move with it"

        # the operator's CLI, logged in as rf-ops
        env = {**os.environ, "RACKFLOW_REDIS_URL": svc.role_urls["ops"], "RACKFLOW_ETCD_URL": ep.etcd_url}
        cli = subprocess.run([sys.executable, "-m", "workers.cli", "--config", str(path), "fault", "list",
                              "--node", "r0-n1"], env=env, capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0 and "xid" in cli.stdout, (cli.stdout, cli.stderr[-2000:])

        flower = f"http://127.0.0.1:{flower_port}/api/workers?refresh=1"  # refresh: Flower asks the workers now
        _until("Flower to see the Celery worker (its broker login is rf-flower)",
               lambda: (resp := httpx.get(flower, timeout=15)).status_code == 200 and resp.json(), 60, 1.0)

        assert not procs.dead(), [(p.name, p.log_path.read_text()[-1500:]) for p in procs.dead()]
        denials = admin.acl_log(count=20)
        assert denials == [], f"{len(denials)} ACL denials, e.g. {denials[:3]}"
        logs = "".join(p.log_path.read_text() for p in procs.procs)
        assert "NOPERM" not in logs and "NoPermissionError" not in logs
    finally:
        admin.close()
        procs.stop()
        svc.stop()
