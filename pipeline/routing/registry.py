"""Policy registry: names in config (and in the X-Route-Policy header) -> policy objects. An unknown name lists
the valid ones."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

from pipeline.config import NodeSelectionPolicy
from pipeline.routing.node_policies.base import NodePolicy
from pipeline.routing.node_policies.kv_aware import KvAware
from pipeline.routing.node_policies.least_outstanding import LeastOutstanding
from pipeline.routing.node_policies.power_of_two import PowerOfTwo
from pipeline.routing.node_policies.random_choice import RandomChoice
from pipeline.routing.node_policies.round_robin import RoundRobin
from pipeline.routing.node_policies.static_weight import StaticWeight
from pipeline.routing.node_policies.weighted import Weighted
from pipeline.routing.prefix_index import PrefixIndex
from pipeline.routing.rack_affinity import RackAffinityRouter

ROUTER_POLICIES: dict[str, type[Any]] = {RackAffinityRouter.name: RackAffinityRouter}
NODE_POLICIES: dict[str, type[Any]] = {
    cls.name: cls
    for cls in (RoundRobin, RandomChoice, LeastOutstanding, PowerOfTwo, StaticWeight, Weighted, KvAware)
}


def lookup(registry: dict[str, type[Any]], kind: str, name: str) -> type[Any]:
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} policy {name!r}; valid: {', '.join(sorted(registry))}") from None


def make_node_policy(
    name: str,
    params: NodeSelectionPolicy,
    rng: random.Random,
    node_gpus: Mapping[str, str],
    block_tokens: int,
) -> NodePolicy:
    """Build a node policy by name; each gets its own `rng` (seed it per rack and policy for replay)."""
    cls = lookup(NODE_POLICIES, "node", name)
    if cls is RoundRobin or cls is LeastOutstanding:
        return cls()  # type: ignore[no-any-return]
    if cls is RandomChoice or cls is PowerOfTwo:
        return cls(rng)  # type: ignore[no-any-return]
    if cls is StaticWeight:
        return StaticWeight(rng, params.static_weights, node_gpus)
    if cls is Weighted:
        return Weighted(params.latency_decay_per_ms, rng)
    return KvAware(PrefixIndex(params.kv_aware.index_blocks_per_node), block_tokens,
                   params.kv_aware.decode_weight_tokens)


class NodePolicySet:
    """One instance of each policy a rack may use, built lazily, each with its own seeded random source."""

    def __init__(self, params: NodeSelectionPolicy, seed: int, scope: str, node_gpus: Mapping[str, str],
                 block_tokens: int, rng_factory: Callable[[str, str], random.Random] | None = None) -> None:
        self.params = params
        self.seed = seed
        self.scope = scope
        self.node_gpus = dict(node_gpus)
        self.block_tokens = block_tokens
        self.rng_factory = rng_factory
        """(policy name, seed string) -> the policy's random source; replay records or scripts the draws here."""
        self._policies: dict[str, NodePolicy] = {}

    @property
    def default(self) -> str:
        return self.params.policy

    def resolve(self, requested: str) -> str:
        """The policy a request runs under: its own when given and allowed, else the default."""
        if requested and self.params.allow_request_override and requested in self.params.allowed_overrides:
            return requested
        return self.params.policy

    def get(self, name: str) -> NodePolicy:
        pol = self._policies.get(name)
        if pol is None:
            seed = f"{self.seed}:{self.scope}:{name}"
            rng = self.rng_factory(name, seed) if self.rng_factory is not None else random.Random(seed)
            pol = make_node_policy(name, self.params, rng, self.node_gpus, self.block_tokens)
            self._policies[name] = pol
        return pol
