"""GPU worker process for one node (`rackflow worker --node N --engine sim`).

One concern in one file (over 500 lines on purpose): the worker role's process loop, as vLLM's `EngineCoreProc`
is one. What it decides is elsewhere (the version rule in `pipeline/sequences.py`, the engines in `engines/`, the
stores in `stores/`); what stays here is the order of its reads, engine steps and writes.

Consumes `rf:node:{N}:batch` (group "worker"), feeds every request of a batch to the engine, streams tokens to
`rf:out:{id}` (coalesced per `token_flush_ms`), writes each final result once, and acknowledges a batch entry only
when every request in it has its final result (the effect). It publishes its live status (HealthEvent) to the node
status hash and `rf:health`, and keeps `/rackflow/nodes/{N}` alive in etcd under a lease.
On SIGTERM it stops taking batches, marks itself draining, finishes what it holds (up to a grace period) and exits;
what it could not finish stays pending in the stream for its successor (XAUTOCLAIM).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import BusyLoadingError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.backoff import ExponentialBackoff, Retrying
from pipeline.config import RackflowConfig
from pipeline.events import (
    BatchEvent,
    BlockEvent,
    CancelEvent,
    HealthEvent,
    ReleaseEvent,
    RequestEvent,
    ResultEvent,
    ResumeEvent,
    TokenEvent,
)
from pipeline.kv.snapshot import KvSnapshot
from pipeline.sampling import LogprobEntry, SamplingRefused, StopMatcher, check_engine, encode_logprobs
from pipeline.sampling import decode as decode_sampling
from pipeline.sequences import Delivered, Intake, intake, intake_batch
from pipeline.stats import stream_id_key
from streams import codec, keys
from streams.runner import Delivery, StreamConsumer, StreamProducer, connect, last_delivered, minid_for
from workers.control.failover import RELEASE_WAKE_TTL_S, release_wake_key
from workers.engines import StepOutput, build_engine
from workers.engines.base import EngineError, SeqFinished
from workers.kv.manager import KvTierManager
from workers.shell import metrics, tracing
from workers.shell.runtime import WALL, consumer_name, log_context
from workers.stores.etcd import NodeRegistry, SeqRecord, SeqRecorder, SequenceRegistry
from workers.stores.prefix_feed import BLOCK_STREAM_MAXLEN
from workers.stores.results import ResultWriter

log = logging.getLogger(__name__)

IDLE_WAIT_S = (0.2, 2.0)
"""The idle engine loop's wait for work (a batch or a release wakes it at once): 0.2 s after the last step (vLLM's
KV events of that step arrive a moment later and are published then), doubling to 2 s while it stays idle."""
OUTAGE_S = 120.0
"""How long the engine loop keeps retrying its Redis writes through an outage before it gives up."""
OUTAGE_BACKOFF = ExponentialBackoff(base=0.1, cap=2.0)
"""Between two tries of a write through a Valkey outage: 0.1 s doubling to 2 s."""


async def _first_of(stop: asyncio.Event, wake: asyncio.Event, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for `stop` or `wake`; True when `wake` was set (and `stop` not)."""
    if stop.is_set():
        return False
    if not wake.is_set():
        waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(wake.wait())}
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
    return wake.is_set() and not stop.is_set()


@dataclass(slots=True)
class _Live:
    req: RequestEvent
    batch_id: str
    batched_ms: float
    entry_id: str
    pending_tokens: list[tuple[int, int, str]] = field(default_factory=list)  # (index, token_id, text)
    pending_logprobs: list[LogprobEntry] = field(default_factory=list)
    """Of the pending tokens, their log probabilities, when the engine reports them (the client asked)."""
    text: list[str] = field(default_factory=list)
    first_token_ms: float = 0.0
    """Set for a resumed sequence: when the client got its first token (on the old owner)."""
    resumed_at: int = 0
    span: Any = None
    """The `worker.generate` span while tracing is on and the request is traced (admission to final result)."""
    stopper: StopMatcher | None = None
    """The client's stop strings, matched here for an engine that does not stop on strings itself."""
    stopped: bool = False
    started_ms: float = 0.0
    """When this worker handed it to the engine; `first_seen_ms`: when its first token came out here."""
    first_seen_ms: float = 0.0


class Worker:
    def __init__(
        self, config: RackflowConfig, node: str, engine_name: str, redis_url: str, etcd_url: str,
        grace_s: float = 30.0,
    ) -> None:
        self.config = config
        self.node = node
        self.rack = config.rack_of(node)
        self.engine_name = engine_name
        self.engine = build_engine(config, node, engine_name)
        self.redis_url = redis_url
        self.etcd_url = etcd_url
        self.grace_s = grace_s
        sp = config.policies.streams
        self.r = connect(redis_url)
        self.retention_ms = sp.retention_s * 1000
        self._health_trimmed_ms = 0.0
        self.producer = StreamProducer(self.r, WALL.now_ms, self.retention_ms)
        self.results = ResultWriter(
            self.r, WALL.now_ms, self.retention_ms, out_ttl_s=sp.output_ttl_s,
            ewma_alpha=config.policies.profiling.ewma_alpha,
        )
        self.registry = NodeRegistry(etcd_url, ttl_s=config.policies.worker.lease_ttl_s)
        self.consumer = StreamConsumer(
            self.r,
            keys.node_batches(node),
            keys.GROUP_WORKER,
            consumer_name(f"worker-{node}"),
            self._on_batches,
            now_ms=WALL.now_ms,
            count=16,
            block_ms=sp.block_ms,
            claim_idle_ms=sp.claim_idle_ms,
            max_deliveries=sp.max_deliveries,
            retention_ms=self.retention_ms,
            accepts=(BatchEvent, ResumeEvent),
        )
        self.live: dict[str, _Live] = {}
        self.batch_left: dict[str, set[str]] = {}
        self.entries_of: dict[str, set[str]] = {}
        """request id -> batch entries waiting for it (a request may come in two deliveries of a batch)."""
        self.last_batch_entry = ""
        self._wake = asyncio.Event()
        self._releases: list[tuple[ReleaseEvent, asyncio.Future[bool]]] = []
        """Releases waiting for the engine loop (it runs them between two steps: see `_release`)."""
        self._engine_task: asyncio.Task[None] | None = None
        self.completed = 0
        self._room_published = 0.0
        """When `_publish_room` last rewrote the status hash (time.monotonic())."""
        self._room_later: asyncio.Task[None] | None = None
        """A rewrite due at the end of the current `room_status_ms` interval."""
        self._beat_ms = float(config.policies.worker.status_interval_ms)
        """The heartbeat interval in force, announced with each heartbeat (`HealthEvent.next_ms`): the configured one
        while the node works, doubling to `worker.idle_status_interval_ms` while it is idle."""
        self._beat_now = asyncio.Event()
        """Set when work arrives at an idle-paced node: its heartbeat loop publishes at once and beats fast again."""
        # metric children bound once (labels() on every step costs more than the increment)
        self._m_steps = metrics.ENGINE_STEPS.labels(node, engine_name)
        self._m_tokens = metrics.ENGINE_TOKENS.labels(node, engine_name)
        self._m_step_ms = metrics.ENGINE_STEP_MS.labels(node)
        self._m_results = metrics.RESULTS.labels(node, "ok")
        self._kv_seen: dict[tuple[str, str], int] = {}
        """KV tier hits/misses already counted (the tier ledger's counts are cumulative)."""
        # KV tiers of this node (L1 host memory shared by the node's processes, L2 the stream server): where an
        # engine swaps sequences out when its L0 is full, and where migrations put and find snapshots
        self.kv = KvTierManager.for_node(config.policies.kv, node, self.r)
        self.seqs = SequenceRegistry(self.registry.client)
        self.recorder = SeqRecorder(self.seqs)
        self.control = StreamConsumer(
            self.r, keys.node_control(node), keys.GROUP_WORKER, consumer_name(f"worker-{node}"), self._on_control,
            now_ms=WALL.now_ms, count=64, block_ms=sp.block_ms, claim_idle_ms=sp.claim_idle_ms,
            max_deliveries=sp.max_deliveries, retention_ms=self.retention_ms, accepts=(ReleaseEvent, CancelEvent),
        )

    # -- intake ------------------------------------------------------------------------------------------------
    async def _on_batches(self, deliveries: list[Delivery]) -> None:
        """A read of the batch stream, as vLLM's `EngineCore.step()` beside its process loop: one read of every
        delivered request's result markers, one pure decision per request (pipeline/sequences.py: the version
        rule), the engine submissions, then one write of every final result the decisions produce (refused,
        cancelled before it started)."""
        now = WALL.now_ms()
        ids = [r.request_id for d in deliveries if isinstance(d.event, BatchEvent) for r in d.event.requests]
        ids += [d.event.request.request_id for d in deliveries if isinstance(d.event, ResumeEvent)]
        done, cancelled = await self.results.done_and_cancelled(list(dict.fromkeys(ids)))
        claims: list[SeqRecord] = []
        finals: list[ResultEvent] = []
        for d in deliveries:
            ev = d.event
            if isinstance(ev, ResumeEvent):
                with log_context(request_id=ev.request.request_id, seq_id=ev.request.request_id):
                    await self._on_resume(d, ev, claims, now, done, cancelled)
                continue
            if not isinstance(ev, BatchEvent):
                raise TypeError(f"expected a batch on {d.stream}, got {type(ev).__name__}")
            if ev.node != self.node:
                log.warning("batch %s addressed to %s arrived at %s", ev.batch_id, ev.node, self.node)
            finals += self._start_batch(d, ev, now, done, cancelled, claims)
            self._advance_last(d.id)
        if finals:
            written = await self.results.write_many(finals, [])
            for result, ok in zip(finals, written, strict=True):
                if ok:
                    metrics.RESULTS.labels(self.node, result.status).inc()
        self.recorder.claim(claims)
        self._wake.set()
        if self._beat_ms > self.config.policies.worker.status_interval_ms:
            self._beat_now.set()  # idle-paced: the status says at once that this node works again

    def _start_batch(self, d: Delivery, batch: BatchEvent, now: float, done: set[str], cancelled: set[str],
                     claims: list[SeqRecord]) -> list[ResultEvent]:
        """Apply the version rule to one delivered batch: start, join or skip each request; the final results
        of those that never run are returned for the caller's one write."""
        live = self.live
        requests = batch.requests
        refusals = {r.request_id: self._refusal(r) for r in requests if r.request_id not in live}
        decisions = intake_batch(
            [Delivered(r.request_id, r.version) for r in requests],
            {r.request_id: live[r.request_id].req.version for r in requests if r.request_id in live},
            done, cancelled, refusals,
        )
        finals: list[ResultEvent] = []
        left: set[str] = set()
        for req, decision in zip(requests, decisions, strict=True):
            rid = req.request_id
            if decision is Intake.CANCEL:  # cancelled before it started (a revoked job): it never runs
                finals.append(self._cancelled_result(req, batch.batch_id, batch.created_ms, [],
                                                     "cancelled before it started"))
            elif decision is Intake.REFUSE:
                log.warning("request %s refused: %s", rid, refusals[rid])
                finals.append(self._refused_result(req, batch.batch_id, batch.created_ms, refusals[rid]))
            elif decision is Intake.JOIN:  # running here from an earlier delivery: its end settles both
                left.add(rid)
                self.entries_of.setdefault(rid, set()).add(d.id)
            elif decision is Intake.START:
                self.live[rid] = started = _Live(req, batch.batch_id, batch.created_ms, d.id,
                                                 stopper=self._stopper(req), started_ms=now)
                if req.trace and tracing.TRACER is not None:
                    started.span = self._start_span(req, batch.batch_id, now)
                self.engine.submit(req)
                left.add(rid)
                self.entries_of.setdefault(rid, set()).add(d.id)
                claims.append(SeqRecord(rid, self.node, req.version, self.rack, now, d.id))
            # SKIP (it has its final result: a redelivered batch) and IGNORE (a newer version is the mover's)
        if left:
            self.batch_left[d.id] = left
            d.defer()
        return finals

    def _advance_last(self, entry_id: str) -> None:
        if stream_id_key(entry_id) > stream_id_key(self.last_batch_entry):
            self.last_batch_entry = entry_id

    async def _on_resume(self, d: Delivery, ev: ResumeEvent, claims: list[SeqRecord], now: float,
                         done: set[str], cancelled: set[str]) -> None:
        """A sequence moved here (failover), decided by the version rule (pipeline/sequences.py) against what this
        node holds: absent -> accept; lower version -> replace; same or higher -> refuse (a duplicate or a
        conflict, reported). `done`/`cancelled`: the markers read for this whole delivery."""
        req = ev.request
        rid = req.request_id
        self._advance_last(d.id)
        live = self.live.get(rid)
        refusal = self._refusal(req) if live is None else ""
        decision = intake(Delivered(rid, req.version, resume=True), live.req.version if live else None,
                          rid in done, rid in cancelled, refusal)
        if decision is Intake.SKIP:
            return  # it finished meanwhile (the old owner got there first): nothing to resume
        if decision is Intake.CANCEL:
            await self._write_cancelled(req, f"resume:{ev.src}", now, list(ev.texts), "cancelled while moving")
            self.recorder.release([rid])  # the mover made this node its owner: the record goes with the request
            return
        if decision is Intake.REFUSE:
            await self._write_refused(req, f"resume:{ev.src}", now, refusal)
            self.recorder.release([rid])
            return
        if decision is Intake.STALE and live is not None:
            metrics.MIGRATIONS.labels(self.node, "refused").inc()
            log.warning("sequence %s: resume at v%d refused, this node holds v%d", rid, req.version,
                        live.req.version)
            return
        if decision is Intake.REPLACE:
            self.engine.abort(rid)  # an older incarnation: the newer version wins
            old = self.live.pop(rid, None)
            if old is not None and old.span is not None:
                tracing.end_span(old.span, error="replaced by a newer version")
            await self._settle([rid])
        snap = None
        if ev.snapshot_version:
            try:
                snap = await self.kv.get(rid)
            except Exception as e:
                log.warning("sequence %s: KV snapshot unreadable (%s); re-prefilling", rid, e)
            if snap is not None and (snap.version != ev.snapshot_version or len(snap.generated) < len(ev.generated)):
                snap = None
        try:
            if snap is not None:
                try:
                    self.engine.import_kv(snap, req)
                except EngineError as e:
                    log.warning("sequence %s: snapshot not usable here (%s); re-prefilling", rid, e)
                    snap = None
            if snap is None:
                self.engine.import_kv(
                    self.engine.resume_snapshot(req, ev.generated, ev.start_ms, ev.first_token_ms), req)
        except EngineError as e:
            log.error("sequence %s: cannot resume here: %s", rid, e)
            metrics.MIGRATIONS.labels(self.node, "failed").inc()
            return
        # the stop strings are matched from here on (text the old owner held back from the client went with it)
        live = _Live(req, f"resume:{ev.src}", now, d.id, text=list(ev.texts), stopper=self._stopper(req),
                     started_ms=ev.start_ms or now)
        live.first_token_ms = ev.first_token_ms
        live.resumed_at = len(ev.generated)
        if req.trace and tracing.TRACER is not None:
            live.span = self._start_span(req, live.batch_id, now, resumed_from=ev.src, resumed_at=live.resumed_at)
        self.live[rid] = live
        self.batch_left[d.id] = {rid}
        self.entries_of.setdefault(rid, set()).add(d.id)
        d.defer()
        claims.append(SeqRecord(rid, self.node, req.version, self.rack, now, d.id))
        metrics.MIGRATIONS.labels(self.node, "resumed_kv" if snap is not None else "resumed_prefill").inc()
        log.info("sequence %s resumed at v%d after %d tokens (%s) from %s", rid, req.version, len(ev.generated),
                 "KV snapshot" if snap is not None else "re-prefill", ev.src)

    async def _on_control(self, deliveries: list[Delivery]) -> None:
        releases: list[ReleaseEvent] = []
        for d in deliveries:
            ev = d.event
            if isinstance(ev, CancelEvent):
                with log_context(request_id=ev.request_id, seq_id=ev.request_id):
                    await self._cancel(ev.request_id, ev.reason)
                continue
            if not isinstance(ev, ReleaseEvent):
                raise TypeError(f"expected a control message on {d.stream}, got {type(ev).__name__}")
            releases.append(ev)
        # every release of this read at once: the engine loop runs them all between the same two steps (a drain
        # moves a node's sequences together; one at a time, each would wait for a step of its own)
        if releases:
            await asyncio.gather(*(self._release_logged(ev) for ev in releases))

    async def _release_logged(self, ev: ReleaseEvent) -> None:
        with log_context(request_id=ev.seq_id, seq_id=ev.seq_id):
            await self._release(ev)

    async def _cancel(self, rid: str, reason: str = "") -> bool:
        """Abort a live sequence (a revoked job): the engine drops it, the tokens it made so far go out, and its
        final result is written with status `cancelled` by the exactly-once writer (a finish that races with this
        cannot add a second result). A request that is not live here is left alone: if it is still on its way,
        its cancellation marker stops it at admission. True when the sequence was live here."""
        live = self.live.get(rid)
        if live is None:
            return False
        self.engine.abort(rid)
        await self._write_cancelled(live.req, live.batch_id, live.batched_ms, live.text,
                                    reason or "cancelled", live=live)
        log.info("request %s cancelled after %d tokens (%s)", rid, len(live.text), reason or "no reason given")
        return True

    def _refusal(self, req: RequestEvent) -> str:
        """Why this node cannot run `req` at all (empty: it can). Only sizes no gateway admits: an entry that
        carries them (a hostile or corrupted one) would otherwise hold the engine for good (a prompt of 2**63
        tokens sleeps a sim step forever; an output that never ends keeps its slot and memory)."""
        spec = self.config.models.get(req.model)
        if spec is None:
            return f"model {req.model!r} is not configured"
        if (req.in_tokens < 0 or req.max_tokens < 0 or req.in_tokens > spec.context
                or req.in_tokens + req.max_tokens > spec.context):  # a negative max_tokens must not offset the prompt
            return (f"in_tokens {req.in_tokens} + max_tokens {req.max_tokens} do not fit the context of "
                    f"{req.model} ({spec.context} tokens)")
        budget_kb = self.config.node_kv_capacity_kb(self.node)
        if not 0.0 <= req.mem_est_kb <= budget_kb:
            # the batcher never sends one (it rejects what no node's budget holds); admitted, a size of 1e308
            # would overflow the engine's memory ledger to inf/NaN and leave it one sequence at a time for good
            return f"mem_est_kb {req.mem_est_kb:g} is outside this node's budget [0, {budget_kb:g}] KB"
        if req.sampling:  # a gateway refuses these first; a mixed cluster or an old gateway may still send one
            try:
                check_engine(decode_sampling(req.sampling), self.engine_name)
            except (SamplingRefused, ValueError, TypeError) as e:
                return str(e)
        return ""

    def _stopper(self, req: RequestEvent) -> StopMatcher | None:
        if not req.sampling or getattr(self.engine, "stops_on_strings", False):
            return None
        stops = decode_sampling(req.sampling).stop
        return StopMatcher(stops) if stops else None

    def _refused_result(self, req: RequestEvent, batch_id: str, batched_ms: float, reason: str) -> ResultEvent:
        return ResultEvent.of(req, "error", self.node, self.rack, WALL.now_ms(), batch_id=batch_id,
                              error=f"refused: {reason}", batched_ms=batched_ms)

    def _cancelled_result(self, req: RequestEvent, batch_id: str, batched_ms: float, texts: list[str], reason: str,
                          live: _Live | None = None) -> ResultEvent:
        return ResultEvent.of(
            req, "cancelled", self.node, self.rack, WALL.now_ms(), out_tokens=len(texts), batch_id=batch_id,
            text="".join(texts), error=reason, batched_ms=batched_ms,
            first_token_ms=live.first_token_ms if live is not None else 0.0,
        )

    async def _write_refused(self, req: RequestEvent, batch_id: str, batched_ms: float, reason: str) -> None:
        """The final `error` result of a request this node refuses to run (exactly once)."""
        log.warning("request %s refused: %s", req.request_id, reason)
        if await self.results.write(self._refused_result(req, batch_id, batched_ms, reason)):
            metrics.RESULTS.labels(self.node, "error").inc()

    async def _write_cancelled(self, req: RequestEvent, batch_id: str, batched_ms: float, texts: list[str],
                               reason: str, live: _Live | None = None) -> None:
        """The final `cancelled` result of `req` (exactly once); a live sequence also leaves this worker."""
        rid = req.request_id
        tokens = self._token_events([rid], WALL.now_ms()) if live is not None else []
        result = self._cancelled_result(req, batch_id, batched_ms, texts, reason, live)
        if live is not None:
            self.live.pop(rid, None)
        written = await self.results.write_many([result], tokens)
        if any(written):
            metrics.RESULTS.labels(self.node, "cancelled").inc()
        if live is not None:
            if live.span is not None:
                tracing.end_span(live.span, cancelled=True, out_tokens=len(texts))
            self.recorder.release([rid])
            await self._settle([rid])

    async def _cancel_marked(self) -> None:
        """Backstop of the control message: live sequences whose cancellation marker is set are aborted (a
        cancel that looked for the owner before this worker had recorded the sequence in etcd)."""
        ids = list(self.live)
        if not ids:
            return
        _done, cancelled = await self.results.done_and_cancelled(ids)
        for rid in cancelled:
            await self._cancel(rid, "cancelled")

    async def _release(self, ev: ReleaseEvent) -> None:
        """Stop a sequence that is being moved away: its tokens so far go out, its KV goes to the tiers at the new
        version, it leaves this engine without a result, and the release marker tells the mover to go on.

        The engine loop does the work, between two steps: the snapshot then counts exactly the tokens that went to
        the client. Done from here, a step could run while the tokens are flushed (or, with the torch engine, be
        in flight in its thread while the KV is exported): its new token would be in the snapshot but dropped with
        the sequence, and the new owner, resuming after it, would leave a hole in the client's stream."""
        rid = ev.seq_id
        live = self.live.get(rid)
        exported = False
        if live is not None and live.req.version < ev.version:
            if self._engine_task is not None and not self._engine_task.done():
                done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
                self._releases.append((ev, done))
                self._wake.set()
                exported = await done
            else:
                exported = await self._release_now(ev)
        # the marker says what the mover will find (the KV exported or not); the entry on the wake stream lets a
        # mover that waits for it block on it (XREAD BLOCK) instead of polling the marker
        mark = b"kv" if exported else b"none"
        wake = release_wake_key(rid, ev.version)
        pipe = self.r.pipeline(transaction=True)
        pipe.set(keys.seq_released(rid, ev.version), mark, ex=3600)
        pipe.xadd(wake, {b"m": mark})
        pipe.expire(wake, RELEASE_WAKE_TTL_S)
        await pipe.execute()

    async def _run_releases(self) -> None:
        """The releases queued by `_release`, run by the engine loop while no step is in flight."""
        while self._releases:
            ev, done = self._releases.pop(0)
            try:
                exported = await self._release_now(ev)
            except BaseException as e:
                if not done.done():
                    done.set_exception(e)
                if not isinstance(e, Exception):
                    raise
            else:
                if not done.done():
                    done.set_result(exported)

    async def _release_now(self, ev: ReleaseEvent) -> bool:
        """Flush the sequence's tokens, export its KV (L2) at the new version, drop it here; whether KV went out."""
        rid = ev.seq_id
        live = self.live.get(rid)
        if live is None or live.req.version >= ev.version:
            return False
        exported = False
        await self._flush_tokens(only=[rid])
        try:
            snap = self.engine.export_kv(rid, ev.version, remove=True)
            # L2: the new owner is another node, and L1 is this node's own host memory
            exported = await self.kv.put(snap, tier="L2")
        except Exception as e:  # the move still goes on: the new owner re-prefills
            log.warning("sequence %s: KV export on release failed: %s", rid, e)
            self.engine.abort(rid)
        if live.span is not None:
            tracing.end_span(live.span, released_to=ev.dst or "", kv_exported=exported)
        self.live.pop(rid, None)
        await self._settle([rid])
        self.recorder.release([])  # the record now belongs to the new owner: never delete it from here
        metrics.MIGRATIONS.labels(self.node, "released").inc()
        log.info("sequence %s released to %s at v%d (KV %s)", rid, ev.dst, ev.version,
                 "exported" if exported else "not exported")
        return exported

    # -- engine loop -------------------------------------------------------------------------------------------
    def _start_engine_loop(self, stop: asyncio.Event) -> asyncio.Task[None]:
        self._engine_task = asyncio.create_task(self._engine_loop(stop), name="engine")
        return self._engine_task

    async def _engine_loop(self, stop: asyncio.Event) -> None:
        flush_ms = self.config.policies.worker.token_flush_ms
        last_flush = WALL.now_ms()
        idle_wait = IDLE_WAIT_S[0]
        while True:
            await self._run_releases()
            if not self.engine.has_work():
                if stop.is_set():
                    return
                # what the engine's prefix cache reported after its last step (vLLM's KV events arrive over a socket,
                # a moment after the step that stored them): published now, not at the next request's first step,
                # so that the next turn of a conversation finds its prefix in the batchers' index
                await self._publish_blocks()
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=idle_wait)
                    idle_wait = IDLE_WAIT_S[0]
                except TimeoutError:  # still idle: the late events are in; wake less often (a batch wakes it)
                    idle_wait = min(IDLE_WAIT_S[1], idle_wait * 2)
                continue
            idle_wait = IDLE_WAIT_S[0]
            out = await self.engine.step()
            await self._publish_blocks()
            self._m_steps.inc()
            self._m_tokens.inc(len(out.tokens))
            self._m_step_ms.observe(out.step_ms)
            await self._handle_output(out, flush_all=False)
            now = WALL.now_ms()
            if now - last_flush >= flush_ms:
                await self._flush_tokens()
                last_flush = now

    async def _handle_output(self, out: StepOutput, flush_all: bool) -> None:
        first: list[str] = []
        stopped: list[SeqFinished] = []
        for t in out.tokens:
            live = self.live.get(t.request_id)
            if live is None or live.stopped:
                continue
            text = t.text
            if live.stopper is not None:
                text, hit = live.stopper.feed(text)
                if hit:  # a stop string completed: the answer ends here, the stop string and what follows cut
                    live.stopped = True
                    self.engine.abort(t.request_id)
                    now = WALL.now_ms()
                    stopped.append(SeqFinished(t.request_id, t.index + 1, live.started_ms,
                                               live.first_token_ms or live.first_seen_ms or now, now, "stop"))
            live.pending_tokens.append((t.index, t.token_id, text))
            if t.logprob is not None:
                live.pending_logprobs.append(t.logprob)
            live.text.append(text)
            if t.index == 0:
                first.append(t.request_id)
                live.first_seen_ms = WALL.now_ms()
        # the first token goes out at once (it is the client's time to first token); a finished sequence's last
        # tokens go out with its result; everything of this step in one round trip (two with the results)
        finished = [f for f in out.finished if f.request_id in self.live and not self.live[f.request_id].stopped]
        for f in finished:  # ended without a stop string: what was held back as a possible one goes out now
            live = self.live[f.request_id]
            if live.stopper is not None and (rest := live.stopper.flush()):
                live.text.append(rest)
                if live.pending_tokens:
                    i, tid, txt = live.pending_tokens[-1]
                    live.pending_tokens[-1] = (i, tid, txt + rest)
        finished += stopped
        now = WALL.now_ms()
        tokens = self._token_events([*first, *(f.request_id for f in finished)], now)
        results = []
        spans = []
        for f in finished:
            live = self.live.pop(f.request_id)
            if live.span is not None:
                spans.append((live.span, f.out_tokens))
            if f.error:  # the engine refused or failed it: an error, with the engine's reason
                results.append(ResultEvent.of(
                    live.req, "error", self.node, self.rack, f.finish_ms, out_tokens=f.out_tokens,
                    batch_id=live.batch_id, batched_ms=live.batched_ms, start_ms=f.start_ms,
                    error=f"engine: {f.error}",
                ))
                continue
            results.append(ResultEvent.of(
                live.req, "ok", self.node, self.rack, f.finish_ms, out_tokens=f.out_tokens, batch_id=live.batch_id,
                text="".join(live.text), batched_ms=live.batched_ms, start_ms=f.start_ms,
                first_token_ms=live.first_token_ms or f.first_token_ms, finish_reason=f.reason,
            ))
        if not tokens and not results:
            return
        await self._outage_safe("writing results", lambda: self.results.write_many(results, tokens))
        for span, out_tokens in spans:  # empty unless tracing is on
            tracing.end_span(span, out_tokens=out_tokens)
        if results:
            self.recorder.release([r.request_id for r in results])
            self._m_results.inc(len(results))
            self.completed += len(results)
            done_ids = [r.request_id for r in results]
            await self._outage_safe("acknowledging batches", lambda: self._settle(done_ids))
            await self._publish_room()

    async def _publish_room(self) -> None:
        """Sequences finished: there is room. Rewrite the status hash (not the heartbeat) at most every
        `room_status_ms`: at once when the last rewrite is that old, otherwise once at the end of the interval (a
        completion is never left to the next heartbeat), so that a batcher holding requests sees the room at once."""
        wait = self._room_published + self.config.policies.worker.room_status_ms / 1000.0 - time.monotonic()
        if wait <= 0:
            await self._write_room()
        elif self._room_later is None or self._room_later.done():
            self._room_later = asyncio.create_task(self._write_room(wait), name="room-status")

    async def _write_room(self, after_s: float = 0.0) -> None:
        if after_s > 0:
            await asyncio.sleep(after_s)
        self._room_published = time.monotonic()
        try:
            await self.r.hset(keys.node_status(self.node),
                              mapping=codec.encode(self.health_event()))  # type: ignore[arg-type]
        except RedisError as e:  # an outage, or an ACL without the grant: the heartbeat writes it (and says why)
            log.debug("node %s: room status not written (%s); the heartbeat will", self.node, e)
            return
        try:  # wake the rack's batchers that hold requests (they poll too: a lost message costs one poll interval)
            await self.r.publish(keys.rack_room(self.rack), self.node)
        except RedisError as e:
            log.debug("node %s: room not announced (%s); the batchers' poll finds it", self.node, e)

    async def _publish_blocks(self, cleared: bool = False) -> None:
        """What the engine's prefix cache stored and evicted since the last step, for the batchers' and routers'
        prefix indexes (`rf:rack:{R}:blocks`); `cleared` first: this engine holds nothing (it just started)."""
        take = getattr(self.engine, "take_block_events", None)
        changes = take() if take is not None else []
        if not changes and not cleared:
            return
        now = WALL.now_ms()
        events = [BlockEvent(self.node, self.rack, now, cleared=True)] if cleared else []
        events += [BlockEvent(self.node, self.rack, now, stored, removed) for stored, removed in changes]
        key = keys.rack_blocks(self.rack)

        async def write() -> None:
            pipe = self.r.pipeline(transaction=False)
            for ev in events:
                pipe.xadd(key, codec.encode(ev), maxlen=BLOCK_STREAM_MAXLEN, approximate=True)  # type: ignore[arg-type]
            await pipe.execute()

        await self._outage_safe("publishing prefix blocks", write)

    async def _outage_safe(self, what: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        """A Redis write of the engine loop outlives a Valkey outage (a restart, a failover): retried with backoff
        for up to OUTAGE_S instead of killing the loop. Safe to repeat: final results are exactly-once by their
        marker, a repeated token chunk is skipped by index at the gateway, an ack twice is an ack."""
        retry = Retrying(OUTAGE_BACKOFF)
        deadline = time.monotonic() + OUTAGE_S
        while True:
            try:
                return await fn()
            except (RedisConnectionError, RedisTimeoutError, BusyLoadingError) as e:
                if time.monotonic() > deadline:
                    raise
                delay = retry.next_delay()
                log.warning("node %s: %s failed (%s); retrying in %.1f s", self.node, what, e, delay)
                await asyncio.sleep(delay)

    async def _settle(self, request_ids: list[str]) -> None:
        acks = []
        for rid in request_ids:
            for entry_id in self.entries_of.pop(rid, ()):
                left = self.batch_left.get(entry_id)
                if left is None:
                    continue
                left.discard(rid)
                if not left:
                    del self.batch_left[entry_id]
                    acks.append(entry_id)
        await self.consumer.ack(acks)

    def _token_events(self, request_ids: list[str], now: float) -> list[TokenEvent]:
        events = []
        for rid in dict.fromkeys(request_ids):
            live = self.live.get(rid)
            if live is None or not live.pending_tokens:
                continue
            toks, lps = live.pending_tokens, live.pending_logprobs
            events.append(TokenEvent(
                request_id=rid, version=live.req.version, index=toks[0][0], token_ids=tuple(t[1] for t in toks),
                texts=tuple(t[2] for t in toks), ts_ms=now, node=self.node, reply_to=live.req.reply_to,
                logprobs=encode_logprobs(lps) if len(lps) == len(toks) else "",
            ))
            live.pending_tokens = []
            live.pending_logprobs = []
        return events

    async def _flush_tokens(self, only: list[str] | None = None) -> None:
        events = self._token_events(only if only is not None else list(self.live), WALL.now_ms())
        await self._outage_safe("streaming tokens", lambda: self.results.stream_tokens(events))

    # -- status ------------------------------------------------------------------------------------------------
    def health_event(self) -> HealthEvent:
        s = self.engine.stats()
        kv_capacity_kb, kv_used_kb = s.kv_capacity_kb, s.kv_used_kb
        if not getattr(self.engine, "kv_in_estimate_units", True):
            # The batcher budgets in the served model's memory estimates (mem_est_kb); an engine that counts other
            # bytes (the CPU torch stand-in: a tiny model's real KV, swapped to L1/L2 beyond its L0) is reported in
            # those units, so a request the node's budget holds is never held back by the stand-in's byte count.
            kv_capacity_kb = self.config.node_kv_capacity_kb(self.node)
            kv_used_kb = sum(live.req.mem_est_kb for live in self.live.values())
        batch = [live.req.mem_est_kb for live in self.live.values() if live.req.priority]
        batch_prefill = s.batch_prefill_tokens if s.batch_prefill_tokens >= 0 else sum(
            live.req.in_tokens for live in self.live.values() if live.req.priority and not live.text)
        return HealthEvent(
            node=self.node,
            rack=self.rack,
            ts_ms=WALL.now_ms(),
            source="worker",
            gpu_mem_total_gb=s.gpu_mem_total_gb,
            gpu_mem_free_gb=s.gpu_mem_free_gb,
            kv_capacity_kb=kv_capacity_kb,
            kv_used_kb=kv_used_kb,
            avg_latency_ms=s.avg_step_ms,
            running=s.running,
            waiting=s.waiting,
            last_batch_entry=self.last_batch_entry,
            prefill_tokens=s.prefill_tokens,
            decode_seqs=s.decode_seqs,
            decode_tokens=s.decode_tokens,
            kv_usage=s.kv_usage,
            slowdown=s.slowdown,
            max_seqs=s.max_seqs,
            prefill_slowdown=s.prefill_slowdown,
            prefix_hit_tokens=s.prefix_hit_tokens,
            prompt_tokens=s.prompt_tokens,
            kv_blocks_total=s.kv_blocks_total,
            kv_blocks_free=s.kv_blocks_free,
            kv_block_tokens=s.kv_block_tokens,
            next_ms=self._beat_ms,
            batch_seqs=len(batch),
            batch_kv_kb=sum(batch),
            batch_prefill_tokens=batch_prefill,
        )

    async def publish_status(self) -> None:
        ev = self.health_event()
        self._export_tier_metrics()
        metrics.ENGINE_RUNNING.labels(self.node).set(ev.running)
        metrics.ENGINE_WAITING.labels(self.node).set(ev.waiting)
        metrics.KV_USED_KB.labels(self.node).set(ev.kv_used_kb)
        metrics.KV_CAPACITY_KB.labels(self.node).set(ev.kv_capacity_kb)
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(keys.node_status(self.node), mapping=codec.encode(ev))  # type: ignore[arg-type]
        pipe.xadd(keys.HEALTH, codec.encode(ev), maxlen=keys.HEALTH_MAXLEN, approximate=True)  # type: ignore[arg-type]
        if ev.ts_ms - self._health_trimmed_ms >= keys.HEALTH_TRIM_EVERY_MS:  # and no older than the retention
            pipe.xtrim(keys.HEALTH, minid=minid_for(ev.ts_ms, self.retention_ms), approximate=True)
            self._health_trimmed_ms = ev.ts_ms
        await pipe.execute()

    async def _apply_faults(self) -> None:
        """An injected `slow` fault (`rackflow fault inject --kind slow`) slows this node's engine down."""
        raw = await self.r.hget(keys.node_faults(self.node), "slow")
        factor = 1.0
        if raw:
            try:
                f = json.loads(raw)
                if float(f.get("until_ms", 0)) > WALL.now_ms():
                    factor = max(1.0, float(f.get("factor", 1.0)))
            except (ValueError, TypeError):
                log.warning("node %s: unreadable slow fault %r", self.node, raw[:80])
        if hasattr(self.engine, "slow_factor"):
            self.engine.slow_factor = factor

    def _idle(self) -> bool:
        """Nothing to do: no sequence in the engine or waiting for it, no release queued."""
        return not self.live and not self._releases and not self.engine.has_work()

    def _next_beat_ms(self) -> float:
        """The interval to the next heartbeat: the configured one while the node works; while it is idle, double the
        last one, up to `worker.idle_status_interval_ms` (capped at a third of `node_selection.stale_ms`)."""
        pol = self.config.policies
        base = float(pol.worker.status_interval_ms)
        if not self._idle():
            return base
        return min(max(base, pol.idle_pace_ms()), self._beat_ms * 2.0)

    async def _heartbeat_loop(self, stop: asyncio.Event) -> None:
        """The worker's heartbeat: its status (HealthEvent on `rf:health` and the node's status hash, one round
        trip) every `status_interval_ms`, on a fixed schedule that nothing else in this loop can hold up. The
        monitor takes a worker whose heartbeats stop for `health.worker_heartbeat_timeout_ms` for dead; engine
        steps never block it (the engines sleep or compute off the event loop), nor do the fault and cancel checks
        (their own loop, `_checks_loop`). While the node is idle the interval doubles up to
        `worker.idle_status_interval_ms`, each heartbeat announcing the next one (`next_ms`: the monitor stretches
        the node's timeout by it); work arriving brings a heartbeat at once and the fast pace back."""
        due = time.monotonic()
        failing = False
        while not stop.is_set():
            self._beat_ms = self._next_beat_ms()
            try:
                await self.publish_status()
                if failing:
                    log.info("node %s: status published again", self.node)
                failing = False
            except Exception as e:
                if not failing:  # once per outage
                    log.warning("node %s: status publish failed: %s", self.node, e)
                failing = True
            due += self._beat_ms / 1000.0
            now = time.monotonic()
            if due < now:  # late (the publish took longer than an interval): the next one at once, on a new grid
                due = now
            if await _first_of(stop, self._beat_now, max(0.0, due - now)):
                self._beat_now.clear()
                due = time.monotonic()

    async def _checks_loop(self, stop: asyncio.Event) -> None:
        """Injected faults (a `slow` engine) and the cancellation markers' backstop, every heartbeat interval (slower
        while the node is idle: no sequence to cancel, and a fault shows on the next batch's steps)."""
        while not stop.is_set():
            try:
                await self._apply_faults()
                await self._cancel_marked()
            except Exception as e:
                log.warning("node %s: fault and cancel checks failed: %s", self.node, e)
            try:
                await asyncio.wait_for(stop.wait(), timeout=self._beat_ms / 1000.0)
            except TimeoutError:
                pass

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def _wire_swap(self) -> None:
        set_swap = getattr(self.engine, "set_swap", None)
        if set_swap is None:
            return
        loop = asyncio.get_running_loop()

        def put(snap: KvSnapshot) -> bool:  # called from the engine's compute thread
            return bool(asyncio.run_coroutine_threadsafe(self.kv.put(snap), loop).result(timeout=30))

        def get(request_id: str) -> KvSnapshot | None:
            return asyncio.run_coroutine_threadsafe(self.kv.get(request_id), loop).result(timeout=30)

        set_swap(put, get)

    def _export_tier_metrics(self) -> None:
        st = self.kv.stats()
        for tier in self.kv.tiers:
            for name, table in (("hits", st.hits), ("misses", st.misses), ("entries", st.entries),
                                ("bytes", st.bytes)):
                metrics.KV_TIER.labels(self.node, tier, name).set(table.get(tier, 0))
        for name in ("bytes_moved", "demotions", "promotions", "drops", "refused_stale"):
            metrics.KV_TIER.labels(self.node, "all", name).set(getattr(st, name))
        metrics.export_kv_counters(self.node, {t: st.hits.get(t, 0) for t in self.kv.tiers},
                                   {t: st.misses.get(t, 0) for t in self.kv.tiers}, self._kv_seen)

    def _start_span(self, req: RequestEvent, batch_id: str, now: float, **attributes: object) -> Any:
        """`worker.generate` of a traced request: child of the batcher's span, open until the final result."""
        attrs = {"request_id": req.request_id, "model": req.model, "tenant": req.tenant, "version": req.version,
                 "node": self.node, "rack": self.rack, "batch_id": batch_id, "engine": self.engine_name,
                 "in_tokens": req.in_tokens, **attributes}
        return tracing.start_span("worker.generate", req.trace, attrs, now)

    async def run(self, stop: asyncio.Event) -> int:
        await self.engine.start()
        try:
            await self.kv.rebuild()
        except Exception as e:  # a tier that cannot be read must not keep the node out of service
            log.warning("node %s: KV tiers could not be rebuilt: %s", self.node, e)
        self._wire_swap()
        await self.registry.register(
            self.node, {"rack": self.rack, "engine": self.engine_name, "pid": os.getpid(), "since": WALL.now_ms()}
        )
        engine_stop = asyncio.Event()
        status_stop = asyncio.Event()
        await self._publish_blocks(cleared=True)  # whatever an earlier incarnation had cached is gone
        # Every batch entry delivered before this start went to an earlier incarnation (and then to the failover
        # drain, or stays pending for this one to claim): the batchers release their reservations for them. A
        # restarted worker that reported "" would leave them reserved forever, and its rack's batcher would never
        # dispatch to it again.
        delivered = await last_delivered(self.r, keys.node_batches(self.node), keys.GROUP_WORKER)
        self.last_batch_entry = max(self.last_batch_entry, delivered, key=stream_id_key)
        await self.publish_status()
        self.recorder.start()
        tasks = [
            asyncio.create_task(self.consumer.run(), name="consume"),
            self._start_engine_loop(engine_stop),
            asyncio.create_task(self._heartbeat_loop(status_stop), name="heartbeat"),
            asyncio.create_task(self._checks_loop(status_stop), name="checks"),
            asyncio.create_task(self.control.run(), name="control"),
        ]
        log.info("worker %s (rack %s, engine %s) ready", self.node, self.rack, self.engine_name)
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t is not stopper and t.exception() is not None:
                log.error("worker %s: task %s failed: %r", self.node, t.get_name(), t.exception())
        log.info("worker %s: stopping; draining %d live sequences", self.node, len(self.live))
        self.consumer.stop()
        try:
            await self.registry.set_state("draining")
        except Exception as e:
            log.warning("node %s: could not mark draining: %s", self.node, e)
        engine_stop.set()
        try:
            await asyncio.wait_for(tasks[1], timeout=self.grace_s)
        except TimeoutError:
            log.warning("worker %s: %d sequences left after %.0fs grace; they stay pending for a successor",
                        self.node, len(self.live), self.grace_s)
        status_stop.set()
        stopper.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, stopper, return_exceptions=True)
        self.control.stop()
        await self.consumer.close()
        await self.control.close()
        await self.recorder.close()
        await self.engine.stop()
        await self.registry.close()
        await self.r.aclose()
        log.info("worker %s stopped (%d completed)", self.node, self.completed)
        return 0
