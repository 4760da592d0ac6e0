"""`sglang`: SGLang router's `cache_aware` policy, as a baseline.

Source: sgl-project/sglang `sgl-router/src/policies/cache_aware.rs` (`CacheAwarePolicy::select_worker`) and
`sgl-router/src/policies/tree.rs`; defaults of the launched router (`sgl-router/src/main.rs`): cache_threshold 0.3,
balance_abs_threshold 64, balance_rel_threshold 1.5, max_tree_size 2^26 characters. The formula carries over; the
code is ours.

    load(w) = requests routed to w and not finished (the router's own in-flight count)
    imbalanced  iff  max_load - min_load > balance_abs_threshold  and  max_load > balance_rel_threshold x min_load
    imbalanced: the least-loaded worker (ties: the first)
    balanced:   match the prompt in the approximate prefix tree of what was routed where;
                match_rate = matched tokens / prompt tokens;
                match_rate > cache_threshold: the worker holding the deepest match;
                else: the worker with the smallest tree (fewest cached tokens), load ignored
    then the prompt is recorded in the tree under the chosen worker; a worker's tree is trimmed least recently used
    beyond max_tree_size.
The tree is character-level in SGLang; here it is an LRU of the request's prefix blocks per worker (a block stands for
its tokens, and 2^26 characters at 4 characters a token are 2^24 tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pipeline.events import RequestEvent
from pipeline.routing.node_policies.base import NodeChoice, outstanding
from pipeline.routing.prefix_index import PrefixIndex
from pipeline.routing.views import NodeView

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
MAX_TREE_TOKENS = 2**26 // 4


class Sglang:
    name: ClassVar[str] = "sglang"
    per_request: ClassVar[bool] = True

    def __init__(self, index: PrefixIndex, block_tokens: int) -> None:
        self.index = index
        self.block_tokens = block_tokens

    def choose(self, nodes: Sequence[NodeView], req: RequestEvent | None) -> NodeChoice:
        if not nodes:
            return NodeChoice(None)
        views = sorted(nodes, key=lambda v: v.name)
        loads = {v.name: outstanding(v) for v in views}
        hi, lo = max(loads.values()), min(loads.values())
        if hi - lo > BALANCE_ABS_THRESHOLD and hi > BALANCE_REL_THRESHOLD * lo:
            best = min(views, key=lambda v: loads[v.name])
            return NodeChoice(best.name, scores={k: float(x) for k, x in loads.items()})
        hashes = req.prefix_hashes if req is not None and req.prefix_cache else ()
        matched = {v.name: self.index.matched_blocks(v.name, hashes) for v in views} if hashes else {}
        deepest = max(matched.values(), default=0)
        rate = min(1.0, deepest * self.block_tokens / req.in_tokens) if req is not None and req.in_tokens else 0.0
        if rate > CACHE_THRESHOLD:
            best = next(v for v in views if matched[v.name] == deepest)
            return NodeChoice(best.name, scores={k: float(x) for k, x in matched.items()})
        sizes = {v.name: float(self.index.size(v.name) * self.block_tokens) for v in views}
        best = min(views, key=lambda v: sizes[v.name])
        return NodeChoice(best.name, scores=sizes)

    def observe(self, node: str, req: RequestEvent) -> None:
        if req.prefix_hashes and req.prefix_cache:
            self.index.insert(node, req.prefix_hashes)
