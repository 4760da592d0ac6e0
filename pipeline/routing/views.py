"""What routing policies see of the cluster: plain snapshots built by the shell from live status."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RackView:
    name: str
    healthy: bool
    """At least one active node."""
    load: float
    """Outstanding work of the rack (requests queued + running), in requests."""


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    active: bool
    """Registered and not draining."""
    vram_total_gb: float
    free_vram_gb: float
    pcie_util_pct: float
    avg_latency_ms: float
    kv_capacity_kb: float
    kv_free_kb: float
    """Free KV memory for new sequences, after reservations the batcher has not seen admitted yet."""
    running: int
    waiting: int

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0
