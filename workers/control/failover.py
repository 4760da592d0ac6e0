"""Failover actions (ARCHITECTURE §5): what the Celery tasks `drain_node`, `migrate_sequence` and `requeue_request`
do. They are idempotent and take ids, not objects: each re-reads the state it needs (etcd records, streams).

- drain_node(node): every live sequence the node owns (its etcd records) is migrated to a healthy node of the same
  rack (plan_migrations), in this task (`move_sequences`: no Celery hop per sequence); every request waiting in the
  node's batch stream that it never started (pending or not yet delivered) is requeued to its rack. Safe to run
  again: moved sequences are `already` moved, and a move whose target was never told (the drain died in between)
  is told again. A sequence whose record or request is not where the plan saw it is left to a `migrate_sequence`
  task of its own.
- migrate_sequence(uuid, version, src, dst): ownership (src, v) -> (dst, v+1) by compare-and-swap in etcd; if the
  source is alive it is told to release the sequence (its tokens flushed, its KV exported to the tiers) and the move
  waits for that; the request and the tokens the client already has are read back (the request from the stream
  entry that carried it, the tokens from the client's own stream), and a ResumeEvent goes to the target, which
  applies the seed's version rule and continues after the last token the client saw: no gap, no repeat.
- requeue_request(uuid, version): the request goes back to its rack's batcher at version + 1 (when no node can take
  a live sequence, or a request never started).

A move is lean: ONE etcd transaction changes the owner (a compare-and-swap on the mod revision the plan read) and
reads the source's registration (is its lease alive?), while ONE Valkey round trip reads what the move needs (the
result marker, the entry that carried the request, the client stream); then one Valkey round trip hands the
sequence to its new owner (a ResumeEvent; to a source taken for dead, whose process may only be stalled, also a
release that stops its copy by the version rule). A live source is released first: the mover blocks on the
release's wake stream (XREAD BLOCK), it does not poll. Several sequences can share the transaction (one nested
compare-and-swap each, decided each on its own): a live source's drain moves them so, with one set of releases.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import redis.asyncio as aioredis

from pipeline.config import RackflowConfig
from pipeline.events import BatchEvent, DecisionEvent, ReleaseEvent, RequestEvent, ResultEvent, ResumeEvent, TokenEvent
from pipeline.failover import LiveSequence, plan_migrations
from pipeline.routing.views import NodeView
from streams import codec, keys
from streams.errors import DecodeError
from streams.runner import StreamProducer, connect
from workers.shell.runtime import WALL
from workers.stores.cluster_view import ClusterView
from workers.stores.etcd import MoveOutcome, MoveResult, NodeRegistry, PlannedMove, SeqRecord, SequenceRegistry

log = logging.getLogger(__name__)

RELEASE_WAKE_TTL_S = 60
"""How long a release's wake stream lives."""


def release_wake_key(seq_id: str, version: int) -> str:
    """A stream the old owner appends to right after it set the release marker of (seq_id, version): the mover
    blocks on it (XREAD BLOCK) instead of polling the marker. Same hash slot as the marker; a stream, not a list,
    because the worker's Valkey user may append to streams under `rf:seq:*` (deploy/valkey/users.acl.example)."""
    return keys.seq_released(seq_id, version) + ":wake"


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
    """Moved: from the start of the move to its ResumeEvent in the target's stream."""
    prepare_ms: float = 0.0
    """... of which reading the markers, requests and client streams and changing the owner (overlapped)."""
    release_ms: float = 0.0
    """... of which waiting for a live source to release the sequence."""
    batch: int = 1
    """How many sequences were moved together."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class MoveItem:
    """One sequence to move off its source: (seq_id, version) -> dst at version + 1, with what the plan read of its
    record (the mod revision, the entry that carried its request, its rack); 0 / "" where unknown."""

    seq_id: str
    version: int
    dst: str | None
    mod_revision: int = 0
    entry: str = ""
    rack: str = ""

    @property
    def planned(self) -> bool:
        """Everything a move in one transaction needs is known."""
        return bool(self.dst and self.mod_revision > 0 and self.entry)


@dataclass
class _Seen:
    """What the streams say about a sequence being moved."""

    done: bool = False
    req: RequestEvent | None = None
    ids: list[int] = dataclasses.field(default_factory=list)
    texts: list[str] = dataclasses.field(default_factory=list)
    first_ms: float = 0.0
    finished: bool = False


def _is_cluster(r: Any) -> bool:
    from redis.asyncio.cluster import RedisCluster

    return isinstance(r, RedisCluster)


def _request_in(ev: Any, seq_id: str) -> RequestEvent | None:
    if isinstance(ev, BatchEvent):
        return next((q for q in ev.requests if q.request_id == seq_id), None)
    if isinstance(ev, ResumeEvent) and ev.request.request_id == seq_id:
        return ev.request
    return None


def _decode_or_none(fields: Any) -> Any:
    try:
        return codec.decode(fields)
    except DecodeError:
        return None


_TOKEN_T = TokenEvent.TYPE.encode()
_RESULT_T = ResultEvent.TYPE.encode()
_CODEC_V = str(codec.CODEC_VERSION).encode()


def _token_chunk(fields: Any) -> tuple[int, list[int], list[str], float] | None:
    """(index, token ids, texts, ts) of a client-stream entry that is a plain TokenEvent, read straight from its
    msgpack payload (17x faster than the validating decode: a move reads every token the client has, ~100 entries
    per sequence); None for anything else or anything unusual, which then takes the validating decode."""
    if fields.get(b"t") != _TOKEN_T or fields.get(b"v") != _CODEC_V or b"o" in fields:
        return None
    try:
        d = msgpack.unpackb(fields[b"d"], raw=False)
        index, ids, texts, ts = d["index"], d["token_ids"], d["texts"], d["ts_ms"]
    except Exception:
        return None
    if type(index) is not int or type(ids) is not list or type(texts) is not list or type(ts) not in (int, float):
        return None
    n = len(ids)
    if n != len(texts) or not n:
        return None
    if n == 1:  # the usual chunk (one token per flush); no generator for it
        if type(ids[0]) is not int or type(texts[0]) is not str:
            return None
    elif not all(type(x) is int for x in ids) or not all(type(x) is str for x in texts):
        return None
    return index, ids, texts, float(ts)


def _tokens_of(rows: list[Any]) -> tuple[list[int], list[str], float, bool]:
    """The tokens a client stream holds (deduplicated by index), when the first came, whether a result ended it."""
    ids: list[int] = []
    texts: list[str] = []
    first_ms = 0.0
    for _eid, fields in rows:
        if fields.get(b"t") == _RESULT_T:
            return ids, texts, first_ms, True
        chunk = _token_chunk(fields)
        if chunk is None:
            ev = _decode_or_none(fields)
            if isinstance(ev, ResultEvent):
                return ids, texts, first_ms, True
            if not isinstance(ev, TokenEvent):
                continue
            chunk = (ev.index, list(ev.token_ids), list(ev.texts), ev.ts_ms)
        index, tids, ttexts, ts = chunk
        if not first_ms:
            first_ms = ts
        if index + len(tids) <= len(ids) or index > len(ids):
            continue  # a repeat the client skips, or (never seen) a gap
        cut = len(ids) - index
        ids += tids[cut:]
        texts += ttexts[cut:]
    return ids, texts, first_ms, False


async def _find_request(ctx: FailoverContext, node: str, entry: str, seq_id: str) -> RequestEvent | None:
    """The request as it reached `node`: from the batch (or resume) entry that carried it."""
    if not entry:
        return None
    for _eid, fields in await ctx.r.xrange(keys.node_batches(node), min=entry, max=entry):
        return _request_in(_decode_or_none(fields), seq_id)
    return None


async def _client_tokens(ctx: FailoverContext, seq_id: str) -> tuple[list[int], list[str], float, bool]:
    """The tokens the client has received (deduplicated by index), when it got the first, and whether the stream
    already ended with a result."""
    return _tokens_of(await ctx.r.xrange(keys.request_out(seq_id)))


async def _read_state(ctx: FailoverContext, src: str, items: list[MoveItem],
                      carriers: dict[str, Any] | None = None) -> list[_Seen]:
    """For every item, in ONE round trip: its result marker, the entry that carried its request to `src`, and its
    client stream. `carriers`: entries already read and decoded (entry id -> event), filled in with the new ones: a
    batch entry carries many sequences, and a drain reads and decodes it once."""
    carriers = {} if carriers is None else carriers
    entries = list(dict.fromkeys(it.entry for it in items if it.entry and it.entry not in carriers))
    pipe = ctx.r.pipeline(transaction=False)
    for it in items:
        pipe.exists(keys.result_done(it.seq_id))
    for e in entries:
        pipe.xrange(keys.node_batches(src), min=e, max=e)
    for it in items:
        pipe.xrange(keys.request_out(it.seq_id))
    rows = await pipe.execute()
    n, m = len(items), len(entries)
    carriers.update({e: (_decode_or_none(r[0][1]) if r else None) for e, r in zip(entries, rows[n:n + m],
                                                                                     strict=True)})
    out = []
    for k, it in enumerate(items):
        ids, texts, first_ms, finished = _tokens_of(rows[n + m + k])
        out.append(_Seen(bool(rows[k]), _request_in(carriers.get(it.entry), it.seq_id) if it.entry else None,
                         ids, texts, first_ms, finished))
    return out


async def _await_releases(ctx: FailoverContext, src: str, moves: list[tuple[str, int, str]]) -> dict[str, int]:
    """Tell the live source to release each (seq_id, new_version, dst), in one round trip, and wait for its
    markers, blocked on their wake streams (never a poll); seq_id -> the KV snapshot version to import (0: none).
    A release not confirmed within `release_timeout_s` is given up (the new owner then re-prefills)."""
    now = WALL.now_ms()
    await ctx.producer.add_many((keys.node_control(src), ReleaseEvent(sid, v, dst, now)) for sid, v, dst in moves)
    waiting = {sid: v for sid, v, _dst in moves}
    out: dict[str, int] = {}
    deadline = time.monotonic() + ctx.release_timeout_s
    while waiting:
        pipe = ctx.r.pipeline(transaction=False)
        for sid, v in waiting.items():
            pipe.get(keys.seq_released(sid, v))
        marks = await pipe.execute()
        for (sid, v), mark in zip(list(waiting.items()), marks, strict=True):
            if mark is not None:
                out[sid] = v if mark == b"kv" else 0
                del waiting[sid]
        left = deadline - time.monotonic()
        if not waiting:
            break
        if left <= 0:
            log.warning("%d sequences: %s did not confirm their release in %.1fs; moving on (re-prefill)",
                        len(waiting), src, ctx.release_timeout_s)
            break
        wake = {release_wake_key(sid, v): "0-0" for sid, v in waiting.items()}
        if _is_cluster(ctx.r):  # one stream per blocking read there: the wake streams live in their sequences' slots
            wake = dict(list(wake.items())[:1])
        await ctx.r.xread(wake, count=1, block=max(1, int(min(left, 1.0) * 1000)))
    return out


async def _deliver(ctx: FailoverContext, src: str, moved: list[tuple[MoveItem, _Seen, SeqRecord | None]],
                   alive: bool, t0: float, t_prep: float, batch: int,
                   phases: dict[str, float] | None = None) -> tuple[
                       list[MigrationReport], list[tuple[str, Any]], list[SeqRecord]]:
    """The owner has changed for every (item, seen, record): a live source releases them first (and the client
    streams are read again after that), then ONE round trip hands each to its new owner: a ResumeEvent in its batch
    stream; a source taken for dead also gets a release of each (a stalled process that wakes up drops its copy by
    the version rule). Returns the reports, the DecisionEvents to write and the records written for sequences
    that turned out finished (to delete again), for the caller to write after its moves."""
    if not moved:
        return [], [], []
    snapshots: dict[str, int] = {}
    t_rel0 = time.perf_counter()
    if alive:
        snapshots = await _await_releases(ctx, src, [(it.seq_id, it.version + 1, str(it.dst)) for it, _s, _r in moved])
        pipe = ctx.r.pipeline(transaction=False)
        for it, _s, _r in moved:
            pipe.xrange(keys.request_out(it.seq_id))
        for (_it, sn, _r), rows in zip(moved, await pipe.execute(), strict=True):
            sn.ids, sn.texts, sn.first_ms, sn.finished = _tokens_of(rows)
    t_rel = time.perf_counter()
    now = WALL.now_ms()
    items: list[tuple[str, Any]] = []
    sent: list[tuple[MoveItem, _Seen]] = []
    reports: list[MigrationReport] = []
    finished: list[SeqRecord] = []
    for it, sn, rec in moved:
        new_version = it.version + 1
        if sn.finished:  # it ended before its release landed: nothing to resume, the new record goes again
            reports.append(MigrationReport(it.seq_id, "finished", src, it.dst, new_version, tokens=len(sn.ids)))
            if rec is not None:
                finished.append(rec)
            continue
        req = sn.req
        if req is None:  # callers hand over only sequences whose request they found
            continue
        items.append((keys.node_batches(str(it.dst)), ResumeEvent(
            request=dataclasses.replace(req, version=new_version), generated=tuple(sn.ids), texts=tuple(sn.texts),
            src=src, first_token_ms=sn.first_ms, start_ms=req.arrival_ms,
            snapshot_version=snapshots.get(it.seq_id, 0), reason="failover",
        )))
        if not alive:
            items.append((keys.node_control(src), ReleaseEvent(it.seq_id, new_version, str(it.dst), now)))
        sent.append((it, sn))
    if items:
        await ctx.producer.add_many(items)
    t_end = time.perf_counter()
    ms = (t_end - t0) * 1000.0
    prepare = (t_prep - t0) * 1000.0
    release = (t_rel - t_rel0) * 1000.0
    decisions = []
    for it, sn in sent:
        snap = snapshots.get(it.seq_id, 0)
        reports.append(MigrationReport(it.seq_id, "moved", src, it.dst, it.version + 1,
                                       "snapshot" if snap else "re-prefill", len(sn.ids), ms, prepare, release, batch))
        decisions.append((keys.DECISIONS, DecisionEvent(
            kind="migration", policy="failover", choice=str(it.dst), request_ids=(it.seq_id,), ts_ms=now,
            scores={"ms": ms, "tokens": float(len(sn.ids)), "version": float(it.version + 1),
                    "kv_snapshot": float(bool(snap)), "prepare_ms": prepare, "release_ms": release,
                    "batch": float(batch), **(phases or {})},
            batch_id=src,
        )))
        log.info("sequence %s: moved %s -> %s at v%d after %d tokens in %.1f ms (%d moved together)", it.seq_id,
                 src, it.dst, it.version + 1, len(sn.ids), ms, batch)
    return reports, decisions, finished


MOVE_CONCURRENCY = 1
"""Moves of one drain in flight at once. Each sequence is moved on its own: it waits for its own reads and writes,
not for every other sequence's (reading and decoding a client stream of ~100 entries is most of a move's CPU).
Measured on 2 loaded cores (load ~5), 14 sequences with 100-entry client streams, against the same Valkey and
etcd: per move p50 3.5-4.0 ms one at a time, 5.9-6.3 ms two at a time, 10.4-11 ms four at a time, and 20-43 ms
with all of them in one transaction and one read (each waited for the whole batch); the drain's total was about
the same in every case (the mover's CPU is the limit), so one at a time."""


async def move_sequences(ctx: FailoverContext, src: str, items: list[MoveItem],
                         together: bool = False) -> tuple[list[MigrationReport], list[MoveItem]]:
    """Move planned sequences off `src`, each a lean move (the module docstring: its Valkey reads overlapped with
    ONE etcd transaction that changes the owner and reads the source's registration, then one Valkey round trip
    that hands it over), MOVE_CONCURRENCY at a time. `together`: all in one transaction and one set of releases
    instead (a live source, whose releases are waited for: it runs them all between the same two engine steps).
    The decisions (DecisionEvent per move) and the clean-up of records written for sequences that turned out
    finished follow the moves, in one round trip each. Returns the reports of what
    was settled here, and the items left to a `migrate_sequence` task each: their record changed in a way this
    move does not decide, or their request was not in the entry the plan named."""
    reports: list[MigrationReport] = []
    left: list[MoveItem] = []
    decisions: list[tuple[str, Any]] = []
    finished: list[SeqRecord] = []
    groups = [items] if together else [[it] for it in items]
    carriers: dict[str, Any] = {}
    slots = asyncio.Semaphore(MOVE_CONCURRENCY)

    async def one(group: list[MoveItem]) -> Any:
        async with slots:
            return await _move_group(ctx, src, group, carriers)

    outs = await asyncio.gather(*(one(g) for g in groups if g), return_exceptions=True)
    for out in outs:
        if isinstance(out, BaseException):
            continue
        r, lf, d, f = out
        reports += r
        left += lf
        decisions += d
        finished += f
    failed = next((o for o in outs if isinstance(o, BaseException)), None)
    if failed is not None:  # the drain is retried (what was handed over is `already` moved then), its decisions kept
        if decisions:
            await ctx.producer.add_many(decisions)
        raise failed
    if decisions:
        await ctx.producer.add_many(decisions)
    if finished:
        await ctx.seqs.delete_if_unchanged(finished)
    return reports, left


async def _move_group(ctx: FailoverContext, src: str, items: list[MoveItem],
                      carriers: dict[str, Any] | None = None) -> tuple[
        list[MigrationReport], list[MoveItem], list[tuple[str, Any]], list[SeqRecord]]:
    t0 = time.perf_counter()
    planned = [PlannedMove(it.seq_id, it.version, src, str(it.dst), it.mod_revision, it.rack, it.entry)
               for it in items]
    cas_done: list[float] = []
    read_done: list[float] = []

    async def stamp(coro: Any, when: list[float]) -> Any:
        out = await coro
        when.append(time.perf_counter())
        return out

    seen, (results, alive) = await asyncio.gather(
        stamp(_read_state(ctx, src, items, carriers), read_done),
        stamp(ctx.seqs.move_many(planned, WALL.now_ms(), probe=src), cas_done))
    t_prep = time.perf_counter()
    phases = {"read_ms": (read_done[0] - t0) * 1000.0, "cas_ms": (cas_done[0] - t0) * 1000.0}
    reports: list[MigrationReport] = []
    left: list[MoveItem] = []
    moved: list[tuple[MoveItem, _Seen, SeqRecord | None]] = []
    finished: list[SeqRecord] = []
    for it, sn, res in zip(items, seen, results, strict=True):
        report = _settled(res, sn, src)
        if report is not None:
            reports.append(report)
            if report.outcome == "finished" and res.outcome is MoveOutcome.MOVED and res.record is not None:
                finished.append(res.record)
        elif sn.req is None:
            left.append(it)  # the owner is changed; the task finds the request elsewhere and tells the target
        else:
            moved.append((it, sn, res.record if res.outcome is MoveOutcome.MOVED else None))
    done, decisions, more = await _deliver(ctx, src, moved, bool(alive), t0, t_prep, len(items), phases)
    return reports + done, left, decisions, finished + more


def _settled(res: MoveResult, sn: _Seen, src: str) -> MigrationReport | None:
    """The report of a move that ends here (None: the owner changed to its target, hand the sequence over)."""
    m = res.move
    if res.outcome is MoveOutcome.MOVED or res.unclaimed_ours:
        if sn.done or sn.finished:
            return MigrationReport(m.seq_id, "finished", src, m.dst, m.version + 1, tokens=len(sn.ids))
        return None
    rec = res.record
    if res.outcome is MoveOutcome.MISSING and sn.done:
        return MigrationReport(m.seq_id, "finished", src, m.dst, m.version)
    return MigrationReport(m.seq_id, res.outcome.value, src, rec.owner if rec else m.dst,
                           rec.version if rec else m.version)


async def _views(ctx: FailoverContext) -> ClusterView:
    view = ClusterView(ctx.config, ctx.r, ctx.registry, stale_ms=ctx.config.policies.node_selection.stale_ms)
    await view.refresh()
    return view


async def _targets(
    ctx: FailoverContext, src: str
) -> tuple[list[NodeView], list[NodeView], dict[str, frozenset[str]]]:
    """What a move off `src` can go to: the nodes of its rack, the others, and the models each serves."""
    return _targets_in(ctx, await _views(ctx), src)


def _targets_in(ctx: FailoverContext, view: ClusterView, src: str) -> tuple[
        list[NodeView], list[NodeView], dict[str, frozenset[str]]]:
    now = WALL.now_ms()
    rack = ctx.config.rack_of(src)
    same = view.node_views(now, rack)
    others = [v for r in ctx.config.rack_names() if r != rack for v in view.node_views(now, r)]
    return same, others, {n.name: frozenset(n.models) for n in ctx.config.nodes()}


async def choose_target(ctx: FailoverContext, src: str, seq: LiveSequence) -> str | None:
    same, others, serves = await _targets(ctx, src)
    plan = plan_migrations(src, [seq], same, others, serves)
    return plan[0].dst if plan else None


async def migrate_sequence(ctx: FailoverContext, seq_id: str, version: int, src: str, dst: str | None,
                           mod_revision: int = 0, entry: str = "", rack: str = "") -> MigrationReport:
    """Move one sequence. With the plan's hints (`dst`, the record's `mod_revision` and `entry`) it is the lean
    move of `move_sequences`; without them (or when the record or request is no longer where the hints say) the
    record is read first, the request searched for, the target chosen, and then the owner changed. A record that
    an earlier attempt of this move already changed, but whose target never claimed the sequence (that attempt
    died before it told the target), is handed to the target again."""
    item = MoveItem(seq_id, version, dst, mod_revision, entry, rack)
    if item.planned:
        reports, _left = await move_sequences(ctx, src, [item])
        if reports:
            return reports[0]
        item = dataclasses.replace(item, mod_revision=0)  # its request was not in the entry: look for it
    t0 = time.perf_counter()
    rec, seen = await asyncio.gather(ctx.seqs.get(seq_id), _read_state(ctx, src, [item]))
    sn = seen[0]
    if sn.done or sn.finished:
        if rec is not None and rec.owner == src and rec.version == version:  # its dead owner never deleted it
            await ctx.seqs.delete_if_unchanged([rec])
        return MigrationReport(seq_id, "finished", src, dst, version)
    resend = False
    if rec is not None and rec.version > version:
        resend = (rec.version == version + 1 and not rec.entry and rec.moved_from in ("", src)
                  and (dst is None or rec.owner == dst))
        if not resend:
            return MigrationReport(seq_id, "already", src, rec.owner, rec.version)
        dst = rec.owner
    req = sn.req
    carrier = (rec.from_entry if resend else rec.entry) if rec is not None else ""
    if req is None and carrier and carrier != item.entry:
        req = await _find_request(ctx, src, carrier, seq_id)
    if req is None:
        req = await _search_request(ctx, src, seq_id, rec.last_update_ts if rec else None)
    if req is None:
        log.warning("sequence %s: its request is not in %s's stream; requeue instead", seq_id, src)
        return MigrationReport(seq_id, "missing", src, dst, version + 1 if resend else version)
    sn.req = req
    if dst is None:
        dst = await choose_target(ctx, src, LiveSequence(seq_id, version, req.model, req.mem_est_kb))
    if dst is None:
        return MigrationReport(seq_id, "no-target", src, None, version)
    item = dataclasses.replace(item, dst=dst)
    record: SeqRecord | None = None
    if resend:
        alive = False  # an earlier attempt released it from a live source already, if there was one
        log.warning("sequence %s: moved to %s at v%d by an earlier attempt that never told it; telling it now",
                    seq_id, dst, version + 1)
    else:
        results, probed = await ctx.seqs.move_many(
            [PlannedMove(seq_id, version, src, dst, rec.mod_revision if rec else 0, rec.rack if rec else "",
                         rec.entry if rec else "")],
            WALL.now_ms(), probe=src)
        res = results[0]
        report = _settled(res, sn, src)
        if report is not None:
            return report
        alive = bool(probed)
        record = res.record if res.outcome is MoveOutcome.MOVED else None
    reports, decisions, finished = await _deliver(ctx, src, [(item, sn, record)], alive, t0, time.perf_counter(), 1)
    if decisions:
        await ctx.producer.add_many(decisions)
    if finished:
        await ctx.seqs.delete_if_unchanged(finished)
    return reports[0]


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


DRAIN_CONSUMER = "failover-drain"
"""The consumer (in the node's worker group) a drain reads the undelivered tail of a node's batch stream as: the read
is a delivery, so the group's bookkeeping stays exact (its `lag`, which `remaining_work`, the cluster view and the
metrics read) and an entry appended after it (a batcher whose view still listed the node) is still undelivered
work that the monitor's redrive sees. Moving the group with XGROUP SETID instead left `lag` unknown (null), read as
0: such an entry was lost."""


@dataclass(frozen=True)
class Unstarted:
    """What a node was handed and never finished: the requests, and the stream entries that carried them (to be
    acknowledged only once every request is safely back with its rack's batcher)."""

    requests: list[RequestEvent]
    pending_ids: list[str]
    """Every entry read: the group's pending entries and the undelivered tail (now pending under DRAIN_CONSUMER)."""


def _id_str(i: Any) -> str:
    return i.decode() if isinstance(i, bytes) else str(i)


async def unstarted_requests(ctx: FailoverContext, node: str) -> Unstarted:
    """Requests in `node`'s batch stream that it has not finished: pending entries of its consumer group and
    entries not delivered yet. The undelivered ones are delivered to DRAIN_CONSUMER (XREADGROUP, in the same round
    trip as the pending entries' reads), so they stay pending until `release_unstarted` acknowledges them: a drain
    that dies in between leaves them to the next one, and an entry appended afterwards is never skipped."""
    stream = keys.node_batches(node)
    try:
        groups = await ctx.r.xinfo_groups(stream)
    except aioredis.ResponseError:
        return Unstarted([], [])
    group = next((g for g in groups if g.get("name") in (keys.GROUP_WORKER, keys.GROUP_WORKER.encode())), None)
    if group is None:
        return Unstarted([], [])
    pending = await ctx.r.xpending_range(stream, keys.GROUP_WORKER, min="-", max="+", count=100_000)
    ids = [_id_str(p["message_id"]) for p in pending]
    pipe = ctx.r.pipeline(transaction=False)  # every pending entry and the undelivered tail in one round trip
    for i in ids:
        pipe.xrange(stream, min=i, max=i)
    pipe.xreadgroup(keys.GROUP_WORKER, DRAIN_CONSUMER, {stream: ">"}, count=100_000)
    rows = await pipe.execute()
    entries = [row for rs in rows[:-1] for row in rs]
    tail = [row for _s, rs in (rows[-1] or []) for row in rs]
    entries += tail
    ids += [_id_str(eid) for eid, _f in tail]
    reqs: list[RequestEvent] = []
    seen: set[str] = set()
    for _eid, fields in entries:
        if not fields:
            continue
        try:
            ev = codec.decode(fields)
        except DecodeError:
            continue
        batch = ev.requests if isinstance(ev, BatchEvent) else (ev.request,) if isinstance(ev, ResumeEvent) else ()
        for q in batch:
            if q.request_id not in seen:
                seen.add(q.request_id)
                reqs.append(q)
    done = await _done_set(ctx, [q.request_id for q in reqs])
    return Unstarted([q for q in reqs if q.request_id not in done], ids)


async def release_unstarted(ctx: FailoverContext, node: str, unstarted: Unstarted) -> None:
    """Acknowledge the entries `unstarted` read (the pending ones and the tail it delivered to itself), so a
    restarted worker of the node does not run them again. Called after their requests were requeued: a crash in
    between requeues them twice (harmless: one final result per request, tokens deduplicated by index), never zero
    times."""
    if unstarted.pending_ids:
        await ctx.r.xack(keys.node_batches(node), keys.GROUP_WORKER, *unstarted.pending_ids)


async def _done_set(ctx: FailoverContext, ids: list[str]) -> set[str]:
    if not ids:
        return set()
    values = await ctx.r.mget([keys.result_done(i) for i in ids])
    return {i for i, v in zip(ids, values, strict=True) if v is not None}


@dataclass(frozen=True)
class DrainPlan:
    migrate: list[MoveItem]
    """The live sequences with a record, each with its target (None: no node has room now) and the record's hints."""
    records: dict[str, SeqRecord]
    """Every sequence record as the plan read it (of this node and the others)."""
    src_registered: bool = False
    """The node's worker was registered (its lease alive) when the plan read the registry: a live source."""


@dataclass(frozen=True)
class DrainReport:
    node: str
    moves: list[MigrationReport]
    """The moves settled in the drain itself."""
    delegated: list[MoveItem]
    """Left to a `migrate_sequence` task each (no target now, or not where the plan saw it)."""
    requeued: int
    plan_ms: float = 0.0
    """Reading who owns what and where it can go."""
    move_ms: float = 0.0
    """Moving the live sequences (all of them, from the first read to the last handover)."""
    requeue_ms: float = 0.0


UNTOLD_AFTER_MS = 2000.0
"""A move off a node whose target has not claimed the sequence this long after the owner changed is taken for one
whose mover died before it told the target (a target claims within milliseconds of the resume)."""


def untold_moves(records: dict[str, SeqRecord], node: str, now_ms: float) -> list[SeqRecord]:
    """Records moved off `node` whose target never claimed them, UNTOLD_AFTER_MS after the move."""
    return [r for r in records.values() if r.moved_from == node and not r.entry
            and now_ms - r.last_update_ts > UNTOLD_AFTER_MS]


@dataclass(frozen=True)
class _Known:
    """The registry part of a ClusterView's refresh, answered from a snapshot already read."""

    registered: dict[str, dict[str, Any]]
    verdicts: dict[str, dict[str, Any]]

    async def nodes(self) -> dict[str, dict[str, Any]]:
        return self.registered

    async def admin(self) -> dict[str, dict[str, Any]]:
        return self.verdicts


async def plan_drain(ctx: FailoverContext, node: str) -> DrainPlan:
    """Who owns what (every record, one read) and where each of `node`'s live sequences goes, read together; and
    the moves off `node` an earlier drain changed the owner of but never told the target about (it died in between):
    they are handed to that target again."""
    records, registered, admin = await ctx.seqs.snapshot()  # one etcd round trip for all three
    view = ClusterView(ctx.config, ctx.r, _Known(registered, admin),  # type: ignore[arg-type]
                       stale_ms=ctx.config.policies.node_selection.stale_ms)
    await view.refresh()  # its Valkey side only: the registry part is what was just read
    same, others, serves = _targets_in(ctx, view, node)
    owned = [r for r in records.values() if r.owner == node]
    model = ctx.config.node(node).models[0]
    live = [LiveSequence(r.seq_id, r.version, model, 0.0) for r in owned]
    plan = plan_migrations(node, live, same, others, serves)
    migrate = [MoveItem(m.seq_id, m.version - 1, m.dst, records[m.seq_id].mod_revision, records[m.seq_id].entry,
                        records[m.seq_id].rack) for m in plan]
    untold = untold_moves(records, node, WALL.now_ms())
    if untold:
        log.warning("drain %s: %d moves off it were never told to their target; telling them now", node, len(untold))
    migrate += [MoveItem(r.seq_id, r.version - 1, r.owner, r.mod_revision, r.from_entry, r.rack) for r in untold]
    return DrainPlan(migrate, records, node in view.registered)


async def _open_connections(ctx: FailoverContext, n: int) -> None:
    """Have `n` Valkey connections open in the pool while the plan reads (a move's reads and a release's blocking
    read each hold one): a connection opened inside a move would add its handshake to the move."""
    await asyncio.gather(*(ctx.r.ping() for _ in range(n)))


async def drain(ctx: FailoverContext, node: str) -> DrainReport:
    """drain_node's work: plan, move every live sequence that has a target (`move_sequences`, in this task: no
    Celery hop per sequence), then requeue what the node never started and acknowledge its entries. The moves come
    first: their clients are mid-stream."""
    t0 = time.perf_counter()
    plan, _ = await asyncio.gather(plan_drain(ctx, node), _open_connections(ctx, 2))
    t1 = time.perf_counter()
    ready = [it for it in plan.migrate if it.planned]
    moves, left = await move_sequences(ctx, node, ready, together=plan.src_registered)
    t2 = time.perf_counter()
    recorded = {r.seq_id for r in plan.records.values() if r.owner == node}
    requeued = await drain_unstarted(ctx, node, recorded, plan.records)
    t3 = time.perf_counter()
    return DrainReport(node, moves, left + [it for it in plan.migrate if not it.planned], requeued,
                       (t1 - t0) * 1000.0, (t2 - t1) * 1000.0, (t3 - t2) * 1000.0)


async def drain_unstarted(ctx: FailoverContext, node: str, recorded: set[str],
                          records: dict[str, SeqRecord] | None = None) -> int:
    """Requeue what `node` never started (its batch entries' requests without a record of the node), in this task
    and in one round trip (not fanned out: the entries are acknowledged right after, so a task lost in between would
    lose its request), then acknowledge the entries. A request whose record says it moved on (a higher version) is
    left alone. Returns how many were requeued."""
    unstarted = await unstarted_requests(ctx, node)
    if records is None:
        records = await ctx.seqs.records()
    todo = [q for q in unstarted.requests if q.request_id not in recorded
            and not (q.request_id in records and records[q.request_id].version > q.version)]
    if todo:
        await ctx.producer.add_many((keys.rack_requests(q.rack or ctx.config.rack_of(node)),
                                     dataclasses.replace(q, version=q.version + 1)) for q in todo)
        stale = [q.request_id for q in todo if q.request_id in records]
        if stale:
            await ctx.seqs.apply([], stale)
        log.info("drain %s: %d unstarted requests requeued", node, len(todo))
    await release_unstarted(ctx, node, unstarted)
    return len(todo)


async def remaining_work(seqs: SequenceRegistry, r: aioredis.Redis, node: str) -> tuple[int, int]:
    """(live sequences still recorded as owned by `node`, or moved off it but never told to their target;
    batch-stream entries it holds or has not been given): what a drain of the node has not finished yet."""
    records = await seqs.records()
    owned = sum(1 for rec in records.values() if rec.owner == node) + len(untold_moves(records, node, WALL.now_ms()))
    stream = keys.node_batches(node)
    try:
        groups = await r.xinfo_groups(stream)
    except aioredis.ResponseError:
        return owned, 0
    group = next((g for g in groups if g.get("name") in (keys.GROUP_WORKER, keys.GROUP_WORKER.encode())), None)
    if group is None:
        return owned, 0
    lag = group.get("lag")
    if lag is None:
        # unknown: the group was moved with XGROUP SETID (as drains before DRAIN_CONSUMER did) or entries were
        # deleted, and Valkey cannot count what lies past its last delivery; an entry there is still work (a
        # request a batcher placed after the drain), so look: one XRANGE of at most one entry
        last = _id_str(group.get("last-delivered-id") or "0-0")
        lag = len(await r.xrange(stream, min=f"({last}", max="+", count=1) or [])
    return owned, int(group.get("pending") or 0) + int(lag)
