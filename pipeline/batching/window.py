"""WindowBatcher: per rack, collect a window of requests, sort by estimated memory, pack into node budgets.

Rules (ARCHITECTURE §3, seed §4):
- a window opens with its first request and closes after `window_ms`, or earlier when a node of the rack is idle
  or the pending memory already fills the largest node budget (the window is a bound, not a forced wait);
- at close, requests are sorted by mem_est ascending and packed into the node chosen by the node policy until its
  budget (min(live free KV memory, cap)) is reached; then the next node is chosen among the rest, and so on
  (first fit over the chosen nodes); a per-request policy (kv_aware) places each request on its own;
- only nodes serving the request's model are candidates (model-aware placement), and a request may name its own
  node policy (X-Route-Policy) when config allows it;
- what does not fit waits for the next window; a request that waited `age_after_windows` windows is packed first,
  and if it fits no node now, the node with the largest budget is reserved for it (it gets no other work), so a
  large request is never starved by a stream of small ones;
- a request larger than every node's cap can never run and is rejected with a reason, never dropped.
Pure: the caller passes the time, the node views and the random source (inside the selector).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from pipeline.config import BatcherPolicy
from pipeline.events import RequestEvent
from pipeline.routing.registry import NodePolicySet
from pipeline.routing.views import NodeView


@dataclass(slots=True)
class PendingRequest:
    request: RequestEvent
    entry_id: str
    """Stream id of the request in the rack stream; acknowledged once the batch holding it is written."""
    enqueued_ms: float
    windows_waited: int = 0


@dataclass(frozen=True, slots=True)
class DispatchChoice:
    """One node-policy decision: which requests it placed on which node, and what it saw."""

    policy: str
    node: str
    request_ids: tuple[str, ...]
    draw: float
    scores: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class BatchPlan:
    node: str
    requests: tuple[PendingRequest, ...]
    mem_est_kb: float
    budget_kb: float
    choices: tuple[DispatchChoice, ...] = ()

    @property
    def utilisation(self) -> float:
        return self.mem_est_kb / self.budget_kb if self.budget_kb > 0 else 0.0

    @property
    def draw(self) -> float:
        return self.choices[0].draw if self.choices else -1.0

    @property
    def probabilities(self) -> Mapping[str, float]:
        return self.choices[0].scores if self.choices else {}


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

    @property
    def choices(self) -> tuple[DispatchChoice, ...]:
        return tuple(c for p in self.plans for c in p.choices)


@dataclass
class WindowBatcher:
    policy: BatcherPolicy
    policies: NodePolicySet
    node_caps_kb: Mapping[str, float]
    """Per node: the largest budget it can ever offer (mem_budget_fraction x GPU memory x tp)."""
    node_models: Mapping[str, frozenset[str]] | None = None
    """Per node: the models it serves; None: every node serves every model."""
    pending: list[PendingRequest] = field(default_factory=list)
    window_open_ms: float | None = None

    def offer(self, req: PendingRequest) -> None:
        if self.window_open_ms is None:
            self.window_open_ms = req.enqueued_ms
        self.pending.append(req)

    def serves(self, node: str, model: str) -> bool:
        return self.node_models is None or model in self.node_models.get(node, frozenset())

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
        if now_ms >= self.window_open_ms + self.policy.window_ms:  # same float expression as the timer
            return CloseReason.WINDOW_ELAPSED
        budgets = self.budgets(nodes)
        if self.policy.close_when_node_idle and any(n.idle and budgets.get(n.name, 0) > 0 for n in nodes):
            return CloseReason.NODE_IDLE
        if budgets and sum(p.request.mem_est_kb for p in self.pending) >= max(budgets.values()):
            return CloseReason.BUDGET_FULL
        return CloseReason.NOT_YET

    def _cap_for(self, model: str) -> float:
        return max((c for n, c in self.node_caps_kb.items() if self.serves(n, model)), default=0.0)

    def close(self, now_ms: float, nodes: Sequence[NodeView]) -> WindowOutcome:
        rejections: list[Rejection] = []
        keep: list[PendingRequest] = []
        for p in self.pending:
            p.windows_waited += 1
            cap = self._cap_for(p.request.model)
            if cap <= 0:
                rejections.append(Rejection(p, f"no node of this rack serves model {p.request.model!r}"))
            elif p.request.mem_est_kb > cap:
                rejections.append(
                    Rejection(
                        p,
                        f"estimated memory {p.request.mem_est_kb / 1e6:.1f} GB exceeds the largest node budget "
                        f"{cap / 1e6:.1f} GB for {p.request.model} in this rack; shorten the prompt or max_tokens",
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
        if aged and budgets and not any(
            aged[0].request.mem_est_kb <= b for n, b in budgets.items() if self.serves(n, aged[0].request.model)
        ):
            # Reserve a node that can EVER hold it (cap >= its size), the one closest to holding it now.
            need = aged[0].request.mem_est_kb
            able = [
                n for n in sorted(budgets)
                if self.node_caps_kb.get(n, 0.0) >= need and self.serves(n, aged[0].request.model)
            ]
            if able:
                reserved = max(able, key=lambda n: budgets[n])
                del budgets[reserved]
        opening_budget = dict(budgets)
        plans: dict[str, list[PendingRequest]] = {}
        choices: dict[str, list[DispatchChoice]] = {}
        opened: dict[tuple[str, str], list[str]] = {}
        open_choice: dict[tuple[str, str, str], int] = {}
        left: list[PendingRequest] = []
        refused = False
        for p in order:
            req = p.request
            mem = req.mem_est_kb
            pname = self.policies.resolve(req.route_policy)
            pol = self.policies.get(pname)
            cands = [views[n] for n in sorted(budgets) if budgets[n] >= mem and self.serves(n, req.model)]
            if not cands:
                left.append(p)
                continue
            key = (req.model, pname)
            node: str | None = None
            if not pol.per_request:
                node = next((n for n in opened.get(key, ()) if budgets[n] >= mem), None)
                if node is not None:  # first fit into a node this policy already chose in this window
                    i = open_choice[(req.model, pname, node)]
                    c = choices[node][i]
                    choices[node][i] = replace(c, request_ids=(*c.request_ids, req.request_id))
            if node is None:
                ch = pol.choose(cands, req if pol.per_request else None)
                node = ch.node
                if node is None:  # the policy found none of the nodes with room eligible (e.g. all W = 0)
                    refused = True
                    left.append(p)
                    continue
                choices.setdefault(node, []).append(
                    DispatchChoice(pname, node, (req.request_id,), ch.draw, dict(ch.scores))
                )
                if not pol.per_request:
                    opened.setdefault(key, []).append(node)
                    open_choice[(req.model, pname, node)] = len(choices[node]) - 1
            plans.setdefault(node, []).append(p)
            budgets[node] -= mem
            v = views[node]
            views[node] = replace(v, kv_free_kb=max(0.0, v.kv_free_kb - mem), waiting=v.waiting + 1)
            pol.observe(node, req)
        out = tuple(
            BatchPlan(
                node, tuple(reqs), sum(q.request.mem_est_kb for q in reqs), opening_budget[node],
                tuple(choices.get(node, ())),
            )
            for node, reqs in plans.items()
        )
        if not left:
            stop = StopReason.ALL_PACKED
        elif not opening_budget or refused:
            stop = StopReason.NO_NODE
        else:
            stop = StopReason.NO_BUDGET
        self.pending = left
        self.window_open_ms = now_ms if left else None
        return WindowOutcome(out, tuple(rejections), len(left), reserved, stop)
