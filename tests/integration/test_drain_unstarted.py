"""What a dead node was handed and never started goes back to its rack's batcher, including a batch placed on the
node AFTER its drain (a batcher whose cluster view, refreshed every `refresh_ms`, still listed the node: with the
heartbeat failover the drain runs ~100 ms after the verdict). Such a batch is still undelivered work that the
monitor's redrive sees, and the next drain requeues it. Before: the drain moved the group past what it read with
XGROUP SETID, which leaves the group's lag unknown (null) once the stream grows; `remaining_work` read that as 0, no
drain was ever re-sent, and the request was lost (tests/chaos/test_failover.py::test_sigkill_worker_mid_generation).
"""

from __future__ import annotations

import asyncio

from pipeline.events import BatchEvent, RequestEvent
from streams import codec, keys
from streams.runner import connect
from tests.integration import harness
from workers.control.failover import FailoverContext, drain_unstarted, remaining_work
from workers.shell.runtime import WALL

NODE = "r1-n0"


def _req(rid: str) -> RequestEvent:
    return RequestEvent(request_id=rid, version=1, tenant="t", user_id="u", model="qwen2-7b", in_tokens=100,
                        out_tokens=10, max_tokens=10, mem_est_kb=1000.0, arrival_ms=WALL.now_ms(), rack="r1")


def _batch(rid: str) -> BatchEvent:
    now = WALL.now_ms()
    return BatchEvent(batch_id=f"b-{rid}", rack="r1", node=NODE, requests=(_req(rid),), mem_est_kb=1000.0,
                      mem_budget_kb=1e6, window_open_ms=now, created_ms=now)


def test_a_batch_placed_on_a_dead_node_after_its_drain_is_requeued_by_the_next(clean_services, config_file):  # type: ignore[no-untyped-def]
    config = harness.small_config(config_file(harness.SMALL_CLUSTER))
    stream = keys.node_batches(NODE)

    async def run() -> None:
        ctx = FailoverContext.open(config, clean_services.redis_url, clean_services.etcd_url)
        r = connect(clean_services.redis_url)

        async def requeued() -> dict[str, int]:
            return {ev.request_id: ev.version for ev in
                    (codec.decode(f) for _i, f in await r.xrange(keys.rack_requests("r1")))}

        try:
            await r.xgroup_create(stream, keys.GROUP_WORKER, id="0", mkstream=True)
            await r.xadd(stream, codec.encode(_batch("started")))  # type: ignore[arg-type]
            # the worker took the first batch (pending, never finished), then died; the second never reached it
            await r.xreadgroup(keys.GROUP_WORKER, "worker-1", {stream: ">"}, count=1)
            await r.xadd(stream, codec.encode(_batch("queued")))  # type: ignore[arg-type]
            assert await drain_unstarted(ctx, NODE, set(), {}) == 2
            assert await requeued() == {"started": 2, "queued": 2}
            assert await remaining_work(ctx.seqs, r, NODE) == (0, 0)  # the drain left nothing behind

            # a batcher that has not refreshed its view yet places a request on the dead node after the drain
            await r.xadd(stream, codec.encode(_batch("late")))  # type: ignore[arg-type]
            assert await remaining_work(ctx.seqs, r, NODE) == (0, 1), "the late batch is not seen as work"
            assert await drain_unstarted(ctx, NODE, set(), {}) == 1  # the redriven drain
            assert (await requeued())["late"] == 2
            assert await remaining_work(ctx.seqs, r, NODE) == (0, 0)
        finally:
            await r.aclose()
            await ctx.close()

    asyncio.run(run())


def test_remaining_work_sees_an_entry_past_a_group_moved_by_setid(clean_services, config_file):  # type: ignore[no-untyped-def]
    """A group moved with XGROUP SETID (as drains did before) has no lag Valkey can count: the entry past its last
    delivery is still found."""
    config = harness.small_config(config_file(harness.SMALL_CLUSTER))
    stream = keys.node_batches(NODE)

    async def run() -> None:
        ctx = FailoverContext.open(config, clean_services.redis_url, clean_services.etcd_url)
        r = connect(clean_services.redis_url)
        try:
            await r.xgroup_create(stream, keys.GROUP_WORKER, id="0", mkstream=True)
            await r.xadd(stream, codec.encode(_batch("a")))  # type: ignore[arg-type]
            tail = await r.xadd(stream, codec.encode(_batch("b")))  # type: ignore[arg-type]
            await r.xgroup_setid(stream, keys.GROUP_WORKER, tail)  # what such a drain did after reading a and b
            await r.xadd(stream, codec.encode(_batch("late")))  # type: ignore[arg-type]
            group = (await r.xinfo_groups(stream))[0]
            assert group["lag"] is None  # the precondition: Valkey cannot say
            assert await remaining_work(ctx.seqs, r, NODE) == (0, 1)
        finally:
            await r.aclose()
            await ctx.close()

    asyncio.run(run())
