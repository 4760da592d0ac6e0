"""Fuzzing the HTTP gateway (issue 9): no input gets a 5xx.

The gateway's app (`workers.gateway.http.create_app`) runs in-process (Starlette's TestClient, lifespan included)
against the real Valkey of the session, once with JWT auth on and once with auth off. A small responder stands in
for the pipeline: it answers every request admitted to `rf:ingress` with a final result, so a valid request gets its
200 instead of waiting for a timeout.

- schemathesis generates requests for every operation of the gateway's OpenAPI schema, positive (valid per schema)
  and negative (schema-violating) ones. The app serves no schema of its own (`openapi_url=None`) and reads its
  bodies by hand, so the schema is FastAPI's `app.openapi()` with the request bodies added from the pydantic models
  the gateway validates with (`CompletionRequest`, `ChatCompletionRequest`, narrowed by `servable` to what the
  gateway serves, so that positive cases reach the admission and the reply stream) and the job spec, plus the
  headers the gateway reads (X-Model, X-Route-Policy). With auth on, most cases carry a valid token; some a bad,
  expired or no token.
- A hypothesis strategy of raw requests adds what a schema cannot express: malformed JSON, wrong content types,
  bodies over `gateway.max_body_bytes`, odd header values, unknown paths and methods.

Every request the gateway admitted names its own reply stream in `reply_to`, whatever the body said
(`audit_ingress`).

The long tier (`-m long`, in `make test-hardening`): LONG_REQUESTS generated requests per auth setting (10,000 in
all), schemathesis cases and raw requests, sent CONCURRENCY at a time by an httpx AsyncClient to the app, which runs
in an event loop of its own thread as a server runs it (ASGI lifespan, then requests): no answer >= 500, no
exception out of the app, at least 1% answered 2xx. Each test counts what it sent and fails below its share.

The number of generated cases is printed (`pytest -s`) and written to `.rackflow/hardening/fuzz_counts.json`
(sections `gateway`, and `gateway-long` with statuses per kind of request and the wall time).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import json
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pipeline.config import ALL_NODE_POLICIES, DEFAULT_CONFIG_DIR, RackflowConfig, load_config
from pipeline.events import RequestEvent
from streams import codec, keys
from tests.hardening.test_fuzz_consumers import COUNTS_FILE, write_counts
from tests.integration.harness import Responder

pytestmark = [pytest.mark.integration, pytest.mark.hardening]

SECRET = "hardening-fuzz-secret-0123456789abcdef"
MODEL = "qwen2-7b"
MAX_BODY = 65_536
COUNTS: Counter[str] = Counter()
SCHEMA_EXAMPLES = 120
"""Per generation mode (positive, negative) and auth setting."""
RAW_EXAMPLES = 200
"""Raw requests per auth setting."""


@pytest.fixture(scope="module", autouse=True)
def _report_counts() -> Iterator[None]:
    yield
    if COUNTS:
        print("\n" + write_counts("gateway", COUNTS))


# -- the app, its schema, a stand-in pipeline -------------------------------------------------------------------------
def gateway_config(tmp_path: Path) -> RackflowConfig:
    p = tmp_path / "gw.yaml"
    p.write_text(yaml.safe_dump({
        "cluster": {"racks": [{"name": "r0", "node_count": 1,
                               "node": {"gpu": "h100-80gb", "tp": 1, "models": [MODEL]}}]},
        "gateway": {"max_body_bytes": MAX_BODY, "request_timeout_s": 20.0},
    }))
    return load_config(DEFAULT_CONFIG_DIR, [p])


UNSERVED = ("echo", "logprobs", "top_logprobs", "best_of", "suffix", "n")
"""OpenAI fields the gateway refuses but for their defaults (its validators say so; the JSON schema cannot)."""


def servable(body: dict[str, Any]) -> dict[str, Any]:
    """A body schema narrowed to what the gateway serves: the cluster's model (required: no token names one), no
    field it refuses, no field beyond its own, output limits that fit the context. Positive cases then reach the
    admission and the reply stream (with the bare pydantic schema none did: a random model, logprobs, n, suffix);
    negative ones break these rules too."""
    props = body["properties"]
    for name in UNSERVED:
        props.pop(name, None)
    props["model"] = {"type": "string", "enum": [MODEL]}
    for name in ("max_tokens", "max_completion_tokens"):
        if name in props:
            props[name] = {"type": "integer", "minimum": 1, "maximum": 256}
    body["required"] = sorted({*body.get("required", []), "model"})
    body["additionalProperties"] = False
    return body


def openapi_schema(app: Any) -> dict[str, Any]:
    """FastAPI's schema of the app, with the request bodies and headers the gateway reads by hand."""
    from pipeline.openai_format import ChatCompletionRequest, CompletionRequest

    raw = copy.deepcopy(app.fastapi.openapi())  # GatewayApp: FastAPI behind the hot path
    comps = raw.setdefault("components", {}).setdefault("schemas", {})

    def model_schema(model: Any) -> dict[str, Any]:
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        comps.update(js.pop("$defs", {}))
        return js  # type: ignore[no-any-return]

    spec = {
        "type": "object",
        "properties": {"prompt": {"type": "string", "minLength": 1}, "model": {"type": "string", "minLength": 1},
                       "max_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
                       "user": {"type": "string", "minLength": 1}},
        "required": ["prompt"],
        "additionalProperties": False,
    }
    job_body = {"anyOf": [spec, {"type": "object", "properties": {"requests": {"type": "array", "items": spec,
                                                                                  "minItems": 1, "maxItems": 4}},
                                 "required": ["requests"], "additionalProperties": False}]}
    bodies = {
        ("/v1/completions", "post"): servable(model_schema(CompletionRequest)),
        ("/v1/chat/completions", "post"): servable(model_schema(ChatCompletionRequest)),
        ("/v1/jobs", "post"): job_body,
    }
    headers = [
        {"name": "X-Model", "in": "header", "required": False, "schema": {"type": "string", "enum": [MODEL]}},
        {"name": "X-Route-Policy", "in": "header", "required": False,
         "schema": {"type": "string", "enum": list(ALL_NODE_POLICIES)}},
    ]
    for path, ops in raw["paths"].items():
        for method, op in ops.items():
            op.setdefault("parameters", []).extend(copy.deepcopy(headers))
            if (path, method) in bodies:
                op["requestBody"] = {"required": True,
                                     "content": {"application/json": {"schema": bodies[(path, method)]}}}
    return raw  # type: ignore[no-any-return]


@dataclasses.dataclass
class GatewayUnderTest:
    mode: str
    """"auth" (JWT) or "no-auth"."""
    app: Any
    tokens: dict[str, str]
    redis_url: str
    client: Any = None
    """The fast tier's TestClient."""


def make_gateway(mode: str, services: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> GatewayUnderTest:
    from workers.gateway.auth import mint_token
    from workers.gateway.http import create_app

    monkeypatch.setenv("RACKFLOW_JWT_SECRET", SECRET)
    config = gateway_config(tmp_path)
    app = create_app(config, services.redis_url, services.etcd_url, no_auth=mode != "auth")
    tokens = {
        "valid": mint_token(config.gateway.auth, tenant="t1", sub="u1"),
        "other-model": mint_token(config.gateway.auth, tenant="t1", sub="u1", models=["llama-2-7b"]),
        "expired": mint_token(config.gateway.auth, tenant="t1", sub="u1", now=time.time() - 7200),
        "bad-signature": mint_token(config.gateway.auth, tenant="t1", sub="u1")[:-4] + "AAAA",
    }
    return GatewayUnderTest(mode, app, tokens, services.redis_url)


def audit_ingress(g: GatewayUnderTest) -> int:
    """A client cannot choose where a request's outputs go: every request the gateway admitted names its own reply
    stream (or none), whatever `reply_to` the body carried. Returns how many were looked at."""
    own = g.app.state.api.gateway.replies.key
    assert keys.is_gateway_replies(own), own
    r = redis.Redis.from_url(g.redis_url)
    try:
        seen = 0
        bad = []
        for _id, f in r.xrange(keys.INGRESS):
            ev = codec.decode(f)
            assert isinstance(ev, RequestEvent), ev
            seen += 1
            if ev.reply_to not in ("", own):
                bad.append(ev)
    finally:
        r.close()
    assert not bad, (f"{len(bad)} admitted requests name another reply stream than the gateway's {own}: "
                     f"{bad[:3]!r:.1000}")
    return seen


@pytest.fixture(params=["auth", "no-auth"])
def gateway(request, clean_services, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    g = make_gateway(request.param, clean_services, tmp_path, monkeypatch)
    with Responder(clean_services.redis_url), TestClient(g.app, raise_server_exceptions=False) as client:
        g.client = client
        yield g
        audit_ingress(g)


AUTH_CHOICES = st.sampled_from(["valid", "valid", "valid", "valid", "other-model", "expired", "bad-signature",
                                "garbage", "none"])


def auth_header(choice: str, tokens: dict[str, str]) -> dict[str, str]:
    if choice == "none":
        return {}
    if choice == "garbage":
        return {"Authorization": "Bearer not.a.jwt"}
    return {"Authorization": f"Bearer {tokens[choice]}"}


def check(resp: Any, what: str) -> None:
    assert resp.status_code < 500, f"{resp.status_code} for {what}: {resp.text[:500]}"


# -- schemathesis over the OpenAPI schema ---------------------------------------------------------------------------
def case_request(case: Any, who: str, mode: str, tokens: dict[str, str]) -> tuple[dict[str, Any], str]:
    """The keyword arguments of an httpx request (TestClient's or an AsyncClient's) for a schemathesis case, with
    the auth header `who` picks; and how to name it in a failure."""
    kw = case.as_transport_kwargs(base_url="http://testserver")
    headers = {k: v for k, v in (kw.pop("headers", None) or {}).items() if k.lower() != "authorization"}
    if mode == "auth":
        headers |= auth_header(who, tokens)
    data = kw.pop("data", None)
    if data is not None and "json" not in kw:
        kw["content"] = data if isinstance(data, bytes | str) else json.dumps(data)
    for k in ("files", "allow_redirects", "auth", "timeout", "verify"):
        kw.pop(k, None)
    if not kw.get("cookies"):
        kw.pop("cookies", None)
    kw["headers"] = headers
    return kw, f"{case.method} {case.formatted_path} {headers} {case.body!r:.300}"


def test_openapi_operations_never_answer_5xx(gateway) -> None:  # type: ignore[no-untyped-def]
    import schemathesis
    from schemathesis import GenerationMode

    mode, app, client, tokens = gateway.mode, gateway.app, gateway.client, gateway.tokens
    schema = schemathesis.openapi.from_dict(openapi_schema(app))
    ops = sorted(f"{op.method.upper()} {op.path}" for op in (r.ok() for r in schema.get_all_operations()))
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /v1/results/{request_id}",
            "POST /v1/jobs", "GET /v1/jobs/{job_id}", "DELETE /v1/jobs/{job_id}", "GET /healthz",
            "GET /metrics"} <= set(ops), ops
    statuses: Counter[int] = Counter()
    def fuzzer(gen_mode: GenerationMode) -> Any:
        @settings(max_examples=SCHEMA_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=schema.as_strategy(gen_mode), who=AUTH_CHOICES)
        def fuzz(case: Any, who: str) -> None:
            kw, what = case_request(case, who, mode, tokens)
            resp = client.request(**kw)
            COUNTS[f"schemathesis:{mode}:{gen_mode.value}"] += 1
            statuses[resp.status_code] += 1
            check(resp, what)

        return fuzz

    for gen_mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        fuzzer(gen_mode)()
    print(f"\nschemathesis ({mode}): statuses {dict(sorted(statuses.items()))}")
    assert any(200 <= s < 300 for s in statuses), "no case ever got through: the fuzzing reached nothing"


# -- raw requests: what a schema cannot say ---------------------------------------------------------------------------
PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/results/x", "/v1/jobs", "/v1/jobs/x",
         "/v1/jobs/x/cancel", "/healthz", "/metrics", "/", "/v1", "/v1/completions/", "/v1/results/%00", "/v1/jobs/%ff",
         "/v1/results/" + "a" * 5000]
ROUTES = [("POST", "/v1/completions")] * 3 + [("POST", "/v1/chat/completions")] * 3 + [("POST", "/v1/jobs")] * 2 + [
    ("GET", "/v1/models"), ("GET", "/v1/results/x"), ("GET", "/v1/jobs/x"), ("DELETE", "/v1/jobs/x"),
    ("POST", "/v1/jobs/x/cancel"), ("GET", "/healthz"), ("GET", "/metrics")]
CONTENT_TYPES = ["application/json", "application/json; charset=latin-1", "text/plain", "application/x-www-form-"
                 "urlencoded", "multipart/form-data; boundary=x", "multipart/form-data", "application/msgpack",
                 "*/*", "", "application/json; charset=utf-16", "\x00"]
REPLY_TO_BODIES = ["rf:ingress", "rf:results", "rf:dlq", "rf:gw:{someone-else}:out", "rf:gw:{x}:out", ""]
"""A body naming where its outputs should go: the gateway reads no such field (every admitted request names the
gateway's own reply stream: `audit_ingress`)."""
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4), max_leaves=10)
valid_like = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, "", "nope", 5, None]), "prompt": st.text(max_size=30) | json_values},
    optional={"max_tokens": st.integers(-5, 10**20) | json_values, "stream": st.booleans() | json_values,
              "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x", 1]),
                                                          "content": st.text(max_size=10) | json_values}),
                                   max_size=3) | json_values,
              "temperature": st.floats() | json_values, "stream_options": json_values,
              "requests": st.lists(json_values, max_size=3), "n": st.integers(-1, 5), "user": json_values,
              "reply_to": st.sampled_from(REPLY_TO_BODIES) | json_values},
)
bodies = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    json_values.map(lambda v: json.dumps(v).encode()),
    valid_like.map(lambda v: json.dumps(v).encode()),
    valid_like.map(lambda v: json.dumps(v).encode()[:-1]),  # truncated JSON
    st.sampled_from([b"", b"{", b"[", b"null", b'{"prompt": "\\ud800"}', b'{"prompt": NaN}', b'{"prompt": 1e999}',
                     b"\xef\xbb\xbf{}", b'{"model": "qwen2-7b", "prompt": "x", "max_tokens": 1e400}',
                     b'{"a": ' * 5000 + b"1" + b"}" * 5000, b"[" * 100_000,
                     b'{"prompt": "' + b"x" * (MAX_BODY + 10) + b'"}']),
)
header_values = st.sampled_from(["", " ", "qwen2-7b", "nope", "\t", "x" * 8000, "é", "latency", "round_robin",
                                 "../../etc", "Bearer", "Bearer ", "Basic Zm9vOmJhcg==", "null"])


@st.composite
def raw_requests(draw: st.DrawFn) -> dict[str, Any]:
    if draw(st.integers(0, 4)):  # mostly a route that exists, with its own method
        method, path = draw(st.sampled_from(ROUTES))
    else:
        method = draw(st.sampled_from(["GET", "POST", "DELETE", "PUT", "PATCH", "OPTIONS", "HEAD"]))
        path = draw(st.sampled_from(PATHS))
    headers: dict[str, str] = {}
    ct = draw(st.sampled_from(CONTENT_TYPES) | st.none())
    if ct is not None:
        headers["Content-Type"] = ct
    for name in draw(st.lists(st.sampled_from(["X-Model", "X-Route-Policy", "Accept", "Accept-Encoding",
                                               "Content-Encoding", "X-Request-Id", "Authorization"]),
                              max_size=3, unique=True)):
        headers[name] = draw(header_values)
    return {"method": method, "path": path, "headers": headers, "body": draw(bodies),
            "query": draw(st.sampled_from(["", "?stream=true", "?a=%00", "?" + "a=1&" * 500]))}


def raw_request(req: dict[str, Any], who: str, mode: str, tokens: dict[str, str]) -> tuple[dict[str, Any], str]:
    """The keyword arguments of an httpx request for a drawn raw request, and how to name it in a failure."""
    headers = dict(req["headers"])
    if mode == "auth" and "Authorization" not in headers:
        headers |= auth_header(who, tokens)
    encoded = {k: v.encode("utf-8") for k, v in headers.items()}
    body = req["body"] if req["method"] not in ("GET", "HEAD", "OPTIONS") else b""
    return ({"method": req["method"], "url": req["path"] + req["query"], "headers": encoded, "content": body},
            f"{req['method']} {req['path'][:80]} {headers!r:.300} {body[:300]!r}")


def test_raw_requests_never_answer_5xx(gateway) -> None:  # type: ignore[no-untyped-def]
    mode, client, tokens = gateway.mode, gateway.client, gateway.tokens
    statuses: Counter[int] = Counter()

    @settings(max_examples=RAW_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(req=raw_requests(), who=AUTH_CHOICES)
    def fuzz(req: dict[str, Any], who: str) -> None:
        kw, what = raw_request(req, who, mode, tokens)
        resp = client.request(**kw)
        COUNTS[f"raw:{mode}"] += 1
        statuses[resp.status_code] += 1
        check(resp, what)

    fuzz()
    print(f"\nraw requests ({mode}): statuses {dict(sorted(statuses.items()))}")


def test_oversized_bodies_get_413_not_5xx(gateway) -> None:  # type: ignore[no-untyped-def]
    """Bodies over gateway.max_body_bytes, with and without a truthful Content-Length, and streamed in chunks."""
    mode, client, tokens = gateway.mode, gateway.client, gateway.tokens
    headers = {"Content-Type": "application/json"} | (auth_header("valid", tokens) if mode == "auth" else {})
    big = b'{"model": "qwen2-7b", "prompt": "' + b"x" * (4 * MAX_BODY) + b'"}'
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/jobs"):
        resp = client.post(path, content=big, headers=headers)
        COUNTS[f"oversized:{mode}"] += 1
        assert resp.status_code == 413, (path, resp.status_code, resp.text[:200])

        def chunks() -> Iterator[bytes]:
            for i in range(0, len(big), 8192):
                yield big[i:i + 8192]

        resp = client.post(path, content=chunks(), headers=headers)
        COUNTS[f"oversized:{mode}"] += 1
        assert resp.status_code == 413, (path, resp.status_code, resp.text[:200])


DEEP_BODIES = {"nested objects": b'{"a": ' * 5000 + b"1" + b"}" * 5000, "open arrays": b"[" * 60_000,
               "nested arrays": b"[" * 3000 + b"]" * 3000}
"""Bodies deeper than the JSON parser's recursion limit (within max_body_bytes)."""


@pytest.mark.parametrize("what", sorted(DEEP_BODIES))
def test_deeply_nested_json_gets_400_not_5xx(gateway, what: str) -> None:  # type: ignore[no-untyped-def]
    """Found by the long tier: POST /v1/jobs parsed its body with json.loads and caught ValueError only, so a body
    nested deeper than the recursion limit raised RecursionError out of the endpoint: a 500."""
    mode, client, tokens = gateway.mode, gateway.client, gateway.tokens
    headers = {"Content-Type": "application/json"} | (auth_header("valid", tokens) if mode == "auth" else {})
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/jobs"):
        resp = client.post(path, content=DEEP_BODIES[what], headers=headers)
        COUNTS[f"deep:{mode}"] += 1
        assert resp.status_code == 400, (path, resp.status_code, resp.text[:300])


# -- the long tier: the same properties, at volume --------------------------------------------------------------------
LONG_REQUESTS = 5_000
"""Requests per auth setting (two settings: the long tier's >= 10,000)."""
LONG_MIX = {"schemathesis:positive": 0.3, "schemathesis:negative": 0.15}
"""Shares of the schemathesis cases; raw requests make the rest. Drawing is what the tier spends its CPU on (about
10 ms a positive case, 25 ms a negative one, 6 ms a raw request; sending one costs 2 or 3 ms)."""
CONCURRENCY = 8
"""Requests in flight at once: enough to overlap the Valkey round trips of one event loop, few enough that no answer
waits on the others for long (on a starved machine, 32 at a time held a /healthz ping past its 2 s bound: a 503)."""
BATCH = 250
"""Requests handed to the sending loop at a time (drawing the next batch overlaps sending this one)."""
LONG_RESULTS: dict[str, dict[str, Any]] = {}


class AsgiLoop:
    """The gateway app in an event loop of its own thread, run as a server runs it (the ASGI lifespan, then
    requests), with an httpx AsyncClient over ASGI that sends CONCURRENCY requests at a time. An exception out of
    the app is a crash: it comes back with its traceback (raise_app_exceptions)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="gateway")
        self.client: httpx.AsyncClient | None = None

    def _call(self, coro: Any, timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self) -> None:
        self._in: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self._lifespan = asyncio.ensure_future(self.app(scope, self._in.get, self._out.put))
        await self._in.put({"type": "lifespan.startup"})
        msg = await self._out.get()
        assert msg["type"] == "lifespan.startup.complete", msg
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app, raise_app_exceptions=True),
                                        base_url="http://testserver", timeout=None)
        self._sem = asyncio.Semaphore(CONCURRENCY)

    async def _stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        await self._in.put({"type": "lifespan.shutdown"})
        msg = await self._out.get()
        assert msg["type"] == "lifespan.shutdown.complete", msg
        await self._lifespan

    def __enter__(self) -> AsgiLoop:
        self.thread.start()
        self._call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._call(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            self.loop.close()

    async def _send(self, kw: dict[str, Any]) -> tuple[int | None, str]:
        assert self.client is not None
        async with self._sem:
            try:
                resp = await self.client.request(**kw)
            except Exception:
                return None, traceback.format_exc()
            return resp.status_code, resp.text[:500] if resp.status_code >= 500 else ""

    async def _send_all(self, batch: list[dict[str, Any]]) -> list[tuple[int | None, str]]:
        return await asyncio.gather(*(self._send(kw) for kw in batch))

    def submit(self, batch: list[dict[str, Any]]) -> concurrent.futures.Future[list[tuple[int | None, str]]]:
        return asyncio.run_coroutine_threadsafe(self._send_all(batch), self.loop)


@dataclasses.dataclass
class Tally:
    """What the long tier sent and what came back."""

    sent: Counter[str] = dataclasses.field(default_factory=Counter)
    statuses: Counter[int] = dataclasses.field(default_factory=Counter)
    by_label: dict[str, Counter[int]] = dataclasses.field(default_factory=dict)
    crashes: list[str] = dataclasses.field(default_factory=list)
    server_errors: list[str] = dataclasses.field(default_factory=list)

    @property
    def answered(self) -> int:
        return sum(self.statuses.values())


class Sender:
    """Batches of drawn requests to the AsgiLoop, at most two in flight; the answers go into the tally."""

    def __init__(self, gw: AsgiLoop, tally: Tally) -> None:
        self.gw = gw
        self.tally = tally
        self.batch: list[tuple[str, dict[str, Any], str]] = []
        self.in_flight: list[tuple[list[tuple[str, dict[str, Any], str]],
                                   concurrent.futures.Future[list[tuple[int | None, str]]]]] = []

    def add(self, label: str, kw: dict[str, Any], what: str) -> None:
        self.batch.append((label, kw, what))
        if len(self.batch) >= BATCH:
            self.flush()

    def flush(self) -> None:
        if self.batch:
            self.in_flight.append((self.batch, self.gw.submit([kw for _l, kw, _w in self.batch])))
            self.batch = []
        while len(self.in_flight) > 1:
            self._collect()

    def drain(self) -> None:
        self.flush()
        while self.in_flight:
            self._collect()

    def _collect(self) -> None:
        batch, fut = self.in_flight.pop(0)
        for (label, _kw, what), (status, text) in zip(batch, fut.result(600), strict=True):
            t = self.tally
            t.sent[label] += 1
            if status is None:
                t.crashes.append(f"{what}\n{text}")
                continue
            t.statuses[status] += 1
            t.by_label.setdefault(label, Counter())[status] += 1
            if status >= 500:
                t.server_errors.append(f"{status} for {what}: {text}")


@pytest.fixture(params=["auth", "no-auth"])
def gateway_long(request, clean_services, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """The app run as a server runs it, in a thread of its own, with an async client (the Responder answers)."""
    g = make_gateway(request.param, clean_services, tmp_path, monkeypatch)
    with Responder(clean_services.redis_url) as responder, AsgiLoop(g.app) as loop:
        yield g, loop, responder


def _draw_schema_cases(schema: Any, gen_mode: Any, n: int, g: GatewayUnderTest, sender: Sender) -> None:
    label = f"schemathesis:{gen_mode.value}"
    made = 0
    while made < n:  # hypothesis may stop a run early (an exhausted corner): draw again until n

        @settings(max_examples=n - made, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                  phases=[Phase.generate])  # no shrinking: a failure is reported with its request, as drawn
        @given(case=schema.as_strategy(gen_mode), who=AUTH_CHOICES)
        def draw(case: Any, who: str) -> None:
            nonlocal made
            if made < n:
                made += 1
                sender.add(label, *case_request(case, who, g.mode, g.tokens))

        draw()


def _draw_raw_requests(n: int, g: GatewayUnderTest, sender: Sender) -> None:
    made = 0
    while made < n:

        @settings(max_examples=n - made, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                  phases=[Phase.generate])
        @given(req=raw_requests(), who=AUTH_CHOICES)
        def draw(req: dict[str, Any], who: str) -> None:
            nonlocal made
            if made < n:
                made += 1
                sender.add("raw", *raw_request(req, who, g.mode, g.tokens))

        draw()


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_requests_never_answer_5xx_at_volume(gateway_long) -> None:  # type: ignore[no-untyped-def]
    """LONG_REQUESTS generated requests per auth setting (>= 10,000 with both), schemathesis cases (positive and
    negative) and raw ones, CONCURRENCY at a time against the running app: no answer >= 500, no exception out of
    the app, and every admitted request names the gateway's own reply stream."""
    import schemathesis
    from schemathesis import GenerationMode

    g, loop, responder = gateway_long
    t0 = time.monotonic()
    schema = schemathesis.openapi.from_dict(openapi_schema(g.app))
    tally = Tally()
    sender = Sender(loop, tally)
    n_pos = int(LONG_REQUESTS * LONG_MIX["schemathesis:positive"])
    n_neg = int(LONG_REQUESTS * LONG_MIX["schemathesis:negative"])
    _draw_schema_cases(schema, GenerationMode.POSITIVE, n_pos, g, sender)
    _draw_schema_cases(schema, GenerationMode.NEGATIVE, n_neg, g, sender)
    _draw_raw_requests(LONG_REQUESTS - n_pos - n_neg, g, sender)
    sender.drain()
    admitted = audit_ingress(g)
    wall = time.monotonic() - t0
    total = sum(tally.sent.values())
    ok = sum(n for s, n in tally.statuses.items() if 200 <= s < 300)
    summary = {"requests": total, "answered": tally.answered, "crashes": len(tally.crashes),
               "5xx": len(tally.server_errors), "2xx": ok, "admitted": admitted, "answered_by_responder":
               responder.answered, "wall_s": round(wall, 1), "sent": dict(sorted(tally.sent.items())),
               "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
               "by_label": {k: {str(s): n for s, n in sorted(v.items())} for k, v in sorted(tally.by_label.items())}}
    LONG_RESULTS[g.mode] = summary
    write_long_results()
    print(f"\nfuzzed {total} API requests ({g.mode}; {dict(tally.sent)}) in {wall:.0f} s, {CONCURRENCY} at a time: "
          f"{len(tally.crashes)} crashes, {len(tally.server_errors)} answers >= 500; statuses "
          f"{dict(sorted(tally.statuses.items()))}; {admitted} admitted, all naming the gateway's reply stream")
    assert not tally.crashes, f"{len(tally.crashes)} requests raised out of the app, e.g.:\n" + "\n".join(
        tally.crashes[:3])
    assert not tally.server_errors, f"{len(tally.server_errors)} answers >= 500, e.g.:\n" + "\n".join(
        tally.server_errors[:5])
    assert total >= LONG_REQUESTS and tally.answered == total, (total, tally.answered)
    assert ok >= total // 100, f"only {ok} of {total} requests got a 2xx: the fuzzing hardly reached the pipeline"


def write_long_results(path: Path = COUNTS_FILE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    section = data.get("gateway-long", {})
    section.update(LONG_RESULTS)
    section["all"] = {k: sum(v[k] for m, v in section.items() if m != "all") for k in ("requests", "crashes", "5xx")}
    data["gateway-long"] = section
    path.write_text(json.dumps(data, indent=2) + "\n")
