"""The gateway's side of priority classes and tenant limits (docs/PRIORITY.md): the class a request runs in (its
`X-Priority` header, its tenant's configured class, its token's `priority` claim as a ceiling) reaches the pipeline in
the RequestEvent; a tenant's tokens-per-minute limit (the token's `tpm` claim, else `gateway.tenants`) answers 429
with Retry-After once the minute's tokens are spent, and batch-class requests are not charged.

The gateway runs in-process (TestClient) on the session's real Valkey and etcd; a stand-in pipeline answers what is
admitted and records it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from pipeline.config import DEFAULT_CONFIG_DIR, RackflowConfig, load_config
from pipeline.events import RequestEvent, ResultEvent
from tests.integration.harness import Responder, ok_result
from workers.local.services import ServiceEndpoints

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SECRET = "priority-test-secret-0123456789abcdef"
MODEL = "qwen2-7b"


def _config(tmp_path: Path) -> RackflowConfig:
    p = tmp_path / "priority.yaml"
    p.write_text(yaml.safe_dump({
        "cluster": {"racks": [{"name": "r0", "node_count": 1,
                               "node": {"gpu": "h100-80gb", "tp": 1, "models": [MODEL]}}]},
        "gateway": {"request_timeout_s": 30.0, "auth": {"mode": "hs256", "secret_env": "RACKFLOW_JWT_SECRET"},
                    "routing": "router",
                    "tenants": {"nightly": {"priority": "batch"}, "metered": {"tpm": 250}}},
        "policies": {"kv": {"l1_dir": str(tmp_path / "l1")}},
    }))
    return load_config(DEFAULT_CONFIG_DIR, [p])


Client = tuple[TestClient, RackflowConfig, list[RequestEvent]]


@pytest.fixture
def client(clean_services: ServiceEndpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Client]:
    from workers.gateway.http import create_app

    monkeypatch.setenv("RACKFLOW_JWT_SECRET", SECRET)
    config = _config(tmp_path)
    seen: list[RequestEvent] = []

    def answer(req: RequestEvent) -> ResultEvent:
        seen.append(req)
        return ok_result(req)

    app = create_app(config, clean_services.redis_url, clean_services.etcd_url, no_auth=False)
    with Responder(clean_services.redis_url, answer), TestClient(app, raise_server_exceptions=False) as c:
        yield c, config, seen


def _auth(config: RackflowConfig, tenant: str = "t1", **kw: Any) -> dict[str, str]:
    from workers.gateway.auth import mint_token

    return {"Authorization": f"Bearer {mint_token(config.gateway.auth, tenant=tenant, sub='u1', **kw)}"}


def _ask(c: TestClient, headers: dict[str, str], max_tokens: int = 8) -> Any:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": max_tokens}
    return c.post("/v1/completions", headers=headers, json=body)


def test_the_class_comes_from_the_header_the_tenant_and_the_token_as_a_ceiling(client: Client) -> None:
    c, config, seen = client
    cases = [
        ({}, "t1", {}, 0),  # the default: interactive
        ({"X-Priority": "batch"}, "t1", {}, 1),  # a request may lower itself
        ({}, "nightly", {}, 1),  # the tenant's configured class
        ({"X-Priority": "interactive"}, "nightly", {}, 0),  # the request's own choice over its tenant's
        ({"X-Priority": "interactive"}, "t1", {"priority": "batch"}, 1),  # a batch token cannot ask for more
    ]
    for extra, tenant, claims, want in cases:
        r = _ask(c, {**_auth(config, tenant, **claims), **extra})
        assert r.status_code == 200, r.text
        rid = r.json()["id"].removeprefix("cmpl-")
        got = next(q for q in seen if q.request_id == rid)
        assert got.priority == want, (extra, tenant, claims, got.priority)
    # OpenAI's service_tier: flex runs as batch, priority as interactive; the header wins over it
    for tier, extra, want in (("flex", {}, 1), ("priority", {}, 0), ("default", {}, 0),
                              ("flex", {"X-Priority": "interactive"}, 0)):
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "service_tier": tier}
        r = c.post("/v1/completions", headers={**_auth(config), **extra}, json=body)
        assert r.status_code == 200, r.text
        got = next(q for q in seen if q.request_id == r.json()["id"].removeprefix("cmpl-"))
        assert got.priority == want, (tier, extra)
    bad_tier = c.post("/v1/completions", headers=_auth(config),
                      json={"model": MODEL, "prompt": "hello", "max_tokens": 4, "service_tier": "urgent"})
    assert bad_tier.status_code == 400 and bad_tier.json()["error"]["param"] == "service_tier", bad_tier.text
    bad = _ask(c, {**_auth(config), "X-Priority": "urgent"})
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert err["param"] == "X-Priority" and "interactive, batch" in err["message"]


def test_a_tenant_over_its_tokens_per_minute_gets_429_with_retry_after_and_batch_work_is_not_charged(
        client: Client) -> None:
    c, config, _seen = client
    # the limit is per wall-clock minute: start where the minute cannot end within the test (it takes about a second)
    while time.time() % 60 > 40:
        time.sleep(0.5)
    metered = _auth(config, "metered")  # gateway.tenants.metered.tpm = 250
    codes = [_ask(c, metered, 40).status_code for _ in range(8)]  # about 41 tokens each
    assert codes[:5] == [200] * 5 and 429 in codes, codes
    refused = _ask(c, metered, 40)
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    err = refused.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and "tokens per minute" in err["message"], err
    # batch-class work runs in idle capacity: not charged
    assert _ask(c, {**metered, "X-Priority": "batch"}, 40).status_code == 200
    # the token's claim takes precedence over the tenant's configured limit; one request over it alone: 400
    big = _ask(c, _auth(config, "other", tpm=30), 40)
    assert big.status_code == 400 and big.json()["error"]["code"] == "request_too_large", big.text
    assert _ask(c, _auth(config, "other", tpm=30), 8).status_code == 200
