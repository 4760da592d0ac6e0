"""The gateway's own route (`gateway.routing: inline`, workers/stores/rack_routing.py) on a real Valkey: a request goes
straight to its rack's stream with its record and the decision in the same round trip, requests admitted together
share one round trip, the rack is the one the router would choose over the same views, and a request no healthy rack
can take still reaches the router."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid

import pytest

from pipeline.config import RackflowConfig, load_config
from pipeline.events import BlockEvent, DecisionEvent, HealthEvent, RequestEvent
from pipeline.profiling import ProfileInput
from pipeline.routing.registry import build_router
from streams import codec, keys
from streams.runner import connect
from workers.local.services import ServiceEndpoints
from workers.shell.runtime import WALL
from workers.stores.ingress import Gateway
from workers.stores.rack_routing import RackRouting

pytestmark = pytest.mark.integration

CLUSTER = {
    "cluster": {"racks": [
        {"name": "r0", "node_count": 2, "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}},
        {"name": "r1", "node_count": 2, "node": {"gpu": "a100-80gb", "tp": 1, "models": ["qwen2-7b"]}},
        {"name": "r2", "node_count": 2, "node": {"gpu": "a100-80gb", "tp": 1, "models": ["qwen2-7b"]}},
    ]},
    "gateway": {"routing": "inline"},
}


def _config(config_file) -> RackflowConfig:  # type: ignore[no-untyped-def]
    return load_config(overrides=[config_file(CLUSTER)])


def _input(i: int) -> ProfileInput:
    return ProfileInput(request_id=str(uuid.uuid4()), tenant="t1", user_id=f"user-{i % 7}", model="qwen2-7b",
                        arrival_ms=WALL.now_ms(), prompt_tokens=100 + 37 * i, max_tokens=16)


async def _nodes_up(r, config: RackflowConfig) -> None:  # type: ignore[no-untyped-def]
    now = WALL.now_ms()
    for n in config.nodes():
        ev = HealthEvent(node=n.name, rack=config.rack_of(n.name), ts_ms=now, source="worker", running=0, waiting=0,
                         kv_capacity_kb=1e6, gpu_mem_total_gb=80.0, gpu_mem_free_gb=40.0)
        await r.hset(keys.node_status(n.name), mapping=codec.encode(ev))


@contextlib.asynccontextmanager
async def _gateway(config: RackflowConfig, redis_url: str, nodes_up: bool = True):  # type: ignore[no-untyped-def]
    """A gateway core on the test's Valkey, routing as `config` says; with `nodes_up`, every node has reported."""
    r = connect(redis_url)
    gw = Gateway(config, r)
    try:
        if nodes_up:
            await _nodes_up(r, config)
        await gw.start_routing()
        yield r, gw
    finally:
        await gw.stop_routing()
        await r.aclose()


async def _requests(r, stream: str) -> list[RequestEvent]:  # type: ignore[no-untyped-def]
    out = []
    for _eid, fields in await r.xrange(stream):
        ev = codec.decode(fields)
        assert isinstance(ev, RequestEvent)
        out.append(ev)
    return out


def test_requests_admitted_together_go_to_their_racks_in_one_round_trip(clean_services: ServiceEndpoints,
                                                                        config_file) -> None:  # type: ignore[no-untyped-def]
    config = _config(config_file)

    async def run() -> None:
        async with _gateway(config, clean_services.redis_url) as (r, gw):
            assert gw.inline is not None
            _queues, views = await gw.rack_queues()
            reqs = [gw.profile(_input(i)) for i in range(40)]
            entered = await asyncio.gather(*(gw.inline.submit(q, views) for q in reqs))
            assert entered == [True] * 40
            assert gw.inline.round_trips == 1  # all forty were waiting when the write went

            # the router's choice over the same views, charged request by request in the same order
            expect = RackRouting(config, build_router(config), None)
            seen = dict(views)
            want = []
            for q in reqs:
                d = expect.route(q, seen, None)
                assert d.rack is not None
                expect.forward(codec.encode(q), q, d, seen, WALL.now_ms(), "test")
                want.append(d.rack)
            assert len(set(want)) > 1  # the test means something: the batch spreads over racks

            decisions = [codec.decode(f) for _e, f in await r.xrange(keys.DECISIONS)]
            assert len(decisions) == 1 and isinstance(decisions[0], DecisionEvent)
            assert list(decisions[0].request_ids) == [q.request_id for q in reqs]
            assert list(decisions[0].choices) == want

            on_racks = {q.request_id: q for rk in config.rack_names()
                        for q in await _requests(r, keys.rack_requests(rk))}
            assert {k: v.rack for k, v in on_racks.items()} == dict(zip([q.request_id for q in reqs], want,
                                                                        strict=True))
            record = await _requests(r, keys.ADMITTED)
            assert [q.request_id for q in record] == [q.request_id for q in reqs]
            assert [q.rack for q in record] == want
            assert dataclasses.replace(record[3], rack=None, routed_ms=0.0) == reqs[3]  # the request as admitted
            assert await r.xlen(keys.INGRESS) == 0  # no router hop

    asyncio.run(run())


def test_admit_routes_inline_and_falls_back_to_the_router_without_a_healthy_rack(
        clean_services: ServiceEndpoints, config_file) -> None:  # type: ignore[no-untyped-def]
    config = _config(config_file)

    async def run() -> None:
        async with _gateway(config, clean_services.redis_url, nodes_up=False) as (r, gw):
            # no node has reported: no rack is healthy, so the router gets it (it waits for a rack)
            first = await gw.admit(_input(0))
            assert [q.request_id for q in await _requests(r, keys.INGRESS)] == [first.request_id]
            assert await r.exists(keys.ADMITTED) == 0

            await _nodes_up(r, config)
            gw._queues_t = float("-inf")  # read the racks again now (their figures are cached for 200 ms)
            second = await gw.admit(_input(1))
            assert [q.request_id for q in await _requests(r, keys.ADMITTED)] == [second.request_id]
            assert await r.xlen(keys.INGRESS) == 1

    asyncio.run(run())


def test_gateway_routing_router_leaves_every_request_to_the_router(clean_services: ServiceEndpoints,
                                                                  config_file) -> None:  # type: ignore[no-untyped-def]
    assert load_config().gateway.routing == "inline"  # the default
    config = load_config(overrides=[config_file({**CLUSTER, "gateway": {"routing": "router"}})])

    async def run() -> None:
        async with _gateway(config, clean_services.redis_url) as (r, gw):
            assert gw.inline is None
            req = await gw.admit(_input(2))
            assert [q.request_id for q in await _requests(r, keys.INGRESS)] == [req.request_id]

    asyncio.run(run())


def test_the_inline_route_weighs_where_a_prefix_is_cached(clean_services: ServiceEndpoints,
                                                          config_file) -> None:  # type: ignore[no-untyped-def]
    """The gateway reads the nodes' block events as the router does: a prompt whose blocks one rack's node holds
    goes to that rack, whichever rack its user hashes to."""
    config = _config(config_file)
    assert build_router(config).prefix_aware, "the default rack policy weighs cached prefixes"

    async def run() -> None:
        async with _gateway(config, clean_services.redis_url) as (r, gw):
            assert gw.inline is not None and gw.inline.routing.feed is not None
            feed = gw.inline.routing.feed
            ids = [(7 * i) % 30_000 for i in range(16_384)]  # a prefix worth more than user affinity (8,192 tokens)
            probe = gw.profile(ProfileInput(request_id="probe", tenant="t1", user_id="someone", model="qwen2-7b",
                                            arrival_ms=WALL.now_ms(), token_ids=ids, max_tokens=8))
            assert probe.in_tokens > config.policies.router.affinity_tokens and len(probe.prefix_hashes) >= 4
            _q, views = await gw.rack_queues()
            plain = build_router(config, prefix_aware=False).route("someone", "qwen2-7b", views).rack
            holder = next(rk for rk in config.rack_names() if rk != plain)
            node = next(n.name for n in config.nodes() if config.rack_of(n.name) == holder)
            await r.xadd(keys.rack_blocks(holder), codec.encode(BlockEvent(
                node=node, rack=holder, ts_ms=WALL.now_ms(), stored=tuple(probe.prefix_hashes))))
            deadline = time.monotonic() + 60  # the feed applies it within one read: wait for that, not a time
            while not feed.applied:
                assert time.monotonic() < deadline, "the gateway's prefix feed never applied the block event"
                await asyncio.sleep(0.05)
            req = await gw.admit(ProfileInput(request_id=str(uuid.uuid4()), tenant="t1", user_id="someone",
                                              model="qwen2-7b", arrival_ms=WALL.now_ms(), token_ids=ids,
                                              max_tokens=8))
            routed = [q for q in await _requests(r, keys.ADMITTED) if q.request_id == req.request_id]
            assert routed and routed[0].rack == holder, (plain, holder, routed)

    asyncio.run(run())
