"""Router policy `rack_affinity`: user-affinity consistent hash of user_id over the racks serving the model,
with bounded load (Mirrokni et al., "Consistent Hashing with Bounded Loads"): a rack that is unhealthy or whose load
is above `load_bound` x the mean rack load + `load_slack` is skipped and the ring is walked to the next rack."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

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
    ) -> None:
        if load_bound < 1.0:
            raise ValueError(f"load_bound must be >= 1.0, got {load_bound}")
        if load_slack < 0:
            raise ValueError(f"load_slack must be >= 0, got {load_slack}")
        self.load_bound = load_bound
        self.load_slack = load_slack
        self._rings = {m: HashRing(r, virtual_nodes) for m, r in racks_by_model.items() if r}

    def models(self) -> tuple[str, ...]:
        return tuple(sorted(self._rings))

    def route(self, user_id: str, model: str, racks: Mapping[str, RackView]) -> RouteDecision:
        ring = self._rings.get(model)
        if ring is None:
            raise KeyError(f"no rack serves model {model!r}; served: {', '.join(self.models())}")
        views = [racks[m] for m in ring.members if m in racks]
        healthy = [v for v in views if v.healthy]
        primary = ring.primary(user_id)
        if not healthy:
            return RouteDecision(None, primary, "no healthy rack")
        mean = sum(v.load for v in healthy) / len(healthy)
        bound = self.load_bound * mean + self.load_slack

        def ok(m: str) -> bool:
            v = racks.get(m)
            return v is not None and v.healthy and v.load <= bound

        chosen = ring.lookup(user_id, ok)
        if chosen is None:  # every healthy rack is over the bound: least loaded healthy rack
            chosen = min(healthy, key=lambda v: (v.load, v.name)).name
            return RouteDecision(chosen, primary, "all racks over load bound")
        return RouteDecision(chosen, primary, "affinity" if chosen == primary else "walked")


def keeps_prefix_cache(enabled: bool, min_tokens: int, in_tokens: int, decision: RouteDecision, asked: bool) -> bool:
    """Seed rule (ARCHITECTURE §2): a prompt longer than `min_tokens` that leaves its affinity rack runs with
    prefix caching off; otherwise the request keeps what it asked for."""
    if enabled and decision.rack is not None and decision.rack != decision.primary and in_tokens > min_tokens:
        return False
    return asked
