"""A sequence moved to a node that died before claiming it (its etcd record has no entry) is still found: the
failover tasks find its request in the ResumeEvent of the move (or on the rack's stream) and requeue it, instead of
reporting it missing forever (seen once under CPU starvation: every worker's lease expired in turn)."""

from __future__ import annotations

import asyncio

from pipeline.events import RequestEvent, ResumeEvent
from streams import codec, keys
from streams.runner import connect
from tests.integration import harness
from workers.control.failover import FailoverContext, migrate_sequence, requeue_request
from workers.shell.runtime import WALL
from workers.stores.etcd import SeqRecord


def _req(rid: str) -> RequestEvent:
    return RequestEvent(request_id=rid, version=2, tenant="t", user_id="u", model="qwen2-7b", in_tokens=100,
                        out_tokens=10, max_tokens=10, mem_est_kb=1000.0, arrival_ms=WALL.now_ms(), rack="r1")


def test_a_moved_sequence_whose_target_never_claimed_it_is_requeued(clean_services, config_file):  # type: ignore[no-untyped-def]
    config = harness.small_config(config_file(harness.SMALL_CLUSTER))

    async def run() -> tuple[str, str, list[RequestEvent]]:
        ctx = FailoverContext.open(config, clean_services.redis_url, clean_services.etcd_url)
        r = connect(clean_services.redis_url)
        try:
            # seq A: moved r1-n1 -> r1-n0 at v3; the ResumeEvent is in r1-n0's batch stream; r1-n0 died unclaimed
            a = _req("seq-a")
            await r.xadd(keys.node_batches("r1-n0"), codec.encode(ResumeEvent(  # type: ignore[arg-type]
                request=a, generated=(1, 2), texts=("a", "b"),
                src="r1-n1")))
            # seq B: only the router's copy on the rack stream is left
            b = _req("seq-b")
            await r.xadd(keys.rack_requests("r1"), codec.encode(b))  # type: ignore[arg-type]
            now = WALL.now_ms()
            await ctx.seqs.apply([SeqRecord("seq-a", "r1-n0", 3, "r1", now, ""),
                                  SeqRecord("seq-b", "r1-n0", 3, "r1", now, "")], [])
            got_a = await requeue_request(ctx, "seq-a", 3, "r1-n0")
            rep_b = await migrate_sequence(ctx, "seq-b", 3, "r1-n0", None)
            queued = [codec.decode(f) for _i, f in await r.xrange(keys.rack_requests("r1"))]
            return got_a, rep_b.outcome, queued  # type: ignore[return-value]
        finally:
            await r.aclose()
            await ctx.close()

    got_a, out_b, queued = asyncio.run(run())
    assert got_a == "requeued"
    assert any(q.request_id == "seq-a" and q.version == 4 for q in queued), queued
    # no live node registered: the move finds the request and then has no target (not "missing")
    assert out_b == "no-target"
