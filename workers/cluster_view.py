"""Live view of the cluster for the router and the batchers: which nodes are registered (etcd) and what their
last status says (Valkey hash), turned into the plain NodeView / RackView snapshots the policies take.

Refreshed every `node_selection.refresh_ms` (200 ms by default). A node counts as active only when its etcd lease
is alive with state `active` AND its status is fresher than `stale_ms`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from pipeline.config import RackflowConfig
from pipeline.events import HealthEvent
from pipeline.routing.views import NodeView, RackView
from streams import codec, keys
from streams.errors import DecodeError
from workers.etcd_store import EtcdStoreError, NodeRegistry

log = logging.getLogger(__name__)


def node_view_from_status(
    name: str, status: HealthEvent | None, registered: Mapping[str, object] | None, now_ms: float, stale_ms: float
) -> NodeView:
    state = registered.get("state") if registered else None
    if status is None:
        return NodeView(name, False, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)
    fresh = now_ms - status.ts_ms <= stale_ms
    return NodeView(
        name=name,
        active=bool(state == "active" and fresh),
        vram_total_gb=status.gpu_mem_total_gb,
        free_vram_gb=status.gpu_mem_free_gb,
        pcie_util_pct=status.pcie_util_pct,
        avg_latency_ms=status.avg_latency_ms,
        kv_capacity_kb=status.kv_capacity_kb,
        kv_free_kb=max(0.0, status.kv_capacity_kb - status.kv_used_kb),
        running=status.running,
        waiting=status.waiting,
    )


@dataclass
class ClusterView:
    config: RackflowConfig
    r: aioredis.Redis
    registry: NodeRegistry
    stale_ms: float = 3000.0
    statuses: dict[str, HealthEvent] = field(default_factory=dict)
    registered: dict[str, dict[str, object]] = field(default_factory=dict)
    rack_backlog: dict[str, int] = field(default_factory=dict)

    async def refresh(self, racks: tuple[str, ...] | None = None, with_backlog: bool = False) -> None:
        try:
            self.registered = await self.registry.nodes()
        except EtcdStoreError as e:
            log.warning("node registry unavailable, keeping the last view: %s", e)
        names = [n.name for n in self.config.nodes()]
        pipe = self.r.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(keys.node_status(n))
        rows = await pipe.execute()
        for n, fields in zip(names, rows, strict=True):
            if not fields:
                continue
            try:
                ev = codec.decode(fields)
            except DecodeError as e:
                log.warning("node %s: undecodable status: %s", n, e)
                continue
            if isinstance(ev, HealthEvent):
                self.statuses[n] = ev
        if with_backlog:
            for rack in racks or self.config.rack_names():
                try:
                    groups = await self.r.xinfo_groups(keys.rack_requests(rack))
                except aioredis.ResponseError:
                    groups = []
                backlog = 0
                for g in groups:
                    if g.get("name") in (keys.GROUP_BATCHER, keys.GROUP_BATCHER.encode()):
                        backlog = int(g.get("lag") or 0) + int(g.get("pending") or 0)
                self.rack_backlog[rack] = backlog

    def node_views(self, now_ms: float, rack: str | None = None) -> list[NodeView]:
        out = []
        for r in self.config.cluster.racks:
            if rack is not None and r.name != rack:
                continue
            for n in r.expanded():
                out.append(
                    node_view_from_status(
                        n.name, self.statuses.get(n.name), self.registered.get(n.name), now_ms, self.stale_ms
                    )
                )
        return out

    def rack_views(self, now_ms: float) -> dict[str, RackView]:
        out = {}
        for r in self.config.cluster.racks:
            nodes = self.node_views(now_ms, r.name)
            active = [n for n in nodes if n.active]
            load = sum(n.running + n.waiting for n in active) + self.rack_backlog.get(r.name, 0)
            out[r.name] = RackView(r.name, bool(active), float(load))
        return out
