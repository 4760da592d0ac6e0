"""Routing through the real processes: decisions recorded for replay, per-request policy override, kv_aware
prefix affinity, and stale node status making a node unavailable."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest

from pipeline.events import DecisionEvent
from pipeline.profiling import ProfileInput
from pipeline.routing.hashring import HashRing
from streams import codec, keys
from streams.runner import connect
from tests.integration import harness
from workers.local.launcher import ClusterProcesses, wait_cluster_ready
from workers.shell.runtime import WALL

pytestmark = pytest.mark.integration


def decisions(url: str) -> list[DecisionEvent]:
    out = []
    for _eid, fields in asyncio.run(harness.read_stream(url, keys.DECISIONS)):
        ev = codec.decode(fields)
        assert isinstance(ev, DecisionEvent)
        out.append(ev)
    return out


def user_on(rack: str, racks: list[str]) -> str:
    ring = HashRing(racks, 160)
    return next(f"user-{i}" for i in range(10_000) if ring.primary(f"user-{i}") == rack)


@pytest.fixture
def cluster(clean_services, config_file, tmp_path):  # type: ignore[no-untyped-def]
    override = dict(harness.SMALL_CLUSTER)
    # a generous rack load slack: these tests are about node choice and decisions, not the rack walk (a burst of
    # one user's requests read in one router batch would otherwise walk to the other rack by bounded load, and a
    # burst of one heavy user would be walked off its rack by the share guard)
    override["policies"] = {"streams": {"claim_idle_ms": 1500}, "node_selection": {"stale_ms": 1000},
                            "router": {"load_slack": 50.0, "affinity_tokens": 1e6, "share_bound": 0.0}}
    path = config_file(override)
    config = harness.small_config(path)
    procs = ClusterProcesses(config, clean_services.redis_url, clean_services.etcd_url, tmp_path / "logs",
                             ["--config", str(path)], log_level="WARNING")
    procs.start()
    try:
        asyncio.run(wait_cluster_ready(config, clean_services.redis_url, clean_services.etcd_url))
        yield config, procs, clean_services.redis_url
    finally:
        procs.stop()


def _inp(user: str, policy: str = "", tokens: int = 300, hashes: tuple[int, ...] | None = None) -> ProfileInput:
    return ProfileInput(str(uuid.uuid4()), "t1", user, "qwen2-7b", WALL.now_ms(), prompt_tokens=tokens,
                        max_tokens=4, route_policy=policy, prefix_hashes=hashes)


def test_decisions_cover_every_request_and_override_is_honoured(cluster) -> None:  # type: ignore[no-untyped-def]
    config, _procs, url = cluster
    items = [_inp(f"user-{i % 7}", policy="least_outstanding" if i % 3 == 0 else "") for i in range(60)]
    sent = asyncio.run(harness.submit(config, url, items))
    got, _ = asyncio.run(harness.wait_results(url, {r.request_id for r in sent}, timeout_s=90))
    assert len(got) == 60
    ds = decisions(url)
    routes = [d for d in ds if d.kind == "route"]
    dispatches = [d for d in ds if d.kind == "dispatch"]
    assert sorted(rid for d in routes for rid in d.request_ids) == sorted(r.request_id for r in sent)
    placed = [rid for d in dispatches for rid in d.request_ids]
    assert sorted(placed) == sorted(r.request_id for r in sent), "each request in exactly one dispatch decision"
    by_req = {rid: d for d in dispatches for rid in d.request_ids}
    for item, req in zip(items, sent, strict=True):
        d = by_req[req.request_id]
        assert d.policy == (item.route_policy or config.policies.node_selection.policy)
        assert d.choice == got[req.request_id].node
        assert d.choice in config.nodes_serving("qwen2-7b", got[req.request_id].rack)
    # route decisions carry what the router saw
    assert all("load:r0" in d.scores and "healthy:r1" in d.scores for d in routes)


def test_kv_aware_keeps_a_shared_prefix_on_one_node(cluster) -> None:  # type: ignore[no-untyped-def]
    config, _procs, url = cluster
    user = user_on("r0", ["r0", "r1"])
    prefix = tuple(range(1000, 1008))  # 8 shared blocks of 512 tokens
    first = asyncio.run(harness.submit(config, url, [_inp(user, "kv_aware", 4096, prefix)]))
    asyncio.run(harness.wait_results(url, {first[0].request_id}, timeout_s=30))
    rest = asyncio.run(harness.submit(config, url, [_inp(user, "kv_aware", 4096, prefix) for _ in range(8)]))
    got, _ = asyncio.run(harness.wait_results(url, {r.request_id for r in first + rest}, timeout_s=60))
    nodes = {got[r.request_id].node for r in first + rest}
    assert len(nodes) == 1, f"shared prefix spread over {nodes}"


def test_stale_node_is_not_routed_to(cluster) -> None:  # type: ignore[no-untyped-def]
    config, procs, url = cluster
    user = user_on("r0", ["r0", "r1"])
    paused = next(p for p in procs.procs if p.name == "worker-r0-n0")
    os.kill(paused.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(2.0)  # > stale_ms: its status stops updating
        sent = asyncio.run(harness.submit(config, url, [_inp(user, "round_robin") for _ in range(12)]))
        got, _ = asyncio.run(harness.wait_results(url, {r.request_id for r in sent}, timeout_s=60))
    finally:
        os.kill(paused.proc.pid, signal.SIGCONT)
    assert len(got) == 12
    routes = [d for d in decisions(url) if d.kind == "route"]
    assert {e.node for e in got.values()} == {"r0-n1"}, f"a node with stale status got work: {routes[-1:]}"


def test_user_output_ewma_is_updated_on_completion_and_feeds_the_estimate(cluster) -> None:  # type: ignore[no-untyped-def]
    from workers.stores.ingress import Gateway

    config, _procs, url = cluster
    for n in (4, 8, 12):  # one after the other, so the EWMA sees them in this order
        item = ProfileInput(str(uuid.uuid4()), "t-ewma", "alice", "qwen2-7b", WALL.now_ms(), prompt_tokens=50,
                            max_tokens=n)
        sent = asyncio.run(harness.submit(config, url, [item]))
        asyncio.run(harness.wait_results(url, {sent[0].request_id}, timeout_s=30))
    expected = 4.0
    for n in (8, 12):
        expected = 0.2 * n + 0.8 * expected  # alpha = profiling.ewma_alpha

    async def check() -> tuple[float | None, int, int]:
        r = connect(url)
        try:
            gw = Gateway(config, r)
            avg = await gw.user_avg_out("t-ewma", "alice")
            req = await gw.admit(ProfileInput(str(uuid.uuid4()), "t-ewma", "alice", "qwen2-7b", WALL.now_ms(),
                                              prompt="hello"))
            other = await gw.admit(ProfileInput(str(uuid.uuid4()), "t-other", "alice", "qwen2-7b", WALL.now_ms(),
                                                prompt="hello"))
            return avg, req.out_tokens, other.out_tokens
        finally:
            await r.aclose()

    avg, out_tokens, other_tenant = asyncio.run(check())
    assert avg == pytest.approx(expected)
    assert out_tokens == round(expected)
    assert other_tenant == config.models["qwen2-7b"].default_out_tokens  # history is per tenant and user
