"""Windowing batcher process for one rack (`rackflow batcher --rack R`): consumer group "batcher" on
`rf:rack:{R}:req`.

Requests are held in the WindowBatcher (their stream entries deferred, so a batcher that dies loses nothing: its
pending entries are claimed by another batcher of the rack). When the window closes, each BatchPlan becomes a
BatchEvent appended to `rf:node:{N}:batch` plus a DecisionEvent; only then are the requests acknowledged.
Requests that can never fit get an error result. Node views come from the live status with this batcher's own
in-flight reservations subtracted (ReservationLedger).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from pipeline.batching.ledger import ReservationLedger
from pipeline.batching.window import CloseReason, PendingRequest
from pipeline.config import RackflowConfig
from pipeline.events import BatchEvent, BlockEvent, DecisionEvent, RequestEvent
from pipeline.replay import DrawLog, rack_batcher, window_record
from pipeline.routing.node_policies.weighted import node_weight
from pipeline.routing.prefix_index import BlockIndex
from pipeline.routing.views import NodeView
from streams import keys
from streams.runner import Delivery, StreamConsumer, StreamProducer, connect
from workers.shell import metrics, tracing
from workers.shell.runtime import WALL, consumer_name, log_context
from workers.stores.cluster_view import ClusterView, PacedRefresh
from workers.stores.etcd import NodeRegistry
from workers.stores.prefix_feed import PrefixFeed
from workers.stores.results import ResultWriter, error_result

log = logging.getLogger(__name__)

MAX_TENANTS_PUBLISHED = 64
"""Tenants whose waiting requests a batcher publishes (the most waiting first) for the gateway's fair share."""
ROOM_RESUBSCRIBE_S = 5.0
"""How often a batcher whose room subscription failed (`_subscribe_room`) tries it again; it polls meanwhile."""
IDLE_WAKE_S = 2.0
"""While the window is empty the tick and room loops wait for an arrival (which wakes them at once), waking on their
own only this often: an idle batcher does not poll."""


class Batcher:
    def __init__(self, config: RackflowConfig, rack: str, redis_url: str, etcd_url: str) -> None:
        if rack not in config.rack_names():
            raise ValueError(f"unknown rack {rack!r}; racks: {', '.join(config.rack_names())}")
        self.config = config
        self.rack = rack
        pol = config.policies
        # The same construction replay uses; every node policy's draws are logged so each window record carries them.
        self.draws = DrawLog()
        self.r = connect(redis_url)
        self.blocks = BlockIndex()
        self.feed = PrefixFeed(self.r, [rack], self.blocks, keep_log=True)
        """The rack's precise prefix index, from its nodes' block events (each close records what it applied)."""
        self.window, self.policies = rack_batcher(config, rack, self.draws.factory, blocks=self.blocks)
        self.ledger = ReservationLedger()
        self.actor = consumer_name(f"batcher-{rack}")
        self.registry = NodeRegistry(etcd_url)
        self.view = ClusterView(config, self.r, self.registry, stale_ms=pol.node_selection.stale_ms)
        retention_ms = pol.streams.retention_s * 1000
        self.producer = StreamProducer(self.r, WALL.now_ms, retention_ms)
        self.results = ResultWriter(self.r, WALL.now_ms, retention_ms, out_ttl_s=pol.streams.output_ttl_s)
        self.consumer = StreamConsumer(
            self.r, keys.rack_requests(rack), keys.GROUP_BATCHER, self.actor,
            self._on_requests, now_ms=WALL.now_ms, count=pol.streams.read_count, block_ms=pol.streams.block_ms,
            claim_idle_ms=pol.streams.claim_idle_ms, max_deliveries=pol.streams.max_deliveries,
            retention_ms=retention_ms, accepts=(RequestEvent,),
        )
        self._lock = asyncio.Lock()
        self.paced = PacedRefresh(self._refresh, config.policies.node_selection.refresh_ms / 1000.0)
        """The full view refresh, paced by traffic (backs off while no request comes)."""
        self._arrived = asyncio.Event()
        self._arrived_room = asyncio.Event()
        """Requests arrived: the room watch (`_room_loop`) starts watching."""
        self._held: set[str] = set()
        self._offered: list[tuple[str, int, float]] = []
        self._to_ack: list[str] = []
        """Entries of dispatched batches not acknowledged yet (an ack that failed is retried on the next tick)."""
        self._idle_closes = 0
        self._last_idle_ms = 0.0
        self._blocks_seen: list[BlockEvent] = []
        """Block events applied to the index since the last window record (replay applies them before it)."""
        """Requests offered since the last close (id, version, enqueue time), for the window's replay record."""
        self.batches = 0
        self.dispatched = 0

    async def _on_requests(self, deliveries: list[Delivery]) -> None:
        await self.paced.on_request()  # after an idle spell the view backed off: a placement needs a fresh one
        now = WALL.now_ms()
        async with self._lock:
            for d in deliveries:
                req = d.event
                if not isinstance(req, RequestEvent):
                    raise TypeError(f"expected a request on {d.stream}, got {type(req).__name__}")
                d.defer()
                if d.id in self._held:
                    continue  # redelivery of an entry already waiting in the window
                self._held.add(d.id)
                self.window.offer(PendingRequest(req, d.id, now))
                self._offered.append((req.request_id, req.version, now))
        self._arrived.set()
        self._arrived_room.set()

    def node_views(self, now: float) -> list[NodeView]:
        views = []
        for v in self.view.node_views(now, self.rack):
            status = self.view.statuses.get(v.name)
            views.append(self.ledger.apply(v, status.last_batch_entry if status else ""))
        return views

    async def tick(self) -> CloseReason:
        async with self._lock:
            await self._ack_dispatched()
            now = WALL.now_ms()
            nodes = self.node_views(now)
            reason = self.window.close_reason(now, nodes)
            if reason in (CloseReason.EMPTY, CloseReason.NOT_YET):
                return reason
            window_open = self.window.window_open_ms if self.window.window_open_ms is not None else now
            self._blocks_seen.extend(self.feed.take_log())  # what the index learnt before this close
            self.draws.take()  # nothing draws outside a close; start this close's log empty
            outcome = self.window.close(now, nodes)
            draws = self.draws.take()
            record = None
            if outcome.plans or outcome.rejections or self._offered:
                record = window_record(
                    actor=self.actor, rack=self.rack, policy=self.policies.default, reason=reason.value, now_ms=now,
                    nodes=nodes, offered=self._offered, draws=draws, pending_after=outcome.waiting,
                    idle_closes=self._idle_closes, last_idle_ms=self._last_idle_ms, blocks=self._blocks_seen,
                )
                self._blocks_seen = []
                self._offered = []
                self._idle_closes = 0
            else:
                # A close that placed, rejected and received nothing (requests waiting for memory) only ages the
                # waiting ones: replay re-applies it from a count on the next record instead of one entry each.
                self._idle_closes += 1
                self._last_idle_ms = now
            sent = 0  # plans whose batch entry is written (dispatched, whatever fails after)
            try:
                for plan in outcome.plans:
                    batch_id = str(uuid.uuid4())
                    requests = tuple(p.request for p in plan.requests)
                    if tracing.TRACER is not None:  # a span per traced request; the worker's spans are its children
                        requests = tracing.dispatch(requests, [p.enqueued_ms for p in plan.requests], now,
                                                    rack=self.rack, node=plan.node, batch_id=batch_id)
                    batch = BatchEvent(
                        batch_id=batch_id, rack=self.rack, node=plan.node,
                        requests=requests, mem_est_kb=plan.mem_est_kb,
                        mem_budget_kb=plan.budget_kb, window_open_ms=window_open, created_ms=now,
                    )
                    # the batch entry and its dispatch decisions in one round trip, the batch first: a batch that
                    # was not written raises here and goes back to the window below; one that was is dispatched
                    # (booked and acknowledged) even when a decision record after it failed, which then raises
                    entry_id, decision_error = await self.producer.add_with(
                        (keys.node_batches(plan.node), batch),
                        ((keys.DECISIONS, DecisionEvent(
                            kind="dispatch", policy=c.policy, choice=c.node, request_ids=c.request_ids, ts_ms=now,
                            scores=dict(c.scores), draw=c.draw, batch_id=batch.batch_id, rack=self.rack,
                            actor=self.actor,
                        )) for c in plan.choices),
                    )
                    sent += 1
                    batch_class = [p.request for p in plan.requests if p.request.priority]
                    self.ledger.record(plan.node, entry_id, plan.mem_est_kb, len(plan.requests),
                                       sum(p.request.in_tokens for p in plan.requests), len(batch_class),
                                       sum(r.mem_est_kb for r in batch_class), sum(r.in_tokens for r in batch_class))
                    self._to_ack.extend(p.entry_id for p in plan.requests)  # acked after the plans (next tick if not)
                    self.batches += 1
                    self.dispatched += len(plan.requests)
                    metrics.BATCHES.labels(self.rack, plan.node, plan.choices[0].policy if plan.choices else "").inc()
                    metrics.BATCH_REQUESTS.labels(self.rack).observe(len(plan.requests))
                    metrics.BATCH_MEM_UTIL.labels(self.rack).observe(plan.utilisation)
                    for p in plan.requests:
                        metrics.BATCH_WAIT_MS.labels(self.rack).observe(max(0.0, now - p.enqueued_ms))
                    if log.isEnabledFor(logging.DEBUG):
                        with log_context(node=plan.node, batch_id=batch.batch_id):
                            log.debug("rack %s: batch %s -> %s: %d requests, %.1f%% of budget (%s)", self.rack,
                                      batch.batch_id, plan.node, len(plan.requests), 100 * plan.utilisation,
                                      reason.value)
                    if decision_error is not None:  # the batch is out but its decision record is not: the close stops
                        raise decision_error
                await self._ack_dispatched()  # every plan's requests in one XACK
                for rej in outcome.rejections:
                    metrics.REJECTED.labels(self.rack).inc()
                    await self.results.write(error_result(rej.pending.request, rej.reason, rack=self.rack))
                    await self.consumer.ack([rej.pending.entry_id])
                    self._held.discard(rej.pending.entry_id)
            except Exception:
                # Valkey went away mid-close (a restart, a failover): what was not dispatched goes back into the
                # window (its stream entries are still held and unacknowledged), or it would be lost to this
                # batcher; dispatched plans' acks are retried on the next tick.
                for plan in outcome.plans[sent:]:
                    for p in plan.requests:
                        self.window.offer(PendingRequest(p.request, p.entry_id, p.enqueued_ms))
                        self._offered.append((p.request.request_id, p.request.version, p.enqueued_ms))
                for rej in outcome.rejections:
                    if rej.pending.entry_id in self._held:
                        self.window.offer(rej.pending)
                raise
            if record is not None:
                await self.producer.add(keys.DECISIONS, record)
            return reason

    async def _ack_dispatched(self) -> None:
        if self._to_ack:
            ids = list(self._to_ack)
            await self.consumer.ack(ids)
            self._held.difference_update(ids)
            del self._to_ack[: len(ids)]

    async def _tick_loop(self, stop: asyncio.Event) -> None:
        """A close is tried at once when requests arrive; while requests wait, every 10 ms (a node's room or the
        window's end may come at any time); while the window is empty, only when requests arrive (and every
        `IDLE_WAKE_S` as a backstop: it costs nothing idle)."""
        while not stop.is_set():
            reason = CloseReason.NOT_YET
            self._arrived.clear()  # before the tick: an arrival during it wakes the next one at once
            try:
                reason = await self.tick()
            except Exception:
                log.exception("rack %s: window tick failed", self.rack)
            idle = reason is CloseReason.EMPTY and not self._to_ack and not self.window.pending_count
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=IDLE_WAKE_S if idle else 0.01)
            except TimeoutError:
                pass

    async def _publish_backlog(self) -> None:
        """The prompt tokens this batcher holds, for the router's work figure of the rack."""
        tokens = sum(p.request.in_tokens for p in self.window.pending if not p.request.priority)
        tenants = self.window.tenant_waiting()
        if len(tenants) > MAX_TENANTS_PUBLISHED:  # the largest ones: those the admission sheds first
            tenants = dict(sorted(tenants.items(), key=lambda kv: -kv[1])[:MAX_TENANTS_PUBLISHED])
        await self.r.hset(keys.rack_status(self.rack), mapping={f"tokens:{self.actor}": str(tokens),
                                                                 f"batch:{self.actor}": str(self.window.batch_waiting),
                                                                 f"tenants:{self.actor}": json.dumps(tenants),
                                                                 f"ts:{self.actor}": str(WALL.now_ms())})

    async def _refresh(self) -> bool:
        try:
            await self.view.refresh()
            await self._publish_backlog()
            self._export_metrics()
            return True
        except Exception as e:
            log.warning("rack %s: cluster view refresh failed: %s", self.rack, e)
            return False

    async def _room_loop(self, stop: asyncio.Event) -> None:
        """While the window holds requests, re-read this rack's node statuses when a worker announces room
        (`keys.rack_room`: it rewrote its status after sequences finished), and every `room_refresh_ms` besides, and
        tick when a node's status changed: the window closes on fresh room, not on the next full refresh. While no
        status changes, the poll's interval doubles up to `refresh_ms` (a rack whose nodes are full on long
        sequences is not read 100 times a second); the announcement wakes it at once whatever the interval.
        Measured without it (the poll alone, `rackflow sim validate`'s live run, 2026-12-07): the live TTFT P99 was
        445-563 ms where the room was seen at once 281 ms, requests waiting for a slot up to one backed-off interval
        after it freed. Idle, it only waits for requests."""
        fast = self.config.policies.node_selection.room_refresh_ms / 1000.0
        slow = max(fast, self.config.policies.node_selection.refresh_ms / 1000.0)
        interval = fast
        nodes = [n.name for r in self.config.cluster.racks if r.name == self.rack for n in r.expanded()]
        room = await self._subscribe_room()
        retry_at = time.monotonic() + ROOM_RESUBSCRIBE_S
        try:
            while not stop.is_set():
                if not self.window.pending_count:
                    self._arrived_room.clear()
                    interval = fast
                    try:
                        await asyncio.wait_for(self._arrived_room.wait(), timeout=IDLE_WAKE_S)
                    except TimeoutError:
                        pass
                    room = await self._drain_room(room)  # announcements while idle: the refresh below reads them
                    continue
                before = {n: getattr(self.view.statuses.get(n), "ts_ms", None) for n in nodes}
                try:
                    await self.view.refresh_statuses(nodes)
                except Exception as e:
                    log.warning("rack %s: room refresh failed: %s", self.rack, e)
                if any(getattr(self.view.statuses.get(n), "ts_ms", None) != before[n] for n in nodes):
                    self._arrived.set()
                    interval = fast
                else:  # nothing changed (nodes full and busy on long sequences): read less, up to the full refresh
                    interval = min(slow, interval * 2)
                if room is None and time.monotonic() >= retry_at:  # lost (an outage): subscribe again, now and then
                    retry_at = time.monotonic() + ROOM_RESUBSCRIBE_S
                    room = await self._subscribe_room()
                room = await self._wait_room(room, stop, interval)
        finally:
            if room is not None:
                try:
                    await room.aclose()
                except Exception:  # closing a connection that already failed
                    pass

    async def _subscribe_room(self) -> Any:
        """A pub/sub connection on the rack's room channel, or None (a client without pub/sub, an ACL without the
        grant, an outage): the room watch then polls alone."""
        try:
            ps = self.r.pubsub()
            await ps.subscribe(keys.rack_room(self.rack))
            return ps
        except Exception as e:  # any failure leaves the poll, which works without it
            log.warning("rack %s: no room announcements (%s); polling node statuses alone", self.rack, e)
            return None

    async def _drain_room(self, room: Any) -> Any:
        """Drop the announcements already received (they predate the next refresh)."""
        if room is None:
            return None
        try:
            while await room.get_message(ignore_subscribe_messages=True, timeout=0.0) is not None:
                pass
            return room
        except Exception as e:
            log.warning("rack %s: room announcements lost (%s); polling node statuses alone", self.rack, e)
            return None

    async def _wait_room(self, room: Any, stop: asyncio.Event, interval: float) -> Any:
        """Until a node announces room, or `interval` passes, or `stop`; the room connection (None once it failed)."""
        if room is None:
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
            except TimeoutError:
                pass
            return None
        try:
            msg = await room.get_message(ignore_subscribe_messages=True, timeout=interval)
            if msg is not None:  # several nodes at once: one refresh reads them all
                return await self._drain_room(room)
            return room
        except Exception as e:
            log.warning("rack %s: room announcements lost (%s); polling node statuses alone", self.rack, e)
            return None

    def _export_metrics(self) -> None:
        """The weighted policy's W of each node of the rack as this batcher sees it (its reservations applied), and
        each node's share of the rack's W (its dispatch probability under `weighted`)."""
        views = self.node_views(WALL.now_ms())
        k = self.config.policies.node_selection.latency_decay_per_ms
        weights = {v.name: node_weight(v, k) for v in views}
        total = sum(weights.values())
        for v in views:
            metrics.NODE_WEIGHT.labels(self.rack, v.name).set(weights[v.name])
            metrics.NODE_WEIGHT_SHARE.labels(self.rack, v.name).set(weights[v.name] / total if total > 0 else 0.0)
            metrics.NODE_ACTIVE.labels(self.rack, v.name).set(1.0 if v.active else 0.0)

    async def run(self, stop: asyncio.Event) -> int:
        await self.view.refresh()
        tasks = [
            asyncio.create_task(self.paced.run(stop, lambda: bool(self.window.pending_count))),
            asyncio.create_task(self._tick_loop(stop)),
            asyncio.create_task(self._room_loop(stop)),
            asyncio.create_task(self.consumer.run()),
            asyncio.create_task(self.feed.run(stop)),
        ]
        log.info("batcher for rack %s ready", self.rack)
        await stop.wait()
        self.consumer.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Requests still in the window stay pending in the stream: another batcher of the rack claims them.
        await self.consumer.close()
        await self.registry.close(revoke=False)
        await self.r.aclose()
        log.info("batcher %s stopped (%d batches, %d requests, %d left pending)", self.rack, self.batches,
                 self.dispatched, self.window.pending_count)
        return 0
