"""How a node's view merges the worker's status with its health agent's GPU sample and the monitor's verdict."""

from __future__ import annotations

from pipeline.events import HealthEvent
from workers.stores.cluster_view import node_view_from_status


def _ev(source: str, total: float, free: float, ts: float = 1000.0) -> HealthEvent:
    return HealthEvent(node="n0", rack="r0", ts_ms=ts, source=source, gpu_mem_total_gb=total, gpu_mem_free_gb=free,
                       kv_capacity_kb=1e6, kv_used_kb=2e5, running=3)


ACTIVE = {"state": "active"}


def test_worker_status_alone() -> None:
    v = node_view_from_status("n0", _ev("worker", 80, 30), ACTIVE, 1000.0, 3000.0)
    assert v.active and v.vram_total_gb == 80 and v.free_vram_gb == 30 and v.kv_free_kb == 8e5


def test_agent_memory_caps_the_engines_bookkeeping() -> None:
    # NVML sees less free memory than the engine accounts for (another process, fragmentation): the agent wins
    v = node_view_from_status("n0", _ev("worker", 80, 30), ACTIVE, 1000.0, 3000.0, gpu=_ev("nvml", 80, 10))
    assert v.vram_total_gb == 80 and v.free_vram_gb == 10


def test_engine_with_another_total_is_compared_as_a_fraction() -> None:
    # the CPU torch engine accounts 2 GB of which 1.5 free, next to a modelled 80 GB GPU with 60 free: 75% free
    # of the device, not min(1.5, 60) GB of 80 (which would look full and starve the node of batches)
    v = node_view_from_status("n0", _ev("worker", 2, 1.5), ACTIVE, 1000.0, 3000.0, gpu=_ev("sim", 80, 70))
    assert v.vram_total_gb == 80 and v.free_vram_gb == 60


def test_stale_agent_is_ignored_and_verdicts_deactivate() -> None:
    v = node_view_from_status("n0", _ev("worker", 80, 30), ACTIVE, 10_000.0, 3000.0, gpu=_ev("nvml", 80, 5, ts=1.0),
                              )
    assert v.free_vram_gb == 30 and not v.active  # the worker's own status is stale too at 10 s
    fresh = _ev("worker", 80, 30, ts=9_000.0)
    assert node_view_from_status("n0", fresh, ACTIVE, 10_000.0, 3000.0).active
    for verdict in ("draining", "dead"):
        assert not node_view_from_status("n0", fresh, ACTIVE, 10_000.0, 3000.0, admin={"state": verdict}).active
    assert not node_view_from_status("n0", fresh, {"state": "draining"}, 10_000.0, 3000.0).active
