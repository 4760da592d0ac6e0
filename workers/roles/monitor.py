"""Monitor process (`rackflow monitor`): the cluster's failure detector and the one that starts failover.

- One active monitor at a time: candidates race for `/rackflow/monitor/leader` under an etcd lease; the leader keeps
  it alive, and when it dies another takes over within the lease TTL. Only the leader consumes `rf:health` (consumer
  group "failover"); a new leader resumes the group where the old one stopped and claims what it left pending.
- Health: every agent sample (NVML or sim) goes through the HealthScorer (weights, hysteresis). A node whose score
  falls below the threshold, whose worker lease expired (killed, crashed, partitioned), or whose agent heartbeat
  stopped is marked `draining`/`dead` in etcd (`/rackflow/admin/{node}`: routers and batchers stop sending to it at
  their next refresh) and a Celery `drain_node` task moves its live sequences away. A node that recovers (score back
  above the recovery threshold for long enough, or a fresh worker registered after a death) is cleared.
- Worker heartbeats: every worker's status event on `rf:health` (every `worker.status_interval_ms`, 200 ms) is a
  heartbeat. A worker silent for `health.worker_heartbeat_timeout_ms` (800 ms) on the stream's own clock
  (pipeline/health.py: HeartbeatWatch) is taken for dead in under a second: the monitor marks it dead, revokes its
  etcd lease (the registration is gone at once, as at the lease's expiry: etcd still says who is alive, and every
  mover sees the same answer), then sends the drain. The lease's expiry stays the backstop. A worker that was only
  stalled finds its lease gone when it wakes, registers again, and is back in service once its heartbeats are
  too; the sequences moved meanwhile are fenced by the version rule (the movers' release messages stop its copies).
- Every verdict is also a DecisionEvent on `rf:decisions` (kind `failover`), so replay can explain it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Any

from pipeline.config import RackflowConfig
from pipeline.events import DecisionEvent, HealthEvent
from pipeline.health import HealthSample, HealthScorer, HeartbeatWatch
from pipeline.sequences import NodeState, NodeTrigger, node_transition
from pipeline.stats import stream_id_ms
from streams import keys
from streams.runner import Delivery, StreamConsumer, StreamProducer, cancel_and_wait, connect
from workers.control import app as celery_app
from workers.shell import metrics
from workers.shell.runtime import WALL, log_context
from workers.stores.etcd import EtcdStoreError, LeaderElection, NodeAdmin, NodeRegistry, SequenceRegistry

IDLE_CHECK_S = 2.0
"""While every worker beats at its idle pace, the liveness check (registrations, agent heartbeats, redrives: three
etcd reads) runs this often instead of every `check_ms`: a worker or agent that dies while nothing runs is still
caught by its heartbeats on `rf:health` (4 s at the 1 s idle pace) and its lease, at most this much later on etcd."""

log = logging.getLogger(__name__)


class Monitor:
    def __init__(self, config: RackflowConfig, redis_url: str, etcd_url: str, check_ms: int = 500,
                 redrive_ms: int = 5000) -> None:
        self.config = config
        self.redis_url = redis_url
        self.etcd_url = etcd_url
        self.identity = f"monitor@{socket.gethostname()}:{os.getpid()}"
        self.r = connect(redis_url)
        self.registry = NodeRegistry(etcd_url)
        self.admin = NodeAdmin(self.registry.client)
        self.election = LeaderElection(self.registry.client, self.identity, ttl_s=3)
        self.scorer = HealthScorer(config.policies.health)
        self.check_ms = check_ms
        self.redrive_ms = redrive_ms
        """A drained node that still holds work this long after its last drain task gets another one."""
        self.seqs = SequenceRegistry(self.registry.client)
        self.last_drain: dict[str, float] = {}
        sp = config.policies.streams
        self.producer = StreamProducer(self.r, WALL.now_ms, sp.retention_s * 1000)
        self.consumer: StreamConsumer | None = None
        self.leader = False
        self.seen_registered: set[str] = set()
        self.seen_heartbeat: set[str] = set()
        self.verdicts: dict[str, NodeState] = {}
        self.actions = 0
        self.nodes = frozenset(n.name for n in config.nodes())
        self.watch = self._new_watch()
        self.hb_dead: set[str] = set()
        """Nodes this monitor declared dead on their heartbeats: a registration alone does not bring one back, its
        heartbeats must flow again too (a stalled worker re-registers the moment it wakes)."""
        self.health_pending: dict[str, bool] = {}
        """node -> draining: a change of a node's health verdict not yet applied (its etcd write failed). The scorer
        reports a change once; kept here, it is applied at the node's next sample instead of being lost."""
        celery_app.configure(config, redis_url, etcd_url)

    def _new_watch(self) -> HeartbeatWatch | None:
        timeout = self.config.policies.worker_heartbeat_timeout_ms()
        if not timeout:
            return None
        return HeartbeatWatch(float(timeout), float(self.config.policies.health.heartbeat_settle_ms),
                              interval_ms=float(self.config.policies.worker.status_interval_ms))

    # -- leadership --------------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> int:
        log.info("monitor %s started", self.identity)
        consume: asyncio.Task[None] | None = None
        check: asyncio.Task[None] | None = None
        while not stop.is_set():
            try:
                if not self.leader:
                    if await self.election.try_acquire():
                        self.leader = True
                        metrics.MONITOR_LEADER.set(1)
                        log.info("monitor %s is the leader", self.identity)
                        self.verdicts = {k: NodeState(v["state"]) for k, v in (await self.admin.all()).items()
                                         if v.get("state") in {s.value for s in NodeState}}
                        for n in self.config.nodes():
                            metrics.set_node_state(n.name, self._state(n.name))
                        self.watch = self._new_watch()  # judged on what this leader reads from here on
                        try:
                            celery_app.warm_sender()  # the first drain must not open the broker connection
                        except Exception as e:
                            log.warning("monitor %s: Celery broker not reachable yet (%s)", self.identity, e)
                        self.hb_dead = {n for n, v in self.verdicts.items() if v is NodeState.DEAD}
                        self.consumer = self._consumer()
                        consume = asyncio.create_task(self.consumer.run())
                        check = asyncio.create_task(self._check_loop())
                elif not await self.election.keep():
                    log.warning("monitor %s lost the leadership", self.identity)
                    self.leader = False
                    metrics.MONITOR_LEADER.set(0)
                    await self._step_down(consume, check)
                    consume = check = None
            except EtcdStoreError as e:  # etcd restarting or without quorum: keep trying
                log.warning("monitor %s: etcd unavailable (%s)", self.identity, e)
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0 if self.leader else 0.5)
            except TimeoutError:
                pass
        await self._step_down(consume, check)
        if self.leader:
            await self.election.resign()
        await self.registry.close(revoke=False)
        await self.r.aclose()
        log.info("monitor %s stopped (%d actions)", self.identity, self.actions)
        return 0

    def _consumer(self) -> StreamConsumer:
        sp = self.config.policies.streams
        return StreamConsumer(
            self.r, keys.HEALTH, "failover", self.identity, self._on_health, now_ms=WALL.now_ms, count=512,
            block_ms=sp.block_ms, claim_idle_ms=sp.claim_idle_ms, max_deliveries=sp.max_deliveries,
            retention_ms=sp.retention_s * 1000, accepts=(HealthEvent,), pace_ms=self._read_pace_ms,
        )

    def _read_pace_ms(self) -> float:
        """While every worker beats at its idle pace, the health stream is read at most every quarter of that
        pace (250 ms at 1 s): the idle cluster's 16 heartbeats and samples a second come in a few reads, not one
        read and one XACK each (`HeartbeatWatch.idle_pace_ms`)."""
        return self.watch.idle_pace_ms() if self.watch is not None else 0.0

    async def _step_down(self, *tasks: asyncio.Task[None] | None) -> None:
        if self.consumer is not None:
            self.consumer.stop()
        await cancel_and_wait(*tasks)
        if self.consumer is not None:
            await self.consumer.close()
            self.consumer = None

    # -- health samples ----------------------------------------------------------------------------------------
    async def _on_health(self, deliveries: list[Delivery]) -> None:
        watch = self.watch
        if watch is not None:
            for d in deliveries:  # the stream's clock first: every entry moves it, a worker's status is a heartbeat
                ev = d.event
                beat = isinstance(ev, HealthEvent) and ev.source == "worker" and ev.node in self.nodes
                watch.observe(stream_id_ms(d.id), ev.node if beat else None,  # type: ignore[union-attr]
                              ev.next_ms if beat else 0.0)  # type: ignore[union-attr]
            await self.check_heartbeats()
        for d in deliveries:
            ev = d.event
            if not isinstance(ev, HealthEvent) or ev.source not in ("nvml", "sim"):
                continue  # the workers' own status events feed routing and the heartbeat watch, not health scores
            self.seen_heartbeat.add(ev.node)
            verdict = self.scorer.observe(HealthSample(
                ev.node, ev.ts_ms, xid_errors=ev.xid_errors, ecc_errors=ev.ecc_errors,
                nvlink_crc_errors=ev.nvlink_crc_errors, temp_c=ev.temp_c, avg_latency_ms=ev.avg_latency_ms,
            ))
            metrics.HEALTH_SCORE.labels(ev.node).set(verdict.score)
            if verdict.changed:  # the scorer says so once: kept until applied (etcd may not answer right now)
                self.health_pending[ev.node] = verdict.draining
            if ev.node not in self.health_pending:
                continue
            draining = self.health_pending[ev.node]
            trigger = NodeTrigger.UNHEALTHY if draining else NodeTrigger.RECOVERED
            why = (f"health {verdict.score:.2f}: {', '.join(verdict.reasons) or 'earlier samples'}" if draining
                   else f"recovered, health {verdict.score:.2f}")
            try:
                await self._transition(ev.node, trigger, why, {"score": verdict.score} if draining else {})
            except EtcdStoreError as e:
                log.warning("monitor: node %s health verdict (%s) not applied, etcd unavailable (%s); tried again "
                            "at its next sample", ev.node, "draining" if draining else "recovered", e)
                continue
            del self.health_pending[ev.node]

    # -- liveness ----------------------------------------------------------------------------------------------
    async def check_heartbeats(self) -> None:
        """Declare dead every worker whose heartbeats stopped (HeartbeatWatch): mark it, revoke its lease, drain."""
        if self.watch is None:
            return
        for node, silent in self.watch.missed():
            if self._state(node) is NodeState.DEAD:
                self.watch.forget(node)  # dead already (its lease expired first): nothing more to do
                continue
            try:
                await self._transition(node, NodeTrigger.LEASE_LOST,
                                       f"no heartbeat for {silent:.0f} ms; lease revoked", {"silent_ms": silent},
                                       fence=True)
            except EtcdStoreError as e:  # tried again at the next health entry
                log.warning("monitor: node %s missed its heartbeats but cannot be marked dead now (%s)", node, e)
                return
            self.watch.forget(node)
            self.hb_dead.add(node)

    async def _check_loop(self) -> None:
        last = float("-inf")
        while True:
            now = time.monotonic()
            if self._read_pace_ms() > 0 and now - last < IDLE_CHECK_S:
                await asyncio.sleep(self.check_ms / 1000.0)  # every worker idle: the etcd reads every IDLE_CHECK_S
                continue
            last = now
            try:
                await self.check_liveness()
            except EtcdStoreError as e:
                log.warning("monitor: liveness check skipped, etcd unavailable (%s)", e)
            except Exception:
                log.exception("monitor: liveness check failed")
            await asyncio.sleep(self.check_ms / 1000.0)

    async def check_liveness(self) -> None:
        registered = set(await self.registry.nodes())
        heartbeats = await self.admin.heartbeats()
        self.seen_heartbeat |= heartbeats
        for node in (n.name for n in self.config.nodes()):
            if node in registered:
                # a fresh worker registered for a node we buried: back in service (one declared dead on its
                # heartbeats only once they flow again: a stalled worker re-registers as soon as it wakes)
                silent = node in self.hb_dead and self.watch is not None and not self.watch.fresh(node)
                if not silent and await self._transition(node, NodeTrigger.REGISTERED, "a new worker registered", {}):
                    self.hb_dead.discard(node)
                    if self.watch is not None:
                        self.watch.reset(node)  # a full heartbeat window before it can be judged again
                self.seen_registered.add(node)
                if node in self.seen_heartbeat and node not in heartbeats and self._state(node) is NodeState.ACTIVE:
                    await self._transition(node, NodeTrigger.HEARTBEAT_LOST, "health agent heartbeat expired", {})
            elif node in self.seen_registered:
                await self._transition(node, NodeTrigger.LEASE_LOST, "worker lease expired", {})
        await self.redrive()

    async def redrive(self) -> None:
        """Reconcile: a node marked draining or dead that still owns sequences or holds batch entries some time
        after its drain task was sent gets the task again. A drain task can be lost with the Celery worker that
        took it (kill -9 of the whole worker: the broker redelivers only after its visibility timeout); drains are
        idempotent, so sending one too many costs nothing."""
        from workers.control.failover import remaining_work

        now = WALL.now_ms()
        for node, state in list(self.verdicts.items()):
            if state is NodeState.ACTIVE or now - self.last_drain.get(node, 0.0) < self.redrive_ms:
                continue
            owned, entries = await remaining_work(self.seqs, self.r, node)
            if state is NodeState.DRAINING and node in await self.registry.nodes():
                entries = 0  # a live draining worker still reads its own stream; only its sequences must move
            if owned or entries:
                task = celery_app.send("drain_node", node)
                log.warning("node %s (%s) still holds %d sequences, %d batch entries: drain re-sent, task %s",
                            node, state, owned, entries, task.id)
            self.last_drain[node] = now

    # -- actions -----------------------------------------------------------------------------------------------
    def _state(self, node: str) -> NodeState:
        return self.verdicts.get(node, NodeState.ACTIVE)

    async def _transition(self, node: str, trigger: NodeTrigger, reason: str, scores: dict[str, float],
                          fence: bool = False) -> bool:
        """Apply the node lifecycle (pipeline/sequences.py: NODE_TRANSITIONS): a verdict and its drain, a return
        to service, or nothing when the trigger changes nothing in the node's state (False). `fence`: revoke the
        worker's lease before the drain is sent (a death seen on the heartbeats, ahead of the lease)."""
        nxt = node_transition(self._state(node), trigger)
        if nxt is None:
            return False
        if nxt is NodeState.ACTIVE:
            await self._clear(node, reason)
        else:
            await self._act(node, nxt, reason, scores, fence)
        return True

    async def _act(self, node: str, state: NodeState, reason: str, scores: dict[str, float],
                   fence: bool = False) -> None:
        now = WALL.now_ms()
        if fence:  # before the drain: its movers must find the node unregistered, as after the lease's expiry
            await self.admin.set_and_fence(node, state, reason, now)
        else:
            await self.admin.set(node, state, reason, now)
        self.verdicts[node] = state
        task = celery_app.send("drain_node", node)
        self.last_drain[node] = now
        self.actions += 1
        metrics.FAILOVER_ACTIONS.labels(state).inc()
        metrics.set_node_state(node, state)
        with log_context(node=node, rack=self.config.rack_of(node)):
            log.warning("node %s marked %s (%s); drain task %s", node, state, reason, task.id)
        await self._decision(node, state, reason, scores, now)

    async def _clear(self, node: str, reason: str) -> None:
        now = WALL.now_ms()
        await self.admin.clear(node)
        self.verdicts.pop(node, None)
        metrics.FAILOVER_ACTIONS.labels(NodeState.ACTIVE).inc()
        metrics.set_node_state(node, NodeState.ACTIVE)
        with log_context(node=node, rack=self.config.rack_of(node)):
            log.info("node %s back in service (%s)", node, reason)
        await self._decision(node, NodeState.ACTIVE, reason, {}, now)

    async def _decision(self, node: str, state: str, reason: str, scores: dict[str, float], now: float) -> None:
        await self.producer.add(keys.DECISIONS, DecisionEvent(
            kind="failover", policy="health", choice=f"{node}:{state}", request_ids=(), ts_ms=now,
            scores=dict(scores), batch_id=reason[:200],
        ))

    def status(self) -> dict[str, Any]:
        return {"identity": self.identity, "leader": self.leader, "verdicts": dict(self.verdicts),
                "actions": self.actions}
