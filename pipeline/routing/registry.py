"""Policy registry: names in config -> policy classes. An unknown name lists the valid ones."""

from __future__ import annotations

from typing import Any

from pipeline.routing.rack_affinity import RackAffinityRouter
from pipeline.routing.weighted_random import WeightedRandomSelector

ROUTER_POLICIES: dict[str, type[Any]] = {RackAffinityRouter.name: RackAffinityRouter}
NODE_POLICIES: dict[str, type[Any]] = {WeightedRandomSelector.name: WeightedRandomSelector}


def lookup(registry: dict[str, type[Any]], kind: str, name: str) -> type[Any]:
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} policy {name!r}; valid: {', '.join(sorted(registry))}") from None
