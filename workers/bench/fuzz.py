"""`rackflow bench fuzz`: the real cluster, end to end, under malformed and hostile HTTP.

It starts what `rackflow up` starts (embedded Valkey and etcd, router, batchers, `sim` workers, gateway with JWT auth,
health agents, monitor, Celery worker) and sends it `requests` requests from a seeded generator, `concurrency` at a
time, at least `streamed` of them streaming (some read to the end, some dropped by the client after the first
chunk). The requests are valid ones and their mutations: bodies that are not JSON, not an object, deeply nested,
huge or truncated; every field with the wrong type, out of range, empty or absurd; unknown fields; tokens missing,
malformed, expired or signed with another key; wrong methods, paths, content types and header values; requests
for unknown models and results of other tenants.

What it counts (the targets of the everyday-use issue):
- `status_5xx`: answers of 500 or more (503 with Retry-After for overload counts too: a fuzz run must not overload
  it), and `transport_errors` (a connection reset or a stream cut by the server);
- `roles_crashed`: role processes that exited during the run;
- `leaked_keys`: once every admitted request has its final result, the Valkey keys a finished request left without
  an expiry (its output stream, result and cancel markers, job records, release markers, users' EWMAs: each must
  carry a TTL) and the sequence ownership records left in etcd. Streams that are trimmed by retention (ingress,
  decisions, results, health, per-rack and per-node streams) are the cluster's, not a request's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

MODEL = "qwen2-7b"
SECRET = "rackflow-fuzz-secret-" + "0" * 24


def _token(secret: str, **claims: Any) -> str:
    import jwt

    base = {"tenant": "fuzz", "sub": "u1", "exp": int(time.time()) + 3600}
    return jwt.encode({**base, **claims}, secret, algorithm="HS256")


def _valid_chat(rng: random.Random, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * rng.randint(1, 40)}],
                            "max_tokens": rng.randint(1, 24), "stream": stream}
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(["the ", "node", "\n", "x"])]
    if rng.random() < 0.2:
        body["n"] = rng.randint(1, 3)
    if rng.random() < 0.2:
        body["temperature"] = rng.choice([0, 0.7, 1.0])
        body["seed"] = rng.randint(0, 10)
    if stream and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    return body


JUNK: list[Any] = [None, True, -1, 0, 2**63, -(2**70), 1e308, -1e-308, "", "x" * 10_000, "\u0000\ud7ff\uffff", [], {},
                   [[[]]], {"a": {"b": {"c": []}}}, "NaN", 3.5, "-5", ["a"] * 50]


def _mutate(rng: random.Random, body: dict[str, Any]) -> dict[str, Any]:
    b = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        fields = ["model", "messages", "max_tokens", "stream", "stop", "n", "temperature", "top_p", "seed", "user",
                  "logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "logit_bias",
                  "presence_penalty", "frequency_penalty", "max_completion_tokens", "stream_options", "prompt",
                  "echo", "best_of", "suffix", "functions"]
        f = rng.choice(fields)
        if op < 0.6:
            b[f] = rng.choice(JUNK)
        elif op < 0.75:
            b.pop(rng.choice(list(b) or ["model"]), None)
        elif op < 0.85 and isinstance(b.get("messages"), list) and b["messages"]:
            b["messages"][0] = rng.choice([{"role": rng.choice(JUNK), "content": "x"}, {"content": rng.choice(JUNK)},
                                           {"role": "user", "content": [{"type": "image_url"}]}, "hi", 5])
        else:
            b[f"unknown_{rng.randint(0, 9)}"] = rng.choice(JUNK)
    return b


def _case(rng: random.Random, i: int, url: str, tokens: dict[str, str], streaming: bool) -> dict[str, Any]:
    """One request: method, path, headers, raw body, whether it streams and when the client drops it."""
    good = {"Authorization": f"Bearer {tokens['good']}", "Content-Type": "application/json"}
    if streaming:
        body = _valid_chat(rng, True) if rng.random() < 0.7 else _mutate(rng, _valid_chat(rng, True))
        body["stream"] = True
        return {"kind": "stream", "method": "POST", "path": "/v1/chat/completions", "headers": good,
                "content": json.dumps(body).encode(), "stream": True,
                "drop_after": 1 if rng.random() < 0.3 else None}
    r = rng.random()
    if r < 0.15:  # valid, non-streaming, chat or completion
        if rng.random() < 0.5:
            body = _valid_chat(rng, False)
            path = "/v1/chat/completions"
        else:
            body = {"model": MODEL, "prompt": "Once " * rng.randint(1, 20), "max_tokens": rng.randint(1, 16)}
            path = "/v1/completions"
        return {"kind": "valid", "method": "POST", "path": path, "headers": good, "content": json.dumps(body).encode()}
    if r < 0.55:  # a valid body mutated
        body = _mutate(rng, _valid_chat(rng, False))
        path = rng.choice(["/v1/chat/completions", "/v1/completions"])
        return {"kind": "mutated", "method": "POST", "path": path, "headers": good,
                "content": json.dumps(body).encode()}
    if r < 0.7:  # raw bytes that are not a valid JSON object
        raw = rng.choice([b"", b"{", b"[1,2]", b"null", b'{"model": "' + b"\xff\xfe" + b'"}', b"\x00" * 100,
                          b'{"a":' * 5000 + b"1" + b"}" * 5000, json.dumps({"model": MODEL}).encode()[:-3],
                          os.urandom(rng.randint(1, 400)), b"x" * 70_000])
        return {"kind": "raw", "method": "POST", "path": rng.choice(["/v1/chat/completions", "/v1/completions",
                                                                      "/v1/jobs"]), "headers": good, "content": raw}
    if r < 0.85:  # auth and headers
        h = dict(good)
        choice = rng.randrange(7)
        if choice == 0:
            h.pop("Authorization")
        elif choice == 1:
            h["Authorization"] = "Bearer " + rng.choice(["-", "x", "a.b.c", tokens["expired"], tokens["other_key"]])
        elif choice == 2:
            # (values a client library refuses to send, like a lone tab or trailing blanks, are left out: they would
            # count as the client's transport errors, not the server's)
            h["Authorization"] = rng.choice(["Basic dXNlcjpwYXNz", "Bearer", "bearer " + tokens["good"], "Token x"])
        elif choice == 3:
            h["Content-Type"] = rng.choice(["text/plain", "application/xml", "multipart/form-data", "json"])
        elif choice == 4:
            h["X-Route-Policy"] = rng.choice(["nope", "work_aware", "x" * 5000, "../../etc"])
        elif choice == 5:
            h["X-Model"] = rng.choice(["", "no-such-model", "x" * 3000])
        else:
            h["Authorization"] = f"Bearer {tokens['wrong_model']}"
        return {"kind": "auth", "method": "POST", "path": "/v1/chat/completions", "headers": h,
                "content": json.dumps(_valid_chat(rng, False)).encode()}
    # methods, paths and reads of things that are not yours
    method, path = rng.choice([("GET", "/v1/chat/completions"), ("DELETE", "/v1/models"), ("PUT", "/v1/completions"),
                               ("GET", "/v1/models/" + rng.choice(["no-such-model", MODEL, "%00", "a/b/c"])),
                               ("GET", f"/v1/results/{uuid.uuid4()}"), ("GET", "/v1/results/../../etc/passwd"),
                               ("GET", f"/v1/jobs/{uuid.uuid4()}"), ("DELETE", f"/v1/jobs/{uuid.uuid4()}"),
                               ("GET", "/nope"), ("POST", "/v1/jobs"), ("GET", "/healthz"), ("GET", "/v1/models")])
    content = json.dumps(_mutate(rng, {"prompt": "x", "model": MODEL})).encode() if method == "POST" else None
    return {"kind": "path", "method": method, "path": path, "headers": good, "content": content}


async def _send(client: Any, url: str, case: dict[str, Any]) -> tuple[int, str]:
    """(status, "" or the transport error)."""
    import httpx

    try:
        if case.get("stream"):
            async with client.stream(case["method"], url + case["path"], headers=case["headers"],
                                     content=case["content"]) as resp:
                lines = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        lines += 1
                        if line.startswith("data: {") and '"error"' in line and resp.status_code == 200:
                            err = json.loads(line[6:]).get("error", {})
                            if str(err.get("code", "")) in ("internal_error",):
                                return 500, ""
                    if case.get("drop_after") and lines >= case["drop_after"]:
                        break  # the client goes away mid-stream
                return resp.status_code, ""
        resp = await client.request(case["method"], url + case["path"], headers=case["headers"],
                                    content=case["content"])
        return resp.status_code, ""
    except httpx.TransportError as e:
        return 0, f"{type(e).__name__}: {e}"


def _leaks(redis_url: str, etcd_url: str) -> dict[str, Any]:
    import asyncio as _a

    import redis

    from streams import keys
    from workers.stores.etcd import etcd_client

    r = redis.Redis.from_url(redis_url)
    per_request = ("rf:out:", "{rf:results}:done:", "{rf:results}:cancel:", "rf:job:", "rf:seq:", "rf:user:",
                   "rf:gw:")
    no_ttl: list[str] = []
    scanned = 0
    try:
        for key in r.scan_iter(count=1000):
            scanned += 1
            name = key.decode(errors="replace")
            if name.startswith(per_request) and r.ttl(key) == -1:
                no_ttl.append(name)
    finally:
        r.close()

    async def seqs() -> list[str]:
        c = etcd_client(etcd_url)
        try:
            return [kv.key.decode() for kv in await c.get_prefix(keys.ETCD_SEQ.encode())]
        finally:
            close = getattr(c, "close", None)
            if close is not None:
                await close()

    left = _a.run(seqs())
    return {"leaked_keys": len(no_ttl) + len(left), "keys_without_ttl": no_ttl[:20], "etcd_sequences_left": left[:20],
            "keys_scanned": scanned}


def bench_fuzz(requests: int = 10_000, streamed: int = 1_000, concurrency: int = 32, seed: int = 0,
               progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    from workers.local.cluster import LocalCluster
    from workers.local.launcher import gateway_url, wait_cluster_ready

    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="rackflow-fuzz-"))
    # the gateway requires tokens, as `rackflow up` does with a secret set: set for the processes it starts, and put
    # back as it was once they run (a caller's environment is not changed for good)
    before = os.environ.get("RACKFLOW_JWT_SECRET")
    os.environ["RACKFLOW_JWT_SECRET"] = SECRET

    def restore_env() -> None:
        if before is None:
            os.environ.pop("RACKFLOW_JWT_SECRET", None)
        else:
            os.environ["RACKFLOW_JWT_SECRET"] = before
    args = argparse.Namespace(config_dir=str(Path(__file__).resolve().parents[2] / "configs"), config=[],
                              redis_url=None, etcd_url=None, log_level="WARNING", gateway_port=0, no_auth=False,
                              engine="sim", metrics=False, routers=1, batchers_per_rack=None, gateways=1,
                              agent_source="sim", flower_port=None)
    try:
        cluster = LocalCluster(args, work, with_gateway=True, with_failover=True)
    except BaseException:
        restore_env()
        raise
    tokens = {"good": _token(SECRET), "expired": _token(SECRET, exp=int(time.time()) - 60),
              "other_key": _token("another-secret-" + "1" * 24), "wrong_model": _token(SECRET, models=["other"])}
    statuses: Counter[int] = Counter()
    by_kind: dict[str, Counter[int]] = {}
    transport: list[str] = []
    t0 = time.perf_counter()
    try:
        try:
            cluster.start()
        finally:
            restore_env()
        asyncio.run(wait_cluster_ready(cluster.config, cluster.redis_url, cluster.etcd_url, 120))
        url = gateway_url(cluster.procs)
        stream_every = max(1, requests // max(1, streamed))
        cases = [_case(rng, i, url, tokens, streaming=(i % stream_every == 0)) for i in range(requests)]

        async def run_all() -> None:
            import httpx

            sem = asyncio.Semaphore(concurrency)
            bar = tqdm(total=len(cases), desc="fuzz", unit="req", disable=not progress, mininterval=0.5)
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:
                async def one(c: dict[str, Any]) -> None:
                    async with sem:
                        status, err = await _send(client, url, c)
                    statuses[status] += 1
                    by_kind.setdefault(c["kind"], Counter())[status] += 1
                    if err:
                        transport.append(err)
                    bar.update(1)

                await asyncio.gather(*(one(c) for c in cases))
            bar.close()

        asyncio.run(run_all())
        send_s = time.perf_counter() - t0
        # every admitted request ends (the dropped streams' too): wait for the pipeline to drain, then look
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            leak = _leaks(cluster.redis_url, cluster.etcd_url)
            if not leak["etcd_sequences_left"]:
                break
            time.sleep(2.0)
        time.sleep(2.0)
        leak = _leaks(cluster.redis_url, cluster.etcd_url)
        dead = [f"{p.name} (exit {p.proc.returncode}, log {p.log_path})" for p in cluster.procs.dead()]
    finally:
        cluster.stop()
    n5 = sum(v for k, v in statuses.items() if k >= 500)
    return {
        "target": "rackflow up",
        "requests": sum(statuses.values()),
        "streamed": sum(1 for c in cases if c.get("stream")),
        "status_5xx": n5,
        "transport_errors": len(transport),
        "transport_error_samples": transport[:5],
        "roles_crashed": len(dead),
        "crashed": dead,
        **leak,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "by_kind": {k: {str(s): n for s, n in sorted(v.items())} for k, v in sorted(by_kind.items())},
        "send_s": round(send_s, 1),
        "wall_s": round(time.perf_counter() - t0, 1),
        "seed": seed,
        "work_dir": str(work),
    }
