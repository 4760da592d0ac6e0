"""Horizontal roles: two routers (one consumer group on rf:ingress), two batchers per rack (one consumer group per
rack stream) and two HTTP gateways, all real processes on real Valkey and etcd with sim workers. ~600 requests over
both gateways, a quarter of them streamed: every request is routed once, dispatched once, ends with exactly one
final result, every streamed answer has each token once, and every replica did part of the work."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.config import RackflowConfig
from pipeline.events import DecisionEvent
from streams import codec, keys
from streams.runner import connect
from tests.integration import harness
from workers.local.launcher import ClusterProcesses, wait_cluster_ready
from workers.local.supervise import free_port

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

MODEL = "qwen2-7b"
N_REQUESTS = 600
HORIZONTAL = {
    "cluster": {"racks": [
        {"name": "r0", "node_count": 1, "node": {"gpu": "h100-80gb", "tp": 1, "models": [MODEL]}},
        {"name": "r1", "node_count": 1, "node": {"gpu": "h100-80gb", "tp": 1, "models": [MODEL]}},
    ]},
    "policies": {"streams": {"claim_idle_ms": 1500}},
}


@dataclass
class Horizontal:
    config: RackflowConfig
    procs: ClusterProcesses
    redis_url: str
    gateways: list[str]


async def _group_consumers(redis_url: str, stream: str, group: str) -> list[dict[str, Any]]:
    r = connect(redis_url)
    try:
        out = []
        for c in await r.xinfo_consumers(stream, group):
            out.append({(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                        for k, v in c.items()})
        return out
    except Exception:
        return []
    finally:
        await r.aclose()


def _wait_replicas(h: Horizontal, timeout_s: float = 60.0) -> None:
    """Both routers and both batchers of each rack have joined their groups, and both gateways answer."""
    deadline = time.monotonic() + timeout_s
    want = [(keys.INGRESS, keys.GROUP_ROUTER)] + [(keys.rack_requests(rk), keys.GROUP_BATCHER)
                                                   for rk in h.config.rack_names()]
    while True:
        counts = [len(asyncio.run(_group_consumers(h.redis_url, s, g))) for s, g in want]
        up = 0
        for url in h.gateways:
            try:
                up += httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                pass
        if all(c >= 2 for c in counts) and up == len(h.gateways):
            return
        dead = h.procs.dead()
        assert not dead, f"{dead[0].name} exited: {dead[0].log_path.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"replicas not up: consumers {counts}, gateways up {up}"
        time.sleep(0.2)


@pytest.fixture(params=["router", "inline"])
def horizontal(request, clean_services, config_file, tmp_path: Path) -> Iterator[Horizontal]:  # type: ignore[no-untyped-def]
    """`router`: the gateways queue every request on rf:ingress for the two routers; `inline` (the default): each
    gateway routes its own requests."""
    path = config_file({**HORIZONTAL, "gateway": {"routing": request.param}})
    config = harness.small_config(path)
    procs = ClusterProcesses(config, clean_services.redis_url, clean_services.etcd_url, tmp_path / "logs",
                             ["--config", str(path)], log_level="INFO", gateway_no_auth=True,
                             routers=2, batchers_per_rack=2)
    try:
        procs.start()
        gateways = []
        for name in ("gateway-a", "gateway-b"):
            port = free_port()
            procs.start_gateway(name, port)
            gateways.append(f"http://127.0.0.1:{port}")
        h = Horizontal(config, procs, clean_services.redis_url, gateways)
        asyncio.run(wait_cluster_ready(config, clean_services.redis_url, clean_services.etcd_url, 60))
        _wait_replicas(h)
        yield h
    finally:
        procs.stop()


async def _one(client: httpx.AsyncClient, base: str, i: int, stream: bool, rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(2, 12), "user": f"user-{rng.randrange(64)}"}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True},
                 "messages": [{"role": "user", "content": f"request {i}: tell me about racks"}]}
        rid, text, usage, finish, datas = None, [], None, None, 0
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200, (resp.status_code, await resp.aread())
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    datas += 1
                    continue
                ev = json.loads(data)
                assert "error" not in ev, ev
                rid = ev["id"].removeprefix("chatcmpl-")
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev.get("choices", []):
                    text.append(ch["delta"].get("content", ""))
                    finish = ch.get("finish_reason") or finish
        assert datas == 1 and rid is not None and usage is not None and finish is not None
        return {"id": rid, "text": "".join(text), "out": usage["completion_tokens"], "stream": True, "gw": base}
    body["prompt"] = f"request {i}: " + "tokens " * rng.randint(4, 60)
    resp = await client.post(f"{base}/v1/completions", json=body)
    assert resp.status_code == 200, (resp.status_code, resp.text)
    j = resp.json()
    return {"id": j["id"].removeprefix("cmpl-"), "text": j["choices"][0]["text"],
            "out": j["usage"]["completion_tokens"], "stream": False, "gw": base}


async def _send_all(gateways: list[str]) -> list[dict[str, Any]]:
    rng = random.Random(11)
    sem = asyncio.Semaphore(48)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
        async def go(i: int) -> dict[str, Any]:
            async with sem:
                return await _one(client, gateways[i % len(gateways)], i, i % 4 == 0, rng)

        return await asyncio.gather(*(go(i) for i in range(N_REQUESTS)))


async def _decisions(redis_url: str) -> list[DecisionEvent]:
    r = connect(redis_url)
    try:
        out = []
        for _eid, fields in await r.xrange(keys.DECISIONS):
            ev = codec.decode(fields)
            if isinstance(ev, DecisionEvent):
                out.append(ev)
        return out
    finally:
        await r.aclose()


def test_two_routers_two_batchers_per_rack_two_gateways_each_request_once(horizontal: Horizontal) -> None:
    h = horizontal
    t0 = time.monotonic()
    answers = asyncio.run(_send_all(h.gateways))
    took = time.monotonic() - t0
    ids = [a["id"] for a in answers]
    assert len(set(ids)) == N_REQUESTS, "two HTTP requests got the same request id"
    assert Counter(a["gw"] for a in answers) == {g: N_REQUESTS // 2 for g in h.gateways}

    # exactly one final result per request, and what each client got is that result
    got, counts = asyncio.run(harness.wait_results(h.redis_url, set(ids), timeout_s=30))
    assert set(got) >= set(ids), f"{len(set(ids) - set(got))} requests have no final result"
    dup = [i for i in ids if counts[i] != 1]
    assert not dup, f"{len(dup)} requests have {counts[dup[0]]} final results, e.g. {dup[0]}"
    for a in answers:
        res = got[a["id"]]
        assert res.status == "ok", (a["id"], res.error)
        assert a["out"] == res.out_tokens, (a, res.out_tokens)
        # a streamed answer: each token once and in order (a duplicate or missing chunk changes the text)
        assert a["text"] == res.text, (a["id"], a["stream"], a["text"][:80], res.text[:80])
    assert sum(a["stream"] for a in answers) == N_REQUESTS // 4

    # routed once, dispatched once: no duplicate processing across the replicas of a consumer group
    decisions = asyncio.run(_decisions(h.redis_url))
    routed = Counter(rid for d in decisions if d.kind == "route" for rid in d.request_ids)
    dispatched = Counter(rid for d in decisions if d.kind == "dispatch" for rid in d.request_ids)
    assert {i: routed[i] for i in ids} == dict.fromkeys(ids, 1), \
        f"route decisions per request: {Counter(routed[i] for i in ids)}"
    assert {i: dispatched[i] for i in ids} == dict.fromkeys(ids, 1), \
        f"dispatch decisions per request: {Counter(dispatched[i] for i in ids)}"

    # every replica did part of the work
    actors: dict[str, Counter[str]] = {}
    for d in decisions:
        if d.kind == "dispatch":
            actors.setdefault(d.rack, Counter())[d.actor] += len(d.request_ids)
    for rack in h.config.rack_names():
        assert len(actors.get(rack, {})) == 2, f"rack {rack}: dispatches by batcher {dict(actors.get(rack, {}))}"
    if h.config.gateway.routing == "inline":  # each gateway routed the requests it admitted, once each
        by_gateway = Counter(d.actor for d in decisions if d.kind == "route" and d.actor.startswith("gateway-")
                             for _ in d.request_ids)
        # (a request that found no healthy rack for a moment goes to the routers: once all the same, checked above)
        assert len(by_gateway) == 2 and all(n > N_REQUESTS // 4 for n in by_gateway.values()), by_gateway
        h.procs.stop()
        return
    routers = asyncio.run(_group_consumers(h.redis_url, keys.INGRESS, keys.GROUP_ROUTER))
    assert len(routers) == 2, routers
    assert all(c["pending"] == 0 for c in routers), routers
    if all("inactive" in c for c in routers):  # Valkey/Redis >= 7.2: -1 = never read an entry
        assert all(int(c["inactive"]) >= 0 for c in routers), routers

    router_logs = {p.name: p.log_path for p in h.procs.procs if p.role == "router"}
    h.procs.stop()  # routers log how many requests each routed when they stop
    per_router = {}
    for name, log_path in router_logs.items():
        m = re.search(r"router stopped \((\d+) routed\)", log_path.read_text())
        assert m, f"{name} did not stop cleanly"
        per_router[name] = int(m.group(1))
    assert len(per_router) == 2 and all(n > 0 for n in per_router.values()), per_router
    assert sum(per_router.values()) == N_REQUESTS, per_router
    print(f"\n{N_REQUESTS} requests in {took:.1f}s; routed per router {per_router}; "
          f"dispatched per batcher {[dict(c) for c in actors.values()]}")
