"""Failover actions (ARCHITECTURE §5): what the Celery tasks `drain_node`, `migrate_sequence` and `requeue_request`
do. They are idempotent and take ids, not objects: each re-reads the state it needs (etcd records, streams).

- drain_node(node): every live sequence the node owns (its etcd records) is migrated to a healthy node of the same
  rack (plan_migrations); every request waiting in the node's batch stream that it never started (pending or not
  yet delivered) is requeued to its rack. Safe to run again: moved sequences are `already` moved.
- migrate_sequence(uuid, version, src, dst): ownership (src, v) -> (dst, v+1) by compare-and-swap in etcd; if the
  source is alive it is told to release the sequence (its tokens flushed, its KV exported to the tiers) and the move
  waits for that; the request and the tokens the client already has are read back (the request from the stream
  entry that carried it, the tokens from the client's own stream), and a ResumeEvent goes to the target, which
  applies the seed's version rule and continues after the last token the client saw: no gap, no repeat.
- requeue_request(uuid, version): the request goes back to its rack's batcher at version + 1 (when no node can take
  a live sequence, or a request never started).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from pipeline.config import RackflowConfig
from pipeline.events import BatchEvent, DecisionEvent, ReleaseEvent, RequestEvent, ResultEvent, ResumeEvent, TokenEvent
from pipeline.failover import LiveSequence, plan_migrations
from pipeline.routing.views import NodeView
from pipeline.stats import stream_id_key
from streams import codec, keys
from streams.errors import DecodeError
from streams.runner import StreamProducer, connect
from workers.shell.runtime import WALL
from workers.stores.cluster_view import ClusterView
from workers.stores.etcd import MoveOutcome, NodeRegistry, SeqRecord, SequenceRegistry

log = logging.getLogger(__name__)


@dataclass
class FailoverContext:
    config: RackflowConfig
    r: aioredis.Redis
    registry: NodeRegistry
    seqs: SequenceRegistry
    producer: StreamProducer
    release_timeout_s: float = 5.0

    @classmethod
    def open(cls, config: RackflowConfig, redis_url: str, etcd_url: str) -> FailoverContext:
        r = connect(redis_url)
        registry = NodeRegistry(etcd_url)
        return cls(config, r, registry, SequenceRegistry(registry.client),
                   StreamProducer(r, WALL.now_ms, config.policies.streams.retention_s * 1000))

    async def close(self) -> None:
        await self.registry.close(revoke=False)
        await self.r.aclose()


@dataclass(frozen=True)
class MigrationReport:
    seq_id: str
    outcome: str
    """moved | already | conflict | missing | finished | requeued | no-target"""
    src: str
    dst: str | None
    version: int
    kv: str = ""
    """`snapshot` when the target can import the source's KV, `re-prefill` otherwise."""
    tokens: int = 0
    ms: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


async def _find_request(ctx: FailoverContext, node: str, entry: str, seq_id: str) -> RequestEvent | None:
    """The request as it reached `node`: from the batch (or resume) entry that carried it."""
    if not entry:
        return None
    rows = await ctx.r.xrange(keys.node_batches(node), min=entry, max=entry)
    for _eid, fields in rows:
        try:
            ev = codec.decode(fields)
        except DecodeError:
            return None
        if isinstance(ev, BatchEvent):
            return next((q for q in ev.requests if q.request_id == seq_id), None)
        if isinstance(ev, ResumeEvent) and ev.request.request_id == seq_id:
            return ev.request
    return None


async def _client_tokens(ctx: FailoverContext, seq_id: str) -> tuple[list[int], list[str], float, bool]:
    """The tokens the client has received (deduplicated by index), when it got the first, and whether the stream
    already ended with a result."""
    ids: list[int] = []
    texts: list[str] = []
    first_ms = 0.0
    for _eid, fields in await ctx.r.xrange(keys.request_out(seq_id)):
        try:
            ev = codec.decode(fields)
        except DecodeError:
            continue
        if isinstance(ev, ResultEvent):
            return ids, texts, first_ms, True
        if isinstance(ev, TokenEvent):
            if not first_ms:
                first_ms = ev.ts_ms
            for k, (tid, text) in enumerate(zip(ev.token_ids, ev.texts, strict=True)):
                if ev.index + k == len(ids):
                    ids.append(tid)
                    texts.append(text)
    return ids, texts, first_ms, False


async def _views(ctx: FailoverContext) -> ClusterView:
    view = ClusterView(ctx.config, ctx.r, ctx.registry, stale_ms=ctx.config.policies.node_selection.stale_ms)
    await view.refresh()
    return view


async def _targets(
    ctx: FailoverContext, src: str
) -> tuple[list[NodeView], list[NodeView], dict[str, frozenset[str]]]:
    """What a move off `src` can go to: the nodes of its rack, the others, and the models each serves."""
    view = await _views(ctx)
    now = WALL.now_ms()
    rack = ctx.config.rack_of(src)
    same = view.node_views(now, rack)
    others = [v for r in ctx.config.rack_names() if r != rack for v in view.node_views(now, r)]
    return same, others, {n.name: frozenset(n.models) for n in ctx.config.nodes()}


async def choose_target(ctx: FailoverContext, src: str, seq: LiveSequence) -> str | None:
    same, others, serves = await _targets(ctx, src)
    plan = plan_migrations(src, [seq], same, others, serves)
    return plan[0].dst if plan else None


async def migrate_sequence(ctx: FailoverContext, seq_id: str, version: int, src: str,
                           dst: str | None) -> MigrationReport:
    t0 = time.perf_counter()
    if await ctx.r.exists(keys.result_done(seq_id)):
        return MigrationReport(seq_id, "finished", src, dst, version)
    rec = await ctx.seqs.get(seq_id)
    if rec is not None and rec.version > version:
        return MigrationReport(seq_id, "already", src, rec.owner, rec.version)
    entry = rec.entry if rec is not None else ""
    req = await _find_request(ctx, src, entry, seq_id)
    if req is None:
        req = await _search_request(ctx, src, seq_id, rec.last_update_ts if rec else None)
    if req is None:
        log.warning("sequence %s: its request is not in %s's stream; requeue instead", seq_id, src)
        return MigrationReport(seq_id, "missing", src, dst, version)
    if dst is None:
        dst = await choose_target(ctx, src, LiveSequence(seq_id, version, req.model, req.mem_est_kb))
    if dst is None:
        return MigrationReport(seq_id, "no-target", src, None, version)
    outcome, moved = await ctx.seqs.move(seq_id, version, src, dst, WALL.now_ms())
    if outcome != MoveOutcome.MOVED:
        return MigrationReport(seq_id, outcome.value, src, moved.owner if moved else dst,
                               moved.version if moved else version)
    new_version = version + 1
    # a live source stops the sequence first (no token from it after this), exporting its KV to the tiers
    snapshot_version = 0
    if src in await ctx.registry.nodes():
        await ctx.producer.add(keys.node_control(src), ReleaseEvent(seq_id, new_version, dst, WALL.now_ms()))
        deadline = time.monotonic() + ctx.release_timeout_s
        while time.monotonic() < deadline:
            mark = await ctx.r.get(keys.seq_released(seq_id, new_version))
            if mark is not None:
                snapshot_version = new_version if mark == b"kv" else 0
                break
            await asyncio.sleep(0.01)
        else:
            log.warning("sequence %s: %s did not confirm the release in %.1fs; moving on", seq_id, src,
                        ctx.release_timeout_s)
    ids, texts, first_ms, finished = await _client_tokens(ctx, seq_id)
    if finished:
        return MigrationReport(seq_id, "finished", src, dst, new_version, tokens=len(ids))
    resume = ResumeEvent(
        request=dataclasses.replace(req, version=new_version), generated=tuple(ids), texts=tuple(texts), src=src,
        first_token_ms=first_ms, start_ms=req.arrival_ms, snapshot_version=snapshot_version, reason="failover",
    )
    await ctx.producer.add(keys.node_batches(dst), resume)
    ms = (time.perf_counter() - t0) * 1000.0
    await ctx.producer.add(keys.DECISIONS, DecisionEvent(
        kind="migration", policy="failover", choice=dst, request_ids=(seq_id,), ts_ms=WALL.now_ms(),
        scores={"ms": ms, "tokens": float(len(ids)), "version": float(new_version),
                "kv_snapshot": float(bool(snapshot_version))}, batch_id=src,
    ))
    log.info("sequence %s: moved %s -> %s at v%d after %d tokens in %.1f ms", seq_id, src, dst, new_version,
             len(ids), ms)
    return MigrationReport(seq_id, "moved", src, dst, new_version, "snapshot" if snapshot_version else "re-prefill",
                           len(ids), ms)


async def requeue_request(ctx: FailoverContext, seq_id: str, version: int, src: str) -> str:
    """Send a request back to its rack's batcher at version + 1 (its earlier owner's work is dropped; tokens the
    client already has are regenerated identically and skipped by index at the gateway)."""
    if await ctx.r.exists(keys.result_done(seq_id)):
        return "finished"
    rec = await ctx.seqs.get(seq_id)
    if rec is not None and rec.version > version:
        return "already"
    req = await _find_request(ctx, src, rec.entry if rec else "", seq_id)
    if req is None:
        req = await _search_request(ctx, src, seq_id, rec.last_update_ts if rec else None)
    if req is None:
        return "missing"
    rack = req.rack or ctx.config.rack_of(src)
    await ctx.producer.add(keys.rack_requests(rack), dataclasses.replace(req, version=version + 1))
    if rec is not None:
        await ctx.seqs.apply([], [seq_id])
    return "requeued"


async def _search_request(ctx: FailoverContext, node: str, seq_id: str,
                          around_ms: float | None = None) -> RequestEvent | None:
    """The request of `seq_id` when its record does not point at it (a move whose target died before claiming
    it, a record written without its entry): the newest carrier in the node's batch stream (a BatchEvent, or the
    ResumeEvent of an earlier move), else the request as the router placed it on the rack's stream. Bounded to
    two minutes before the record's last update (a sequence is never older than its record's previous hop)."""
    lo = "-" if around_ms is None else str(max(0, int(around_ms) - 120_000))
    for _eid, fields in await ctx.r.xrevrange(keys.node_batches(node), max="+", min=lo, count=5000):
        try:
            ev = codec.decode(fields)
        except DecodeError:
            continue
        if isinstance(ev, BatchEvent):
            for q in ev.requests:
                if q.request_id == seq_id:
                    return q
        elif isinstance(ev, ResumeEvent) and ev.request.request_id == seq_id:
            return ev.request
    try:
        rack = ctx.config.rack_of(node)
    except (KeyError, ValueError):
        return None
    for _eid, fields in await ctx.r.xrevrange(keys.rack_requests(rack), max="+", min=lo, count=20000):
        try:
            ev = codec.decode(fields)
        except DecodeError:
            continue
        if isinstance(ev, RequestEvent) and ev.request_id == seq_id:
            return ev
    return None


@dataclass(frozen=True)
class Unstarted:
    """What a node was handed and never finished: the requests, and the stream entries that carried them (to be
    acknowledged only once every request is safely back with its rack's batcher)."""

    requests: list[RequestEvent]
    pending_ids: list[str]
    tail_id: str | None


async def unstarted_requests(ctx: FailoverContext, node: str) -> Unstarted:
    """Requests in `node`'s batch stream that it has not finished: pending entries of its consumer group and
    entries not delivered yet. Nothing is acknowledged here (see `release_unstarted`)."""
    stream = keys.node_batches(node)
    try:
        groups = await ctx.r.xinfo_groups(stream)
    except aioredis.ResponseError:
        return Unstarted([], [], None)
    group = next((g for g in groups if g.get("name") in (keys.GROUP_WORKER, keys.GROUP_WORKER.encode())), None)
    if group is None:
        return Unstarted([], [], None)
    last = group.get("last-delivered-id")
    last = last.decode() if isinstance(last, bytes) else str(last)
    pending = await ctx.r.xpending_range(stream, keys.GROUP_WORKER, min="-", max="+", count=100_000)
    ids = [p["message_id"].decode() if isinstance(p["message_id"], bytes) else p["message_id"] for p in pending]
    entries = [row for i in ids for row in await ctx.r.xrange(stream, min=i, max=i)]
    entries += await ctx.r.xrange(stream, min=f"({last}", max="+") if last not in ("0-0", "") else []
    reqs: list[RequestEvent] = []
    seen: set[str] = set()
    for _eid, fields in entries:
        try:
            ev = codec.decode(fields)
        except DecodeError:
            continue
        batch = ev.requests if isinstance(ev, BatchEvent) else (ev.request,) if isinstance(ev, ResumeEvent) else ()
        for q in batch:
            if q.request_id not in seen:
                seen.add(q.request_id)
                reqs.append(q)
    tail = entries[-1][0] if entries else None
    tail_id = tail.decode() if isinstance(tail, bytes) else tail
    done = await _done_set(ctx, [q.request_id for q in reqs])
    return Unstarted([q for q in reqs if q.request_id not in done], ids, tail_id)


async def release_unstarted(ctx: FailoverContext, node: str, unstarted: Unstarted) -> None:
    """Acknowledge the entries `unstarted` read and move the group past them, so a restarted worker of the node
    does not run them again. Called after their requests were requeued: a crash in between requeues them twice
    (harmless: one final result per request, tokens deduplicated by index), never zero times."""
    stream = keys.node_batches(node)
    if unstarted.pending_ids:
        await ctx.r.xack(stream, keys.GROUP_WORKER, *unstarted.pending_ids)
    if unstarted.tail_id is not None:
        info = await ctx.r.xinfo_groups(stream)
        group = next((g for g in info if g.get("name") in (keys.GROUP_WORKER, keys.GROUP_WORKER.encode())), None)
        last = group.get("last-delivered-id") if group else None
        last = last.decode() if isinstance(last, bytes) else str(last or "0-0")
        if stream_id_key(unstarted.tail_id) > stream_id_key(last):  # never move the group backwards
            await ctx.r.xgroup_setid(stream, keys.GROUP_WORKER, unstarted.tail_id)


async def _done_set(ctx: FailoverContext, ids: list[str]) -> set[str]:
    if not ids:
        return set()
    values = await ctx.r.mget([keys.result_done(i) for i in ids])
    return {i for i, v in zip(ids, values, strict=True) if v is not None}


@dataclass(frozen=True)
class DrainPlan:
    migrate: list[tuple[str, int, str | None]]
    """(seq_id, version, dst) for live sequences with a record."""
    requeue: list[tuple[str, int]]
    """(seq_id, version) for requests the node never started or whose record was lost."""
    unstarted: Unstarted | None = None
    """The batch-stream entries behind `requeue`, acknowledged by `drain_unstarted` once they are requeued."""


async def plan_drain(ctx: FailoverContext, node: str) -> DrainPlan:
    records: list[SeqRecord] = await ctx.seqs.owned_by(node)
    recorded = {r.seq_id for r in records}
    same, others, serves = await _targets(ctx, node)
    model = ctx.config.node(node).models[0]
    live = [LiveSequence(r.seq_id, r.version, model, 0.0) for r in records]
    plan = plan_migrations(node, live, same, others, serves)
    migrate = [(m.seq_id, m.version - 1, m.dst) for m in plan]
    unstarted = await unstarted_requests(ctx, node)
    requeue = [(q.request_id, q.version) for q in unstarted.requests if q.request_id not in recorded]
    return DrainPlan(migrate, requeue, unstarted)


async def drain_unstarted(ctx: FailoverContext, node: str, plan: DrainPlan) -> int:
    """Requeue what `node` never started, in this task (not fanned out: the entries are acknowledged right after,
    so a task lost in between would lose its request), then acknowledge the entries. Returns how many."""
    for seq_id, version in plan.requeue:
        await requeue_request(ctx, seq_id, version, node)
    if plan.unstarted is not None:
        await release_unstarted(ctx, node, plan.unstarted)
    return len(plan.requeue)


async def remaining_work(seqs: SequenceRegistry, r: aioredis.Redis, node: str) -> tuple[int, int]:
    """(live sequences still recorded as owned by `node`, batch-stream entries it holds or has not been given):
    what a drain of the node has not finished yet."""
    owned = len(await seqs.owned_by(node))
    stream = keys.node_batches(node)
    try:
        groups = await r.xinfo_groups(stream)
    except aioredis.ResponseError:
        return owned, 0
    group = next((g for g in groups if g.get("name") in (keys.GROUP_WORKER, keys.GROUP_WORKER.encode())), None)
    if group is None:
        return owned, 0
    return owned, int(group.get("pending") or 0) + int(group.get("lag") or 0)
