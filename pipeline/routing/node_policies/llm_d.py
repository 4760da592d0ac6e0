"""`llm_d`: llm-d's default scheduler profile (the Gateway API Inference Extension's endpoint picker), as a baseline.

Source: llm-d/llm-d-inference-scheduler `pkg/epp/config/loader/defaults.go` (weights queue 2, KV-cache utilisation 2,
prefix cache 3, since kubernetes-sigs/gateway-api-inference-extension commit ae8adbce, Nov 2025) and the scorers in
`pkg/epp/framework/plugins/scheduling/scorer/` (queuedepth, kvcacheutilization, prefix) and the max-score picker.
The formula carries over; the code is ours.

    score(p) = 2 x queue(p) + 2 x kv(p) + 3 x prefix(p)
    queue(p)  = (q_max - q(p)) / (q_max - q_min) over the candidates, 1 for all when equal; q = requests waiting in
                the engine's queue (vllm:num_requests_waiting), not the running ones
    kv(p)     = 1 - KV-cache usage of the engine (vllm:kv_cache_usage_perc)
    prefix(p) = leading prefix blocks of the request p holds / the request's blocks (at most 256 blocks), from an
                approximate index: after each pick, every block of the request is recorded for the chosen pod in a
                per-pod LRU sized to the engine's KV blocks (the scorer's auto-tune)
    pick: the highest score; ties uniformly at random (the picker shuffles, then sorts stably)
Each score is clamped to [0, 1]; the weighted sum is not normalised (the argmax is the same).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from pipeline.events import RequestEvent
from pipeline.routing.node_policies.base import NodeChoice
from pipeline.routing.prefix_index import PrefixIndex
from pipeline.routing.views import NodeView

QUEUE_WEIGHT = 2.0
KV_WEIGHT = 2.0
PREFIX_WEIGHT = 3.0
MAX_PREFIX_BLOCKS = 256


def _clamp(x: float) -> float:
    return 0.0 if x < 0 else 1.0 if x > 1 else x


class LlmD:
    name: ClassVar[str] = "llm_d"
    per_request: ClassVar[bool] = True

    def __init__(self, index: PrefixIndex, rng: random.Random) -> None:
        self.index = index
        self.rng = rng

    def scores(self, nodes: Sequence[NodeView], req: RequestEvent | None) -> dict[str, float]:
        qs = [v.waiting for v in nodes]
        qmin, qmax = min(qs), max(qs)
        hashes = req.prefix_hashes[:MAX_PREFIX_BLOCKS] if req is not None and req.prefix_cache else ()
        out: dict[str, float] = {}
        for v in nodes:
            queue = 1.0 if qmax == qmin else (qmax - v.waiting) / (qmax - qmin)
            kv = 1.0 - v.kv_usage
            prefix = self.index.matched_blocks(v.name, hashes) / len(hashes) if hashes else 0.0
            out[v.name] = QUEUE_WEIGHT * _clamp(queue) + KV_WEIGHT * _clamp(kv) + PREFIX_WEIGHT * _clamp(prefix)
        return out

    def choose(self, nodes: Sequence[NodeView], req: RequestEvent | None) -> NodeChoice:
        if not nodes:
            return NodeChoice(None)
        scores = self.scores(nodes, req)
        top = max(scores.values())
        tied = sorted(n for n, s in scores.items() if s == top)
        if len(tied) == 1:
            return NodeChoice(tied[0], scores=scores)
        draw = self.rng.random()
        return NodeChoice(tied[min(int(draw * len(tied)), len(tied) - 1)], draw, scores)

    def observe(self, node: str, req: RequestEvent) -> None:
        if req.prefix_hashes and req.prefix_cache:
            self.index.insert(node, req.prefix_hashes[:MAX_PREFIX_BLOCKS])
