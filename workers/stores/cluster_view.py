"""Live view of the cluster for the router and the batchers: which nodes are registered (etcd) and what their
last status says (Valkey hash), turned into the plain NodeView / RackView snapshots the policies take.

Refreshed every `node_selection.refresh_ms` (200 ms by default). A node counts as active only when its etcd lease
is alive with state `active` AND its status is fresher than `stale_ms`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from pipeline.config import RackflowConfig
from pipeline.events import HealthEvent
from pipeline.routing.views import NodeView, RackView
from pipeline.sequences import NodeState
from streams import codec, keys
from streams.errors import DecodeError
from workers.shell.runtime import WALL
from workers.stores.etcd import EtcdStoreError, NodeRegistry

log = logging.getLogger(__name__)


def node_view_from_status(
    name: str,
    status: HealthEvent | None,
    registered: Mapping[str, object] | None,
    now_ms: float,
    stale_ms: float,
    gpu: HealthEvent | None = None,
    admin: Mapping[str, object] | None = None,
) -> NodeView:
    """A node is active when its worker's lease is alive with state active, no monitor verdict (draining/dead)
    stands against it, and its status is fresh. GPU memory and PCIe come from the health agent when one reports
    (NVML sees what the engine's bookkeeping cannot), else from the worker."""
    state = registered.get("state") if registered else None
    if status is None:
        return NodeView(name, False, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)
    fresh = now_ms - status.ts_ms <= stale_ms
    verdict = admin.get("state") if admin else None
    agent = gpu is not None and now_ms - gpu.ts_ms <= stale_ms and gpu.gpu_mem_total_gb > 0
    return NodeView(
        name=name,
        active=bool(state == NodeState.ACTIVE and fresh and verdict not in (NodeState.DRAINING, NodeState.DEAD)),
        vram_total_gb=gpu.gpu_mem_total_gb if agent and gpu else status.gpu_mem_total_gb,
        free_vram_gb=_free_gb(status, gpu if agent else None),
        pcie_util_pct=gpu.pcie_util_pct if agent and gpu else status.pcie_util_pct,
        avg_latency_ms=status.avg_latency_ms,
        kv_capacity_kb=status.kv_capacity_kb,
        kv_free_kb=max(0.0, status.kv_capacity_kb - status.kv_used_kb),
        running=status.running,
        waiting=status.waiting,
        prefill_tokens=status.prefill_tokens,
        decode_seqs=status.decode_seqs,
        decode_tokens=status.decode_tokens,
        kv_usage=status.kv_usage,
        slowdown=status.slowdown,
        max_seqs=status.max_seqs,
        prefill_slowdown=status.prefill_slowdown if status.prefill_slowdown > 0 else None,
        batch_seqs=status.batch_seqs,
        batch_kv_kb=status.batch_kv_kb,
        batch_prefill_tokens=status.batch_prefill_tokens,
    )


def _free_gb(status: HealthEvent, gpu: HealthEvent | None) -> float:
    """Free GPU memory: the agent's (NVML) figure, but never more than the engine's own bookkeeping leaves free,
    compared as fractions of each one's total (an engine may account a different total than the device has, e.g.
    the CPU `torch` engine next to a modelled GPU)."""
    if gpu is None:
        return status.gpu_mem_free_gb
    if status.gpu_mem_total_gb <= 0:
        return gpu.gpu_mem_free_gb
    engine_frac = max(0.0, min(1.0, status.gpu_mem_free_gb / status.gpu_mem_total_gb))
    return min(gpu.gpu_mem_free_gb, gpu.gpu_mem_total_gb * engine_frac)


def pending_tokens(fields: Mapping[bytes | str, bytes | str], now_ms: float, stale_ms: float,
                   what: str = "tokens") -> float:
    """Prompt tokens the batchers of a rack hold, from its status hash: `tokens:{actor}` and `ts:{actor}` per
    batcher; a batcher that stopped writing (older than stale_ms) is not counted. `what="batch"`: the batch-class
    requests they hold (`batch:{actor}`)."""
    vals = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in fields.items()}
    total = 0.0
    prefix = what + ":"
    for k, v in vals.items():
        if not k.startswith(prefix):
            continue
        try:
            if now_ms - float(vals.get("ts:" + k[len(prefix):], "0")) <= stale_ms:
                total += float(v)
        except ValueError:
            continue
    return total


def tenant_counts(fields: Mapping[bytes | str, bytes | str], now_ms: float, stale_ms: float) -> dict[str, int]:
    """Interactive requests the batchers of a rack hold per tenant, from its status hash (`tenants:{actor}`, a JSON
    object); a batcher that stopped writing is not counted, an unreadable entry is skipped."""
    vals = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in fields.items()}
    out: dict[str, int] = {}
    for k, v in vals.items():
        if not k.startswith("tenants:"):
            continue
        try:
            if now_ms - float(vals.get("ts:" + k[8:], "0")) > stale_ms:
                continue
            counts = json.loads(v)
        except ValueError:
            continue
        if isinstance(counts, dict):
            for t, n in counts.items():
                if isinstance(n, int) and n > 0:
                    out[str(t)] = out.get(str(t), 0) + n
    return out


def _keep_status(table: dict[str, HealthEvent], node: str, fields: Mapping[bytes, bytes] | None) -> None:
    """Put a node's status hash, decoded, in `table` (an empty or undecodable one keeps what was there)."""
    if not fields:
        return
    try:
        ev = codec.decode(fields)
    except DecodeError as e:
        log.warning("node %s: undecodable status: %s", node, e)
        return
    if isinstance(ev, HealthEvent):
        table[node] = ev


@dataclass
class ClusterView:
    config: RackflowConfig
    r: aioredis.Redis
    registry: NodeRegistry | None
    """etcd's node registry and the monitor's verdicts. None (a gateway run without etcd), or before the registry
    first answers: a node with a fresh status counts as registered and active (no verdict is known)."""
    stale_ms: float = 3000.0
    statuses: dict[str, HealthEvent] = field(default_factory=dict)
    gpus: dict[str, HealthEvent] = field(default_factory=dict)
    registered: dict[str, dict[str, object]] = field(default_factory=dict)
    admin: dict[str, dict[str, object]] = field(default_factory=dict)
    rack_backlog: dict[str, int] = field(default_factory=dict)
    rack_pending_tokens: dict[str, float] = field(default_factory=dict)
    """Prompt tokens of the requests a rack's batchers hold (their `rf:rack:{R}:status`)."""
    rack_batch_backlog: dict[str, float] = field(default_factory=dict)
    """Of the rack's backlog, the batch-class requests its batchers hold."""
    rack_tenants: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per rack, the interactive requests its batchers hold per tenant."""
    decode_weight_tokens: float = 256.0
    raise_on_denied: bool = False
    """An ACL denial of a queue read raises NoPermissionError (the gateway: without its queue figures it could not
    shed load) instead of being logged (a router balancing blind is still a router)."""
    _now_ms: Callable[[], float] = WALL.now_ms
    _registry_seen: bool = False

    async def refresh(self, racks: tuple[str, ...] | None = None, with_backlog: bool = False) -> None:
        if self.registry is not None:
            try:
                self.registered = await self.registry.nodes()
                self.admin = await self.registry.admin()
                self._registry_seen = True
            except EtcdStoreError as e:
                log.warning("node registry unavailable, keeping the last view: %s", e)
        names = [n.name for n in self.config.nodes()]
        pipe = self.r.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(keys.node_status(n))
            pipe.hgetall(keys.node_gpu(n))
        rows = await pipe.execute()
        for i, n in enumerate(names):
            _keep_status(self.statuses, n, rows[2 * i])
            _keep_status(self.gpus, n, rows[2 * i + 1])
        if with_backlog:
            for rack in racks or self.config.rack_names():
                try:
                    groups = await self.r.xinfo_groups(keys.rack_requests(rack))
                except aioredis.ResponseError as e:  # no stream yet: nothing queued
                    if isinstance(e, NoPermissionError) and self.raise_on_denied:
                        raise
                    if isinstance(e, NoPermissionError):  # an ACL that hides the queues: the balance goes blind
                        log.error("may not read the queue of rack %s (%s): this role's Redis user needs "
                                  "`+xinfo|groups` and `%%R~rf:rack:*` (deploy/valkey/users.acl.example)", rack, e)
                    groups = []
                backlog = 0
                for g in groups:
                    if g.get("name") in (keys.GROUP_BATCHER, keys.GROUP_BATCHER.encode()):
                        backlog = int(g.get("lag") or 0) + int(g.get("pending") or 0)
                self.rack_backlog[rack] = backlog
                status = await self.r.hgetall(keys.rack_status(rack))
                self.rack_pending_tokens[rack] = pending_tokens(status, self._now_ms(), self.stale_ms)
                self.rack_batch_backlog[rack] = pending_tokens(status, self._now_ms(), self.stale_ms, "batch")
                self.rack_tenants[rack] = tenant_counts(status, self._now_ms(), self.stale_ms)

    async def refresh_statuses(self, nodes: list[str]) -> None:
        """Only the status hashes of `nodes` (one round trip, no etcd, no GPU hashes): a batcher watching its own
        rack's room while it holds requests."""
        if not nodes:
            return
        pipe = self.r.pipeline(transaction=False)
        for n in nodes:
            pipe.hgetall(keys.node_status(n))
        for n, fields in zip(nodes, await pipe.execute(), strict=True):
            _keep_status(self.statuses, n, fields)

    def _registration(self, node: str) -> Mapping[str, object] | None:
        if self._registry_seen:
            return self.registered.get(node)
        return {"state": NodeState.ACTIVE.value} if node in self.statuses else None

    def node_views(self, now_ms: float, rack: str | None = None) -> list[NodeView]:
        out = []
        for r in self.config.cluster.racks:
            if rack is not None and r.name != rack:
                continue
            for n in r.expanded():
                out.append(
                    node_view_from_status(
                        n.name, self.statuses.get(n.name), self._registration(n.name), now_ms, self.stale_ms,
                        self.gpus.get(n.name), self.admin.get(n.name),
                    )
                )
        return out

    def rack_views(self, now_ms: float) -> dict[str, RackView]:
        """Per rack: healthy (an active node), load in requests (engines' running + waiting, batcher backlog) and
        work in prompt-token units (prefill queued in its engines and its batchers, plus decode_weight_tokens per
        sequence), compared per active node by the rack choice."""
        out = {}
        dw = self.decode_weight_tokens
        for r in self.config.cluster.racks:
            nodes = self.node_views(now_ms, r.name)
            active = [n for n in nodes if n.active]
            backlog = self.rack_backlog.get(r.name, 0)
            load = sum(n.running + n.waiting for n in active) + backlog
            work = (sum(n.prefill_tokens for n in active) + self.rack_pending_tokens.get(r.name, 0.0)
                    + dw * load)
            out[r.name] = RackView(r.name, bool(active), float(load), float(work), len(active))
        return out


IDLE_REFRESH_S = 2.0
"""While no request arrives, a role's full view refresh backs off from `node_selection.refresh_ms` to this."""


class PacedRefresh:
    """A role's view refresh, paced by its traffic (the router's and each batcher's): every `base_s` while requests
    come; while none does, the interval doubles up to `IDLE_REFRESH_S` (an idle role does not read etcd and every
    node's status five times a second). The first request after an idle spell refreshes before it is placed
    (`on_request`), so no decision is made on a view that backed off. `refresh` does the read and returns whether
    it succeeded (it logs its own failures)."""

    def __init__(self, refresh: Callable[[], Awaitable[bool]], base_s: float, idle_s: float = IDLE_REFRESH_S) -> None:
        self._refresh = refresh
        self.base_s = base_s
        self.idle_s = max(base_s, idle_s)
        self.busy = False
        """A request arrived since the last refresh of the loop."""
        self.refreshed = -math.inf
        """When the view was last refreshed (time.monotonic())."""

    async def refresh(self) -> None:
        if await self._refresh():
            self.refreshed = time.monotonic()

    async def on_request(self) -> None:
        """A request is about to be placed: refresh first when the view is older than two intervals (the loop backed
        off, or fell behind)."""
        self.busy = True
        if time.monotonic() - self.refreshed > 2 * self.base_s:
            await self.refresh()

    async def run(self, stop: asyncio.Event, holding: Callable[[], bool] = lambda: False) -> None:
        """Refresh until `stop`; `holding`: the role still holds requests (keeps the fast pace)."""
        interval = self.base_s
        while not stop.is_set():
            await self.refresh()
            busy, self.busy = self.busy or holding(), False
            interval = self.base_s if busy else min(self.idle_s, interval * 2)
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
            except TimeoutError:
                pass
