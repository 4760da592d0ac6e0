"""WindowBatcher: per rack, collect a window of requests, sort by estimated memory, pack into node budgets.

Rules (ARCHITECTURE §3, seed §4):
- a window opens with its first request and closes after `window_ms`, or earlier when a node of the rack is idle,
  when a waiting request fits a node that can start it now (room: budget and a free sequence slot), or when the
  pending memory already fills the largest node budget (the window is a bound, not a forced wait);
- a node's budget is min(live free KV memory, cap); a node whose engine runs its most sequences (`max_seqs`) with
  requests already waiting, or has `max_queued_prefill_tokens` of prompts queued for prefill, takes nothing more this
  window, so requests wait here, where any node can still take them, rather than in one engine's queue;
- at close, requests are sorted by mem_est ascending and packed into the node chosen by the node policy until its
  budget (min(live free KV memory, cap)) is reached; then the next node is chosen among the rest, and so on
  (first fit over the chosen nodes); a per-request policy (kv_aware) places each request on its own;
- only nodes serving the request's model are candidates (model-aware placement), and a request may name its own
  node policy (X-Route-Policy) when config allows it;
- what does not fit waits for the next window; a request that waited `age_after_windows` windows is packed first,
  and if it fits no node now, the node with the largest budget is reserved for it (it gets no other work), so a
  large request is never starved by a stream of small ones;
- a request larger than every node's cap can never run and is rejected with a reason, never dropped;
- priority classes (pipeline/priority.py): interactive requests are placed first; `batch` ones wait in a queue of
  their own and are placed after them, only on nodes with a free sequence slot (no engine queue), on the node with
  the most free slots, in virtual-token-counter order between tenants. With `batch_yield: preempt` an interactive
  request counts the slots and memory of the batch sequences on a node as its own (the engine preempts them for it);
- with `fair_share`, fresh interactive requests of several tenants are placed in virtual-token-counter order (the
  least served tenant first; each tenant's own smallest first), not by memory alone.
Pure: the caller passes the time, the node views and the random source (inside the selector).
"""

from __future__ import annotations

import bisect
import enum
import heapq
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

from pipeline.config import BatcherPolicy
from pipeline.events import RequestEvent
from pipeline.priority import BATCH, FairQueue, VirtualTokenCounter
from pipeline.routing.node_policies.base import NodePolicy
from pipeline.routing.registry import NodePolicySet
from pipeline.routing.views import NodeView

BATCH_POLICY = "batch_fill"
"""The node choice of batch-class requests (recorded as the dispatch decision's policy): the node with the most free
sequence slots, then the most budget, then by name."""
MAX_BATCH_MISSES = 64
"""Batch requests a close tries in a row that fit no node before it stops trying (the rest wait)."""
MAX_WAIT_CHECKS = 64
"""Waiting requests a close asks their policy whether to keep waiting for a busy node (the rest are placed wherever
there is room, or wait for the next close): bounds a close's cost under a long queue."""
_ORDER = operator.attrgetter("order")
_LateBinds = Callable[[Sequence[NodeView], RequestEvent], bool]


class PendingRequest:
    """A request waiting in a window. `windows_waited` counts the windows closed since it was offered (plus any
    starting value), read off the batcher's close counter so a close costs nothing per waiting request."""

    __slots__ = ("_at", "_base", "_counter", "enqueued_ms", "entry_id", "order", "request")

    def __init__(self, request: RequestEvent, entry_id: str, enqueued_ms: float, windows_waited: int = 0) -> None:
        self.request = request
        self.entry_id = entry_id
        """Stream id of the request in the rack stream; acknowledged once the batch holding it is written."""
        self.enqueued_ms = enqueued_ms
        self.order = (request.mem_est_kb, request.arrival_ms, request.request_id)
        """The order a close places fresh requests in: smallest memory first, then the oldest."""
        self._base = windows_waited
        self._counter: list[int] | None = None
        self._at = 0

    def _attach(self, counter: list[int]) -> None:
        self._base = self.windows_waited
        self._counter = counter
        self._at = counter[0]

    @property
    def windows_waited(self) -> int:
        return self._base + (self._counter[0] - self._at if self._counter is not None else 0)

    @windows_waited.setter
    def windows_waited(self, value: int) -> None:
        self._base = value - (self._counter[0] - self._at if self._counter is not None else 0)

    def __repr__(self) -> str:
        return f"PendingRequest({self.request.request_id!r}, waited={self.windows_waited})"


@dataclass(slots=True, unsafe_hash=True)
class DispatchChoice:
    """One node-policy decision: which requests it placed on which node, and what it saw."""

    policy: str
    node: str
    request_ids: tuple[str, ...]
    draw: float
    scores: Mapping[str, float]

    def __init__(self, policy: str, node: str, request_ids: tuple[str, ...], draw: float,
                 scores: Mapping[str, float]) -> None:
        # written out, and not frozen: compiled, a dataclass's generated __init__ stays interpreted (see
        # pipeline.routing.views.RackView.__init__); nothing assigns to it after
        self.policy = policy
        self.node = node
        self.request_ids = request_ids
        self.draw = draw
        self.scores = scores


@dataclass(slots=True, unsafe_hash=True)
class BatchPlan:
    node: str
    requests: tuple[PendingRequest, ...]
    mem_est_kb: float
    budget_kb: float
    choices: tuple[DispatchChoice, ...] = ()

    def __init__(self, node: str, requests: tuple[PendingRequest, ...], mem_est_kb: float, budget_kb: float,
                 choices: tuple[DispatchChoice, ...] = ()) -> None:
        # written out, not frozen: see DispatchChoice.__init__
        self.node = node
        self.requests = requests
        self.mem_est_kb = mem_est_kb
        self.budget_kb = budget_kb
        self.choices = choices

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
    ROOM = "node has room"
    BUDGET_FULL = "budget full"
    NOT_YET = "not yet"


class StopReason(enum.Enum):
    """Why packing stopped at the end of a window (what is left waits for the next one)."""

    ALL_PACKED = "all packed"
    NO_NODE = "no eligible node"
    NO_BUDGET = "nothing left fits any node's budget"


@dataclass(slots=True, unsafe_hash=True)
class WindowOutcome:
    plans: tuple[BatchPlan, ...]
    rejections: tuple[Rejection, ...]
    waiting: int
    reserved_node: str | None
    stop: StopReason

    def __init__(self, plans: tuple[BatchPlan, ...], rejections: tuple[Rejection, ...], waiting: int,
                 reserved_node: str | None, stop: StopReason) -> None:
        # written out, not frozen: see DispatchChoice.__init__
        self.plans = plans
        self.rejections = rejections
        self.waiting = waiting
        self.reserved_node = reserved_node
        self.stop = stop

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
    window_open_ms: float | None = None
    # Waiting requests: `_fresh` in offer order; `_aged` (waited age_after_windows or more) kept sorted by arrival,
    # with `_aged_mems` sorted, so a close touches only what it places, the fresh ones and the ones turning aged.
    _fresh: list[PendingRequest] = field(default_factory=list)
    _aged: list[tuple[float, str, int, PendingRequest]] = field(default_factory=list)
    _aged_mems: list[float] = field(default_factory=list)
    _closes: list[int] = field(default_factory=lambda: [0])
    _seq: int = 0
    _fresh_min: float = float("inf")
    """The smallest memory estimate in `_fresh` (kept on offer and close: a close leaves them sorted by it)."""
    _batch: FairQueue[PendingRequest] | None = None
    """Batch-class requests waiting (created with the first one)."""
    _vtc: VirtualTokenCounter | None = None
    """Interactive tenants' counters (fair_share)."""
    _waiting_tenants: frozenset[str] = frozenset()
    """Tenants with interactive requests left waiting by the last close."""
    _caps_memo: dict[str, float] = field(default_factory=dict)
    _caps_src: tuple[Mapping[str, float], Mapping[str, frozenset[str]] | None] | None = None
    """`_cap_for`'s memo per model, and the `node_caps_kb` and `node_models` it was made from."""

    def _counter(self) -> VirtualTokenCounter:
        if self._vtc is None:
            self._vtc = VirtualTokenCounter(1.0, self.policy.vtc_out_weight)
        return self._vtc

    def _batch_queue(self) -> FairQueue[PendingRequest]:
        if self._batch is None:
            self._batch = FairQueue(_tenant, _tokens, VirtualTokenCounter(1.0, self.policy.vtc_out_weight))
        return self._batch

    @property
    def batch_waiting(self) -> int:
        """Batch-class requests waiting."""
        return len(self._batch) if self._batch is not None else 0

    def tenant_waiting(self) -> dict[str, int]:
        """Interactive requests waiting, per tenant (the gateway's admission keeps each tenant's share of the
        queue: pipeline/admission.py)."""
        out: dict[str, int] = {}
        for e in self._aged:
            t = e[3].request.tenant
            out[t] = out.get(t, 0) + 1
        for p in self._fresh:
            t = p.request.tenant
            out[t] = out.get(t, 0) + 1
        return out

    @property
    def pending(self) -> list[PendingRequest]:
        """Every waiting request (aged ones first, by arrival; then fresh ones in offer order; then batch ones)."""
        out = [a[3] for a in self._aged] + list(self._fresh)
        if self._batch:
            out.extend(self._batch.items())
        return out

    @property
    def pending_count(self) -> int:
        return len(self._aged) + len(self._fresh) + self.batch_waiting

    def offer(self, req: PendingRequest) -> None:
        if req.request.priority >= BATCH:
            req._attach(self._closes)
            self._batch_queue().push(req)
            return
        if self.window_open_ms is None:
            self.window_open_ms = req.enqueued_ms
        req._attach(self._closes)
        self._fresh.append(req)
        if req.request.mem_est_kb < self._fresh_min:
            self._fresh_min = req.request.mem_est_kb

    def serves(self, node: str, model: str) -> bool:
        return self.node_models is None or model in self.node_models.get(node, frozenset())

    def budgets(self, nodes: Sequence[NodeView]) -> dict[str, float]:
        """Per active node, the memory a request may take: its free KV within its cap; 0 without a free slot. For
        interactive requests the close passes the views `interactive_views` gives."""
        return {
            n.name: (max(0.0, min(self.node_caps_kb.get(n.name, 0.0), n.kv_free_kb)) if _slots(n) > 0 else 0.0)
            for n in nodes
            if n.active and n.name in self.node_caps_kb
        }

    def interactive_views(self, nodes: Sequence[NodeView]) -> Sequence[NodeView]:
        """The nodes as interactive requests see them (NodeView.for_interactive): the batch sequences' queued
        prefill left out, and with `batch_yield: preempt` their slots and memory too; `nodes` itself when no node
        holds batch work."""
        if not any(n.batch_seqs or n.batch_prefill_tokens for n in nodes):
            return nodes
        pre = self.policy.batch_yield == "preempt"
        return [n.for_interactive(pre) for n in nodes]

    def _batch_slots(self, n: NodeView) -> float:
        """Sequence slots a node has free for batch work: running slots nobody uses and nothing waiting for (with
        `batch_yield: hold`, less `batch_hold_slots` of them); unknown slot bound: one, while nothing waits."""
        if not n.active or n.name not in self.node_caps_kb:
            return 0.0
        if n.max_seqs <= 0:
            return 1.0 if n.waiting == 0 else 0.0
        free = n.max_seqs - (n.running + n.waiting) - batch_reserve(self.policy, n.max_seqs)
        return float(free)

    def batch_room(self, nodes: Sequence[NodeView]) -> bool:
        """Some node has a free slot for batch work."""
        return any(self._batch_slots(n) > 0 and n.kv_free_kb > 0 for n in nodes)

    def _late(self, policy: str) -> bool:
        """Late binding for requests of this node policy: `batcher.late_binding` `all`, or `policy` and the policy
        asks for it (work_aware)."""
        mode = self.policy.late_binding
        return mode == "all" or (mode == "policy" and self.policies.late_binding(policy))

    def _age_for(self, req: RequestEvent) -> int:
        """Windows after which a waiting request ages: `late_age_after_windows` for a late-binding policy's request
        (held shortest first until then), else `age_after_windows`."""
        if self._late(self.policies.resolve(req.route_policy)):
            return self.policy.late_age_after_windows
        return self.policy.age_after_windows

    def _room_now(self, n: NodeView, late: bool) -> bool:
        """The node would start more work now: memory and a slot, and for a late-binding policy less than the
        prefill horizon queued."""
        horizon = self.policy.max_queued_prefill_tokens
        return not late or not horizon or n.prefill_tokens < horizon

    def _smallest_pending(self) -> float:
        fresh = self._fresh_min
        return min(fresh, self._aged_mems[0]) if self._aged_mems else fresh

    def close_reason(self, now_ms: float, nodes: Sequence[NodeView]) -> CloseReason:
        if not self._fresh and not self._aged:
            if self._batch:  # batch work alone waits for room, not for a window
                return CloseReason.ROOM if self.batch_room(nodes) else CloseReason.NOT_YET
            return CloseReason.EMPTY
        nodes = self.interactive_views(nodes)
        assert self.window_open_ms is not None
        if now_ms >= self.window_open_ms + self.policy.window_ms:  # same float expression as the timer
            return CloseReason.WINDOW_ELAPSED
        budgets = self.budgets(nodes)
        views_by_name = {n.name: n for n in nodes}
        if self.policy.close_when_node_idle and any(n.idle and budgets.get(n.name, 0) > 0 for n in nodes):
            return CloseReason.NODE_IDLE
        late = self._late(self.policies.default)
        if self.policy.close_when_room and budgets and self._smallest_pending() <= max(
                (b for n, b in budgets.items() if self._room_now(views_by_name[n], late)), default=0.0):
            return CloseReason.ROOM
        if budgets and not late:  # a late-binding policy places when a node has room, not when a window fills
            top = max(budgets.values())
            total = 0.0
            for p in self._fresh:
                total += p.request.mem_est_kb
                if total >= top:
                    return CloseReason.BUDGET_FULL
            if self._aged and total + sum(self._aged_mems) >= top:
                return CloseReason.BUDGET_FULL
        return CloseReason.NOT_YET

    def _cap_for(self, model: str) -> float:
        """The largest node budget for `model` in this rack (memoised while `node_caps_kb` and `node_models` are
        the same objects: each close asks it per model; measured side by side, the 1 k hour 15.8 s with the memo
        against 16.2 s without, four pairs)."""
        src = self._caps_src
        if src is None or src[0] is not self.node_caps_kb or src[1] is not self.node_models:
            self._caps_memo = {}
            self._caps_src = (self.node_caps_kb, self.node_models)
        got = self._caps_memo.get(model)
        if got is None:
            got = self._caps_memo[model] = max(
                (c for n, c in self.node_caps_kb.items() if self.serves(n, model)), default=0.0)
        return got

    def _to_aged(self, p: PendingRequest) -> None:
        self._seq += 1
        bisect.insort(self._aged, (p.request.arrival_ms, p.request.request_id, self._seq, p))
        bisect.insort(self._aged_mems, p.request.mem_est_kb)

    def close(self, now_ms: float, nodes: Sequence[NodeView]) -> WindowOutcome:
        self._closes[0] += 1
        rejections: list[Rejection] = []
        fresh: list[PendingRequest] = []
        caps: dict[str, float] = {}
        ages: dict[str, int] = {}
        for p in self._fresh:
            req = p.request
            cap = caps.get(req.model)
            if cap is None:
                cap = caps[req.model] = self._cap_for(req.model)
            age = ages.get(req.route_policy)
            if age is None:
                age = ages[req.route_policy] = self._age_for(req)
            if cap <= 0:
                rejections.append(Rejection(p, f"no node of this rack serves model {p.request.model!r}"))
            elif p.request.mem_est_kb < 0:  # only a corrupt or hostile entry: it would make room that is not there
                rejections.append(Rejection(p, f"estimated memory {p.request.mem_est_kb:g} KB is negative"))
            elif p.request.mem_est_kb > cap:
                rejections.append(
                    Rejection(
                        p,
                        f"estimated memory {p.request.mem_est_kb / 1e6:.1f} GB exceeds the largest node budget "
                        f"{cap / 1e6:.1f} GB for {p.request.model} in this rack; shorten the prompt or max_tokens",
                    )
                )
            elif p.windows_waited >= age:
                self._to_aged(p)
            else:
                fresh.append(p)
        fresh.sort(key=_ORDER)
        fair = False
        if self.policy.fair_share and len(fresh) > 1:
            ordered = self._fair_order(fresh)
            fair = ordered is not fresh
            fresh = ordered
        raw = nodes
        nodes = self.interactive_views(nodes)
        budgets = self.budgets(nodes)
        views = {n.name: n for n in nodes}
        reserved: str | None = None
        if self._aged and budgets:
            oldest = self._aged[0][3].request
            if not any(oldest.mem_est_kb <= b for n, b in budgets.items() if self.serves(n, oldest.model)):
                # Reserve a node that can EVER hold it (cap >= its size), the one closest to holding it now.
                able = [n for n in sorted(budgets)
                        if self.node_caps_kb.get(n, 0.0) >= oldest.mem_est_kb and self.serves(n, oldest.model)]
                if able:
                    reserved = max(able, key=lambda n: budgets[n])
                    del budgets[reserved]
        opening_budget = dict(budgets)
        pack = _Packing(self, now_ms, budgets, views)
        place = pack.place

        # aged requests first, oldest first (first fit; with fair_share and several tenants, the oldest of the least
        # served tenant first); stop as soon as no budget holds the smallest of them
        aged = self._fair_aged() if self.policy.fair_share and len(self._aged) > 1 else self._aged
        if aged is self._aged:
            kept: list[tuple[float, str, int, PendingRequest]] = []
            for k, entry in enumerate(self._aged):
                if not self._aged_mems or pack.max_budget < self._aged_mems[0]:
                    kept.extend(self._aged[k:])
                    break
                if place(entry[3]):
                    del self._aged_mems[bisect.bisect_left(self._aged_mems, entry[3].request.mem_est_kb)]
                else:
                    kept.append(entry)
            self._aged = kept
        else:
            placed_aged: set[int] = set()
            for entry in aged:
                if not self._aged_mems or pack.max_budget < self._aged_mems[0]:
                    break
                if place(entry[3]):
                    del self._aged_mems[bisect.bisect_left(self._aged_mems, entry[3].request.mem_est_kb)]
                    placed_aged.add(id(entry[3]))
            self._aged = [e for e in self._aged if id(e[3]) not in placed_aged]
        # then fresh ones by ascending memory: once one does not fit anywhere, no larger one does
        left_fresh: list[PendingRequest] = []
        for k, p in enumerate(fresh):
            if p.request.mem_est_kb > pack.max_budget:
                if not fair:
                    left_fresh.extend(fresh[k:])
                    break
                left_fresh.append(p)  # in tenant order, a smaller one may come later
                continue
            if not place(p):
                left_fresh.append(p)
        if fair:
            left_fresh.sort(key=_ORDER)
        self._fresh = left_fresh
        self._fresh_min = left_fresh[0].request.mem_est_kb if left_fresh else float("inf")
        if self.policy.fair_share:
            self._waiting_tenants = frozenset(p.request.tenant for p in left_fresh) | frozenset(
                e[3].request.tenant for e in self._aged)
        if self._batch:
            self._place_batch(pack, rejections, raw)
        out = tuple(
            BatchPlan(
                node, tuple(reqs), sum(q.request.mem_est_kb for q in reqs), opening_budget[node],
                tuple(pack.choices.get(node, ())),
            )
            for node, reqs in pack.plans.items()
        )
        waiting = self.pending_count
        if not waiting:
            stop = StopReason.ALL_PACKED
        elif not opening_budget or pack.refused:
            stop = StopReason.NO_NODE
        else:
            stop = StopReason.NO_BUDGET
        # the window is the interactive requests' (batch ones wait for room, not for a window)
        self.window_open_ms = now_ms if self._fresh or self._aged else None
        return WindowOutcome(out, tuple(rejections), waiting, reserved, stop)

    def _fair_order(self, fresh: list[PendingRequest]) -> list[PendingRequest]:
        """Fresh interactive requests (sorted by memory) in virtual-token-counter order when several tenants sent
        them: repeatedly the tenant with the smallest counter (as if each request before were placed), its smallest
        request first. One tenant: `fresh` itself."""
        by: dict[str, list[PendingRequest]] = {}
        for p in fresh:
            by.setdefault(p.request.tenant, []).append(p)
        if len(by) < 2:
            return fresh
        return self._interleave(by)

    def _fair_aged(self) -> list[tuple[float, str, int, PendingRequest]]:
        """The aged requests, oldest first per tenant, the tenants interleaved by their counters (as `_fair_order`);
        one tenant: `_aged` itself."""
        by: dict[str, list[PendingRequest]] = {}
        entry: dict[int, tuple[float, str, int, PendingRequest]] = {}
        for e in self._aged:
            by.setdefault(e[3].request.tenant, []).append(e[3])
            entry[id(e[3])] = e
        if len(by) < 2:
            return self._aged
        return [entry[id(p)] for p in self._interleave(by)]

    def _interleave(self, by: dict[str, list[PendingRequest]]) -> list[PendingRequest]:
        """Items grouped by tenant, in virtual-token-counter order: repeatedly the tenant with the smallest counter
        (as if each item handed out before were placed), its next item. A tenant that had nothing waiting starts at
        the smallest counter of those that had (or, when none had, at the largest of those present): idle time earns
        no credit."""
        vtc = self._counter()
        was = [vtc.get(t) for t in by if t in self._waiting_tenants]
        floor = min(was) if was else max(vtc.get(t) for t in by)
        for t in by:
            if t not in self._waiting_tenants:
                vtc.lift(t, floor)
        heap = [(vtc.get(t), t, 0) for t in by]
        heapq.heapify(heap)
        out: list[PendingRequest] = []
        while heap:
            c, t, k = heapq.heappop(heap)
            item = by[t][k]
            out.append(item)
            if k + 1 < len(by[t]):
                req = item.request
                heapq.heappush(heap, (c + vtc.cost(req.in_tokens, req.out_tokens), t, k + 1))
        return out

    def _place_batch(self, pack: _Packing, rejections: list[Rejection], nodes: Sequence[NodeView]) -> None:
        """Batch requests, after every interactive one this close placed: only on nodes with a free slot for batch
        work (`_batch_slots`) and the memory, the node with the most free slots first; in the tenants'
        virtual-token-counter order. What fits nowhere waits (no aging: batch work waits as long as it must)."""
        queue = self._batch
        assert queue is not None
        views = {n.name: n for n in nodes}  # the nodes as they are (batch work included), with this close's placements
        for node, placed_here in pack.plans.items():
            for q in placed_here:
                views[node] = views[node].with_placed(q.request.mem_est_kb, q.request.in_tokens)
        slots = {n.name: self._batch_slots(n) for n in views.values()}
        room = {n: min(self.node_caps_kb.get(n, 0.0), views[n].kv_free_kb) for n, k in slots.items() if k > 0}
        room = {n: b for n, b in room.items() if b > 0}
        if not room:
            return
        placed: list[PendingRequest] = []
        misses = 0
        caps: dict[str, float] = {}
        for p in queue.drain_order():
            req = p.request
            cap = caps.get(req.model)
            if cap is None:
                cap = caps[req.model] = self._cap_for(req.model)
            if cap <= 0 or req.mem_est_kb < 0 or req.mem_est_kb > cap:
                why = (f"no node of this rack serves model {req.model!r}" if cap <= 0 else
                       f"estimated memory {req.mem_est_kb:g} KB is negative" if req.mem_est_kb < 0 else
                       f"estimated memory {req.mem_est_kb / 1e6:.1f} GB exceeds the largest node budget "
                       f"{cap / 1e6:.1f} GB for {req.model} in this rack; shorten the prompt or max_tokens")
                rejections.append(Rejection(p, why))
                placed.append(p)  # out of the queue (not charged: it never runs)
                continue
            cands = [n for n, b in room.items() if b >= req.mem_est_kb and self.serves(n, req.model)]
            if not cands:
                misses += 1
                if misses >= MAX_BATCH_MISSES:
                    break
                continue
            misses = 0
            node = max(cands, key=lambda n: (slots[n], room[n], n))
            pack.plans.setdefault(node, []).append(p)
            pack.choices.setdefault(node, []).append(
                DispatchChoice(BATCH_POLICY, node, (req.request_id,), 0.0,
                               {n: slots[n] for n in sorted(cands)}))
            views[node] = views[node].with_placed(req.mem_est_kb, req.in_tokens, batch=True)
            slots[node] -= 1
            room[node] -= req.mem_est_kb
            if slots[node] <= 0 or room[node] <= 0:
                del room[node]
            placed.append(p)
            queue.vtc.charge(req.tenant, req.in_tokens, req.out_tokens)
            if not room:
                break
        if placed:
            queue.remove(placed)


class _Packing:
    """One close's placement state and its two steps, `place` and `commit` (the closures of `close` they were: a
    class makes no reference cycle per close, and the simulator runs with the cyclic collector off)."""

    skip_known_misses: ClassVar[bool] = True
    """Skip a request that `no_room` says finds no node (off only in the test that checks it changes nothing)."""

    def __init__(self, batcher: WindowBatcher, now_ms: float, budgets: dict[str, float],
                 views: dict[str, NodeView]) -> None:
        self.b = batcher
        self.now_ms = now_ms
        self.horizon = batcher.policy.max_queued_prefill_tokens
        self.budgets = budgets
        self.views = views
        self.slots = {n: _slots(views[n]) for n in budgets}
        self.plans: dict[str, list[PendingRequest]] = {}
        self.choices: dict[str, list[DispatchChoice]] = {}
        self.opened: dict[tuple[str, str], list[str]] = {}
        self.open_choice: dict[tuple[str, str, str], int] = {}
        self.refused = False
        self.max_budget = max(budgets.values(), default=0.0)
        self.checks = 0
        self.routes: dict[str, tuple[str, NodePolicy, bool, _LateBinds | None]] = {}
        """Per route policy asked for: the policy's name, the policy, whether it binds late, its `late_binds`."""
        self.late_age = batcher.policy.late_age_after_windows
        self.names = sorted(budgets)
        """The nodes with a budget, by name (a close only lowers their budgets: the keys stay)."""
        self.serving: dict[str, list[str]] = {}
        """Per model, the nodes of `names` that serve it, in their order (`serving_names`)."""
        self._all_views: list[NodeView] | None = None
        self.no_room: dict[tuple[str, bool], float] = {}
        """(model, held to the prefill horizon) -> the smallest memory of a request of that kind that found no node
        with room. A close only takes room (budgets, slots and the prefill horizon's room all shrink as it places), so
        no request of that kind at least as large finds one later in the close either (a close with thousands waiting
        behind full nodes, as in a flood, tried each of them without this)."""

    def all_views(self) -> list[NodeView]:
        """The views of the nodes with a budget, by name, as placed so far in this close."""
        if self._all_views is None:
            self._all_views = [self.views[n] for n in self.names]
        return self._all_views

    def serving_names(self, model: str) -> list[str]:
        names = self.serving.get(model)
        if names is None:
            b = self.b
            names = self.serving[model] = [n for n in self.names if b.serves(n, model)]
        return names

    def place(self, p: PendingRequest) -> bool:
        """Try to put one request on a node; True when placed."""
        b, budgets, views, horizon = self.b, self.budgets, self.views, self.horizon
        req = p.request
        mem = req.mem_est_kb
        if mem > self.max_budget:
            return False
        route = self.routes.get(req.route_policy)
        if route is None:
            pname = b.policies.resolve(req.route_policy)
            pol = b.policies.get(pname)
            route = self.routes[req.route_policy] = (pname, pol, b._late(pname), getattr(pol, "late_binds", None))
        pname, pol, late, binds = route
        if late and p.windows_waited >= self.late_age:
            late = False
        if late and binds is not None and not binds(self.all_views(), req):
            late = False  # the policy places this one at once (its prefix is cached somewhere)
        late_h = late and bool(horizon)
        miss = self.no_room.get((req.model, late_h)) if self.skip_known_misses else None
        if miss is not None and mem >= miss:
            return False  # a request of this kind as small found no node: neither will this one
        serving = self.serving_names(req.model)
        cands = [views[n] for n in serving if budgets[n] >= mem and (not late_h or views[n].prefill_tokens < horizon)]
        if not cands:
            self.no_room[(req.model, late_h)] = min(mem, miss) if miss is not None else mem
            return False
        waits = getattr(pol, "waits_for", None)
        # a request may wait here for a node that cannot take it now (its prefix is cached there) while it stays
        # free to go anywhere; the policy says for how long (asked for the first MAX_WAIT_CHECKS of a close)
        if waits is not None and self.checks < MAX_WAIT_CHECKS and len(cands) < len(
                everyone := [views[n] for n in serving]):
            self.checks += 1
            if waits(everyone, cands, req, self.now_ms - p.enqueued_ms):
                return False
        key = (req.model, pname)
        node: str | None = None
        choices = self.choices
        if not pol.per_request:
            node = next((n for n in self.opened.get(key, ()) if budgets[n] >= mem), None)
            if node is not None:  # first fit into a node this policy already chose in this window
                i = self.open_choice[(req.model, pname, node)]
                c = choices[node][i]
                choices[node][i] = replace(c, request_ids=(*c.request_ids, req.request_id))
        if node is None:
            ch = pol.choose(cands, req if pol.per_request else None)
            node = ch.node
            if node is None:  # the policy found none of the nodes with room eligible (e.g. all W = 0)
                self.refused = True
                return False
            choices.setdefault(node, []).append(
                DispatchChoice(pname, node, (req.request_id,), ch.draw, dict(ch.scores))
            )
            if not pol.per_request:
                self.opened.setdefault(key, []).append(node)
                self.open_choice[(req.model, pname, node)] = len(choices[node]) - 1
        self.commit(p, node, pol)
        return True

    def commit(self, p: PendingRequest, node: str, pol: NodePolicy) -> None:
        budgets, slots = self.budgets, self.slots
        req = p.request
        if self.b.policy.fair_share:
            self.b._counter().charge(req.tenant, req.in_tokens, req.out_tokens)
        mem = req.mem_est_kb
        self.plans.setdefault(node, []).append(p)
        budgets[node] -= mem
        slots[node] -= 1
        if slots[node] <= 0:
            budgets[node] = 0.0
        self.max_budget = max(budgets.values(), default=0.0)
        self.views[node] = self.views[node].with_placed(mem, req.in_tokens)
        self._all_views = None
        pol.observe(node, req)


def batch_reserve(policy: BatcherPolicy, max_seqs: int) -> int:
    """Sequence slots of a node that batch work leaves free (`batch_hold_slots` rounded up with `batch_yield: hold`,
    `batch_preempt_slots` rounded down with `preempt`): the window's rule and the engine's alike."""
    if policy.batch_yield == "hold":
        return math.ceil(policy.batch_hold_slots * max_seqs)
    return math.floor(policy.batch_preempt_slots * max_seqs)


def _slots(n: NodeView) -> float:
    """Sequences a node can still start soon: free running slots plus one (the next one queued), unbounded when the
    engine does not say how many it runs."""
    if n.max_seqs <= 0:
        return float("inf")
    return n.max_seqs + 1 - (n.running + n.waiting)


def _tenant(p: PendingRequest) -> str:
    return p.request.tenant


def _tokens(p: PendingRequest) -> tuple[int, int]:
    return p.request.in_tokens, p.request.out_tokens
