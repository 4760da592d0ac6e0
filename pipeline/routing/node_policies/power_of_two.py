"""`power_of_two`: sample two eligible nodes at random, keep the one with fewer outstanding sequences
(Mitzenmacher's power of two choices: near least-loaded balance without a global view)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from pipeline.events import RequestEvent
from pipeline.routing.node_policies.base import NodeChoice, outstanding, sorted_views
from pipeline.routing.views import NodeView


class PowerOfTwo:
    name: ClassVar[str] = "power_of_two"
    per_request: ClassVar[bool] = False

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, nodes: Sequence[NodeView], req: RequestEvent | None) -> NodeChoice:
        views = sorted_views(nodes)
        if not views:
            return NodeChoice(None)
        if len(views) == 1:
            return NodeChoice(views[0].name, scores={views[0].name: float(outstanding(views[0]))})
        # two uniform draws pick two distinct nodes (only `random()` is used, so replay can script the draws)
        draw = self.rng.random()
        n = len(views)
        a = min(int(draw * n), n - 1)
        b = min(int(self.rng.random() * (n - 1)), n - 2)
        if b >= a:
            b += 1
        va, vb = views[a], views[b]
        best = min((va, vb), key=lambda v: (outstanding(v), -v.kv_free_kb, v.name))
        return NodeChoice(best.name, draw, {va.name: float(outstanding(va)), vb.name: float(outstanding(vb))})

    def observe(self, node: str, req: RequestEvent) -> None:
        return None
