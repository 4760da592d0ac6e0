"""Router policy `rack_affinity`: user-affinity consistent hash of user_id over the racks serving the model,
with bounded load (Mirrokni et al., "Consistent Hashing with Bounded Loads"): a rack that is unhealthy or whose load
is above `load_bound` x the mean rack load + `load_slack` is skipped and the ring is walked to the next rack."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from pipeline.config import RouterPolicy
from pipeline.routing.hashring import HashRing
from pipeline.routing.views import RackView


@dataclass(frozen=True, slots=True)
class RackSummary:
    """What a route reads of all the racks before it picks one: the healthy racks (in ring-member order) and their
    sums. A caller whose views do not change between requests (the gateway's admission reads them every
    `saturation_refresh_ms`) computes it once per read (`RackAffinityRouter.summarize`) instead of once per
    request: the same sums in the same order, so the same decisions."""

    model: str
    healthy: tuple[RackView, ...]
    names: tuple[str, ...]
    by_work: bool
    work_sum: float
    load_sum: float


@dataclass(frozen=True, slots=True)
class RouteDecision:
    rack: str | None
    """None: no rack serving the model is healthy."""
    primary: str
    """The rack the user's hash maps to (affinity); differs from `rack` when the walk skipped it."""
    reason: str


class RackAffinityRouter:
    name: ClassVar[str] = "rack_affinity"

    def __init__(
        self,
        racks_by_model: Mapping[str, Sequence[str]],
        virtual_nodes: int,
        load_bound: float,
        load_slack: float = 1.0,
        *,
        prefix_aware: bool = False,
        affinity_tokens: float = 8192.0,
        work_slack: float = 32768.0,
    ) -> None:
        if load_bound < 1.0:
            raise ValueError(f"load_bound must be >= 1.0, got {load_bound}")
        if load_slack < 0 or work_slack < 0:
            raise ValueError(f"load_slack and work_slack must be >= 0, got {load_slack}, {work_slack}")
        self.load_bound = load_bound
        self.load_slack = load_slack
        self.prefix_aware = prefix_aware
        self.affinity_tokens = affinity_tokens
        self.work_slack = work_slack
        self._rings = {m: HashRing(r, virtual_nodes) for m, r in racks_by_model.items() if r}

    @classmethod
    def from_config(cls, racks_by_model: Mapping[str, Sequence[str]], rp: RouterPolicy) -> RackAffinityRouter:
        return cls(racks_by_model, rp.virtual_nodes, rp.load_bound, rp.load_slack, prefix_aware=rp.prefix_aware,
                   affinity_tokens=rp.affinity_tokens, work_slack=rp.work_slack_tokens)

    def models(self) -> tuple[str, ...]:
        return tuple(sorted(self._rings))

    def _ring(self, model: str) -> HashRing:
        ring = self._rings.get(model)
        if ring is None:
            raise KeyError(f"no rack serves model {model!r}; served: {', '.join(self.models())}")
        return ring

    def summarize(self, model: str, racks: Mapping[str, RackView]) -> RackSummary:
        """One pass over the racks (a 160-rack cluster routes every request through this): the healthy ones, and
        both means, summed in ring-member order as before so that every decision (and its replay) is the same."""
        healthy: list[RackView] = []
        names: list[str] = []
        by_work = True
        work_sum = 0.0
        load_sum = 0.0
        for m in self._ring(model).members:
            v = racks.get(m)
            if v is None or not v.healthy:
                continue
            healthy.append(v)
            names.append(m)
            load_sum += v.load
            if v.nodes > 0:
                work_sum += v.work / v.nodes
            else:
                by_work = False
        return RackSummary(model, tuple(healthy), tuple(names), by_work, work_sum, load_sum)

    def route(self, user_id: str, model: str, racks: Mapping[str, RackView],
              cached: Mapping[str, float] | None = None, summary: RackSummary | None = None) -> RouteDecision:
        """The rack for a request of `user_id`. `cached`: prompt tokens of the request's prefix each rack holds (from
        the racks' block index); used when the router is prefix-aware. `summary`: `summarize(model, racks)` of
        these very views, when the caller keeps it (else it is computed here)."""
        ring = self._ring(model)
        if summary is None or summary.model != model:
            summary = self.summarize(model, racks)
        healthy, names, by_work = summary.healthy, summary.names, summary.by_work
        work_sum, load_sum = summary.work_sum, summary.load_sum
        pos = ring.start(user_id)
        primary = ring.owner_at(pos)
        if not healthy:
            return RouteDecision(None, primary, "no healthy rack")
        # no nested functions or lambdas below: compiled (workers.sim.compiled), each would make a reference cycle
        # per request, and the simulator runs with the cyclic collector off
        if by_work:
            bound = self.load_bound * (work_sum / len(healthy)) + self.work_slack
        else:
            bound = self.load_bound * (load_sum / len(healthy)) + self.load_slack
        if not self.prefix_aware:
            found = ring.first_from(pos, _WithinBound(racks, by_work, bound))
            if found is not None:
                return RouteDecision(found, primary, "affinity" if found == primary else "walked")
            # every healthy rack is over the bound: least loaded healthy rack
            return RouteDecision(_least(healthy, by_work, None), primary, "all racks over load bound")
        hits = cached or {}
        aff = self.affinity_tokens
        # the cheapest acceptable rack; ties go to the first in ring order (its distance from the key's position:
        # no walk of the ring, which costs as much as the racks times their virtual nodes)
        ties: list[str] = []
        best = 0.0
        for m, v in zip(names, healthy, strict=True):
            lv = _load(v, by_work)
            if lv > bound:
                continue
            c = -hits.get(m, 0.0) + (lv if by_work else 0.0) - (aff if m == primary else 0.0)
            if not ties or c < best:
                ties, best = [m], c
            elif c == best:
                ties.append(m)
        if not ties:
            return RouteDecision(_least(healthy, by_work, hits), primary, "all racks over load bound")
        chosen_m = ties[0]
        if len(ties) > 1:  # min by ring distance: the first of the nearest
            near = ring.distance(pos, chosen_m)
            for m in ties[1:]:
                d = ring.distance(pos, m)
                if d < near:
                    chosen_m, near = m, d
        if chosen_m == primary:
            reason = "affinity"
        elif hits.get(chosen_m, 0.0) > hits.get(primary, 0.0):
            reason = "prefix"
        else:
            reason = "walked"
        return RouteDecision(chosen_m, primary, reason)


def _load(v: RackView, by_work: bool) -> float:
    """A rack's load as the bound compares it: prompt-token work per active node, or requests outstanding."""
    if by_work:
        return v.work / v.nodes if v.nodes > 0 else 0.0
    return v.load


def _least(healthy: Sequence[RackView], by_work: bool, hits: Mapping[str, float] | None) -> str:
    """The healthy rack with the least load (less its cached prompt tokens, with `hits`), then the first name: what
    min() by (load, name) picks."""
    best: tuple[float, str] | None = None
    for v in healthy:
        key = (_load(v, by_work) - hits.get(v.name, 0.0) if hits is not None else _load(v, by_work), v.name)
        if best is None or key < best:
            best = key
    assert best is not None
    return best[1]


class _WithinBound:
    """The ring walk's test: a healthy rack at or under the load bound (a class, not a closure: see `route`)."""

    __slots__ = ("bound", "by_work", "racks")

    def __init__(self, racks: Mapping[str, RackView], by_work: bool, bound: float) -> None:
        self.racks = racks
        self.by_work = by_work
        self.bound = bound

    def __call__(self, m: str) -> bool:
        v = self.racks.get(m)
        return v is not None and v.healthy and _load(v, self.by_work) <= self.bound


def keeps_prefix_cache(enabled: bool, min_tokens: int, in_tokens: int, decision: RouteDecision, asked: bool) -> bool:
    """Seed rule (ARCHITECTURE §2): a prompt longer than `min_tokens` that leaves its affinity rack for load runs
    with prefix caching off; one sent elsewhere because its prefix is cached there keeps it; otherwise the request
    keeps what it asked for."""
    if (enabled and decision.rack is not None and decision.rack != decision.primary and in_tokens > min_tokens
            and decision.reason != "prefix"):
        return False
    return asked


def rack_cached_tokens(node_blocks: Mapping[str, int], rack_of: Mapping[str, str], block_tokens: int,
                       in_tokens: int) -> dict[str, float]:
    """Per rack, the prompt tokens of a request its best node holds (from a node-level block match)."""
    out: dict[str, float] = {}
    cap = max(0, in_tokens - 1)
    for node, k in node_blocks.items():
        rack = rack_of.get(node)
        if rack is None:
            continue
        t = float(min(cap, k * block_tokens))
        if t > out.get(rack, 0.0):
            out[rack] = t
    return out
