"""WindowBatcher: per rack, collect a window of requests, sort by estimated memory, pack into node budgets.

Rules (ARCHITECTURE §3, seed §4):
- a window opens with its first request and closes after `window_ms`, or earlier when a node of the rack is idle
  or the pending memory already fills the largest node budget (the window is a bound, not a forced wait);
- at close, requests are sorted by mem_est ascending and packed into the node chosen by the node policy until its
  budget (min(live free KV memory, cap)) is reached; then the next node is chosen among the rest, and so on;
- what does not fit waits for the next window; a request that waited `age_after_windows` windows is packed first,
  and if it fits no node now, the node with the largest budget is reserved for it (it gets no other work), so a
  large request is never starved by a stream of small ones;
- a request larger than every node's cap can never run and is rejected with a reason, never dropped.
Pure: the caller passes the time, the node views and the random source (inside the selector).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipeline.config import BatcherPolicy
from pipeline.events import RequestEvent
from pipeline.routing.views import NodeView
from pipeline.routing.weighted_random import WeightedRandomSelector


@dataclass(slots=True)
class PendingRequest:
    request: RequestEvent
    entry_id: str
    """Stream id of the request in the rack stream; acknowledged once the batch holding it is written."""
    enqueued_ms: float
    windows_waited: int = 0


@dataclass(frozen=True, slots=True)
class BatchPlan:
    node: str
    requests: tuple[PendingRequest, ...]
    mem_est_kb: float
    budget_kb: float
    draw: float
    probabilities: Mapping[str, float]

    @property
    def utilisation(self) -> float:
        return self.mem_est_kb / self.budget_kb if self.budget_kb > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Rejection:
    pending: PendingRequest
    reason: str


class CloseReason(enum.Enum):
    EMPTY = "empty"
    WINDOW_ELAPSED = "window elapsed"
    NODE_IDLE = "node idle"
    BUDGET_FULL = "budget full"
    NOT_YET = "not yet"


class StopReason(enum.Enum):
    """Why packing stopped at the end of a window (what is left waits for the next one)."""

    ALL_PACKED = "all packed"
    NO_NODE = "no eligible node"
    NO_BUDGET = "nothing left fits any node's budget"


@dataclass(frozen=True, slots=True)
class WindowOutcome:
    plans: tuple[BatchPlan, ...]
    rejections: tuple[Rejection, ...]
    waiting: int
    reserved_node: str | None
    stop: StopReason


@dataclass
class WindowBatcher:
    policy: BatcherPolicy
    selector: WeightedRandomSelector
    node_caps_kb: Mapping[str, float]
    """Per node: the largest budget it can ever offer (mem_budget_fraction x GPU memory x tp)."""
    pending: list[PendingRequest] = field(default_factory=list)
    window_open_ms: float | None = None

    def offer(self, req: PendingRequest) -> None:
        if self.window_open_ms is None:
            self.window_open_ms = req.enqueued_ms
        self.pending.append(req)

    def budgets(self, nodes: Sequence[NodeView]) -> dict[str, float]:
        return {
            n.name: max(0.0, min(self.node_caps_kb.get(n.name, 0.0), n.kv_free_kb))
            for n in nodes
            if n.active and n.name in self.node_caps_kb
        }

    def close_reason(self, now_ms: float, nodes: Sequence[NodeView]) -> CloseReason:
        if not self.pending:
            return CloseReason.EMPTY
        assert self.window_open_ms is not None
        if now_ms - self.window_open_ms >= self.policy.window_ms:
            return CloseReason.WINDOW_ELAPSED
        budgets = self.budgets(nodes)
        if self.policy.close_when_node_idle and any(n.idle and budgets.get(n.name, 0) > 0 for n in nodes):
            return CloseReason.NODE_IDLE
        if budgets and sum(p.request.mem_est_kb for p in self.pending) >= max(budgets.values()):
            return CloseReason.BUDGET_FULL
        return CloseReason.NOT_YET

    def close(self, now_ms: float, nodes: Sequence[NodeView]) -> WindowOutcome:
        max_cap = max(self.node_caps_kb.values(), default=0.0)
        rejections: list[Rejection] = []
        keep: list[PendingRequest] = []
        for p in self.pending:
            p.windows_waited += 1
            if p.request.mem_est_kb > max_cap:
                rejections.append(
                    Rejection(
                        p,
                        f"estimated memory {p.request.mem_est_kb / 1e6:.1f} GB exceeds the largest node budget "
                        f"{max_cap / 1e6:.1f} GB of this rack; shorten the prompt or max_tokens",
                    )
                )
            else:
                keep.append(p)
        aged = sorted(
            (p for p in keep if p.windows_waited >= self.policy.age_after_windows),
            key=lambda p: (p.request.arrival_ms, p.request.request_id),
        )
        fresh = sorted(
            (p for p in keep if p.windows_waited < self.policy.age_after_windows),
            key=lambda p: (p.request.mem_est_kb, p.request.arrival_ms, p.request.request_id),
        )
        order = aged + fresh
        budgets = self.budgets(nodes)
        views = {n.name: n for n in nodes}
        reserved: str | None = None
        if aged and budgets and not any(aged[0].request.mem_est_kb <= b for b in budgets.values()):
            # Reserve a node that can EVER hold it (cap >= its size), the one closest to holding it now.
            need = aged[0].request.mem_est_kb
            able = [n for n in sorted(budgets) if self.node_caps_kb.get(n, 0.0) >= need]
            if able:
                reserved = max(able, key=lambda n: budgets[n])
                del budgets[reserved]
        plans: list[BatchPlan] = []
        stop = StopReason.ALL_PACKED
        while order:
            eligible = [views[n] for n in sorted(budgets) if budgets[n] > 0]
            if not eligible:
                stop = StopReason.NO_NODE if not plans and not budgets else StopReason.NO_BUDGET
                break
            node, draw, probs = self.selector.choose(eligible)
            if node is None:
                stop = StopReason.NO_NODE
                break
            budget = budgets.pop(node)
            taken: list[PendingRequest] = []
            rest: list[PendingRequest] = []
            used = 0.0
            for p in order:
                if used + p.request.mem_est_kb <= budget:
                    taken.append(p)
                    used += p.request.mem_est_kb
                else:
                    rest.append(p)
            if taken:
                plans.append(BatchPlan(node, tuple(taken), used, budget, draw, dict(probs)))
            order = rest
        self.pending = order
        self.window_open_ms = now_ms if order else None
        return WindowOutcome(tuple(plans), tuple(rejections), len(order), reserved, stop)
