"""The health agent of one node (ARCHITECTURE §5): samples its GPUs, publishes the samples, keeps its heartbeat.

Every `policies.health.interval_ms` it takes a sample (NVML, or the model of a simulated node), adds the engine's
recent latency from the worker's status hash, and publishes one HealthEvent (source `nvml`|`sim`) to `rf:health`
and to the node's GPU hash `node_gpu(node)` in one round trip. Beside that it keeps `etcd_heartbeat(node)` under
an etcd lease of 2 s refreshed every second, so a node whose agent dies (kill -9, host down) is seen by the
monitor through lease expiry. Neither a Redis nor an etcd outage stops it: it logs once per outage and carries on.

Stopping: on SIGTERM/SIGINT the agent is stopping for good (node decommissioned, host shutting down), so it revokes
its lease and the monitor sees the heartbeat vanish at once instead of after the TTL, during which it would trust
a node that publishes nothing. `revoke_on_stop=False` (`--keep-heartbeat`) is for a supervised restart/upgrade:
the lease then runs out by itself, and a successor started within the TTL re-puts the key under its own lease
first, so the monitor sees no gap (an expiring lease deletes only the keys still attached to it).

It never scores health or decides anything about the node: that is the monitor's job (`pipeline.health`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import aetcd.exceptions as aex
import redis.asyncio as aioredis

from pipeline.config import RackflowConfig
from pipeline.events import HealthEvent
from streams import codec, keys
from streams.runner import connect, minid_for
from workers.health.nvml_source import NvmlSource, NvmlUnavailable
from workers.health.sim_source import SimGpuSource, worker_status
from workers.shell import metrics
from workers.shell.runtime import WALL
from workers.stores.etcd import EtcdStoreError, _translate, etcd_client

log = logging.getLogger(__name__)

SourceName = Literal["nvml", "sim"]
SOURCES: tuple[SourceName, ...] = ("nvml", "sim")
HEARTBEAT_TTL_S = 2
HEARTBEAT_REFRESH_S = 1.0
EXIT_NO_NVML = 2
_EVENT_FIELDS = frozenset(f.name for f in dataclasses.fields(HealthEvent))


class GpuSource(Protocol):
    async def sample(self, now_ms: float) -> dict[str, Any]:
        """HealthEvent fields of the node now (avg_latency_ms included)."""

    def close(self) -> None: ...


class _NvmlNodeSource:
    """NVML readings (in a thread: a sample blocks ~40 ms) plus the engine latency from the worker's status."""

    def __init__(self, nvml: NvmlSource, r: aioredis.Redis, node: str, max_status_age_ms: float) -> None:
        self.nvml = nvml
        self.r = r
        self.node = node
        self.max_status_age_ms = max_status_age_ms

    async def sample(self, now_ms: float) -> dict[str, Any]:
        fields = await asyncio.to_thread(self.nvml.sample)
        worker = await worker_status(self.r, self.node, now_ms, self.max_status_age_ms)
        fields["avg_latency_ms"] = worker.avg_latency_ms if worker else 0.0
        return fields

    def close(self) -> None:
        self.nvml.close()


@dataclass
class HeartbeatStats:
    beats: int = 0
    grants: int = 0
    """Leases granted (1 + one per expiry: an outage longer than the TTL)."""
    failures: int = 0


class AgentHeartbeat:
    """`etcd_heartbeat(node)` under a lease of `ttl_s`, refreshed every `refresh_s`; a new lease when the old one
    expired (an etcd outage longer than the TTL). etcd errors become EtcdStoreError/EtcdUnavailable."""

    def __init__(self, etcd_url: str, node: str, info: dict[str, Any], ttl_s: int = HEARTBEAT_TTL_S,
                 refresh_s: float = HEARTBEAT_REFRESH_S) -> None:
        # a call that hangs longer than the TTL is no use to a heartbeat
        self.client = etcd_client(etcd_url, timeout=max(1, ttl_s))
        self.node = node
        self.key = keys.etcd_heartbeat(node).encode()
        self.info = info
        self.ttl_s = ttl_s
        self.refresh_s = refresh_s
        self.stats = HeartbeatStats()
        self._lease: Any = None
        self._key_put = False

    async def beat(self) -> None:
        """One step: grant + put when there is no live lease, else refresh (and put again if the put failed)."""
        try:
            if self._lease is not None:
                reply = await self._lease.refresh()
                if reply is None or reply.TTL <= 0:
                    log.warning("node %s: heartbeat lease expired; granting a new one", self.node)
                    self._lease, self._key_put = None, False
            if self._lease is None:
                self._lease = await self.client.lease(self.ttl_s)
                self.stats.grants += 1
            if not self._key_put:
                value = json.dumps({**self.info, "ts_ms": WALL.now_ms()}).encode()
                await self.client.put(self.key, value, lease=self._lease)
                self._key_put = True
        except aex.ClientError as e:
            raise _translate(e) from None
        self.stats.beats += 1

    async def run(self, stop: asyncio.Event) -> None:
        failing = False
        while not stop.is_set():
            try:
                await self.beat()
                if failing:
                    log.info("node %s: heartbeat back", self.node)
                failing = False
            except EtcdStoreError as e:
                self.stats.failures += 1
                if not failing:
                    log.warning("node %s: heartbeat failed (%s); retrying every %.1fs", self.node, e, self.refresh_s)
                failing = True
            except Exception as e:  # grpc internals can raise outside aetcd's hierarchy; never stop beating
                self.stats.failures += 1
                if not failing:
                    log.warning("node %s: heartbeat failed (%r); retrying", self.node, e)
                failing = True
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.refresh_s)
            except TimeoutError:
                pass

    async def worker_pid(self) -> int | None:
        """The pid in the node's worker registration (`etcd_node(node)`), or None."""
        try:
            kv = await self.client.get(keys.etcd_node(self.node).encode())
        except aex.ClientError as e:
            log.warning("node %s: worker registration unreadable: %s", self.node, _translate(e))
            return None
        if kv is None:
            return None
        try:
            pid = json.loads(kv.value).get("pid")
        except (ValueError, AttributeError):
            return None
        return pid if isinstance(pid, int) and pid > 0 else None

    async def close(self, revoke: bool) -> None:
        if revoke and self._lease is not None:
            try:
                await self._lease.revoke()
            except Exception as e:  # the lease then expires by itself after the TTL
                log.warning("node %s: heartbeat lease revoke failed: %s", self.node, e)
        try:
            await self.client.close()
        except Exception as e:
            log.debug("etcd close: %s", e)


@dataclass
class AgentStats:
    samples: int = 0
    publish_failures: int = 0


class HealthAgent:
    def __init__(
        self,
        config: RackflowConfig,
        node: str,
        source: SourceName,
        redis_url: str,
        etcd_url: str,
        *,
        gpu_indices: list[int] | None = None,
        revoke_on_stop: bool = True,
    ) -> None:
        if source not in SOURCES:
            raise ValueError(f"unknown health source {source!r}; allowed: {', '.join(SOURCES)}")
        if gpu_indices is not None and source != "nvml":
            raise ValueError("GPU indices apply to the nvml source only (a simulated node has its tp GPUs)")
        self.config = config
        self.node = node
        self.rack = config.rack_of(node)  # KeyError naming the known nodes
        self.spec = config.node(node)
        self.source_name = source
        self.redis_url = redis_url
        self.etcd_url = etcd_url
        self.gpu_indices = gpu_indices
        self.revoke_on_stop = revoke_on_stop
        self.interval_s = config.policies.health.interval_ms / 1000.0
        self.retention_ms = config.policies.streams.retention_s * 1000
        self._trimmed_ms = 0.0
        self.max_status_age_ms = max(2000.0, 5.0 * config.policies.worker.status_interval_ms)
        self.stats = AgentStats()
        self.heartbeat: AgentHeartbeat | None = None

    def event(self, fields: dict[str, Any], now_ms: float) -> HealthEvent:
        known = {k: v for k, v in fields.items() if k in _EVENT_FIELDS}
        known.update(node=self.node, rack=self.rack, ts_ms=now_ms, source=self.source_name)
        return HealthEvent(**known)

    async def publish(self, r: aioredis.Redis, ev: HealthEvent) -> None:
        enc = codec.encode(ev)
        pipe = r.pipeline(transaction=False)
        pipe.xadd(keys.HEALTH, enc, maxlen=keys.HEALTH_MAXLEN, approximate=True)  # type: ignore[arg-type]
        if ev.ts_ms - self._trimmed_ms >= keys.HEALTH_TRIM_EVERY_MS:  # and trimmed to the retention
            pipe.xtrim(keys.HEALTH, minid=minid_for(ev.ts_ms, self.retention_ms), approximate=True)
            self._trimmed_ms = ev.ts_ms
        pipe.hset(keys.node_gpu(self.node), mapping=enc)  # type: ignore[arg-type]
        await pipe.execute()

    def _open_source(self, r: aioredis.Redis, heartbeat: AgentHeartbeat) -> GpuSource:
        if self.source_name == "sim":
            return SimGpuSource(self.config, self.node, r, worker_pid=heartbeat.worker_pid)
        nvml = NvmlSource(self.gpu_indices, pcie_gbps=self.config.gpus[self.spec.gpu].pcie_gbps)
        if len(nvml.gpus) != self.spec.tp:
            log.warning("node %s: reading %d GPUs but the node runs tp=%d; pass --gpus with its GPUs' indices",
                        self.node, len(nvml.gpus), self.spec.tp)
        return _NvmlNodeSource(nvml, r, self.node, self.max_status_age_ms)

    async def run(self, stop: asyncio.Event) -> int:
        """Sample and publish until `stop`; 0 on a clean stop, 2 when NVML is not available here."""
        ttl = self.config.policies.health.agent_heartbeat_ttl_s
        heartbeat = AgentHeartbeat(self.etcd_url, self.node, {
            "node": self.node, "rack": self.rack, "source": self.source_name, "pid": os.getpid(),
            "since": WALL.now_ms(),
        }, ttl_s=ttl, refresh_s=min(HEARTBEAT_REFRESH_S, ttl / 2))
        self.heartbeat = heartbeat
        r = connect(self.redis_url)
        try:
            source = self._open_source(r, heartbeat)
        except NvmlUnavailable as e:
            log.error("node %s: %s", self.node, e)
            await r.aclose()
            await heartbeat.close(revoke=False)
            return EXIT_NO_NVML
        hb_task = asyncio.create_task(heartbeat.run(stop), name="heartbeat")
        log.info("health agent %s (rack %s, source %s) publishing every %d ms", self.node, self.rack,
                 self.source_name, self.config.policies.health.interval_ms)
        try:
            await self._sample_loop(stop, source, r)
        finally:
            # cancelled, not awaited: a beat hanging on an unreachable etcd must not hold up the stop
            hb_task.cancel()
            await asyncio.gather(hb_task, return_exceptions=True)
            await heartbeat.close(revoke=self.revoke_on_stop)
            source.close()
            await r.aclose()
        log.info("health agent %s stopped (%d samples)", self.node, self.stats.samples)
        return 0

    def _export_metrics(self, ev: HealthEvent) -> None:
        metrics.AGENT_SAMPLES.labels(self.node).inc()
        metrics.GPU_TEMP.labels(self.node).set(ev.temp_c)
        metrics.GPU_MEM_FREE_GB.labels(self.node).set(ev.gpu_mem_free_gb)
        metrics.GPU_XID.labels(self.node).set(ev.xid_errors)

    def idle_interval_s(self) -> float:
        """The longest pause between two samples of a quiet, idle node (`worker.idle_status_interval_ms`, capped at
        a third of `node_selection.stale_ms`), never shorter than `health.interval_ms`."""
        return max(self.interval_s, self.config.policies.idle_pace_ms() / 1000.0)

    def quiet(self, ev: HealthEvent, prev: HealthEvent | None) -> bool:
        """Nothing to watch closely: the GPUs idle (utilization under 1%), no new Xid, ECC or NVLink error since
        the last sample, not throttled, below the warning temperature. Then the next sample may wait longer."""
        if prev is None:
            return False
        return (ev.gpu_util_pct < 1.0 and ev.xid_errors == prev.xid_errors and ev.ecc_errors == prev.ecc_errors
                and ev.nvlink_crc_errors == prev.nvlink_crc_errors and not ev.throttle_reasons
                and ev.temp_c < self.config.policies.health.temp_warn_c)

    async def _sample_loop(self, stop: asyncio.Event, source: GpuSource, r: aioredis.Redis) -> None:
        """A sample every `health.interval_ms`; while the node is idle and quiet (`quiet`), the pause doubles up to
        `idle_interval_s` (measured with `rackflow bench idle`: 8 agents sampling 5 times a second were a fifth of
        an idle cluster's CPU). A busy GPU or any sign of trouble brings the fast pace back at the next sample; the
        monitor's recovery hysteresis counts time, not samples, so a slower agent does not slow a recovery."""
        loop = asyncio.get_running_loop()
        next_t = loop.time()
        failing = False
        prev: HealthEvent | None = None
        interval = self.interval_s
        idle_max = self.idle_interval_s()
        while not stop.is_set():
            now_ms = WALL.now_ms()
            try:
                ev = self.event(await source.sample(now_ms), now_ms)
                await self.publish(r, ev)
                self.stats.samples += 1
                self._export_metrics(ev)
                interval = min(idle_max, interval * 2) if self.quiet(ev, prev) else self.interval_s
                prev = ev
                if failing:
                    log.info("node %s: publishing health samples again", self.node)
                failing = False
            except Exception as e:  # Redis down, a source error: never stop sampling over it
                self.stats.publish_failures += 1
                metrics.AGENT_FAILURES.labels(self.node).inc()
                interval = self.interval_s
                if not failing:
                    log.warning("node %s: health sample not published (%s); retrying each interval", self.node, e)
                failing = True
            # a fixed rate, not a fixed pause: samples stay `interval` apart however long a sample took;
            # ticks missed while stalled are skipped, not caught up in a burst
            next_t += interval
            delay = next_t - loop.time()
            if delay < 0:
                next_t, delay = loop.time(), 0.0
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
            except TimeoutError:
                pass
