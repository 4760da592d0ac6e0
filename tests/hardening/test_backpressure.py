"""Backpressure: a sustained overload (2x capacity for 60 s over HTTP, `sim` engines with real iteration times) is
shed at the gateway with 429 + Retry-After before latency explodes; the queues stay bounded; every accepted request
ends with exactly one final result; afterwards the service is healthy and a fresh request completes.

The cluster is made small and slow on purpose, so that its capacity is set by the engines and not by this 2-core
machine's CPU: 2 racks x 1 H100 node, `max_running: 2` per engine, 32 output tokens (about 8 ms per decode step in
the cost model, so about 0.27 s per request and about 15 requests/s for the cluster). The capacity is measured first
(a closed loop that keeps the engines busy), then twice that rate is offered open loop (the sender does not slow
down when the service does).

Bounds asserted, and why:
- rack queue (batcher lag + pending + engine waiting, sampled every 100 ms): at most `max_rack_queue` plus what
  arrives while the gateway's view is stale (its cache, `saturation_refresh_ms`, plus the nodes' status interval,
  both 200 ms, plus transit and scheduling delays on a shared 2-core machine: OVERSHOOT_S of the offered rate);
- p99 latency of accepted requests: a request waits behind at most that many requests of its rack, which serves
  capacity/racks per second, plus its own service and the control plane: Q / (capacity / racks) + SLACK_S.
  Without shedding, 60 s at 2x capacity would queue about 60 x capacity requests and the last ones would wait about
  60 s; the bound is a few seconds.

Run alone with the figures printed:
    .venv/bin/python -m pytest -q -s tests/hardening/test_backpressure.py
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from pipeline.config import DEFAULT_CONFIG_DIR, RackflowConfig, load_config
from pipeline.events import HealthEvent, ResultEvent
from pipeline.stats import percentile
from streams import codec, keys
from workers.bench.gateway import closed_loop, one_request, open_loop, wait_http_ready
from workers.local.launcher import ClusterProcesses, wait_cluster_ready
from workers.local.services import ServiceEndpoints
from workers.local.supervise import free_port

pytestmark = [pytest.mark.integration, pytest.mark.hardening, pytest.mark.slow, pytest.mark.long]

MAX_TOKENS = 32
RACK_QUEUE = 8
INGRESS_BOUND = 64
OVERLOAD_S = 60.0
CAPACITY_S = 8.0
OVERSHOOT_S = 1.5
SLACK_S = 2.5


@dataclass
class Sampler:
    """Reads the queues every 100 ms from its own connection, the way the gateway defines them."""

    redis_url: str
    config: RackflowConfig
    max_ingress: int = 0
    max_rack: dict[str, int] = field(default_factory=dict)
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def queues(self, r: redis.Redis) -> tuple[int, dict[str, int]]:
        def backlog(stream: str, group: str) -> int:
            try:
                groups = r.xinfo_groups(stream)
            except redis.ResponseError:
                return 0
            return sum(int(g.get("lag") or 0) + int(g.get("pending") or 0) for g in groups
                       if g.get("name") in (group, group.encode()))

        ingress = backlog(keys.INGRESS, keys.GROUP_ROUTER)
        racks = {rk: backlog(keys.rack_requests(rk), keys.GROUP_BATCHER) for rk in self.config.rack_names()}
        for node in self.config.nodes():
            fields = r.hgetall(keys.node_status(node.name))
            if fields:
                ev = codec.decode(fields)
                if isinstance(ev, HealthEvent):
                    racks[self.config.rack_of(node.name)] += int(ev.waiting)
        return ingress, racks

    def _run(self) -> None:
        r = redis.Redis.from_url(self.redis_url)
        try:
            while not self._stop.is_set():
                ingress, racks = self.queues(r)
                self.max_ingress = max(self.max_ingress, ingress)
                for rk, q in racks.items():
                    self.max_rack[rk] = max(self.max_rack.get(rk, 0), q)
                self.samples += 1
                self._stop.wait(0.1)
        finally:
            r.close()

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(10)


@dataclass
class Cluster:
    url: str
    redis_url: str
    config: RackflowConfig
    procs: ClusterProcesses


@pytest.fixture
def cluster(clean_services: ServiceEndpoints, tmp_path: Path) -> Iterator[Cluster]:
    override = {
        "cluster": {"racks": [
            {"name": "r0", "node_count": 1, "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}},
            {"name": "r1", "node_count": 1, "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}},
        ]},
        "policies": {"worker": {"max_running": 2, "token_flush_ms": 50}, "streams": {"claim_idle_ms": 5000}},
        "gateway": {"max_rack_queue": RACK_QUEUE, "max_ingress_backlog": INGRESS_BOUND, "max_retry_after_s": 10},
    }
    path = tmp_path / "overload.yaml"
    path.write_text(yaml.safe_dump(override))
    config = load_config(DEFAULT_CONFIG_DIR, [path])
    port = free_port()
    procs = ClusterProcesses(config, clean_services.redis_url, clean_services.etcd_url, tmp_path / "logs",
                             ["--config", str(path)], log_level="WARNING", with_gateway=True, gateway_no_auth=True,
                             gateway_port=port)
    procs.start()
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_cluster_ready(config, clean_services.redis_url, clean_services.etcd_url))
        asyncio.run(wait_http_ready(url))
        yield Cluster(url, clean_services.redis_url, config, procs)
        assert not procs.dead(), [p.log_path.read_text()[-2000:] for p in procs.dead()]
    finally:
        procs.stop()


def _results(redis_url: str) -> Counter[str]:
    r = redis.Redis.from_url(redis_url)
    try:
        counts: Counter[str] = Counter()
        for _eid, fields in r.xrange(keys.RESULTS):
            ev = codec.decode(fields)
            assert isinstance(ev, ResultEvent)
            counts[ev.request_id] += 1
        return counts
    finally:
        r.close()


def test_overload_is_shed_with_bounded_queues_and_every_accepted_request_completes(cluster: Cluster) -> None:
    racks = len(cluster.config.rack_names())
    with Sampler(cluster.redis_url, cluster.config) as sampler:
        # capacity: 16 clients keep the 4 engine slots busy (16 < 2 racks x (2 running + 8 queued): nothing is shed)
        t0 = time.monotonic()
        cap_runs = asyncio.run(closed_loop(cluster.url, 16, CAPACITY_S, MAX_TOKENS, stream_every=5))
        cap_window = max(CAPACITY_S, max(o.start + o.latency_s for o in cap_runs) - t0)
        capacity = sum(1 for o in cap_runs if o.ok) / cap_window
        assert capacity > 2, f"capacity {capacity:.1f} req/s: the cluster hardly served anything"
        offered = 2 * capacity
        over = asyncio.run(open_loop(cluster.url, offered, OVERLOAD_S, MAX_TOKENS, stream_every=5))
    accepted = [o for o in over if 200 <= o.status < 300]
    shed = [o for o in over if o.status == 429]
    errors = [o for o in over + cap_runs if not o.ok and not o.shed]
    lat = [o.latency_s for o in accepted if o.ok]
    p99 = percentile(lat, 99)
    rate_per_rack = capacity / racks
    q_allow = RACK_QUEUE + math.ceil(offered * OVERSHOOT_S)
    p99_bound = q_allow / rate_per_rack + SLACK_S
    figures = {
        "capacity_rps": round(capacity, 1), "offered_rps": round(offered, 1),
        "offered": len(over), "accepted": len(accepted), "accepted_rps": round(len(accepted) / OVERLOAD_S, 1),
        "shed": len(shed), "errors": len(errors), "p50_accepted_s": round(percentile(lat, 50), 2),
        "p99_accepted_s": round(p99, 2), "p99_bound_s": round(p99_bound, 2), "max_rack_queue": sampler.max_rack,
        "rack_queue_bound": RACK_QUEUE, "rack_queue_allowed": q_allow, "max_ingress_backlog": sampler.max_ingress,
        "queue_samples": sampler.samples,
        "retry_after_s": dict(Counter(o.retry_after for o in shed)),
    }
    print("\noverload:", json.dumps(figures, sort_keys=True))

    assert not errors, [(o.status, o.error) for o in errors[:10]]
    # the gateway shed load, and said when to come back
    assert len(shed) >= 0.2 * len(over), figures
    assert all(o.retry_after is not None and 1 <= int(o.retry_after) <= 10 for o in shed), figures
    # ... while still taking about what the cluster can do
    assert len(accepted) >= 0.6 * capacity * OVERLOAD_S, figures
    # queues stayed bounded
    assert sampler.samples >= OVERLOAD_S * 5, figures
    assert max(sampler.max_rack.values()) <= q_allow, figures
    assert sampler.max_ingress <= INGRESS_BOUND, figures
    # accepted requests were not left to wait behind an unbounded queue
    assert p99 <= p99_bound, figures

    # every accepted request has exactly one final result, and no shed request ever entered the streams
    counts = _results(cluster.redis_url)
    ok_ids = {o.request_id for o in accepted + cap_runs if o.ok}
    assert None not in ok_ids
    assert all(counts[rid] == 1 for rid in ok_ids), [rid for rid in ok_ids if counts[rid] != 1][:5]
    assert set(counts) == ok_ids, (len(counts), len(ok_ids))

    # afterwards: healthy, queues drained, and a fresh request completes
    assert httpx.get(f"{cluster.url}/healthz", timeout=10).json() == {"status": "ok"}
    r = redis.Redis.from_url(cluster.redis_url)
    try:
        deadline = time.monotonic() + 30
        while True:
            ingress, queues = sampler.queues(r)
            if ingress == 0 and not any(queues.values()):
                break
            assert time.monotonic() < deadline, (ingress, queues)
            time.sleep(0.2)
    finally:
        r.close()

    async def fresh() -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            for stream in (False, True):
                o = await one_request(c, cluster.url, 10**6, MAX_TOKENS, stream)
                assert o.ok, (o.status, o.error)

    time.sleep(0.5)  # the gateway's cached view catches up with the drained queues
    asyncio.run(fresh())


def test_store_unreachable_is_503_with_retry_after(services: ServiceEndpoints, tmp_path: Path) -> None:
    """No Redis behind the gateway: /healthz and completions answer 503 with Retry-After (never a hang or a 500)."""
    config = load_config(DEFAULT_CONFIG_DIR, [])
    dead = f"redis://127.0.0.1:{free_port()}/0"
    port = free_port()
    procs = ClusterProcesses(config, dead, services.etcd_url, tmp_path / "logs", [], log_level="WARNING",
                             gateway_no_auth=True, gateway_port=port)
    procs.start_gateway()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(f"{url}/healthz", timeout=10)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, procs.procs[0].log_path.read_text()[-2000:]
                time.sleep(0.2)
        assert health.status_code == 503 and health.headers.get("retry-after") == "1"
        resp = httpx.post(f"{url}/v1/completions", timeout=30,
                          json={"model": "qwen2-7b", "prompt": "x", "max_tokens": 2})
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "store_unavailable" and resp.headers.get("retry-after") == "1"
    finally:
        procs.stop()


def test_retry_after_follows_the_queue_and_the_completion_rate() -> None:
    """Retry-After = the queue ahead / the recent completion rate, within [retry_after_s, max_retry_after_s]."""
    from workers.stores.ingress import Gateway

    gw = Gateway(load_config(DEFAULT_CONFIG_DIR, []), None)  # type: ignore[arg-type]  # no I/O here
    assert gw.retry_after(100, 2) == gw.config.gateway.max_retry_after_s  # no rate known yet: the cap
    gw._done.extend([(0.0, 0), (2.0, 100)])  # 50 results/s over the whole cluster (2 racks)
    assert gw.retry_after(100, 2) == 2
    assert gw.retry_after(100, 1) == 4  # one rack of two: half the rate
    assert gw.retry_after(1, 2) == gw.config.gateway.retry_after_s
    assert gw.retry_after(10**6, 2) == gw.config.gateway.max_retry_after_s
