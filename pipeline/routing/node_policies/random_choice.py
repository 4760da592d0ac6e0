"""`random`: uniform over the eligible nodes."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from pipeline.events import RequestEvent
from pipeline.routing.node_policies.base import NodeChoice, sorted_views
from pipeline.routing.views import NodeView


class RandomChoice:
    name: ClassVar[str] = "random"
    per_request: ClassVar[bool] = False

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, nodes: Sequence[NodeView], req: RequestEvent | None) -> NodeChoice:
        views = sorted_views(nodes)
        if not views:
            return NodeChoice(None)
        draw = self.rng.random()
        i = min(int(draw * len(views)), len(views) - 1)
        return NodeChoice(views[i].name, draw, {v.name: 1.0 / len(views) for v in views})

    def observe(self, node: str, req: RequestEvent) -> None:
        return None
