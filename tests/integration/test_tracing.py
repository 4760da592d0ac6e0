"""OpenTelemetry tracing through the real pipeline: the gateway function, router, batcher and a sim worker (run
in this process, so one in-memory exporter sees every span) on real Valkey + etcd. One request gives the four spans
gateway.admit -> router.route -> batcher.dispatch -> worker.generate, one trace id, each the child of the one
before, with the request's attributes; routed by the gateway itself (`gateway.routing: inline`), the second span is
gateway.route."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from pipeline.events import ResultEvent
from pipeline.profiling import ProfileInput
from tests.integration import harness
from workers.roles.batcher import Batcher
from workers.roles.router import Router
from workers.roles.worker import Worker
from workers.shell import tracing
from workers.shell.runtime import WALL
from workers.stores.ingress import Gateway

pytestmark = pytest.mark.integration

ONE_NODE = {
    "cluster": {"racks": [{"name": "r0", "node_count": 1,
                           "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}}]},
    "policies": {"streams": {"claim_idle_ms": 1500}},
}


@pytest.mark.parametrize("routing", ["router", "inline"])
def test_a_request_is_one_trace_across_gateway_router_batcher_and_worker(clean_services, config_file,  # type: ignore[no-untyped-def]
                                                                         routing):
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    config = harness.small_config(config_file({**ONE_NODE, "gateway": {"routing": routing}}))
    route = "router.route" if routing == "router" else "gateway.route"
    redis_url, etcd_url = clean_services.redis_url, clean_services.etcd_url

    async def main() -> tuple[str, ResultEvent | None]:
        stop = asyncio.Event()
        roles = [Worker(config, "r0-n0", "sim", redis_url, etcd_url, grace_s=5.0),
                 Batcher(config, "r0", redis_url, etcd_url), Router(config, redis_url, etcd_url)]
        tasks = [asyncio.create_task(role.run(stop)) for role in roles]
        r = aioredis.Redis.from_url(redis_url)
        result: ResultEvent | None = None
        rid = str(uuid.uuid4())
        gw = Gateway(config, r)
        await gw.start_routing()
        try:
            if routing == "inline":  # the gateway routes only to a rack it sees healthy: wait for the node's status
                for _ in range(300):
                    gw._queues_t = float("-inf")
                    _q, views = await gw.rack_queues()
                    if any(v.healthy for v in views.values()):
                        break
                    await asyncio.sleep(0.1)
            req = await gw.admit(ProfileInput(
                request_id=rid, tenant="t1", user_id="u1", model="qwen2-7b", arrival_ms=WALL.now_ms(),
                prompt_tokens=64, max_tokens=4))
            assert req.trace
            async for ev in Gateway(config, r).outputs(rid, timeout_s=60):
                if isinstance(ev, ResultEvent):
                    result = ev
        finally:
            stop.set()
            await gw.stop_routing()
            done = await asyncio.gather(*tasks, return_exceptions=True)
            await r.aclose()
        assert all(x == 0 for x in done), done
        return rid, result

    exporter = InMemorySpanExporter()
    assert tracing.init_tracing(True, service="test", exporter=exporter)
    try:
        rid, result = asyncio.run(main())
    finally:
        tracing.shutdown_tracing()
    assert result is not None and result.status == "ok"
    spans = [s for s in exporter.get_finished_spans() if s.attributes.get("request_id") == rid]
    by_name = {s.name: s for s in spans}
    assert sorted(by_name) == sorted(["batcher.dispatch", "gateway.admit", route, "worker.generate"]), \
        [s.name for s in spans]
    assert len(spans) == 4
    assert len({s.context.trace_id for s in spans}) == 1
    assert by_name["gateway.admit"].parent is None
    for child, parent in ((route, "gateway.admit"), ("batcher.dispatch", route),
                          ("worker.generate", "batcher.dispatch")):
        assert by_name[child].parent is not None and by_name[child].parent.span_id == by_name[parent].context.span_id
    assert by_name[route].attributes["rack"] == "r0"
    for name in ("batcher.dispatch", "worker.generate"):
        a = by_name[name].attributes
        assert (a["rack"], a["node"], a["model"]) == ("r0", "r0-n0", "qwen2-7b")
        assert a["batch_id"] == result.batch_id
    assert by_name["worker.generate"].attributes["out_tokens"] == 4
    assert by_name["worker.generate"].end_time >= by_name["worker.generate"].start_time
