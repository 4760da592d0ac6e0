"""`weighted`: the seed's live node weight, weighted-random dispatch (ARCHITECTURE §3)

    W_node = (free_vram_gb / vram_total_gb) * (1 - pcie_util_pct / 100) * exp(-k * avg_latency_ms),  k = 0.05

The seed divides by 80 (an H100's 80 GB); we use the node's own total so mixed GPU types compare fairly. Sampling
is done in log space: choosing proportionally to W equals choosing proportionally to W / max(W), and that stays
well defined when exp(-0.05 * latency) underflows for every node (latencies of tens of ms make W tiny).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import ClassVar

from pipeline.events import RequestEvent
from pipeline.routing.node_policies.base import NodeChoice, weighted_draw
from pipeline.routing.views import NodeView


def node_log_weight(node: NodeView, latency_decay_per_ms: float) -> float:
    """log W; -inf when the node has no free memory, a saturated link or is inactive."""
    if not node.active or node.vram_total_gb <= 0:
        return -math.inf
    free_frac = max(0.0, min(1.0, node.free_vram_gb / node.vram_total_gb))
    link_frac = max(0.0, min(1.0, 1.0 - node.pcie_util_pct / 100.0))
    if free_frac <= 0.0 or link_frac <= 0.0:
        return -math.inf
    return math.log(free_frac) + math.log(link_frac) - latency_decay_per_ms * max(0.0, node.avg_latency_ms)


def node_weight(node: NodeView, latency_decay_per_ms: float) -> float:
    """W itself (may underflow to 0.0 for slow nodes; use node_log_weight to compare)."""
    lw = node_log_weight(node, latency_decay_per_ms)
    return 0.0 if lw == -math.inf else math.exp(lw)


class Weighted:
    name: ClassVar[str] = "weighted"
    per_request: ClassVar[bool] = False

    def __init__(self, latency_decay_per_ms: float, rng: random.Random) -> None:
        self.k = latency_decay_per_ms
        self.rng = rng

    def scores(self, nodes: Sequence[NodeView]) -> dict[str, float]:
        """Normalised selection probabilities (they sum to 1 over eligible nodes)."""
        logs = {n.name: node_log_weight(n, self.k) for n in nodes}
        finite = [v for v in logs.values() if v != -math.inf]
        if not finite:
            return {name: 0.0 for name in logs}
        top = max(finite)
        rel = {name: (0.0 if v == -math.inf else math.exp(v - top)) for name, v in logs.items()}
        total = sum(rel.values())
        return {name: r / total for name, r in rel.items()}

    def choose(self, nodes: Sequence[NodeView], req: RequestEvent | None = None) -> NodeChoice:
        probs = self.scores(nodes)
        draw = self.rng.random()
        return NodeChoice(weighted_draw(probs, draw), draw, probs)

    def observe(self, node: str, req: RequestEvent) -> None:
        return None


# The name the foundation used; kept so existing imports keep working.
WeightedRandomSelector = Weighted
