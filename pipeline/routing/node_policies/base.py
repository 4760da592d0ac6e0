"""The node-policy interface.

`choose(nodes, req)` gets the eligible nodes (active, serving the model, with budget for the request) as plain
NodeViews, and for per-request policies the request; it returns a NodeChoice with what it saw (`scores`) and the
random draw it used, so the decision can be recorded and replayed. `observe(node, req)` tells the policy where a
request went (round robin advances, kv_aware remembers the prefix). Policies hold no I/O and no clock; randomness
comes from the injected `random.Random`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from pipeline.events import RequestEvent
from pipeline.routing.views import NodeView


@dataclass(slots=True, unsafe_hash=True)
class NodeChoice:
    node: str | None
    """None when no node is eligible."""
    draw: float = -1.0
    """The random draw used, -1 when the choice was deterministic."""
    scores: Mapping[str, float] = field(default_factory=dict)
    """What the policy saw per candidate (probabilities, costs or loads)."""

    def __init__(self, node: str | None, draw: float = -1.0, scores: Mapping[str, float] | None = None) -> None:
        # written out, and not frozen: compiled, a dataclass's generated __init__ stays interpreted (see
        # pipeline.routing.views.RackView.__init__); None: a new empty dict, as the factory
        self.node = node
        self.draw = draw
        self.scores = {} if scores is None else scores


class StepTime(Protocol):
    """A node's iteration time (its calibrated cost model), for policies that price work in milliseconds."""

    def step_ms(
        self, prefill_tokens: Sequence[int], decode_seqs: int, decode_kv_tokens: int,
        prefill_cached: Sequence[int] | None = None,
    ) -> float: ...


class NodePolicy(Protocol):
    name: ClassVar[str]
    per_request: ClassVar[bool]
    """True: each request is placed on its own (kv_aware); False: a node is chosen per batch and packed."""

    def choose(self, nodes: Sequence[NodeView], req: RequestEvent | None) -> NodeChoice: ...

    def observe(self, node: str, req: RequestEvent) -> None: ...


def outstanding(n: NodeView) -> int:
    return n.running + n.waiting


def sorted_views(nodes: Sequence[NodeView]) -> list[NodeView]:
    """A fixed order (by name) so a seeded choice does not depend on the caller's order."""
    return sorted(nodes, key=lambda v: v.name)


def weighted_draw(weights: Mapping[str, float], draw: float) -> str | None:
    """The name whose cumulative share (in name order) covers `draw` in [0, 1)."""
    total = sum(w for w in weights.values() if w > 0)
    if total <= 0:
        return None
    acc = 0.0
    last = None
    for name in sorted(weights):
        w = weights[name]
        if w <= 0:
            continue
        acc += w / total
        last = name
        if draw < acc:
            return name
    return last
