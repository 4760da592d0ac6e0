"""`kv_aware`: place each request on the node where it costs least, cost = prompt tokens not already cached there
(prefix blocks, PrefixIndex) + decode_weight_tokens x outstanding sequences (NVIDIA Dynamo's KV router cost, in
tokens). Per request, so requests sharing a prefix follow it; ties go to fewer outstanding, then name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pipeline.events import RequestEvent
from pipeline.routing.node_policies.base import NodeChoice, outstanding
from pipeline.routing.prefix_index import PrefixIndex
from pipeline.routing.views import NodeView


class KvAware:
    name: ClassVar[str] = "kv_aware"
    per_request: ClassVar[bool] = True

    def __init__(self, index: PrefixIndex, block_tokens: int, decode_weight_tokens: float) -> None:
        self.index = index
        self.block_tokens = block_tokens
        self.decode_weight = decode_weight_tokens

    def cost(self, node: NodeView, req: RequestEvent | None) -> float:
        uncached = 0.0
        if req is not None:
            hit = self.index.matched_blocks(node.name, req.prefix_hashes) * self.block_tokens
            uncached = max(0.0, float(req.in_tokens - hit))
        return uncached + self.decode_weight * outstanding(node)

    def choose(self, nodes: Sequence[NodeView], req: RequestEvent | None) -> NodeChoice:
        if not nodes:
            return NodeChoice(None)
        costs = {v.name: self.cost(v, req) for v in nodes}
        best = min(nodes, key=lambda v: (costs[v.name], outstanding(v), v.name))
        return NodeChoice(best.name, scores=costs)

    def observe(self, node: str, req: RequestEvent) -> None:
        if req.prefix_hashes:
            self.index.insert(node, req.prefix_hashes)
