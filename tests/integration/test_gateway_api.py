"""The OpenAI-compatible HTTP gateway as a client meets it: real uvicorn over a real socket, in front of the real
pipeline (router, batchers, sim workers as processes on real Valkey + etcd).

Gateway A (`rackflow gateway --port 0`, JWT auth, HS256) serves the running cluster. Gateway B is a second instance
on another Redis database where no router reads: there, what is admitted is never answered, which makes the
overload bound (429), the timeouts (504 / SSE error event) and a failed result (503) deterministic. Every rejected
request is checked to have left `rf:ingress` untouched.
"""

from __future__ import annotations

import asyncio
import copy
import http.client
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import jwt
import openai
import pytest
import redis
import redis.asyncio as aioredis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pipeline.events import RequestEvent
from streams import codec, keys
from tests.conftest import REPO, _clean
from tests.integration import harness
from workers.local.launcher import ClusterProcesses
from workers.local.services import ServiceEndpoints

pytestmark = pytest.mark.integration

SECRET = "integration-test-secret-0123456789abcdef"
MODEL = "qwen2-7b"
MAX_BODY = 65_536
TIMEOUT_B_S = 2.0
RF = [sys.executable, "-m", "workers.cli"]


# -- processes ---------------------------------------------------------------------------------------------------------
@dataclass
class GatewayProcess:
    proc: subprocess.Popen[str]
    url: str
    log_path: Path

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return int(self.proc.returncode)


def _env(secret: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RACKFLOW_")}
    if secret is not None:
        env["RACKFLOW_JWT_SECRET"] = secret
    return env


def start_gateway(config: Path, redis_url: str, etcd_url: str, log_path: Path, *extra: str,
                  secret: str | None = SECRET) -> GatewayProcess:
    """`rackflow gateway --port 0` as its own process; returns once it printed the address it listens on."""
    cmd = [*RF, "--config", str(config), "--redis-url", redis_url, "--etcd-url", etcd_url, "--log-level", "WARNING",
           "gateway", "--port", "0", *extra]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(secret), stdout=subprocess.PIPE, stderr=log,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        lines.put(proc.stdout.readline())

    threading.Thread(target=read, daemon=True).start()
    try:
        line = lines.get(timeout=60)
    except queue.Empty:
        line = ""
    prefix = "gateway listening on "
    if not line.startswith(prefix):
        GatewayProcess(proc, "", log_path).stop()
        raise AssertionError(f"gateway did not start: {line!r}\n{log_path.read_text()[-3000:]}")
    return GatewayProcess(proc, line.removeprefix(prefix).strip(), log_path)


def _other_db(redis_url: str) -> str:
    parts = urlsplit(redis_url)
    db = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{15 if db != 15 else 14}"))


@dataclass
class Env:
    url: str
    url_b: str
    redis_url: str
    redis_url_b: str
    config: Path
    services: ServiceEndpoints
    tmp: Path

    def r(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def r_b(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url_b)


@pytest.fixture(scope="module")
def env(services: ServiceEndpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    asyncio.run(_clean(services))
    tmp = tmp_path_factory.mktemp("gateway_api")
    override = copy.deepcopy(harness.SMALL_CLUSTER)
    override["policies"]["worker"] = {"token_flush_ms": 0}  # one token event per engine step: visible streaming
    override["gateway"] = {"max_body_bytes": MAX_BODY, "auth": {"mode": "hs256", "secret_env": "RACKFLOW_JWT_SECRET"}}
    path_a = tmp / "cluster.yaml"
    path_a.write_text(yaml.safe_dump(override))
    override_b = copy.deepcopy(override)
    override_b["gateway"].update({"max_ingress_backlog": 2, "request_timeout_s": TIMEOUT_B_S})
    path_b = tmp / "gateway-b.yaml"
    path_b.write_text(yaml.safe_dump(override_b))
    redis_b = _other_db(services.redis_url)
    redis.Redis.from_url(redis_b).flushdb()

    config = harness.small_config(path_a)
    procs = ClusterProcesses(config, services.redis_url, services.etcd_url, tmp / "logs", ["--config", str(path_a)],
                             log_level="WARNING")
    gateways: list[GatewayProcess] = []
    try:
        procs.start()
        gateways.append(start_gateway(path_a, services.redis_url, services.etcd_url, tmp / "gateway-a.log"))
        gateways.append(start_gateway(path_b, redis_b, services.etcd_url, tmp / "gateway-b.log"))
        e = Env(gateways[0].url, gateways[1].url, services.redis_url, redis_b, path_a, services, tmp)
        # the roles need a moment to register; a request sent before is held by the router, not lost
        resp = httpx.post(f"{e.url}/v1/completions", headers=auth(), timeout=60,
                          json={"model": MODEL, "prompt": "warm up", "max_tokens": 1})
        assert resp.status_code == 200, resp.text
        yield e
        assert not procs.dead(), [p.log_path.read_text()[-2000:] for p in procs.dead()]
    finally:
        for g in gateways:
            g.stop()
        procs.stop()
        redis.Redis.from_url(redis_b).flushdb()


# -- helpers -----------------------------------------------------------------------------------------------------------
def token(tenant: str = "acme", sub: str = "alice", secret: str = SECRET, ttl_s: int = 600, **claims: Any) -> str:
    now = int(time.time())
    body: dict[str, Any] = {"sub": sub, "tenant": tenant, "iat": now, "exp": now + ttl_s, **claims}
    return jwt.encode({k: v for k, v in body.items() if v is not None}, secret, algorithm="HS256")


def auth(tenant: str = "acme", **kw: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {token(tenant, **kw)}"}


def xlen(r: redis.Redis) -> int:
    return int(r.xlen(keys.INGRESS))


def assert_error(resp: httpx.Response, status: int, *words: str, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], (w, err)
    if param is not None:
        assert err["param"] == param, err
    assert "Traceback" not in resp.text
    return dict(err)


def sse_events(resp: httpx.Response) -> list[tuple[float, str]]:
    """(arrival time, data) of every SSE `data:` line, read as the bytes arrive."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            out.append((time.monotonic(), line.removeprefix("data: ")))
    return out


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def result_of(e: Env, response_id: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(f"{e.url}/v1/results/{response_id}", headers=auth() if headers is None else headers, timeout=10)


# -- the cluster behind gateway A ------------------------------------------------------------------------------------
LONG_TOKENS = 1500


def test_client_that_goes_away_mid_stream_frees_the_stream(env: Env) -> None:
    before = metric(env.url, "rackflow_gateway_in_flight_requests")
    with httpx.Client(timeout=30) as c, c.stream(
        "POST", f"{env.url}/v1/completions", headers=auth(),
        json={"model": MODEL, "prompt": "a long answer", "max_tokens": LONG_TOKENS, "stream": True},
    ) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        rid = json.loads(first.removeprefix("data: "))["id"]
        assert metric(env.url, "rackflow_gateway_in_flight_requests") == before + 1
    deadline = time.monotonic() + 10
    while metric(env.url, "rackflow_gateway_in_flight_requests") != before:
        assert time.monotonic() < deadline, "the stream kept running after the client left"
        time.sleep(0.02)
    # the gateway let go before generation ended (1,500 tokens take >= 6.7 s of engine steps, so that a gateway
    # starved of CPU on a busy machine still lets go first) ...
    assert result_of(env, rid).status_code == 404
    # ... and the request itself is not lost: its result is readable once it finishes
    deadline = time.monotonic() + 90
    while (res := result_of(env, rid)).status_code == 404 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == LONG_TOKENS


def test_completion_non_streaming(env: Env) -> None:
    resp = httpx.post(f"{env.url}/v1/completions", headers=auth(), timeout=30,
                      json={"model": MODEL, "prompt": "Say hello", "max_tokens": 8, "temperature": 0.2,
                            "logit_bias": {}, "some_future_field": 1})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == MODEL
    assert abs(body["created"] - time.time()) < 60
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 8
    stored = result_of(env, body["id"]).json()
    assert stored["status"] == "ok" and stored["text"] == choice["text"]


def test_chat_completion_non_streaming(env: Env) -> None:
    resp = httpx.post(f"{env.url}/v1/chat/completions", headers=auth(), timeout=30, json={
        "model": MODEL, "max_completion_tokens": 5,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
    })
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"]
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 5
    # the ChatML prompt was profiled: two turns + the open assistant turn is more than a few tokens
    assert body["usage"]["prompt_tokens"] >= 10


def test_sse_stream_arrives_incrementally_and_matches_the_result(env: Env) -> None:
    with httpx.Client(timeout=30) as c, c.stream(
        "POST", f"{env.url}/v1/completions", headers=auth(),
        json={"model": MODEL, "prompt": "Count", "max_tokens": 16, "stream": True,
              "stream_options": {"include_usage": True}},
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _t, d in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert len(texts) >= 3, chunks
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    times = [t for t, d in events if d != "[DONE]" and json.loads(d)["choices"] and json.loads(d)["choices"][0]["text"]]
    assert times[-1] > times[0], "all chunks arrived at once: the stream was buffered"
    stored = result_of(env, chunks[0]["id"]).json()
    assert "".join(texts) == stored["text"]


def test_chat_sse_stream(env: Env) -> None:
    with httpx.Client(timeout=30) as c, c.stream(
        "POST", f"{env.url}/v1/chat/completions", headers=auth(),
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "stream": True},
    ) as resp:
        assert resp.status_code == 200
        events = sse_events(resp)
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _t, d in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"][0]["delta"] == {}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == result_of(env, chunks[0]["id"]).json()["text"]


def test_official_openai_client_works_unchanged(env: Env) -> None:
    client = openai.OpenAI(base_url=f"{env.url}/v1", api_key=token(), max_retries=0, timeout=30)
    comp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert comp.choices[0].text and comp.usage is not None and comp.usage.completion_tokens == 4
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=3)
    assert chat.choices[0].message.content and chat.choices[0].finish_reason == "length"
    parts, usage = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=7, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert parts and usage is not None and usage.completion_tokens == 7
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{env.url}/v1", api_key="nope", max_retries=0).models.list()


def test_models_lists_only_served_models_the_token_allows(env: Env) -> None:
    def ids(headers: dict[str, str]) -> list[str]:
        resp = httpx.get(f"{env.url}/v1/models", headers=headers, timeout=10)
        assert resp.status_code == 200 and resp.json()["object"] == "list"
        return [m["id"] for m in resp.json()["data"]]

    assert ids(auth()) == [MODEL]  # the other configured models are served by no rack of this cluster
    assert ids(auth(models=[MODEL, "qwen2-72b"])) == [MODEL]
    assert ids(auth(models=["qwen2-72b"])) == []
    assert_error(httpx.get(f"{env.url}/v1/models", timeout=10), 401)


def test_model_from_header_and_token_claim(env: Env) -> None:
    url = f"{env.url}/v1/completions"
    resp = httpx.post(url, headers={**auth(), "X-Model": MODEL}, json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert resp.status_code == 200 and resp.json()["model"] == MODEL
    resp = httpx.post(url, headers=auth(model=MODEL), json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert resp.status_code == 200 and resp.json()["model"] == MODEL
    r = env.r()
    n = xlen(r)
    assert_error(httpx.post(url, headers=auth(), json={"prompt": "x", "max_tokens": 2}, timeout=10), 400,
                 "X-Model", param="model")
    assert xlen(r) == n


def test_route_policy_header(env: Env) -> None:
    url = f"{env.url}/v1/completions"
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    resp = httpx.post(url, headers={**auth(), "X-Route-Policy": "kv_aware"}, json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    r = env.r()
    n = xlen(r)
    err = assert_error(httpx.post(url, headers={**auth(), "X-Route-Policy": "fastest"}, json=body, timeout=10), 400,
                       "fastest", "kv_aware", param="X-Route-Policy")
    assert err["code"] == "invalid_route_policy"
    assert xlen(r) == n


def test_tenant_isolation_of_results(env: Env) -> None:
    resp = httpx.post(f"{env.url}/v1/completions", headers=auth("tenant-a"), timeout=30,
                      json={"model": MODEL, "prompt": "secret of a", "max_tokens": 4})
    assert resp.status_code == 200
    rid = resp.json()["id"]
    text = resp.json()["choices"][0]["text"]
    mine = result_of(env, rid, auth("tenant-a", sub="someone-else"))
    assert mine.status_code == 200 and mine.json()["text"] == text
    assert result_of(env, rid.removeprefix("cmpl-"), auth("tenant-a")).status_code == 200
    theirs = result_of(env, rid, auth("tenant-b"))
    assert_error(theirs, 404, param="request_id")
    assert text not in theirs.text
    assert_error(result_of(env, f"cmpl-{uuid.uuid4()}", auth("tenant-a")), 404)
    assert_error(result_of(env, "../../etc", auth("tenant-a")), 404)
    assert_error(result_of(env, rid, {}), 401)


def test_rejected_requests_never_reach_the_ingress_stream(env: Env) -> None:
    r = env.r()
    before = xlen(r)
    url = f"{env.url}/v1/completions"
    chat = f"{env.url}/v1/chat/completions"
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 2}

    def post(body: Any = ok, headers: dict[str, str] | None = None, to: str = url, **kw: Any) -> httpx.Response:
        if "content" not in kw:
            kw["json"] = body
        return httpx.post(to, headers=auth() if headers is None else headers, timeout=10, **kw)

    assert_error(post(content=b'{"model": "qwen2-7b", "prompt": '), 400, "request body is not valid JSON")
    assert_error(post(content=b"[1, 2]"), 400, "JSON object")
    assert_error(post({**ok, "max_tokens": "ten"}), 400, "max_tokens", param="max_tokens")
    assert_error(post({**ok, "max_tokens": 0}), 400, "max_tokens", param="max_tokens")
    assert_error(post({"model": MODEL, "max_tokens": 2}), 400, "prompt", "required", param="prompt")
    assert_error(post({**ok, "prompt": [1, 2, 3]}), 400, "token-id prompts are not supported", param="prompt")
    assert_error(post({**ok, "n": 100}), 400, "n=100", "gateway.max_n", param="n")
    assert_error(post({**ok, "echo": True}), 400, "echo", param="echo")
    assert_error(post({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, to=chat), 400,
                 param="messages.0.content")
    assert_error(post({"model": MODEL}, to=chat), 400, "messages", param="messages")
    err = assert_error(post({**ok, "max_tokens": 40_000}), 400, "32768", param="max_tokens")
    assert err["code"] == "context_length_exceeded"
    assert_error(post({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                       "max_completion_tokens": 40_000}, to=chat), 400, "32768", param="max_completion_tokens")
    big = json.dumps({**ok, "prompt": "x" * MAX_BODY}).encode()
    assert_error(post(content=big), 413, str(MAX_BODY))
    assert_error(post(content=iter([big[:40_000], big[40_000:]])), 413, str(MAX_BODY))  # chunked: no Content-Length
    err = assert_error(post({**ok, "model": "gpt-5"}), 404, "gpt-5", param="model")
    assert err["code"] == "model_not_found"
    assert_error(post({**ok, "model": "qwen2-72b"}), 404, "not served")
    for headers, word in [({}, "missing"), ({"Authorization": "Bearer abc.def.ghi"}, "not a valid JWT"),
                          (auth(ttl_s=-60), "expired"), (auth(secret="wrong-secret" * 4), "signature"),
                          ({"Authorization": f"Bearer {token(tenant=None)}"}, "tenant")]:
        resp = post(headers=headers)
        assert_error(resp, 401, word)
        assert resp.headers["www-authenticate"].startswith("Bearer")
    err = assert_error(post(headers=auth(models=["qwen2-72b"])), 403, MODEL, "qwen2-72b")
    assert err["type"] == "permission_error"
    assert_error(httpx.get(f"{env.url}/v1/nope", timeout=10), 404, "/v1/nope")
    assert_error(httpx.delete(f"{env.url}/v1/completions", timeout=10), 405)
    assert xlen(r) == before, "a rejected request reached rf:ingress"
    assert metric(env.url, "rackflow_gateway_rejected_total", reason="body_too_large") >= 2
    assert metric(env.url, "rackflow_gateway_requests_total", endpoint="/v1/completions", code="401") >= 5


def test_health_and_metrics(env: Env) -> None:
    resp = httpx.get(f"{env.url}/healthz", timeout=10)
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    ok_before = metric(env.url, "rackflow_gateway_requests_total", endpoint="/v1/completions", code="200")
    tokens_before = metric(env.url, "rackflow_gateway_tokens_streamed_total", model=MODEL)
    ttft_before = metric(env.url, "rackflow_gateway_time_to_first_token_seconds_count", model=MODEL)
    resp = httpx.post(f"{env.url}/v1/completions", headers=auth(), timeout=30,
                      json={"model": MODEL, "prompt": "m", "max_tokens": 3})
    assert resp.status_code == 200
    assert metric(env.url, "rackflow_gateway_requests_total", endpoint="/v1/completions", code="200") == ok_before + 1
    assert metric(env.url, "rackflow_gateway_tokens_streamed_total", model=MODEL) == tokens_before + 3
    assert metric(env.url, "rackflow_gateway_time_to_first_token_seconds_count", model=MODEL) == ttft_before + 1
    assert metric(env.url, "rackflow_gateway_request_seconds_count", endpoint="/v1/completions") >= 1
    assert metric(env.url, "rackflow_gateway_in_flight_requests") == 0


def test_idle_keep_alive_connection_outlives_client_pool_expiry(env: Env) -> None:
    """The gateway keeps an idle connection open gateway.keep_alive_s (75 s), longer than client pools and load
    balancers keep theirs (httpx: 5 s; ALB: 60 s). With equal timeouts both sides close together and a request sent
    on the closing connection gets a reset (seen as httpx.ReadError in a 600-request run)."""
    host, port = urlsplit(env.url).hostname, urlsplit(env.url).port
    assert host and port
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        for attempt in range(2):
            conn.request("GET", "/healthz")
            resp = conn.getresponse()  # RemoteDisconnected if the server closed the idle connection
            assert resp.status == 200, (attempt, resp.status)
            resp.read()
            if attempt == 0:
                first = conn.sock
                time.sleep(6.5)  # past uvicorn's 5 s default and httpx's pool expiry
        assert conn.sock is first, "the connection was re-opened"
    finally:
        conn.close()


# -- gateway B: no router behind it ----------------------------------------------------------------------------------
def _reset_b(e: Env) -> redis.Redis:
    """Every key of gateway B's database gone but the gateways' reply streams: a flushed reply stream is re-created
    by its gateway only at its next TTL refresh, and until then a result reaches the gateway only through its sweep
    (two sweeps, up to 2 s), which raced gateway B's 2 s request timeout (a 504 instead of the 503 under test, seen
    on a busy machine)."""
    r = e.r_b()
    doomed = [k for k in r.scan_iter(count=1000) if not keys.is_gateway_replies(k.decode())]
    if doomed:
        r.delete(*doomed)
    time.sleep(0.15)  # the gateway caches the backlog for 0.1 s
    return r


def test_overload_answers_429_with_retry_after(env: Env) -> None:
    r = _reset_b(env)
    for _ in range(2):  # max_ingress_backlog is 2: two requests already wait for a router
        r.xadd(keys.INGRESS, {b"v": b"1", b"t": b"request", b"d": b"\xc0"})
    time.sleep(0.15)
    resp = httpx.post(f"{env.url_b}/v1/completions", headers=auth(), timeout=10,
                      json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    err = assert_error(resp, 429, "overloaded")
    assert resp.headers["retry-after"] == "1" and err["type"] == "rate_limit_error"
    assert xlen(r) == 2
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(base_url=f"{env.url_b}/v1", api_key=token(), max_retries=0).completions.create(
            model=MODEL, prompt="x", max_tokens=2)
    assert xlen(r) == 2


def test_no_result_in_time_is_504_or_an_sse_error_event(env: Env) -> None:
    r = _reset_b(env)
    t0 = time.monotonic()
    resp = httpx.post(f"{env.url_b}/v1/completions", headers=auth(), timeout=30,
                      json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    err = assert_error(resp, 504, "/v1/results/")
    assert err["code"] == "timeout" and time.monotonic() - t0 >= TIMEOUT_B_S
    with httpx.Client(timeout=30) as c, c.stream(
        "POST", f"{env.url_b}/v1/chat/completions", headers=auth(),
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True},
    ) as stream:
        assert stream.status_code == 200
        events = [d for _t, d in sse_events(stream)]
    # no token came, so no chunk came before the error (the first chunk leaves with the first token)
    assert len(events) == 2, events
    assert json.loads(events[-2])["error"]["code"] == "timeout" and events[-1] == "[DONE]"
    assert xlen(r) == 2  # both were admitted (and are still there for a router to serve)


def _fail_next_request(e: Env, r: redis.Redis) -> None:
    """Stand in for the router: read the next admitted request and write an error result for it, the way the
    router does (ResultWriter: exactly once, to its stream and its gateway's reply stream)."""
    from workers.stores.results import ResultWriter, error_result

    resp = r.xread({keys.INGRESS: "0-0"}, count=1, block=5000)
    assert resp, "nothing was admitted"
    req = codec.decode(resp[0][1][0][1])
    assert isinstance(req, RequestEvent)
    assert req.reply_to and keys.is_gateway_replies(req.reply_to), req.reply_to

    async def write() -> None:
        ar = aioredis.Redis.from_url(e.redis_url_b)
        try:
            await ResultWriter(ar, lambda: time.time() * 1000, 60_000).write(
                error_result(req, f"no healthy rack serves model {req.model!r}; retry later"))
        finally:
            await ar.aclose()

    asyncio.run(write())


@pytest.mark.parametrize("stream", [False, True])
def test_failed_result_is_503_or_an_sse_error_event(env: Env, stream: bool) -> None:
    r = _reset_b(env)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": stream}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, f"{env.url_b}/v1/completions", headers=auth(), json=body, timeout=30)
        _fail_next_request(env, r)
        resp = fut.result()
    if not stream:
        err = assert_error(resp, 503, "no healthy rack")
        assert err["type"] == "service_unavailable"
        return
    assert resp.status_code == 200
    events = [line.removeprefix("data: ") for line in resp.text.splitlines() if line.startswith("data: ")]
    assert "no healthy rack" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"


# -- process behaviour -------------------------------------------------------------------------------------------------
def test_gateway_refuses_to_start_without_a_secret(env: Env) -> None:
    res = subprocess.run([*RF, "--config", str(env.config), "--redis-url", env.redis_url, "--etcd-url",
                          env.services.etcd_url, "gateway", "--port", "0"], cwd=REPO, env=_env(None),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "RACKFLOW_JWT_SECRET" in res.stderr and "--no-auth" in res.stderr


def test_no_auth_gateway_and_clean_sigterm(env: Env) -> None:
    gw = start_gateway(env.config, env.redis_url_b, env.services.etcd_url, env.tmp / "gateway-c.log", "--no-auth",
                       secret=None)
    try:
        resp = httpx.get(f"{gw.url}/v1/models", timeout=10)
        assert resp.status_code == 200 and [m["id"] for m in resp.json()["data"]] == [MODEL]
        assert httpx.get(f"{gw.url}/healthz", timeout=10).status_code == 200
    finally:
        rc = gw.stop()
    assert rc == 0, gw.log_path.read_text()[-2000:]
    assert "JWT auth is OFF" in gw.log_path.read_text()


def test_without_redis_health_is_503_and_requests_get_503(env: Env) -> None:
    from workers.local.supervise import free_port

    dead = f"redis://127.0.0.1:{free_port()}/0"
    gw = start_gateway(env.config, dead, env.services.etcd_url, env.tmp / "gateway-d.log")
    try:
        resp = httpx.get(f"{gw.url}/healthz", timeout=10)
        assert resp.status_code == 503 and resp.json()["status"] == "unavailable"
        err = assert_error(httpx.post(f"{gw.url}/v1/completions", headers=auth(), timeout=30,
                                      json={"model": MODEL, "prompt": "x", "max_tokens": 2}), 503, "retry later")
        assert err["code"] == "store_unavailable"
    finally:
        assert gw.stop() == 0


def test_unexpected_error_is_a_500_json_without_traceback() -> None:
    """In process (no server needed): an app whose lifespan never ran fails inside the endpoint."""
    from pipeline.config import load_config
    from workers.gateway.http import create_app

    app = create_app(load_config(), "redis://127.0.0.1:1/0", None, no_auth=True)

    async def call() -> tuple[httpx.Response, str]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as c:
            resp = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
            return resp, (await c.get("/metrics")).text

    resp, metrics = asyncio.run(call())
    err = assert_error(resp, 500, "internal error")
    assert err["type"] == "server_error" and "RuntimeError" not in resp.text
    assert 'rackflow_gateway_requests_total{code="500",endpoint="/v1/completions"} 1.0' in metrics
