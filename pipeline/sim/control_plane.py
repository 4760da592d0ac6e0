"""Costs of the control plane that grow with the cluster: routers, per-rack batchers, Valkey shards, etcd and the
node-to-node fabric, as service stations of the simulator. Every figure comes from a calibration file written by
`rackflow sim calibrate-control-plane` (`data/calibration/control-plane.json`), which ran the benches on a real
Valkey and a real 3-member etcd; the counts (routers, batchers per rack, shards) are settings.

A station is a FIFO queue in front of `servers` identical processes, kept as one "next free at" time: a job
arriving at t starts at max(t, free_at) and is done `service` later; free_at moves on by service / servers (the
pool of processes drains work at servers / service jobs per ms). With one server this is the exact FIFO single
server; with more it is the pooled approximation of M/D/k (the same saturation point, a slightly different wait
below it). O(1) per job, and the simulator calls it only in event-time order.

Which stream operations a request costs (the live path, `docs/ARCHITECTURE.md` section 1):
- global streams (`rf:ingress`, `rf:decisions`, `rf:results` are one key each, so one shard whatever the shard
  count): XADD + read of the ingress entry, XADD of the decision, XADD + read of the result;
- per-rack / per-node / per-request streams (spread over the shards): XADD + read of the rack request, XADD +
  read of the node batch (once per batch), XADD of the first token and one per `token_flush_ms` of decoding
  (charged per engine iteration / decode stretch: each decoding sequence, min(steps, duration / flush)).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class Station:
    """FIFO queue in front of `servers` processes (see the module docstring)."""

    __slots__ = ("busy_ms", "first_ms", "free_at", "jobs", "last_ms", "max_wait_ms", "servers", "wait_ms")

    def __init__(self, servers: int = 1) -> None:
        if servers < 1:
            raise ValueError(f"a station needs at least one server, got {servers}")
        self.servers = servers
        self.free_at = -math.inf
        self.busy_ms = 0.0
        self.wait_ms = 0.0
        self.max_wait_ms = 0.0
        self.jobs = 0
        self.first_ms = math.inf
        self.last_ms = -math.inf

    def serve(self, t: float, service_ms: float) -> float:
        """A job arriving at `t` that waits its turn; returns when it is done."""
        free = self.free_at
        start = t if t > free else free
        w = start - t
        self.free_at = start + service_ms / self.servers
        self.busy_ms += service_ms
        self.wait_ms += w
        if w > self.max_wait_ms:
            self.max_wait_ms = w
        self.jobs += 1
        if t < self.first_ms:
            self.first_ms = t
        self.last_ms = t
        return start + service_ms

    def charge(self, t: float, service_ms: float) -> None:
        """Work the station does at `t` that no request waits on (it delays the jobs behind it)."""
        free = self.free_at
        self.free_at = (t if t > free else free) + service_ms / self.servers
        self.busy_ms += service_ms
        if t > self.last_ms:
            self.last_ms = t

    def report(self, span_ms: float) -> dict[str, float]:
        span = max(span_ms, 1e-9)
        return {
            "servers": self.servers,
            "jobs": self.jobs,
            "busy_ms": round(self.busy_ms, 3),
            "utilisation": round(self.busy_ms / self.servers / span, 4),
            "mean_wait_ms": round(self.wait_ms / self.jobs, 3) if self.jobs else 0.0,
            "max_wait_ms": round(self.max_wait_ms, 3),
            "backlog_ms": round(max(0.0, self.free_at - self.last_ms), 3) if self.busy_ms else 0.0,
        }


@dataclass(frozen=True, slots=True)
class ControlPlaneCosts:
    """Per-operation service times (ms) and the process counts; `from_calibration` builds it from the file."""

    router_ms: float
    """One routing decision of one router process (rack choice, prefix lookup, the prefix-cache rule) plus the
    codec work of its entry (decode the request, encode the decision and the rack request)."""
    batcher_ms: float
    """One request through one rack's batcher process (read, window, pack, node choice, dispatch)."""
    xadd_ms: float
    """One pipelined XADD on one Valkey shard."""
    read_ms: float
    """One entry read and acknowledged by a consumer group on one Valkey shard."""
    etcd_txn_ms: float
    """Latency of one ownership transaction on the 3-member etcd at `etcd_concurrency` concurrent clients."""
    etcd_concurrency: int
    """The etcd station's servers: the concurrency at which `etcd_txn_ms` was measured (its throughput is
    etcd_concurrency / etcd_txn_ms)."""
    node_link_gbps: float
    """GB/s of one node's link to another node (a migration's KV moves over it)."""
    routers: int = 1
    batchers_per_rack: int = 1
    valkey_shards: int = 1
    """Shards the per-rack / per-node / per-request streams spread over (the global streams stay on one)."""
    token_flush_ms: float = 50.0
    """`worker.token_flush_ms`: a decoding sequence's tokens go out as one XADD per interval."""
    fabric: bool = True
    """Model the shared fabric: each node's outbound and inbound link, and each rack's uplink to the spine, as
    stations. A migration's KV crosses the source node's outbound link, and between racks both racks' uplinks, and
    the target's inbound link, which host-tier prefix loads share (False: only the source node's link, as before)."""
    spine_oversubscription: float = 1.0
    """A rack's uplink carries its nodes' links divided by this (1: a non-blocking fat tree; 4: 4:1). 0: no spine
    modelled."""
    record_flush_ms: float = 20.0
    """The workers' sequence records on etcd (`SeqRecorder`): a claim when a sequence arrives and a release when it
    ends, coalesced per node for this long and written as one transaction, one in flight per node. They share the
    etcd station with the migrations' ownership moves. 0: not modelled."""
    etcd_record_ms: float = 0.0
    """Service time of one record transaction on the etcd station (0: `etcd_txn_ms`, the measured ownership move:
    a batched put/delete transaction was not measured apart)."""

    @property
    def ingress_global_ms(self) -> float:
        """Global-shard work before the router's decision is out: ingress XADD + read, decision XADD."""
        return 2 * self.xadd_ms + self.read_ms

    @property
    def result_global_ms(self) -> float:
        return self.xadd_ms + self.read_ms

    @property
    def record_ms(self) -> float:
        return self.etcd_record_ms if self.etcd_record_ms > 0 else self.etcd_txn_ms

    def router_capacity_rps(self) -> float:
        return self.routers * 1000.0 / self.router_ms

    def batcher_capacity_rps(self) -> float:
        """Per rack."""
        return self.batchers_per_rack * 1000.0 / self.batcher_ms

    @classmethod
    def from_calibration(cls, cal: Mapping[str, Any], *, routers: int = 1, batchers_per_rack: int = 1,
                         valkey_shards: int = 1, token_flush_ms: float = 50.0, fabric: bool = True,
                         spine_oversubscription: float = 1.0, record_flush_ms: float = 20.0) -> ControlPlaneCosts:
        d = cal["derived"]
        return cls(
            router_ms=float(d["router_ms_per_decision"]), batcher_ms=float(d["batcher_ms_per_request"]),
            xadd_ms=float(d["valkey_xadd_ms"]), read_ms=float(d["valkey_read_ack_ms"]),
            etcd_txn_ms=float(d["etcd_txn_ms"]), etcd_concurrency=int(d["etcd_concurrency"]),
            node_link_gbps=float(d["node_link_gbps"]), routers=routers, batchers_per_rack=batchers_per_rack,
            valkey_shards=valkey_shards, token_flush_ms=token_flush_ms, fabric=fabric,
            spine_oversubscription=spine_oversubscription, record_flush_ms=record_flush_ms,
        )


def valkey_ms_per_request(c: ControlPlaneCosts, decode_ms: float, batch_size: float) -> tuple[float, float]:
    """(global-shard ms, spread-shards ms) one request costs Valkey, for a request decoding `decode_ms` in batches
    of `batch_size` requests."""
    glob = c.ingress_global_ms + c.result_global_ms
    flushes = 1.0 + decode_ms / c.token_flush_ms if c.token_flush_ms > 0 else 1.0
    # the rack request (XADD by the router, read by the batcher), the node batch (one per batch), the tokens
    spread = (c.xadd_ms + c.read_ms) * (1.0 + 1.0 / max(1.0, batch_size)) + flushes * c.xadd_ms
    return glob, spread


@dataclass(frozen=True, slots=True)
class Sizing:
    routers: int
    batchers_per_rack: int
    valkey_shards: int
    global_shard_utilisation: float
    """The global streams' single shard at that load (above the cap: the streams must be partitioned)."""


def size_for(c: ControlPlaneCosts, rps: float, racks: int, decode_ms: float, batch_size: float,
             cap: float = 0.7) -> Sizing:
    """Processes needed to carry `rps` (spread evenly over `racks`) with each station at most `cap` utilised."""
    if not 0 < cap <= 1:
        raise ValueError(f"utilisation cap must be in (0, 1], got {cap}")
    glob, spread = valkey_ms_per_request(c, decode_ms, batch_size)
    routers = max(1, math.ceil(rps * c.router_ms / 1000.0 / cap))
    per_rack = rps / max(1, racks)
    batchers = max(1, math.ceil(per_rack * c.batcher_ms / 1000.0 / cap))
    shards = max(1, math.ceil(rps * spread / 1000.0 / cap))
    return Sizing(routers, batchers, shards, round(rps * glob / 1000.0, 4))
