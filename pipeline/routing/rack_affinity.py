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
        views = [racks[m] for m in ring.members if m in racks]
        healthy = [v for v in views if v.healthy]
        primary = ring.primary(user_id)
        if not healthy:
            return RouteDecision(None, primary, "no healthy rack")
        by_work = all(v.nodes > 0 for v in healthy)
        if by_work:
            mean = sum(v.work_per_node for v in healthy) / len(healthy)
            bound = self.load_bound * mean + self.work_slack

            def load(v: RackView) -> float:
                return v.work_per_node
        else:
            mean = sum(v.load for v in healthy) / len(healthy)
            bound = self.load_bound * mean + self.load_slack

            def load(v: RackView) -> float:
                return v.load

        def ok(m: str) -> bool:
            v = racks.get(m)
            return v is not None and v.healthy and load(v) <= bound

        if not self.prefix_aware:
            chosen = ring.lookup(user_id, ok)
            if chosen is None:  # every healthy rack is over the bound: least loaded healthy rack
                chosen = min(healthy, key=lambda v: (load(v), v.name)).name
                return RouteDecision(chosen, primary, "all racks over load bound")
            return RouteDecision(chosen, primary, "affinity" if chosen == primary else "walked")
        order = [m for m in ring.walk(user_id) if ok(m)]
        if not order:
            chosen = min(healthy, key=lambda v: (load(v) - (cached or {}).get(v.name, 0.0), v.name)).name
            return RouteDecision(chosen, primary, "all racks over load bound")
        hits = cached or {}

        def cost(m: str) -> float:
            v = racks[m]
            return -hits.get(m, 0.0) + (v.work_per_node if by_work else 0.0) - (
                self.affinity_tokens if m == primary else 0.0)

        chosen = order[min(range(len(order)), key=lambda i: (cost(order[i]), i))]  # ties: ring order
        if chosen == primary:
            reason = "affinity"
        elif hits.get(chosen, 0.0) > hits.get(primary, 0.0):
            reason = "prefix"
        else:
            reason = "walked"
        return RouteDecision(chosen, primary, reason)


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
