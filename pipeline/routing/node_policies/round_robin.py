"""`round_robin`: the next eligible node in name order after the last one chosen (nginx/HAProxy's default)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pipeline.events import RequestEvent
from pipeline.routing.node_policies.base import NodeChoice, sorted_views
from pipeline.routing.views import NodeView


class RoundRobin:
    name: ClassVar[str] = "round_robin"
    per_request: ClassVar[bool] = False

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, nodes: Sequence[NodeView], req: RequestEvent | None) -> NodeChoice:
        names = [v.name for v in sorted_views(nodes)]
        if not names:
            return NodeChoice(None)
        after = [n for n in names if self._last is None or n > self._last]
        return NodeChoice((after or names)[0], scores={n: 1.0 for n in names})

    def observe(self, node: str, req: RequestEvent) -> None:
        self._last = node
