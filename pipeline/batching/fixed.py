"""FixedBatcher: the baseline the seed argues against, a fixed batch of N requests (default 32).

A batch closes when N requests are pending, or when the oldest waited `window_ms` (so a quiet rack still moves); it
takes the first N requests in arrival order, whatever their memory, and sends them to one node chosen by the node
policy. Memory is not budgeted: a batch can ask for more KV than the node has (the engine then queues or preempts),
or much less (memory idles). Same interface as WindowBatcher, so the simulator and the benchmarks swap them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipeline.batching.window import (
    BatchPlan,
    CloseReason,
    DispatchChoice,
    PendingRequest,
    Rejection,
    StopReason,
    WindowOutcome,
)
from pipeline.config import BatcherPolicy
from pipeline.routing.registry import NodePolicySet
from pipeline.routing.views import NodeView


@dataclass
class FixedBatcher:
    policy: BatcherPolicy
    policies: NodePolicySet
    node_caps_kb: Mapping[str, float]
    node_models: Mapping[str, frozenset[str]] | None = None
    batch_size: int = 32
    pending: list[PendingRequest] = field(default_factory=list)
    window_open_ms: float | None = None

    @property
    def pending_count(self) -> int:
        return len(self.pending)

    @property
    def batch_waiting(self) -> int:
        """The fixed baseline has no priority classes: every request is in `pending`, in arrival order."""
        return 0

    def tenant_waiting(self) -> dict[str, int]:
        """No fair shares in the fixed baseline: nothing is reported per tenant."""
        return {}

    def offer(self, req: PendingRequest) -> None:
        if self.window_open_ms is None:
            self.window_open_ms = req.enqueued_ms
        self.pending.append(req)

    def serves(self, node: str, model: str) -> bool:
        return self.node_models is None or model in self.node_models.get(node, frozenset())

    def close_reason(self, now_ms: float, nodes: Sequence[NodeView]) -> CloseReason:
        if not self.pending:
            return CloseReason.EMPTY
        if len(self.pending) >= self.batch_size:
            return CloseReason.BUDGET_FULL
        assert self.window_open_ms is not None
        if now_ms >= self.window_open_ms + self.policy.window_ms:  # same float expression as the timer
            return CloseReason.WINDOW_ELAPSED
        return CloseReason.NOT_YET

    def close(self, now_ms: float, nodes: Sequence[NodeView]) -> WindowOutcome:
        plans: list[BatchPlan] = []
        rejections: list[Rejection] = []
        rest: list[PendingRequest] = []
        queue = list(self.pending)
        while queue:
            batch, queue = queue[: self.batch_size], queue[self.batch_size :]
            if len(batch) < self.batch_size and now_ms < (self.window_open_ms or now_ms) + self.policy.window_ms:
                rest.extend(batch)
                continue
            model = batch[0].request.model
            same = [p for p in batch if p.request.model == model]
            rest.extend(p for p in batch if p.request.model != model)
            cands = [v for v in nodes if v.active and v.name in self.node_caps_kb and self.serves(v.name, model)]
            if not cands:
                rejections.extend(Rejection(p, f"no node of this rack serves model {model!r}") for p in same)
                continue
            pol = self.policies.get(self.policies.default)
            ch = pol.choose(cands, None)
            if ch.node is None:
                rest.extend(same)
                continue
            for p in same:
                pol.observe(ch.node, p.request)
            mem = sum(p.request.mem_est_kb for p in same)
            choice = DispatchChoice(pol.name, ch.node, tuple(p.request.request_id for p in same), ch.draw,
                                    dict(ch.scores))
            plans.append(BatchPlan(ch.node, tuple(same), mem, self.node_caps_kb[ch.node], (choice,)))
        self.pending = rest
        # what is left starts a new window now (a batch that could not go anywhere must not spin on an elapsed one)
        if not rest:
            self.window_open_ms = None
        else:
            oldest = min(p.enqueued_ms for p in rest)
            self.window_open_ms = oldest if now_ms < oldest + self.policy.window_ms else now_ms
        stop = StopReason.ALL_PACKED if not rest else StopReason.NO_BUDGET
        return WindowOutcome(tuple(plans), tuple(rejections), len(rest), None, stop)
