"""Every role's Prometheus /metrics, scraped over HTTP from real processes (router, batcher, worker, health agent,
monitor, Celery worker, gateway) on real Valkey + etcd, after requests went through and one malformed entry went to
the dead-letter stream: each exposes the names of issue 7 (requests by status and model, end-to-end latency and TTFT
histograms, stream lengths and pending counts, batch memory utilisation, node weights, health scores, migrations,
DLQ count, KV tier hits), with samples where the role has had something to count."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from streams import keys
from tests.integration import harness
from workers.local.launcher import ClusterProcesses, wait_cluster_ready
from workers.local.supervise import free_port

pytestmark = pytest.mark.integration

ONE_NODE = {
    "cluster": {"racks": [{"name": "r0", "node_count": 1,
                           "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}}]},
    "policies": {"streams": {"claim_idle_ms": 1500}},
}

Sample = tuple[str, dict[str, str], float]


class Scrape:
    def __init__(self, text: str) -> None:
        self.text = text
        self.names = set(re.findall(r"^# (?:HELP|TYPE) (rackflow_\w+)", text, re.M))
        self.samples: list[Sample] = [
            (s.name, dict(s.labels), s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
        ]
        self.names |= {name for name, _l, _v in self.samples}

    def value(self, name: str, **labels: str) -> float | None:
        for n, lab, v in self.samples:
            if n == name and all(lab.get(k) == x for k, x in labels.items()):
                return v
        return None


def scrape(port: int) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return Scrape(resp.read().decode())


def wait_for(port: int, ok: Callable[[Scrape], bool], what: str, timeout_s: float = 30.0) -> Scrape:
    deadline = time.monotonic() + timeout_s
    last: Scrape | None = None
    while True:
        try:
            last = scrape(port)
            if ok(last):
                return last
        except OSError:
            pass
        if time.monotonic() > deadline:
            tail = last.text[-3000:] if last else "(no answer)"
            raise AssertionError(f"{what}: metrics not as expected after {timeout_s:.0f}s\n{tail}")
        time.sleep(0.3)


def has(s: Scrape, name: str, **labels: str) -> bool:
    return s.value(name, **labels) is not None


def test_every_role_serves_the_required_metrics(clean_services, config_file, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = config_file(ONE_NODE)
    config = harness.small_config(path)
    redis_url, etcd_url = clean_services.redis_url, clean_services.etcd_url
    gw_port = free_port()
    procs = ClusterProcesses(config, redis_url, etcd_url, tmp_path / "logs", ["--config", str(path)],
                             log_level="WARNING", gateway_port=gw_port, gateway_no_auth=True, with_gateway=True,
                             with_failover=True, metrics=True)
    procs.start()
    try:
        ports = {p.role: p.metrics_port for p in procs.procs}
        assert set(ports) == {"router", "batcher", "worker", "agent", "monitor", "celery", "celery-jobs", "gateway"}
        assert all(ports.values()), ports
        targets = procs.metrics_targets()
        assert {t["labels"]["role"] for t in targets} == set(ports)  # type: ignore[index]
        asyncio.run(wait_cluster_ready(config, redis_url, etcd_url, timeout_s=60))
        wait_for(gw_port, lambda s: True, "gateway listening", timeout_s=60)

        async def traffic() -> None:
            r = aioredis.Redis.from_url(redis_url)
            await r.xadd(keys.INGRESS, {b"v": b"1", b"t": b"request", b"d": b"\xc1"})  # to the dead letters
            await r.aclose()
            sent = await harness.submit(config, redis_url, harness.inputs(6, seed=3, max_out=6))
            got, _counts = await harness.wait_results(redis_url, {q.request_id for q in sent}, timeout_s=60)
            assert len(got) == 6
            async with httpx.AsyncClient(timeout=60) as client:
                resp = await client.post(f"http://127.0.0.1:{gw_port}/v1/completions",
                                         json={"model": "qwen2-7b", "prompt": "hello metrics", "max_tokens": 3})
                assert resp.status_code == 200, resp.text

        asyncio.run(traffic())
        model = {"model": "qwen2-7b"}

        router = wait_for(ports["router"], lambda s: has(s, "rackflow_dlq_entries_total", stream=keys.INGRESS)
                          and has(s, "rackflow_rack_load", rack="r0"), "router")
        # the six submitted to rf:ingress; the HTTP request the gateway routed itself (gateway.routing: inline)
        assert (router.value("rackflow_routed_total", rack="r0", affinity="kept") or 0) >= 6
        assert has(router, "rackflow_stream_length", stream=keys.INGRESS)
        assert has(router, "rackflow_stream_pending", stream=keys.INGRESS, group=keys.GROUP_ROUTER)
        assert router.value("rackflow_stream_stats_up") == 1
        assert router.value("rackflow_role_info", role="router") == 1

        rack_stream = keys.rack_requests("r0")
        batcher = wait_for(ports["batcher"], lambda s: has(s, "rackflow_node_weight", rack="r0", node="r0-n0"),
                           "batcher")
        assert (batcher.value("rackflow_batch_mem_util_count", rack="r0") or 0) >= 1
        assert (batcher.value("rackflow_batches_total", rack="r0", node="r0-n0") or 0) >= 1
        assert batcher.value("rackflow_node_weight_share", rack="r0", node="r0-n0") == 1.0
        assert has(batcher, "rackflow_stream_pending", stream=rack_stream, group=keys.GROUP_BATCHER)

        node_stream = keys.node_batches("r0-n0")
        worker = wait_for(ports["worker"], lambda s: (s.value("rackflow_requests_total", status="ok", **model)
                                                      or 0) >= 7, "worker")
        assert (worker.value("rackflow_request_duration_seconds_count", **model) or 0) >= 7
        assert (worker.value("rackflow_time_to_first_token_seconds_count", **model) or 0) >= 7
        assert has(worker, "rackflow_request_duration_seconds_bucket", le="+Inf", **model)
        assert has(worker, "rackflow_stream_length", stream=node_stream)
        assert has(worker, "rackflow_stream_pending", stream=node_stream, group=keys.GROUP_WORKER)
        assert has(worker, "rackflow_engine_kv_capacity_kb", node="r0-n0")
        for name in ("rackflow_migrations_total", "rackflow_kv_tier_hits_total", "rackflow_kv_tier_misses_total"):
            assert name in worker.names, name

        agent = wait_for(ports["agent"], lambda s: (s.value("rackflow_agent_samples_total", node="r0-n0") or 0) > 0,
                         "agent")
        assert has(agent, "rackflow_gpu_temperature_celsius", node="r0-n0")

        monitor = wait_for(ports["monitor"], lambda s: has(s, "rackflow_node_health_score", node="r0-n0")
                           and s.value("rackflow_stream_length", stream=keys.DLQ) == 1, "monitor")
        assert monitor.value("rackflow_monitor_leader") == 1
        assert has(monitor, "rackflow_stream_length", stream=keys.HEALTH)
        assert has(monitor, "rackflow_stream_pending", stream=keys.HEALTH, group="failover")
        assert 0.0 <= (monitor.value("rackflow_node_health_score", node="r0-n0") or -1) <= 1.0

        celery = wait_for(ports["celery"], lambda s: has(s, "rackflow_failover_migrations_total", outcome="moved"),
                          "celery worker")
        assert has(celery, "rackflow_failover_requeues_total", outcome="requeued")

        gateway = wait_for(ports["gateway"], lambda s: has(s, "rackflow_gateway_results_total", status="ok", **model),
                           "gateway")
        assert (gateway.value("rackflow_gateway_time_to_first_token_seconds_count", **model) or 0) >= 1
        assert (gateway.value("rackflow_routed_total", rack="r0", affinity="kept") or 0) >= 1
        assert has(gateway, "rackflow_gateway_requests_total", endpoint="/v1/completions", code="200")
        assert not procs.dead(), [p.log_path.read_text()[-2000:] for p in procs.dead()]
    finally:
        procs.stop()
