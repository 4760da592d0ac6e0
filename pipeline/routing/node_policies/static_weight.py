"""`static_weight`: weighted random on fixed weights from config (per node name, else per GPU type, else 1), the
"weighted round robin by capacity" of classic load balancers; it ignores live load."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import ClassVar

from pipeline.events import RequestEvent
from pipeline.routing.node_policies.base import NodeChoice, weighted_draw
from pipeline.routing.views import NodeView


class StaticWeight:
    name: ClassVar[str] = "static_weight"
    per_request: ClassVar[bool] = False

    def __init__(self, rng: random.Random, weights: Mapping[str, float], node_gpus: Mapping[str, str]) -> None:
        self.rng = rng
        self.weights = dict(weights)
        self.node_gpus = dict(node_gpus)

    def weight(self, node: str) -> float:
        if node in self.weights:
            return self.weights[node]
        return self.weights.get(self.node_gpus.get(node, ""), 1.0)

    def choose(self, nodes: Sequence[NodeView], req: RequestEvent | None) -> NodeChoice:
        w = {v.name: max(0.0, self.weight(v.name)) for v in nodes}
        total = sum(w.values())
        if total <= 0:
            return NodeChoice(None, scores=w)
        draw = self.rng.random()
        return NodeChoice(weighted_draw(w, draw), draw, {k: x / total for k, x in w.items()})

    def observe(self, node: str, req: RequestEvent) -> None:
        return None
