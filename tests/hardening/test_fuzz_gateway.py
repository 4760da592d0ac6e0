"""Fuzzing the HTTP gateway (issue 9): no input gets a 5xx.

The gateway's app (`workers.gateway.http.create_app`) runs in-process (Starlette's TestClient, lifespan included)
against the real Valkey of the session, once with JWT auth on and once with auth off. A small responder stands in
for the pipeline: it answers every request admitted to `rf:ingress` with a final result, so a valid request gets its
200 instead of waiting for a timeout.

- schemathesis generates requests for every operation of the gateway's OpenAPI schema, positive (valid per schema)
  and negative (schema-violating) ones. The app serves no schema of its own (`openapi_url=None`) and reads its
  bodies by hand, so the schema is FastAPI's `app.openapi()` with the request bodies added from the pydantic models
  the gateway validates with (`CompletionRequest`, `ChatCompletionRequest`) and the job spec, plus the headers the
  gateway reads (X-Model, X-Route-Policy). With auth on, most cases carry a valid token; some a bad, expired or no
  token.
- A hypothesis strategy of raw requests adds what a schema cannot express: malformed JSON, wrong content types,
  bodies over `gateway.max_body_bytes`, odd header values, unknown paths and methods.

The number of generated cases is printed (`pytest -s`) and written to `.rackflow/hardening/fuzz_counts.json`.
"""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import DEFAULT_CONFIG_DIR, RackflowConfig, load_config
from tests.hardening.test_fuzz_consumers import write_counts
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


def openapi_schema(app: Any) -> dict[str, Any]:
    """FastAPI's schema of the app, with the request bodies and headers the gateway reads by hand."""
    from workers.gateway.openai_api import ChatCompletionRequest, CompletionRequest

    raw = copy.deepcopy(app.openapi())
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
        ("/v1/completions", "post"): model_schema(CompletionRequest),
        ("/v1/chat/completions", "post"): model_schema(ChatCompletionRequest),
        ("/v1/jobs", "post"): job_body,
    }
    headers = [
        {"name": "X-Model", "in": "header", "required": False, "schema": {"type": "string"}},
        {"name": "X-Route-Policy", "in": "header", "required": False, "schema": {"type": "string"}},
    ]
    for path, ops in raw["paths"].items():
        for method, op in ops.items():
            op.setdefault("parameters", []).extend(copy.deepcopy(headers))
            if (path, method) in bodies:
                op["requestBody"] = {"required": True,
                                     "content": {"application/json": {"schema": bodies[(path, method)]}}}
    return raw  # type: ignore[no-any-return]


@pytest.fixture(params=["auth", "no-auth"])
def gateway(request, clean_services, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    from workers.gateway.auth import mint_token
    from workers.gateway.http import create_app

    auth = request.param == "auth"
    monkeypatch.setenv("RACKFLOW_JWT_SECRET", SECRET)
    config = gateway_config(tmp_path)
    app = create_app(config, clean_services.redis_url, clean_services.etcd_url, no_auth=not auth)
    tokens = {
        "valid": mint_token(config.gateway.auth, tenant="t1", sub="u1"),
        "other-model": mint_token(config.gateway.auth, tenant="t1", sub="u1", models=["llama-2-7b"]),
        "expired": mint_token(config.gateway.auth, tenant="t1", sub="u1", now=time.time() - 7200),
        "bad-signature": mint_token(config.gateway.auth, tenant="t1", sub="u1")[:-4] + "AAAA",
    }
    with Responder(clean_services.redis_url), TestClient(app, raise_server_exceptions=False) as client:
        yield request.param, app, client, tokens


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
def test_openapi_operations_never_answer_5xx(gateway) -> None:  # type: ignore[no-untyped-def]
    import schemathesis
    from schemathesis import GenerationMode

    mode, app, client, tokens = gateway
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
            resp = client.request(kw.pop("method"), kw.pop("url"), headers=headers, **kw)
            COUNTS[f"schemathesis:{mode}:{gen_mode.value}"] += 1
            statuses[resp.status_code] += 1
            check(resp, f"{case.method} {case.formatted_path} {headers} {case.body!r:.300}")

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
              "requests": st.lists(json_values, max_size=3), "n": st.integers(-1, 5), "user": json_values},
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


def test_raw_requests_never_answer_5xx(gateway) -> None:  # type: ignore[no-untyped-def]
    mode, _app, client, tokens = gateway
    statuses: Counter[int] = Counter()

    @settings(max_examples=RAW_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(req=raw_requests(), who=AUTH_CHOICES)
    def fuzz(req: dict[str, Any], who: str) -> None:
        headers = dict(req["headers"])
        if mode == "auth" and "Authorization" not in headers:
            headers |= auth_header(who, tokens)
        encoded = {k: v.encode("utf-8") for k, v in headers.items()}
        body = req["body"] if req["method"] not in ("GET", "HEAD", "OPTIONS") else b""
        resp = client.request(req["method"], req["path"] + req["query"], headers=encoded, content=body)
        COUNTS[f"raw:{mode}"] += 1
        statuses[resp.status_code] += 1
        check(resp, f"{req['method']} {req['path'][:80]} {headers!r:.300} {body[:300]!r}")

    fuzz()
    print(f"\nraw requests ({mode}): statuses {dict(sorted(statuses.items()))}")


def test_oversized_bodies_get_413_not_5xx(gateway) -> None:  # type: ignore[no-untyped-def]
    """Bodies over gateway.max_body_bytes, with and without a truthful Content-Length, and streamed in chunks."""
    mode, _app, client, tokens = gateway
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
