"""`rackflow services up --secure`: one Valkey ACL user per role (rules of deploy/valkey/users.acl.example), a
random password each, the default user off. A role user is refused what its rules do not grant and allowed its own
stream writes; nothing gets in without a login; the files holding the secrets are 0600."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from workers.services import ACL_FILE, ADMIN_USER, EmbeddedServices, acl_role_rules

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
