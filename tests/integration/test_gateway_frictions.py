"""Four frictions a client of the HTTP gateway met, each pinned down:

- an unknown (or unserved) model's 404 offers exactly the models `GET /v1/models` lists to the same caller;
- `finish_reason` is `stop` when the engine ended the sequence itself (an end-of-sequence token, even as the last
  token max_tokens allows) and `length` only when it ran into max_tokens or the context;
- a context-length 400 names the prompt (`prompt`, `messages`, a job's `body.prompt`) and says what to change,
  unless max_tokens alone leaves no room;
- a body sent with a Content-Type that is not JSON gets a 415 in the OpenAI error shape, naming
  `Content-Type: application/json`; a request without a Content-Type is read as JSON.

The gateway's app runs in-process (Starlette's TestClient, lifespan included) on the session's real Valkey and etcd.
A stand-in pipeline answers what is admitted: a responder that writes chosen final results, or, for the engine's
own EOS, a stand-in router that hands each admitted request to a real worker running the torch engine.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from fastapi.testclient import TestClient

from pipeline.config import DEFAULT_CONFIG_DIR, RackflowConfig, load_config
from pipeline.events import BatchEvent, RequestEvent, ResultEvent
from streams import codec, keys
from tests.integration.harness import Responder
from workers.local.services import ServiceEndpoints
from workers.shell.runtime import WALL

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SECRET = "frictions-test-secret-0123456789abcdef"
MODEL = "qwen2-7b"
OTHER = "llama-2-7b"
"""Served too (by rack r1); qwen2-72b and the rest are configured but served by no rack."""
NODE = "r0-n0"


def frictions_config(tmp_path: Path) -> RackflowConfig:
    p = tmp_path / "frictions.yaml"
    p.write_text(yaml.safe_dump({
        "cluster": {"racks": [
            {"name": "r0", "node_count": 1, "node": {"gpu": "h100-80gb", "tp": 1, "models": [MODEL]}},
            {"name": "r1", "node_count": 1, "node": {"gpu": "a100-80gb", "tp": 1, "models": [OTHER]}},
        ]},
        # the tests' stand-in router (TorchWorker) reads rf:ingress: the gateway queues every request there
        "gateway": {"request_timeout_s": 60.0, "auth": {"mode": "hs256", "secret_env": "RACKFLOW_JWT_SECRET"},
                    "routing": "router"},
        "policies": {"kv": {"l1_dir": str(tmp_path / "l1")}},
    }))
    return load_config(DEFAULT_CONFIG_DIR, [p])


def result_for(req: RequestEvent, out_tokens: int, finish_reason: str) -> ResultEvent:
    now = WALL.now_ms()
    return ResultEvent.of(req, "ok", NODE, "r0", now, out_tokens=out_tokens, text="x" * out_tokens,
                          first_token_ms=now, finish_reason=finish_reason)


# What the stand-in engine does, by prompt: (tokens generated given max_tokens, the finish reason it reports).
ENDINGS: dict[str, tuple[Callable[[int], int], str]] = {
    "eos-as-last-token": (lambda m: m, "stop"),  # the end-of-sequence token was the last one max_tokens allowed
    "eos-early": (lambda m: m - 2, "stop"),
    "context-full": (lambda m: m - 2, "length"),  # the engine's context ended it before max_tokens
    "max-tokens": (lambda m: m, "length"),
    "legacy-full": (lambda m: m, ""),  # a result from a worker that does not report why (older than the field)
    "legacy-short": (lambda m: m - 2, ""),
}


def answer(req: RequestEvent) -> ResultEvent:
    ending = next((k for k in ENDINGS if k in req.prompt), "max-tokens")  # a chat prompt is the messages' ChatML
    tokens, reason = ENDINGS[ending]
    return result_for(req, tokens(req.max_tokens), reason)


def token(config: RackflowConfig, **kw: Any) -> dict[str, str]:
    from workers.gateway.auth import mint_token

    return {"Authorization": f"Bearer {mint_token(config.gateway.auth, tenant='t1', sub='u1', **kw)}"}


Gateway = tuple[TestClient, RackflowConfig, ServiceEndpoints]


@pytest.fixture
def gateway(clean_services: ServiceEndpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Gateway]:
    from workers.gateway.http import create_app

    monkeypatch.setenv("RACKFLOW_JWT_SECRET", SECRET)
    config = frictions_config(tmp_path)
    app = create_app(config, clean_services.redis_url, clean_services.etcd_url, no_auth=False)
    with Responder(clean_services.redis_url, answer), TestClient(app, raise_server_exceptions=False) as client:
        yield client, config, clean_services


def error_of(resp: httpx.Response, status: int, param: str | None, *words: str) -> dict[str, Any]:
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], (w, err)
    return dict(err)


def ingress_len(services: ServiceEndpoints) -> int:
    return int(redis.Redis.from_url(services.redis_url).xlen(keys.INGRESS))


def chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


# -- 1. the 404 of an unknown model lists what /v1/models lists ---------------------------------------------------
def offered(err: dict[str, Any]) -> list[str]:
    listed = err["message"].rsplit("available: ", 1)[1]
    return [] if listed == "none" else listed.split(", ")


@pytest.mark.parametrize("models", [None, [MODEL, "gpt-5", "qwen2-72b"], ["gpt-5"]])
def test_unknown_model_404_offers_exactly_what_v1_models_lists(gateway: Gateway, models: list[str] | None) -> None:
    client, config, services = gateway
    headers = token(config, models=models)
    listed = client.get("/v1/models", headers=headers)
    assert listed.status_code == 200, listed.text
    ids = [m["id"] for m in listed.json()["data"]]
    assert ids == ([MODEL, OTHER] if models is None else [MODEL] if MODEL in models else [])
    before = ingress_len(services)
    for name, why in (("gpt-5", "does not exist"), ("qwen2-72b", "not served")):
        if models is not None and name not in models:
            continue  # the token does not allow it: a 403 first
        for path, body, param in (("/v1/completions", {"model": name, "prompt": "x", "max_tokens": 2}, "model"),
                                  ("/v1/chat/completions", {**chat("x", max_tokens=2), "model": name}, "model"),
                                  ("/v1/jobs", {"model": name, "prompt": "x", "max_tokens": 2}, "body.model")):
            err = error_of(client.post(path, headers=headers, json=body), 404, param, repr(name), why)
            assert err["code"] == "model_not_found"
            assert offered(err) == ids, (path, err["message"], ids)
    assert ingress_len(services) == before


# -- 2. finish_reason says why the sequence ended -------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("prompt", "expected"), [
    ("eos-as-last-token", "stop"), ("eos-early", "stop"), ("context-full", "length"), ("max-tokens", "length"),
    ("legacy-full", "length"), ("legacy-short", "stop"),
])
def test_finish_reason_is_what_the_engine_reported(gateway: Gateway, prompt: str, expected: str, stream: bool) -> None:
    client, config, _services = gateway
    headers = token(config)
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 6}),
                       ("/v1/chat/completions", chat(prompt, max_tokens=6))):
        resp = client.post(path, headers=headers, json={**body, "stream": stream})
        assert resp.status_code == 200, resp.text
        if not stream:
            assert resp.json()["choices"][0]["finish_reason"] == expected, (path, resp.json())
            continue
        chunks = [json.loads(line.removeprefix("data: ")) for line in resp.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert finish == [expected], (path, chunks)


def test_old_result_without_finish_reason_still_decodes() -> None:
    """A ResultEvent encoded before the field existed decodes, with an empty finish_reason."""
    import msgpack

    from pipeline.events import to_wire

    old = to_wire(result_for(RequestEvent(str(uuid.uuid4()), 1, "t1", "u1", MODEL, 3, 4, 4, 1.0, 0.0), 4, "stop"))
    del old["finish_reason"]
    ev = codec.decode({b"v": b"1", b"t": b"result", b"d": msgpack.packb(old, use_bin_type=True)})
    assert isinstance(ev, ResultEvent) and ev.finish_reason == "" and ev.out_tokens == 4


class TorchWorker:
    """A real worker (torch engine) on node r0-n0 in a thread of its own, behind a stand-in router and batcher that
    hands every admitted request to it as a one-request batch. `craft(engine)` runs on its engine before it starts."""

    def __init__(self, config: RackflowConfig, services: ServiceEndpoints, craft: Callable[[Any], None]) -> None:
        self.config = config
        self.services = services
        self.craft = craft
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="torch-worker")

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # reported by __exit__
            self.error = e
            self.ready.set()

    async def _main(self) -> None:
        from streams.runner import connect
        from workers.roles.worker import Worker

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        worker = Worker(self.config, NODE, "torch", self.services.redis_url, self.services.etcd_url, grace_s=2.0)
        self.craft(worker.engine)
        task = asyncio.create_task(worker.run(self._stop))
        r = connect(self.services.redis_url)
        try:
            while worker._engine_task is None:
                assert not task.done(), task
                await asyncio.sleep(0.05)
            self.ready.set()
            last = "0-0"
            while not self._stop.is_set():
                for _stream, entries in await r.xread({keys.INGRESS: last}, count=16, block=100) or []:
                    for eid, fields in entries:
                        last = eid.decode()
                        req = codec.decode(fields)
                        assert isinstance(req, RequestEvent)
                        now = WALL.now_ms()
                        req = replace(req, rack="r0", routed_ms=now)
                        batch = BatchEvent(str(uuid.uuid4()), "r0", NODE, (req,), req.mem_est_kb, 1e9, now, now)
                        await r.xadd(keys.node_batches(NODE), codec.encode(batch))  # type: ignore[arg-type]
        finally:
            await r.aclose()
            self._stop.set()
            await asyncio.wait_for(task, 30)

    def __enter__(self) -> TorchWorker:
        self.thread.start()
        assert self.ready.wait(120), "the worker did not start"
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(60)
        if self.error is not None:
            raise self.error


PROMPT = "Once upon a time, in a rack far away, a node served tokens."


def test_eos_from_the_engine_is_finish_reason_stop(clean_services: ServiceEndpoints, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end through a real worker: the torch engine's model, crafted to emit its end-of-sequence token after a
    few tokens (as in tests/unit/test_torch_engine.py), ends the sequence itself; with max_tokens exactly the
    tokens it generates (EOS the last token allowed) the answer is `stop`, one fewer it is `length`."""
    import torch

    from workers.engines.tokenizer import EOS
    from workers.engines.torch_engine import TorchEngine
    from workers.gateway.http import create_app

    monkeypatch.setenv("RACKFLOW_JWT_SECRET", SECRET)
    config = frictions_config(tmp_path)
    tc = config.policies.worker.torch

    def run_alone(engine: TorchEngine, max_tokens: int) -> list[int]:
        req = RequestEvent(str(uuid.uuid4()), 1, "t1", "u1", MODEL, 16, max_tokens, max_tokens, 1.0, 0.0,
                           prompt=PROMPT)
        engine.submit(req)
        ids: list[int] = []
        while engine.has_work():
            ids += [t.token_id for t in asyncio.run(engine.step()).tokens if t.request_id == req.request_id]
        return ids

    ref = run_alone(TorchEngine(tc, config.models.get(tc.model), now_ms=WALL.now_ms), 20)
    K = 4
    assert EOS not in ref

    def craft(engine: TorchEngine) -> None:
        with torch.no_grad():
            engine.model.lm_head.weight[EOS] = 1.5 * engine.model.lm_head.weight[ref[K]]

    crafted = TorchEngine(tc, config.models.get(tc.model), now_ms=WALL.now_ms)
    craft(crafted)
    ids = run_alone(crafted, 20)
    n = len(ids)
    assert ids[-1] == EOS and 2 <= n <= K + 1, (ids, ref)

    app = create_app(config, clean_services.redis_url, clean_services.etcd_url, no_auth=False)
    headers = token(config)
    with TorchWorker(config, clean_services, craft), TestClient(app, raise_server_exceptions=False) as client:
        for max_tokens, expected in ((n, "stop"), (20, "stop"), (n - 1, "length")):
            resp = client.post("/v1/completions", headers=headers,
                               json={"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens})
            assert resp.status_code == 200, resp.text
            body = resp.json()
            assert body["usage"]["completion_tokens"] == min(n, max_tokens), body
            assert body["choices"][0]["finish_reason"] == expected, (max_tokens, n, body)
        rid = body["id"]
        stored = client.get(f"/v1/results/{rid}", headers=headers)
        assert stored.status_code == 200, stored.text
    out = redis.Redis.from_url(clean_services.redis_url).xrange(keys.request_out(rid.removeprefix("cmpl-")))
    final = [ev for ev in (codec.decode(f) for _e, f in out) if isinstance(ev, ResultEvent)]
    assert final and final[0].finish_reason == "length"


# -- 3. a context-length 400 names the prompt ----------------------------------------------------------------------
LONG = "hello world " * 8000
"""About 24,000 tokens by the gateway's estimate (no tokenizer file): under the 32,768 context alone."""


def test_context_length_error_names_the_prompt(gateway: Gateway) -> None:
    client, config, services = gateway
    headers = token(config)
    before = ingress_len(services)
    err = error_of(client.post("/v1/completions", headers=headers,
                               json={"model": MODEL, "prompt": LONG, "max_tokens": 10_000}),
                   400, "prompt", "prompt (", "32768", "shorten the prompt", "max_tokens to at most 8768")
    assert err["code"] == "context_length_exceeded"
    err = error_of(client.post("/v1/chat/completions", headers=headers, json=chat(LONG, max_tokens=10_000)),
                   400, "messages", "messages (", "shorten the messages", "max_tokens to at most")
    assert err["code"] == "context_length_exceeded" and "prompt" not in err["message"]
    error_of(client.post("/v1/chat/completions", headers=headers, json=chat(LONG, max_completion_tokens=10_000)),
             400, "messages", "shorten the messages")
    error_of(client.post("/v1/jobs", headers=headers, json={"model": MODEL, "prompt": LONG, "max_tokens": 10_000}),
             400, "body.prompt", "shorten the prompt")
    # max_tokens alone leaves no room for any prompt: that one is named
    error_of(client.post("/v1/completions", headers=headers,
                         json={"model": MODEL, "prompt": "x", "max_tokens": 40_000}),
             400, "max_tokens", "32768", "lower max_tokens")
    error_of(client.post("/v1/chat/completions", headers=headers, json=chat("x", max_completion_tokens=40_000)),
             400, "max_completion_tokens", "32768")
    assert ingress_len(services) == before
    # a prompt that fits with a smaller max_tokens goes through
    ok = client.post("/v1/completions", headers=headers, json={"model": MODEL, "prompt": LONG, "max_tokens": 8768})
    assert ok.status_code == 200, ok.text


# -- 4. a body that is not JSON by its Content-Type is refused with 415 --------------------------------------------
BODY = b'{"model": "qwen2-7b", "prompt": "x", "max_tokens": 2}'
CHAT_BODY = b'{"model": "qwen2-7b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}'
JOB_BODY = b'{"model": "qwen2-7b", "prompt": "x", "max_tokens": 2}'


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          "text/plain; charset=utf-8", "application/xml", "text/json"])
def test_non_json_content_type_is_415(gateway: Gateway, content_type: str) -> None:
    client, config, services = gateway
    before = ingress_len(services)
    for path, body in (("/v1/completions", BODY), ("/v1/chat/completions", CHAT_BODY), ("/v1/jobs", JOB_BODY)):
        resp = client.post(path, headers=token(config) | {"Content-Type": content_type}, content=body)
        err = error_of(resp, 415, "Content-Type", content_type, "Content-Type: application/json")
        assert err["code"] == "unsupported_media_type" and err["type"] == "invalid_request_error"
        # without a valid token: the 401 comes first, as for every other check of the request
        error_of(client.post(path, headers={"Content-Type": content_type}, content=body), 401, None)
    assert ingress_len(services) == before


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON",
                                          "application/vnd.rackflow+json", None])
def test_json_and_missing_content_types_are_accepted(gateway: Gateway, content_type: str | None) -> None:
    """A missing Content-Type is read as JSON (clients that send raw bytes often send none)."""
    client, config, _services = gateway
    headers = token(config) | ({"Content-Type": content_type} if content_type is not None else {})
    for path, body in (("/v1/completions", BODY), ("/v1/chat/completions", CHAT_BODY)):
        request = client.build_request("POST", path, headers=headers, content=body)
        assert request.headers.get("content-type") == content_type
        resp = client.send(request)
        assert resp.status_code == 200, (path, resp.text)
    resp = client.post("/v1/jobs", headers=headers, content=JOB_BODY)
    assert resp.status_code != 415, resp.text  # the job queue may be down here (no Celery worker): not the point


def test_official_openai_client_sends_json(gateway: Gateway) -> None:
    """What OpenAI's SDK sends passes the check (it always sets application/json)."""
    import openai

    client, config, _services = gateway
    oa = openai.OpenAI(base_url="http://testserver/v1", api_key=token(config)["Authorization"].split()[1],
                       http_client=client, max_retries=0)
    done = oa.completions.create(model=MODEL, prompt="eos-early", max_tokens=6)
    assert done.choices[0].finish_reason == "stop"
    assert oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "max-tokens"}],
                                      max_tokens=3).choices[0].finish_reason == "length"
