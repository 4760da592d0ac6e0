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

    def route(self, user_id: str, model: str, racks: Mapping[str, RackView],
              cached: Mapping[str, float] | None = None) -> RouteDecision:
        """The rack for a request of `user_id`. `cached`: prompt tokens of the request's prefix each rack holds (from
        the racks' block index); used when the router is prefix-aware."""
        ring = self._rings.get(model)
        if ring is None:
            raise KeyError(f"no rack serves model {model!r}; served: {', '.join(self.models())}")
        # One pass over the racks (a 160-rack cluster routes every request through this): the healthy ones, and
        # both means, summed in ring-member order as before so that every decision (and its replay) is the same.
        healthy: list[RackView] = []
        names: list[str] = []
        by_work = True
        work_sum = 0.0
        load_sum = 0.0
        for m in ring.members:
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
        pos = ring.start(user_id)
        primary = ring.owner_at(pos)
        if not healthy:
            return RouteDecision(None, primary, "no healthy rack")
        if by_work:
            bound = self.load_bound * (work_sum / len(healthy)) + self.work_slack

            def load(v: RackView) -> float:
                return v.work / v.nodes if v.nodes > 0 else 0.0
        else:
            bound = self.load_bound * (load_sum / len(healthy)) + self.load_slack

            def load(v: RackView) -> float:
                return v.load

        if not self.prefix_aware:
            def ok(m: str) -> bool:
                v = racks.get(m)
                return v is not None and v.healthy and load(v) <= bound

            found = ring.first_from(pos, ok)
            if found is not None:
                return RouteDecision(found, primary, "affinity" if found == primary else "walked")
            # every healthy rack is over the bound: least loaded healthy rack
            chosen = min(healthy, key=lambda v: (load(v), v.name)).name
            return RouteDecision(chosen, primary, "all racks over load bound")
        hits = cached or {}
        aff = self.affinity_tokens
        # the cheapest acceptable rack; ties go to the first in ring order (its distance from the key's position:
        # no walk of the ring, which costs as much as the racks times their virtual nodes)
        ties: list[str] = []
        best = 0.0
        for m, v in zip(names, healthy, strict=True):
            lv = load(v)
            if lv > bound:
                continue
            c = -hits.get(m, 0.0) + (lv if by_work else 0.0) - (aff if m == primary else 0.0)
            if not ties or c < best:
                ties, best = [m], c
            elif c == best:
                ties.append(m)
        chosen_m = (ties[0] if len(ties) == 1 else min(ties, key=lambda m: ring.distance(pos, m))) if ties else None
        if chosen_m is None:
            chosen = min(healthy, key=lambda v: (load(v) - hits.get(v.name, 0.0), v.name)).name
            return RouteDecision(chosen, primary, "all racks over load bound")
        if chosen_m == primary:
            reason = "affinity"
        elif hits.get(chosen_m, 0.0) > hits.get(primary, 0.0):
            reason = "prefix"
        else:
            reason = "walked"
        return RouteDecision(chosen_m, primary, reason)


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
