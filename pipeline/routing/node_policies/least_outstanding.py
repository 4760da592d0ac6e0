"""`least_outstanding`: the node with the fewest running + waiting sequences (production-stack's / AIBrix's
least-request routing); ties go to the node with more free KV memory, then by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pipeline.events import RequestEvent
from pipeline.routing.node_policies.base import NodeChoice, outstanding
from pipeline.routing.views import NodeView


class LeastOutstanding:
    name: ClassVar[str] = "least_outstanding"
    per_request: ClassVar[bool] = False

    def choose(self, nodes: Sequence[NodeView], req: RequestEvent | None) -> NodeChoice:
        if not nodes:
            return NodeChoice(None)
        best = min(nodes, key=lambda v: (outstanding(v), -v.kv_free_kb, v.name))
        return NodeChoice(best.name, scores={v.name: float(outstanding(v)) for v in nodes})

    def observe(self, node: str, req: RequestEvent) -> None:
        return None
