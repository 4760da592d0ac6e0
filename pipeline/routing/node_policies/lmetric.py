"""`lmetric`: LMetric's score, new prefill tokens x batch size, as a baseline.

Source: D. Zhang et al., "LMetric: Simple is Better - Multiplication May Be All You Need for LLM Request Scheduling",
arXiv 2603.15202 (OSDI '26): "a simple multiplication of two carefully chosen indicators - one for KV$-aware (new
prefill tokens if routed to an instance) and one for load balancing-aware (current batch size of the instance) - as
the scheduling score". No code is published; the formula carries over, the details below are our reading of it.

    score(i) = P(i) x BS(i)        lowest wins
    P(i)  = prompt tokens - tokens of its prefix cached on i (the precise block index of the engines' block events)
    BS(i) = running + waiting requests on i, counting this one (so an idle instance does not score 0 whatever it has
            to prefill)
    ties (several full hits score 0): rotate the starting instance, so that ties spread over the instances
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pipeline.events import RequestEvent
from pipeline.routing.node_policies.base import NodeChoice, outstanding
from pipeline.routing.prefix_index import BlockIndex
from pipeline.routing.views import NodeView


class LMetric:
    name: ClassVar[str] = "lmetric"
    per_request: ClassVar[bool] = True

    def __init__(self, blocks: BlockIndex, block_tokens: int) -> None:
        self.blocks = blocks
        self.block_tokens = block_tokens
        self._turn = 0

    def choose(self, nodes: Sequence[NodeView], req: RequestEvent | None) -> NodeChoice:
        if not nodes:
            return NodeChoice(None)
        views = sorted(nodes, key=lambda v: v.name)
        matched = self.blocks.matches(req.prefix_hashes) if req is not None and req.prefix_cache else {}
        isl = req.in_tokens if req is not None else 1
        scores = {
            v.name: max(0, isl - matched.get(v.name, 0) * self.block_tokens) * (outstanding(v) + 1) for v in views
        }
        low = min(scores.values())
        tied = [v.name for v in views if scores[v.name] == low]
        pick = tied[self._turn % len(tied)]
        self._turn += 1
        return NodeChoice(pick, scores={k: float(x) for k, x in scores.items()})

    def observe(self, node: str, req: RequestEvent) -> None:
        return None
