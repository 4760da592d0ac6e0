"""Policy registry: names in config (and in the X-Route-Policy header) -> policy objects. An unknown name lists
the valid ones."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import NodeSelectionPolicy, RackflowConfig
from pipeline.routing.node_policies.base import NodePolicy, StepTime
from pipeline.routing.node_policies.dynamo import Dynamo
from pipeline.routing.node_policies.kv_aware import KvAware
from pipeline.routing.node_policies.least_outstanding import LeastOutstanding
from pipeline.routing.node_policies.llm_d import LlmD
from pipeline.routing.node_policies.lmetric import LMetric
from pipeline.routing.node_policies.power_of_two import PowerOfTwo
from pipeline.routing.node_policies.random_choice import RandomChoice
from pipeline.routing.node_policies.round_robin import RoundRobin
from pipeline.routing.node_policies.sglang import MAX_TREE_TOKENS as SGLANG_MAX_TREE_TOKENS
from pipeline.routing.node_policies.sglang import Sglang
from pipeline.routing.node_policies.static_weight import StaticWeight
from pipeline.routing.node_policies.weighted import Weighted
from pipeline.routing.node_policies.work_aware import WorkAware
from pipeline.routing.prefix_index import BlockIndex, PrefixIndex
from pipeline.routing.rack_affinity import RackAffinityRouter

ROUTER_POLICIES: dict[str, type[Any]] = {RackAffinityRouter.name: RackAffinityRouter}
NODE_POLICIES: dict[str, type[Any]] = {
    cls.name: cls
    for cls in (RoundRobin, RandomChoice, LeastOutstanding, PowerOfTwo, StaticWeight, Weighted, KvAware, WorkAware,
                LlmD, Dynamo, Sglang, LMetric)
}


def lookup(registry: dict[str, type[Any]], kind: str, name: str) -> type[Any]:
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} policy {name!r}; valid: {', '.join(sorted(registry))}") from None


def build_router(config: RackflowConfig, prefix_aware: bool | None = None) -> RackAffinityRouter:
    """The rack policy of `policies.router`, the one way every component builds it: the router role, the gateway's
    prediction (prefix_aware=False: it has no prefix index), the simulator and replay. An unknown policy name is a
    ValueError listing the valid ones."""
    cls = lookup(ROUTER_POLICIES, "router", config.policies.router.policy)
    router: RackAffinityRouter = cls.from_config(
        {m: config.racks_serving(m) for m in config.models}, config.policies.router)
    if prefix_aware is not None:
        router.prefix_aware = prefix_aware
    return router


def _unit_time(node: str) -> StepTime:
    return _TOKENS


class _TokenTime:
    """Without cost models: one millisecond per prefill token, and a decode step of one ms plus 0.01 ms per sequence
    (only for callers that build policies without a cluster, e.g. tests of other policies)."""

    def step_ms(self, prefill_tokens: Sequence[int], decode_seqs: int, decode_kv_tokens: int,
                prefill_cached: Sequence[int] | None = None) -> float:
        return float(sum(prefill_tokens)) + (1.0 + 0.01 * decode_seqs if decode_seqs else 0.0)


_TOKENS = _TokenTime()


@dataclass(frozen=True)
class PolicyContext:
    """What policies may need beyond the node views: the cluster's node types, each node's cost model, the rack's
    precise prefix index (fed with the engines' block events) and the engine's shape."""

    node_gpus: Mapping[str, str] = field(default_factory=dict)
    block_tokens: int = 512
    cost_of: Callable[[str], StepTime] = _unit_time
    """A node's calibrated cost model (its GPU type, model and tp)."""
    blocks: BlockIndex | None = None
    """The rack's precise prefix index (None: nothing feeds one; policies that need it keep an empty one)."""
    node_blocks: int = 65_536
    """Prefix blocks a node's engine holds (an approximate index learned from dispatches is sized to it)."""
    max_batched_tokens: int = 8192


def make_node_policy(name: str, params: NodeSelectionPolicy, rng: random.Random, ctx: PolicyContext) -> NodePolicy:
    """Build a node policy by name; each gets its own `rng` (seed it per rack and policy for replay)."""
    cls = lookup(NODE_POLICIES, "node", name)
    bt = ctx.block_tokens
    blocks = ctx.blocks if ctx.blocks is not None else BlockIndex()
    if cls is RoundRobin or cls is LeastOutstanding:
        return cls()  # type: ignore[no-any-return]
    if cls is RandomChoice or cls is PowerOfTwo:
        return cls(rng)  # type: ignore[no-any-return]
    if cls is StaticWeight:
        return StaticWeight(rng, params.static_weights, ctx.node_gpus)
    if cls is Weighted:
        return Weighted(params.latency_decay_per_ms, rng)
    if cls is KvAware:
        return KvAware(PrefixIndex(params.kv_aware.index_blocks_per_node), bt, params.kv_aware.decode_weight_tokens)
    if cls is WorkAware:
        wa = params.work_aware
        precise = wa.index == "precise" and ctx.blocks is not None
        return WorkAware(wa, ctx.cost_of, bt, rng, blocks=ctx.blocks if precise else None,
                         approx=None if precise else PrefixIndex(ctx.node_blocks),
                         max_batched_tokens=ctx.max_batched_tokens)
    if cls is LlmD:
        return LlmD(PrefixIndex(ctx.node_blocks), rng)
    if cls is Dynamo:
        return Dynamo(blocks, bt, rng)
    if cls is Sglang:
        return Sglang(PrefixIndex(max(1, SGLANG_MAX_TREE_TOKENS // bt)), bt)
    if cls is LMetric:
        return LMetric(blocks, bt)
    raise AssertionError(f"node policy {name!r} is registered but has no constructor here")


class NodePolicySet:
    """One instance of each policy a rack may use, built lazily, each with its own seeded random source."""

    def __init__(self, params: NodeSelectionPolicy, seed: int, scope: str, node_gpus: Mapping[str, str],
                 block_tokens: int, rng_factory: Callable[[str, str], random.Random] | None = None,
                 context: PolicyContext | None = None) -> None:
        self.params = params
        self.seed = seed
        self.scope = scope
        self.node_gpus = dict(node_gpus)
        self.block_tokens = block_tokens
        self.context = context or PolicyContext(node_gpus=self.node_gpus, block_tokens=block_tokens)
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

    def late_binding(self, name: str) -> bool:
        """The policy holds requests in the batcher until a node can start them (see WindowBatcher._pull)."""
        return bool(getattr(self.get(name), "late_binding", False))

    def get(self, name: str) -> NodePolicy:
        pol = self._policies.get(name)
        if pol is None:
            seed = f"{self.seed}:{self.scope}:{name}"
            rng = self.rng_factory(name, seed) if self.rng_factory is not None else random.Random(seed)
            pol = make_node_policy(name, self.params, rng, self.context)
            self._policies[name] = pol
        return pol
