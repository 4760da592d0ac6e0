"""A simulated node's GPU metrics: what NVML would report for it, modelled from the worker's load and the faults
injected with `rackflow fault` (ARCHITECTURE §5), so the health agent, monitor and failover run without GPUs.

Model (per GPU of the node's `tp`, then `nvml_source.aggregate` as for real GPUs):
- memory used = the node's model weights (split over tp) + the worker's KV in use (its status hash; none: idle);
- utilisation = 100 x (1 - exp(-running / 4)) from the worker's running sequences;
- temperature approaches 45 + 30 x util/100 °C (45..75) with a first-order lag of 5 s; power = (0.3 + 0.7 x util)
  x the architecture's board power (A100 400 W, H100/H200 700 W, Blackwell 1000 W); PCIe a little traffic with load;
- counters start at 0 and only faults move them.
Faults: `xid` +1 Xid per injected fault id; `overheat` 95 °C and the thermal throttle bits; `nvlink-crc` +500 x factor
CRC errors per sample; `slow` is applied by the worker (its engine runs factor x slower), so it shows in the
worker's measured latency reported here; `kill` SIGKILLs the node's worker process (only a
`workers.cli ... worker --node N` process, checked in /proc) and removes the fault. Deterministic: no randomness;
the same inputs (worker status, faults, sample times) give the same samples.
"""

from __future__ import annotations

import logging
import math
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from pipeline.config import RackflowConfig
from pipeline.events import HealthEvent
from streams import codec, keys
from streams.errors import DecodeError
from workers.health import faults
from workers.health.nvml_source import aggregate

log = logging.getLogger(__name__)

BOARD_POWER_W = {"ampere": 400.0, "hopper": 700.0, "blackwell": 1000.0}
IDLE_POWER_SHARE = 0.3
IDLE_TEMP_C = 45.0
FULL_LOAD_TEMP_C = 75.0
OVERHEAT_TEMP_C = 95.0
TEMP_TAU_S = 5.0
UTIL_SCALE_SEQS = 4.0
"""Running sequences at which utilisation reaches 1 - 1/e (63 %)."""
NVLINK_CRC_PER_SAMPLE = 500
PCIE_IDLE_RX_MB_S = 2.0
PCIE_LOAD_SHARE = 0.01
"""Host->device traffic at full load, as a share of the link bandwidth (a decode loop moves little over PCIe)."""
PCIE_TX_OVER_RX = 0.25
# NVML clocks-event reason bits (nvmlClocksEventReasonSwThermalSlowdown, ...HwThermalSlowdown)
THROTTLE_SW_THERMAL = 0x20
THROTTLE_HW_THERMAL = 0x40

WorkerPid = Callable[[], Awaitable[int | None]]


def is_worker_process(pid: int, node: str, proc: Path = Path("/proc")) -> bool:
    """Whether `pid` is this host's `workers.cli ... worker --node <node>` (or `rackflow ... worker ...`) process:
    a kill fault must never hit anything else a stale registration points at."""
    try:
        args = [a.decode(errors="replace") for a in (proc / str(pid) / "cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return False
    cli = any(a == "workers.cli" or a.endswith("/workers/cli/main.py") or Path(a).name == "rackflow" for a in args)
    if not cli or "worker" not in args:
        return False
    return any((a == "--node" and i + 1 < len(args) and args[i + 1] == node) or a == f"--node={node}"
               for i, a in enumerate(args))


async def worker_status(r: aioredis.Redis, node: str, now_ms: float, max_age_ms: float) -> HealthEvent | None:
    """The worker's last status (its HealthEvent in `node_status(node)`), or None when there is none, it does not
    decode, or it is older than `max_age_ms` (a dead worker's last words are not its load)."""
    raw = await r.hgetall(keys.node_status(node))
    if not raw:
        return None
    try:
        ev = codec.decode(raw)
    except DecodeError as e:
        log.warning("node %s: worker status does not decode: %s", node, e)
        return None
    if not isinstance(ev, HealthEvent) or now_ms - ev.ts_ms > max_age_ms:
        return None
    return ev


class SimGpuSource:
    """The GPU metrics of simulated node `node`. `worker_pid` looks up the node's worker pid (its etcd
    registration) for `kill` faults; without it a kill fault is logged and dropped."""

    def __init__(
        self, config: RackflowConfig, node: str, r: aioredis.Redis, *, worker_pid: WorkerPid | None = None,
    ) -> None:
        spec = config.node(node)
        self.node = node
        self.r = r
        self.worker_pid = worker_pid
        self.tp = spec.tp
        self.gpu = config.gpus[spec.gpu]
        # the engine serves the node's first model (CalibratedCostModel.for_node)
        self.weights_gb = config.models[spec.models[0]].weight_bytes / 1e9
        self.max_status_age_ms = max(2000.0, 5.0 * config.policies.worker.status_interval_ms)
        self.xid_errors = 0
        self.nvlink_crc_errors = 0
        self.ecc_errors = 0
        self._xid_seen: set[str] = set()
        self._kills_done: set[str] = set()
        self._temp_c: float | None = None
        self._last_ms: float | None = None
        self.worker: HealthEvent | None = None
        """The worker status the last sample was based on."""

    async def sample(self, now_ms: float) -> dict[str, Any]:
        """HealthEvent fields of the node at `now_ms` (incl. avg_latency_ms: the worker's measured one)."""
        self.worker = await worker_status(self.r, self.node, now_ms, self.max_status_age_ms)
        active = await faults.active(self.r, self.node, now_ms)
        kill = active.get("kill")
        if kill is not None and kill.id not in self._kills_done:
            self._kills_done.add(kill.id)
            await self._kill_worker()
            await faults.remove(self.r, self.node, kill)
        return self.model(now_ms, self.worker, active)

    def model(self, now_ms: float, worker: HealthEvent | None, active: dict[str, faults.Fault]) -> dict[str, Any]:
        """The sample from the worker's status and the active faults (no I/O); advances counters and temperature."""
        running = worker.running if worker else 0
        util = 100.0 * (1.0 - math.exp(-running / UTIL_SCALE_SEQS))
        target = IDLE_TEMP_C + (FULL_LOAD_TEMP_C - IDLE_TEMP_C) * util / 100.0
        if self._temp_c is None or self._last_ms is None:
            self._temp_c = target
        else:
            dt_s = max(0.0, now_ms - self._last_ms) / 1000.0
            self._temp_c += (target - self._temp_c) * (1.0 - math.exp(-dt_s / TEMP_TAU_S))
        self._last_ms = now_ms
        throttle = 0
        if "overheat" in active:
            self._temp_c = OVERHEAT_TEMP_C  # after the fault it cools down along the lag
            throttle = THROTTLE_SW_THERMAL | THROTTLE_HW_THERMAL
        xid = active.get("xid")
        if xid is not None and xid.id not in self._xid_seen:
            self._xid_seen.add(xid.id)
            self.xid_errors += 1
        crc = active.get("nvlink-crc")
        if crc is not None:
            self.nvlink_crc_errors += round(NVLINK_CRC_PER_SAMPLE * crc.factor)
        # A `slow` fault is applied by the worker itself (its engine's iterations take factor x longer), so the
        # latency it measures already carries it: reported as measured, not multiplied a second time.
        latency = worker.avg_latency_ms if worker else 0.0

        kv_gb = (worker.kv_used_kb if worker else 0.0) / 1e6
        link_mb_s = self.gpu.pcie_gbps * 1000.0
        rx = PCIE_IDLE_RX_MB_S + PCIE_LOAD_SHARE * link_mb_s * util / 100.0
        tx = PCIE_TX_OVER_RX * rx
        per_gpu = [
            {
                "gpu_mem_total_gb": self.gpu.memory_gb,
                "gpu_mem_free_gb": max(0.0, self.gpu.memory_gb - (self.weights_gb + kv_gb) / self.tp),
                "gpu_util_pct": util,
                "pcie_tx_mb_s": tx,
                "pcie_rx_mb_s": rx,
                "pcie_util_pct": 100.0 * (tx + rx) / link_mb_s,
                "temp_c": self._temp_c,
                "power_w": BOARD_POWER_W[self.gpu.arch] * (IDLE_POWER_SHARE + (1 - IDLE_POWER_SHARE) * util / 100.0),
                "throttle_reasons": throttle,
            }
            for _ in range(self.tp)
        ]
        # the node's counters on its first GPU: aggregate sums them, so where they sit does not show
        per_gpu[0].update(xid_errors=self.xid_errors, nvlink_crc_errors=self.nvlink_crc_errors,
                          ecc_errors=self.ecc_errors)
        out = aggregate(per_gpu)
        out["avg_latency_ms"] = latency
        return out

    async def _kill_worker(self) -> None:
        pid = await self.worker_pid() if self.worker_pid is not None else None
        if pid is None:
            log.warning("node %s: kill fault: no registered worker pid; fault dropped", self.node)
            return
        if not is_worker_process(pid, self.node):
            log.warning("node %s: kill fault: pid %d is not this node's worker process here; fault dropped",
                        self.node, pid)
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            log.warning("node %s: kill fault: worker pid %d already gone", self.node, pid)
            return
        log.warning("node %s: kill fault: sent SIGKILL to worker pid %d", self.node, pid)

    def close(self) -> None:
        """Nothing to release (the Redis client belongs to the caller)."""
