"""NVML reader of a node's GPUs: one HealthEvent's worth of metrics per `sample()`, aggregated over the node.

Owns every pynvml call of the health agent (ARCHITECTURE §5) and the arithmetic that turns per-GPU readings into
one node sample (`aggregate`, pure). A metric a device does not support (or that fails to read) is left 0 and never
fails the sample; counters (Xid events, NVLink CRC/replay errors, uncorrectable ECC errors) are cumulative, as the
health scorer expects. It never talks to Redis or etcd and never decides what a reading means.

Cost per sample: `nvmlDeviceGetPcieThroughput` samples the link over ~20 ms per call (TX and RX: ~40 ms per GPU),
so GPUs are read in parallel threads (NVML is thread-safe) and the agent calls `sample()` off its event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pynvml

from pipeline.errors import RackflowError

log = logging.getLogger(__name__)

T = TypeVar("T")

NO_LIBRARY = "NVML library not found (no NVIDIA driver): run with --source sim for a simulated node"

# Fields of one GPU's reading (the HealthEvent field names), and how `aggregate` combines them over the node.
SUMMED = ("gpu_mem_total_gb", "gpu_mem_free_gb", "pcie_tx_mb_s", "pcie_rx_mb_s", "power_w",
          "nvlink_crc_errors", "xid_errors", "ecc_errors")
AVERAGED = ("gpu_util_pct", "pcie_util_pct")
MAXIMUM = ("temp_c",)
OR_ED = ("throttle_reasons",)
COUNTERS = frozenset({"nvlink_crc_errors", "xid_errors", "ecc_errors", "throttle_reasons"})

# Clock-event bit "GPU idle": an idle GPU runs slow clocks by design, which is not a throttle (HealthEvent's
# throttle_reasons promises 0 for a GPU that is not throttled).
CLOCKS_EVENT_GPU_IDLE = 0x1
# Events drained per GPU per sample at most: a storm of Xids must not keep one sample from ending.
MAX_EVENTS_PER_SAMPLE = 1024
NVLINK_ERROR_COUNTERS = (
    pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA, pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
)


class NvmlUnavailable(RackflowError):
    """NVML cannot be used on this host (no library, no driver, no GPU, a GPU index that does not exist)."""


def aggregate(per_gpu: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One node sample from its GPUs' readings: memory, PCIe traffic, power and error counters summed; utilisation
    (GPU and PCIe) averaged; temperature the hottest GPU's; throttle reasons OR-ed; `gpus` the number of readings.
    A field missing from a reading counts as 0."""
    n = len(per_gpu)
    out: dict[str, Any] = {"gpus": n}
    for f in SUMMED:
        total = sum(g.get(f, 0) for g in per_gpu)
        out[f] = int(total) if f in COUNTERS else float(total)
    for f in AVERAGED:
        out[f] = float(sum(g.get(f, 0.0) for g in per_gpu) / n) if n else 0.0
    for f in MAXIMUM:
        out[f] = float(max((g.get(f, 0.0) for g in per_gpu), default=0.0))
    for f in OR_ED:
        mask = 0
        for g in per_gpu:
            mask |= int(g.get(f, 0))
        out[f] = mask
    return out


@dataclass(slots=True)
class _Gpu:
    index: int
    handle: Any
    events: Any = None
    """Xid event set of this GPU (None: events not supported)."""
    xid_total: int = 0
    nvlink: list[tuple[int, int]] = field(default_factory=list)
    """(link, counter) pairs that read without error when probed at start."""


class NvmlSource:
    """Reads the node's GPUs through NVML. `gpu_indices` are NVML indices (NVML ignores CUDA_VISIBLE_DEVICES);
    None: every GPU of the host. `pcie_gbps` (the GPU type's host-link bandwidth, both directions) is the
    denominator of PCIe utilisation; None leaves pcie_util_pct 0."""

    def __init__(self, gpu_indices: list[int] | None = None, pcie_gbps: float | None = None) -> None:
        self.pcie_gbps = pcie_gbps
        self._warned: set[tuple[int, str, str]] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            raise NvmlUnavailable(NO_LIBRARY) from None
        except pynvml.NVMLError_DriverNotLoaded:
            raise NvmlUnavailable(
                "NVIDIA driver not loaded (NVML found, no kernel driver): run with --source sim for a simulated node"
            ) from None
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML could not start: {e}; run with --source sim for a simulated node") from None
        try:
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                raise NvmlUnavailable("no NVIDIA GPU on this host: run with --source sim for a simulated node")
            indices = list(range(count)) if gpu_indices is None else list(gpu_indices)
            bad = [i for i in indices if not 0 <= i < count]
            if bad or not indices:
                raise NvmlUnavailable(
                    f"--gpus {','.join(map(str, indices))}: this host has GPUs 0..{count - 1}"
                )
            self.gpus = [self._open(i) for i in indices]
        except NvmlUnavailable:
            self._shutdown()
            raise
        except pynvml.NVMLError as e:
            self._shutdown()
            raise NvmlUnavailable(f"NVML could not open the GPUs: {e}") from None
        if len(self.gpus) > 1:
            self._pool = ThreadPoolExecutor(max_workers=len(self.gpus), thread_name_prefix="nvml")

    # -- setup -----------------------------------------------------------------------------------------------------
    def _open(self, index: int) -> _Gpu:
        gpu = _Gpu(index, pynvml.nvmlDeviceGetHandleByIndex(index))
        try:
            gpu.events = pynvml.nvmlEventSetCreate()
            pynvml.nvmlDeviceRegisterEvents(gpu.handle, pynvml.nvmlEventTypeXidCriticalError, gpu.events)
        except pynvml.NVMLError as e:
            # NOT_SUPPORTED on some boards/vGPUs: Xids then come only from the driver log, which we do not read
            self._warn(index, "xid events", e)
            if gpu.events is not None:
                self._free_events(gpu)
        # probe the NVLink counters once: a GPU has up to NVML_NVLINK_MAX_LINKS links, most absent
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                pynvml.nvmlDeviceGetNvLinkState(gpu.handle, link)
            except pynvml.NVMLError:
                continue  # no such link (or no NVLink at all): NOT_SUPPORTED / INVALID_ARGUMENT
            for c in NVLINK_ERROR_COUNTERS:
                try:
                    pynvml.nvmlDeviceGetNvLinkErrorCounter(gpu.handle, link, c)
                except pynvml.NVMLError:
                    continue
                gpu.nvlink.append((link, c))
        return gpu

    def _free_events(self, gpu: _Gpu) -> None:
        try:
            pynvml.nvmlEventSetFree(gpu.events)
        except pynvml.NVMLError:
            pass
        gpu.events = None

    # -- reading ---------------------------------------------------------------------------------------------------
    def _warn(self, index: int, metric: str, e: pynvml.NVMLError) -> None:
        """Log an unreadable metric once per (GPU, metric, error): NOT_SUPPORTED is expected, at debug."""
        key = (index, metric, str(e))
        if key in self._warned:
            return
        self._warned.add(key)
        if isinstance(e, pynvml.NVMLError_NotSupported):
            log.debug("GPU %d: %s not supported; reported as 0", index, metric)
        else:
            log.warning("GPU %d: %s unreadable (%s); reported as 0", index, metric, e)

    def _read(self, gpu: _Gpu, metric: str, fn: Callable[..., T], *args: Any) -> T | None:
        try:
            return fn(gpu.handle, *args)
        except pynvml.NVMLError as e:
            self._warn(gpu.index, metric, e)
            return None

    def _drain_xids(self, gpu: _Gpu) -> None:
        if gpu.events is None:
            return
        for _ in range(MAX_EVENTS_PER_SAMPLE):
            try:
                data = pynvml.nvmlEventSetWait_v2(gpu.events, 0)  # 0 ms: never blocks
            except pynvml.NVMLError_Timeout:
                return  # nothing (more) pending
            except pynvml.NVMLError as e:
                self._warn(gpu.index, "xid events", e)
                return
            if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                gpu.xid_total += 1
                log.warning("GPU %d: Xid %d", gpu.index, data.eventData)

    def read_gpu(self, gpu: _Gpu) -> dict[str, Any]:
        """One GPU's reading (HealthEvent field names); unreadable metrics are absent, i.e. 0 in `aggregate`."""
        out: dict[str, Any] = {}
        mem = self._read(gpu, "memory", pynvml.nvmlDeviceGetMemoryInfo)
        if mem is not None:
            out["gpu_mem_total_gb"] = mem.total / 1e9
            out["gpu_mem_free_gb"] = mem.free / 1e9
        util = self._read(gpu, "utilization", pynvml.nvmlDeviceGetUtilizationRates)
        if util is not None:
            out["gpu_util_pct"] = float(util.gpu)
        temp = self._read(gpu, "temperature", pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU)
        if temp is not None:
            out["temp_c"] = float(temp)
        power = self._read(gpu, "power", pynvml.nvmlDeviceGetPowerUsage)
        if power is not None:
            out["power_w"] = power / 1000.0  # mW
        tx = self._read(gpu, "pcie tx", pynvml.nvmlDeviceGetPcieThroughput, pynvml.NVML_PCIE_UTIL_TX_BYTES)
        rx = self._read(gpu, "pcie rx", pynvml.nvmlDeviceGetPcieThroughput, pynvml.NVML_PCIE_UTIL_RX_BYTES)
        out["pcie_tx_mb_s"] = (tx or 0) / 1000.0  # KB/s
        out["pcie_rx_mb_s"] = (rx or 0) / 1000.0
        if self.pcie_gbps:
            out["pcie_util_pct"] = min(
                100.0, 100.0 * (out["pcie_tx_mb_s"] + out["pcie_rx_mb_s"]) / (self.pcie_gbps * 1000.0)
            )
        crc = 0
        for link, counter in gpu.nvlink:
            v = self._read(gpu, f"nvlink {link} counter {counter}", pynvml.nvmlDeviceGetNvLinkErrorCounter, link,
                           counter)
            crc += v or 0
        out["nvlink_crc_errors"] = crc
        ecc = self._read(gpu, "ecc", pynvml.nvmlDeviceGetTotalEccErrors, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                         pynvml.NVML_VOLATILE_ECC)
        out["ecc_errors"] = ecc or 0
        out["throttle_reasons"] = self._throttle(gpu) & ~CLOCKS_EVENT_GPU_IDLE
        self._drain_xids(gpu)
        out["xid_errors"] = gpu.xid_total
        return out

    def _throttle(self, gpu: _Gpu) -> int:
        try:
            return int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(gpu.handle))
        except pynvml.NVMLError_FunctionNotFound:  # a driver older than the "clocks event" name
            pass
        except pynvml.NVMLError as e:
            self._warn(gpu.index, "clock events", e)
            return 0
        return int(self._read(gpu, "throttle reasons", pynvml.nvmlDeviceGetCurrentClocksThrottleReasons) or 0)

    def sample(self) -> dict[str, Any]:
        """The node's metrics now, as HealthEvent fields (gpus, memory, util, temperature, power, PCIe, counters).
        Blocks ~40 ms (PCIe throughput sampling); call it from a thread in async code."""
        if self._closed:
            raise NvmlUnavailable("NvmlSource used after close()")
        if self._pool is None:
            readings = [self.read_gpu(g) for g in self.gpus]
        else:
            readings = list(self._pool.map(self.read_gpu, self.gpus))
        return aggregate(readings)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for g in self.gpus:
            if g.events is not None:
                self._free_events(g)
        self._shutdown()

    @staticmethod
    def _shutdown() -> None:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as e:
            log.debug("nvmlShutdown: %s", e)
