"""The gateway judges a rack healthy exactly as the router does (ClusterView: an active node), so the rack it
predicts for shedding is the router's: a rack whose nodes the monitor drained is healthy to neither."""

from __future__ import annotations

import asyncio
import json

import pytest

from pipeline.config import load_config
from pipeline.events import HealthEvent
from streams import codec, keys
from streams.runner import connect
from workers.local.services import ServiceEndpoints
from workers.shell.runtime import WALL
from workers.stores.cluster_view import ClusterView
from workers.stores.etcd import NodeAdmin, NodeRegistry
from workers.stores.ingress import Gateway

pytestmark = pytest.mark.integration


def test_a_drained_rack_is_unhealthy_to_the_gateway_as_to_the_router(clean_services: ServiceEndpoints) -> None:
    config = load_config()
    drained = config.rack_names()[0]

    async def run() -> None:
        r = connect(clean_services.redis_url)
        registry = NodeRegistry(clean_services.etcd_url)
        try:
            now = WALL.now_ms()
            for n in config.nodes():
                rack = config.rack_of(n.name)
                ev = HealthEvent(node=n.name, rack=rack, ts_ms=now, source="worker", running=2, waiting=3,
                                 kv_capacity_kb=1e6, gpu_mem_total_gb=80.0, gpu_mem_free_gb=40.0)
                await r.hset(keys.node_status(n.name), mapping=codec.encode(ev))  # type: ignore[arg-type]
                await registry.client.put(keys.etcd_node(n.name).encode(), json.dumps({"state": "active"}).encode())
            admin = NodeAdmin(registry.client)
            for n in config.nodes():
                if config.rack_of(n.name) == drained:
                    await admin.set(n.name, "draining", "test: the monitor drained it", now)

            queues, views = await Gateway(config, r, registry).rack_queues()
            router_view = ClusterView(config, r, registry, stale_ms=config.policies.node_selection.stale_ms)
            await router_view.refresh(with_backlog=True)
            router_views = router_view.rack_views(WALL.now_ms())
            assert {k: v.healthy for k, v in views.items()} == {k: v.healthy for k, v in router_views.items()}
            assert not views[drained].healthy
            assert all(v.healthy for k, v in views.items() if k != drained)
            # what waits in a drained rack's engines is not that rack's queue for shedding; an active rack's is
            assert queues[drained] == 0
            other = next(k for k in views if k != drained)
            assert queues[other] == 3 * sum(1 for n in config.nodes() if config.rack_of(n.name) == other)

            # without etcd the gateway cannot know verdicts: a fresh status counts as active (the old behaviour)
            _, blind = await Gateway(config, r).rack_queues()
            assert all(v.healthy for v in blind.values())
        finally:
            await registry.close(revoke=False)
            await r.aclose()

    asyncio.run(run())
