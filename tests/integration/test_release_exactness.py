"""A sequence released mid-generation (failover moves it away from a live node): the KV snapshot it exports counts
exactly the tokens its client has been sent. Were the snapshot one token ahead, the new owner would resume after a
token nobody sent (a hole in the client's stream); one behind, it would send a token twice.

A real worker (the sim engine, and the torch engine whose steps run in a thread; coalesced token flushes) on real
Valkey and etcd, in this process; each sequence is released once it has produced a random number of tokens (up to
half its length, drawn per sequence), so a release and a step interleave in every way they can. The moment comes
from the token count the worker observed, not from the wall clock: on a loaded machine every release still lands
mid-generation."""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis

from pipeline.events import BatchEvent, ReleaseEvent, RequestEvent, TokenEvent
from streams import codec, keys
from streams.runner import connect
from tests.integration import harness
from workers.local.services import ServiceEndpoints
from workers.shell.runtime import WALL

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NODE, RACK, MODEL = "r0-n0", "r0", "qwen2-7b"
SEQUENCES = 16


def _request(max_tokens: int) -> RequestEvent:
    return RequestEvent(
        request_id=str(uuid.uuid4()), version=1, tenant="t1", user_id="u1", model=MODEL, in_tokens=64,
        out_tokens=max_tokens, max_tokens=max_tokens, mem_est_kb=64.0, arrival_ms=WALL.now_ms(), prompt="hello",
        rack=RACK,
    )


async def _sent_indices(r: aioredis.Redis, rid: str) -> list[int]:
    out = []
    for _eid, fields in await r.xrange(keys.request_out(rid)):
        ev = codec.decode(fields)
        if isinstance(ev, TokenEvent):
            out += [ev.index + k for k in range(len(ev.token_ids))]
    return out


async def _scenario(ep: ServiceEndpoints, config: Any, seed: int, engine: str) -> list[tuple[str, int, list[int]]]:
    from workers.roles.worker import Worker

    rng = random.Random(seed)
    worker = Worker(config, NODE, engine, ep.redis_url, ep.etcd_url, grace_s=2.0)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    r = connect(ep.redis_url)
    try:
        while worker._engine_task is None:
            assert not task.done(), task
            await asyncio.sleep(0.05)
        reqs = [_request(rng.randint(150, 400)) for _ in range(SEQUENCES)]
        now = WALL.now_ms()
        await r.xadd(keys.node_batches(NODE), codec.encode(BatchEvent(str(uuid.uuid4()), RACK, NODE, tuple(reqs),
                                                                      64.0 * len(reqs), 1e6, now, now)))
        while sum(rid in worker.live for rid in (q.request_id for q in reqs)) < SEQUENCES:
            await asyncio.sleep(0.01)
        # mid-generation, at uneven token counts
        targets = {q.request_id: rng.randint(1, q.max_tokens // 2) for q in reqs}
        while targets:
            for rid, target in list(targets.items()):
                live = worker.live.get(rid)
                assert live is not None, f"{rid} left the worker before its release (target {target} tokens)"
                if len(live.text) >= target:
                    del targets[rid]
                    await r.xadd(keys.node_control(NODE), codec.encode(ReleaseEvent(rid, 2, "r0-n1", WALL.now_ms())))
            await asyncio.sleep(0.002)
        out = []
        for q in reqs:
            for _ in range(400):
                mark = await r.get(keys.seq_released(q.request_id, 2))
                if mark is not None:
                    break
                await asyncio.sleep(0.025)
            if mark == b"none":  # it had finished before its release landed: nothing to move
                assert await r.exists(keys.result_done(q.request_id)), f"{q.request_id}: released without KV"
                continue
            assert mark == b"kv", f"{q.request_id}: release marker {mark!r}"
            snap = await worker.kv.get_from("L2", q.request_id)
            assert snap is not None and snap.version == 2
            out.append((q.request_id, len(snap.generated), await _sent_indices(r, q.request_id)))
        return out
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await r.aclose()


@pytest.mark.parametrize(("engine", "seed"), [("sim", 1), ("sim", 2), ("torch", 3)])
def test_released_snapshot_counts_exactly_the_tokens_sent(clean_services: ServiceEndpoints, config_file: Any,
                                                          engine: str, seed: int) -> None:
    path = config_file({**harness.SMALL_CLUSTER, "policies": {"worker": {"token_flush_ms": 30}}})
    config = harness.small_config(path)
    rows = asyncio.run(_scenario(clean_services, config, seed, engine))
    mid = [n for _rid, n, _sent in rows if n > 0]
    assert len(mid) == SEQUENCES, f"a release landed after its sequence ended: {[n for _r, n, _s in rows]}"
    print(f"\n{engine}: {len(mid)} sequences released mid-generation, after {min(mid)}-{max(mid)} tokens")
    for rid, n, sent in rows:
        assert sorted(sent) == list(range(len(sent))), f"{rid}: sent token indices have a gap or a repeat"
        assert len(sent) == n, f"{rid}: snapshot holds {n} generated tokens, its client was sent {len(sent)}"
