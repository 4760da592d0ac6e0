"""`dynamo`: NVIDIA Dynamo's KV router cost, as a baseline.

Source: ai-dynamo/dynamo `docs/architecture/kv_cache_routing.md` ("Cost Calculation", "Worker Selection") and
`lib/llm/src/kv_router/scheduler.rs` (`DefaultWorkerSelector`) with `sequence.rs` (active sequences); defaults from
`KvRouterConfig::default()`: overlap_score_weight 1.0, router_temperature 0. The formula carries over; the code is ours.

    prefill_blocks(w) = (uncached prefill tokens still queued on w + in - overlap(w) x B) / B
    decode_blocks(w)  = active KV blocks on w + the request's blocks not already there
    cost(w)           = overlap_score_weight x prefill_blocks(w) + decode_blocks(w)       lowest wins
    ties (temperature 0): the worker with the smallest cached-block count, then uniformly at random
overlap(w) comes from a precise index of the engines' block events (Dynamo's radix tree of KV events). The queued
prefill tokens and the active blocks are the engine's own figures (Dynamo tracks the same from its routing decisions
and first-token notices). B is the prefix block size; the cost is proportional to tokens, so B only scales it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from pipeline.events import RequestEvent
from pipeline.routing.node_policies.base import NodeChoice
from pipeline.routing.prefix_index import BlockIndex
from pipeline.routing.views import NodeView

OVERLAP_SCORE_WEIGHT = 1.0


class Dynamo:
    name: ClassVar[str] = "dynamo"
    per_request: ClassVar[bool] = True

    def __init__(self, blocks: BlockIndex, block_tokens: int, rng: random.Random,
                 overlap_score_weight: float = OVERLAP_SCORE_WEIGHT) -> None:
        self.blocks = blocks
        self.block_tokens = block_tokens
        self.rng = rng
        self.weight = overlap_score_weight

    def costs(self, nodes: Sequence[NodeView], req: RequestEvent | None) -> dict[str, float]:
        b = float(self.block_tokens)
        matched = self.blocks.matches(req.prefix_hashes) if req is not None and req.prefix_cache else {}
        isl = req.in_tokens if req is not None else 0
        out: dict[str, float] = {}
        for v in nodes:
            new = max(0.0, isl - matched.get(v.name, 0) * b)
            prefill_blocks = (v.prefill_tokens + new) / b
            decode_blocks = (v.decode_tokens + v.prefill_tokens + new) / b
            out[v.name] = self.weight * prefill_blocks + decode_blocks
        return out

    def choose(self, nodes: Sequence[NodeView], req: RequestEvent | None) -> NodeChoice:
        if not nodes:
            return NodeChoice(None)
        costs = self.costs(nodes, req)
        low = min(costs.values())
        tied = [n for n, c in costs.items() if c == low]
        if len(tied) > 1:
            smallest = min(self.blocks.size(n) for n in tied)
            tied = sorted(n for n in tied if self.blocks.size(n) == smallest)
        if len(tied) == 1:
            return NodeChoice(tied[0], scores=costs)
        draw = self.rng.random()
        return NodeChoice(tied[min(int(draw * len(tied)), len(tied) - 1)], draw, costs)

    def observe(self, node: str, req: RequestEvent) -> None:
        return None  # the index follows the engines' block events, not the router's guesses
