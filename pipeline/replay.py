"""Deterministic replay of routing and batching decisions (pure: no I/O, no clock).

What the live processes record so a run can be re-decided later:

- the router writes one `route` DecisionEvent per batch of requests it read, with the rack views it saw
  (`load:{rack}`, `healthy:{rack}`) and its choice for each request in order; a gateway that routes requests
  itself does the same, per round trip. Each names its process (`actor`), and each process is replayed by a router
  object of its own (the share guard counts what its own process sent);
- a batcher writes, for every window it closes, a `window` DecisionEvent: the close time, the reason, the node
  views the window saw (after its own reservations), the requests offered since its previous close with their
  enqueue times, and the random draws each node policy made during the close (`inputs`, see `window_inputs`); the
  batches it formed are the `dispatch` DecisionEvents of the same actor and time.

`Replayer` feeds those inputs, in recorded order and in virtual time (the recorded timestamps), to the SAME router,
WindowBatcher/FixedBatcher and node policy objects the live services use, and compares what they decide with what
was recorded. With the recorded config and policy the decisions must match exactly (random policies get their
recorded draws back, so this holds for an export that starts mid-run too); with another node policy or config it is
a what-if: the same arrivals, close times and node views, decided differently, and the differences are listed.

A what-if is open loop: later node views are the recorded ones, not what the other policy's placements would have
produced. For closed-loop answers run the simulator (`rackflow sim`) on the recorded requests.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pipeline.batching.fixed import FixedBatcher
from pipeline.batching.window import PendingRequest, WindowBatcher, WindowOutcome
from pipeline.config import NodeSpec, RackflowConfig
from pipeline.events import BlockEvent, DecisionEvent, RequestEvent
from pipeline.routing.node_policies.base import StepTime
from pipeline.routing.prefix_index import BlockIndex
from pipeline.routing.rack_affinity import RackAffinityRouter
from pipeline.routing.registry import NODE_POLICIES, NodePolicySet, PolicyContext, build_router, lookup
from pipeline.routing.views import NodeView, RackView

VIEW_FIELDS = (
    "active", "vram_total_gb", "free_vram_gb", "pcie_util_pct", "avg_latency_ms", "kv_capacity_kb", "kv_free_kb",
    "running", "waiting", "prefill_tokens", "decode_seqs", "decode_tokens", "kv_usage", "slowdown", "max_seqs",
    "prefill_slowdown", "batch_seqs", "batch_kv_kb", "batch_prefill_tokens",
)
"""The NodeView fields a window record carries, in order (a record written before a field existed is shorter: the
missing fields take their defaults). `prefill_slowdown` None (the node learned no prefill speed of its own) is
recorded as -1."""
NODE_PREFIX = "node:"
BLOCKS_PREFIX = "blk:"
"""`blk:{k:08d}:{node}`: the k-th block event the batcher's prefix index applied before this close: (cleared,
stored count, stored hashes, removed hashes), each hash as two floats (high 31 bits, low 32 bits: exact)."""
ENQ_PREFIX = "enq:"
DRAWS_PREFIX = "draws:"
IDLE_KEY = "idle_closes"
RngFactory = Callable[[str, str], random.Random]


# ---- random sources -------------------------------------------------------------------------------------------


class RecordingRandom(random.Random):
    """A seeded random source that logs every `random()` it returns (the batcher records them per close)."""

    def __init__(self, seed: str, log: list[float]) -> None:
        super().__init__(seed)
        self.log = log

    def random(self) -> float:
        x = super().random()
        self.log.append(x)
        return x


class DrawLog:
    """The draws of each node policy since the last `take()`; `factory` is a NodePolicySet rng_factory."""

    def __init__(self) -> None:
        self.draws: dict[str, list[float]] = {}

    def factory(self, policy: str, seed: str) -> random.Random:
        return RecordingRandom(seed, self.draws.setdefault(policy, []))

    def take(self) -> dict[str, list[float]]:
        out = {k: list(v) for k, v in self.draws.items() if v}
        for v in self.draws.values():
            v.clear()
        return out


class ScriptedRandom(random.Random):
    """Returns the draws it is given, in order; past them (a what-if that draws more), its own seeded stream."""

    def __init__(self, seed: str) -> None:
        super().__init__(seed)
        self.script: deque[float] = deque()
        self.unscripted = 0

    def load(self, draws: Iterable[float]) -> None:
        self.script.clear()
        self.script.extend(draws)

    def random(self) -> float:
        if self.script:
            return self.script.popleft()
        self.unscripted += 1
        return super().random()


# ---- building the same objects the live services use ---------------------------------------------------------


def policy_context(config: RackflowConfig, rack: str, blocks: BlockIndex | None,
                   cost_of: Callable[[NodeSpec], StepTime] | None = None) -> PolicyContext:
    """What the node policies of one rack see beyond the node views: each node's cost model (`cost_of`, default
    the calibrated model with the committed calibration), the rack's precise prefix index, the engines' KV block
    count and token budget."""
    from pipeline.costmodel import CalibratedCostModel

    nodes = config.cluster.racks[config.rack_names().index(rack)].expanded()
    from pipeline.costmodel.linear import LinearStepCost

    def default(n: NodeSpec) -> StepTime:
        profile = config.gpus[n.gpu].step_profile
        if profile:
            return LinearStepCost.from_profile(profile)
        return CalibratedCostModel.for_node(config, n)

    make = cost_of or default
    costs = {n.name: make(n) for n in nodes}
    bt = config.policies.profiling.prefix_block_tokens
    kv_tokens = min(config.node_kv_capacity_kb(n.name) * 1000 // config.models[n.models[0]].kv_bytes_per_token
                    for n in nodes)
    return PolicyContext(
        node_gpus={n.name: n.gpu for n in nodes}, block_tokens=bt, cost_of=costs.__getitem__, blocks=blocks,
        node_blocks=max(1, int(kv_tokens // bt)), max_batched_tokens=config.policies.worker.max_batched_tokens,
    )


def rack_batcher(
    config: RackflowConfig, rack: str, rng_factory: RngFactory | None = None, blocks: BlockIndex | None = None
) -> tuple[WindowBatcher | FixedBatcher, NodePolicySet]:
    """The batcher of one rack as `rackflow batcher` builds it (window or fixed mode, caps, models, policies);
    `blocks`: the rack's precise prefix index (fed with its nodes' block events)."""
    if rack not in config.rack_names():
        raise ValueError(f"unknown rack {rack!r}; racks: {', '.join(config.rack_names())}")
    pol = config.policies
    nodes = config.cluster.racks[config.rack_names().index(rack)].expanded()
    caps = {n.name: config.node_kv_capacity_kb(n.name) for n in nodes}
    # Each policy of this rack gets its own random source seeded by (seed, rack, policy).
    policies = NodePolicySet(
        pol.node_selection, pol.seed, rack, {n.name: n.gpu for n in nodes}, pol.profiling.prefix_block_tokens,
        rng_factory, context=policy_context(config, rack, blocks),
    )
    models = {n.name: frozenset(n.models) for n in nodes}
    window: WindowBatcher | FixedBatcher
    if pol.batcher.mode == "fixed":
        window = FixedBatcher(pol.batcher, policies, caps, models, pol.batcher.fixed_batch)
    else:
        window = WindowBatcher(pol.batcher, policies, caps, models)
    return window, policies


def rack_router(config: RackflowConfig) -> RackAffinityRouter:
    """The router policy as `rackflow router` builds it."""
    return build_router(config)


def with_node_policy(config: RackflowConfig, policy: str | None) -> RackflowConfig:
    """The config with another default node policy (a what-if); None: unchanged."""
    if not policy:
        return config
    lookup(NODE_POLICIES, "node", policy)  # a clear error listing the valid names
    ns = config.policies.node_selection.model_copy(update={"policy": policy})
    pols = config.policies.model_copy(update={"node_selection": ns})
    return config.model_copy(update={"policies": pols})


# ---- what a window close records -----------------------------------------------------------------------------


def view_inputs(v: NodeView) -> tuple[float, ...]:
    return tuple(float(x) if (x := getattr(v, f)) is not None else -1.0 for f in VIEW_FIELDS)


def view_from_inputs(name: str, t: Sequence[float]) -> NodeView:
    vals = dict(zip(VIEW_FIELDS, t, strict=False))
    return NodeView(
        name=name, active=bool(vals["active"]), vram_total_gb=vals["vram_total_gb"], free_vram_gb=vals["free_vram_gb"],
        pcie_util_pct=vals["pcie_util_pct"], avg_latency_ms=vals["avg_latency_ms"],
        kv_capacity_kb=vals["kv_capacity_kb"], kv_free_kb=vals["kv_free_kb"], running=int(vals["running"]),
        waiting=int(vals["waiting"]), prefill_tokens=int(vals.get("prefill_tokens", 0)),
        decode_seqs=int(vals.get("decode_seqs", 0)), decode_tokens=int(vals.get("decode_tokens", 0)),
        kv_usage=vals.get("kv_usage", 0.0), slowdown=vals.get("slowdown", 1.0), max_seqs=int(vals.get("max_seqs", 0)),
        prefill_slowdown=ps if (ps := vals.get("prefill_slowdown", -1.0)) >= 0 else None,
        batch_seqs=int(vals.get("batch_seqs", 0)), batch_kv_kb=vals.get("batch_kv_kb", 0.0),
        batch_prefill_tokens=int(vals.get("batch_prefill_tokens", 0)),
    )


def window_record(
    *,
    actor: str,
    rack: str,
    policy: str,
    reason: str,
    now_ms: float,
    nodes: Sequence[NodeView],
    offered: Sequence[tuple[str, int, float]],
    draws: Mapping[str, Sequence[float]],
    pending_after: int,
    idle_closes: int = 0,
    last_idle_ms: float = 0.0,
    blocks: Sequence[BlockEvent] = (),
) -> DecisionEvent:
    """The `window` DecisionEvent of one close. `offered`: (request id, version, enqueued_ms) in offer order;
    `idle_closes`: closes since the previous record that placed, rejected and received nothing (the last at
    `last_idle_ms`) — they are not recorded one by one, replay re-applies them before this one."""
    inputs: dict[str, tuple[float, ...]] = {NODE_PREFIX + v.name: view_inputs(v) for v in nodes}
    if idle_closes:
        inputs[IDLE_KEY] = (float(idle_closes), float(last_idle_ms))
    for rid, version, enq in offered:
        inputs[ENQ_PREFIX + rid] = (float(enq), float(version))
    for name, ds in draws.items():
        inputs[DRAWS_PREFIX + name] = tuple(ds)
    for k, ev in enumerate(blocks):
        inputs[f"{BLOCKS_PREFIX}{k:08d}:{ev.node}"] = block_inputs(ev)
    return DecisionEvent(
        kind="window", policy=policy, choice=reason, request_ids=tuple(r for r, _, _ in offered), ts_ms=now_ms,
        scores={"pending": float(pending_after)}, rack=rack, actor=actor, inputs=inputs,
    )


def _split(h: int) -> tuple[float, float]:
    return float(h >> 32), float(h & 0xFFFFFFFF)


def block_inputs(ev: BlockEvent) -> tuple[float, ...]:
    out: list[float] = [1.0 if ev.cleared else 0.0, float(len(ev.stored))]
    for h in (*ev.stored, *ev.removed):
        out.extend(_split(h))
    return tuple(out)


def apply_block_inputs(index: BlockIndex, node: str, t: Sequence[float]) -> None:
    """Re-apply one recorded block event to a prefix index (the inverse of `block_inputs`)."""
    hashes = [(int(t[i]) << 32) | int(t[i + 1]) for i in range(2, len(t) - 1, 2)]
    n = int(t[1])
    if t[0]:
        index.clear(node)
    if hashes[n:]:
        index.removed(node, hashes[n:])
    if hashes[:n]:
        index.stored(node, hashes[:n])


def replay_idle_closes(window: WindowBatcher | FixedBatcher, n: int, last_ms: float) -> None:
    """Re-apply `n` closes that placed, rejected and received nothing: they aged the waiting requests (window
    mode) and restarted the window (fixed mode), nothing else."""
    if isinstance(window, WindowBatcher):
        for _ in range(n):
            window.close(last_ms, [])  # no node: nothing can be placed, as nothing was
    elif window.pending:
        oldest = min(p.enqueued_ms for p in window.pending)
        window.window_open_ms = oldest if last_ms < oldest + window.policy.window_ms else last_ms


# ---- replaying -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Difference:
    """One decision that came out differently in the replay."""

    kind: str
    """`route` (request -> rack) or `dispatch` (request -> node)."""
    request_id: str
    ts_ms: float
    recorded: str
    replayed: str
    """`(waiting)`: the replay left the request in the window at that close."""
    where: str = ""
    """The rack (dispatch) or the model (route)."""


@dataclass
class _Actor:
    window: WindowBatcher | FixedBatcher
    rngs: dict[str, ScriptedRandom]
    blocks: BlockIndex


@dataclass
class ReplayStats:
    route_decisions: int = 0
    route_matched: int = 0
    dispatch_decisions: int = 0
    dispatch_matched: int = 0
    windows: int = 0
    requests_dispatched_recorded: int = 0
    requests_same_node: int = 0
    missing_requests: int = 0
    unscripted_draws: int = 0
    warmup_decisions: int = 0
    replayed_nodes: Counter[str] = field(default_factory=Counter)
    recorded_nodes: Counter[str] = field(default_factory=Counter)

    @property
    def decisions(self) -> int:
        return self.route_decisions + self.dispatch_decisions

    @property
    def matched(self) -> int:
        return self.route_matched + self.dispatch_matched

    @property
    def match_rate(self) -> float:
        return self.matched / self.decisions if self.decisions else 1.0


class Replayer:
    """Re-decides a recorded run. Feed the recorded requests (`add_request`) before the decisions that use them,
    then every DecisionEvent in recorded order (`decision`); decisions before `count_from_ms` only warm the state
    (policy memory, waiting requests) and are not counted."""

    def __init__(
        self, config: RackflowConfig, policy: str | None = None, count_from_ms: float = 0.0,
        max_differences: int = 10_000,
    ) -> None:
        self.recorded_policy = config.policies.node_selection.policy
        self.config = with_node_policy(config, policy)
        self.what_if = bool(policy) and policy != self.recorded_policy
        self.router = rack_router(self.config)
        self._routers: dict[str, RackAffinityRouter] = {"": self.router}
        """One router policy per routing process (a decision's `actor`: each router, each gateway that routes
        itself): the share guard's counts are each process's own."""
        self.count_from_ms = count_from_ms
        self.max_differences = max_differences
        self.stats = ReplayStats()
        self.differences: list[Difference] = []
        self._actors: dict[str, _Actor] = {}
        self._requests: dict[tuple[str, int], RequestEvent] = {}
        self._who: dict[str, tuple[str, str, int]] = {}
        self._dispatches: dict[tuple[str, float], list[DecisionEvent]] = {}

    # -- inputs --
    def add_request(self, req: RequestEvent) -> None:
        """A request as the router read it (ingress) or as a batcher read it (rack stream, with its version)."""
        self._who[req.request_id] = (req.user_id, req.model, req.in_tokens)
        if req.rack:
            self._requests[(req.request_id, req.version)] = dataclasses.replace(req, prompt="")

    def decision(self, d: DecisionEvent) -> None:
        if d.kind == "route":
            self._route(d)
        elif d.kind == "dispatch" and d.actor:
            self._dispatches.setdefault((d.actor, d.ts_ms), []).append(d)
        elif d.kind == "window" and d.actor:
            self._window(d)

    def finish(self) -> ReplayStats:
        """Dispatch decisions whose window record never came (the batcher died between the two) count as
        unmatched."""
        for (_actor, ts), ds in self._dispatches.items():
            if ts >= self.count_from_ms:
                self.stats.dispatch_decisions += len(ds)
        self._dispatches.clear()
        for a in self._actors.values():
            self.stats.unscripted_draws += sum(r.unscripted for r in a.rngs.values())
        return self.stats

    # -- routing --
    def _route(self, d: DecisionEvent) -> None:
        counted = d.ts_ms >= self.count_from_ms
        racks = {k[5:] for k in d.scores if k.startswith("load:")}
        views = {
            r: RackView(r, bool(d.scores.get(f"healthy:{r}", 0.0)), float(d.scores[f"load:{r}"]),
                        float(d.scores.get(f"work:{r}", 0.0)), int(d.scores.get(f"nodes:{r}", 0.0)))
            for r in racks
        }
        dw = self.config.policies.router.decode_weight_tokens
        choices = d.choices or (d.choice,)
        for rid, recorded in zip(d.request_ids, choices, strict=False):
            who = self._who.get(rid)
            if who is None:
                if counted:
                    self.stats.missing_requests += 1
                    self.stats.route_decisions += 1
                continue
            user, model, in_tokens = who
            prefix = f"cached:{rid}:"
            cached = {k[len(prefix):]: v for k, v in d.scores.items() if k.startswith(prefix)} or None
            router = self._routers.get(d.actor)
            if router is None:
                router = self._routers[d.actor] = rack_router(self.config)
            try:
                rack = router.route(user, model, views, cached).rack
                got = rack or "(none)"
            except KeyError:
                rack, got = None, "(model not served)"
            if rack is not None and rack in views:
                v = views[rack]
                views[rack] = dataclasses.replace(v, load=v.load + 1.0, work=v.work + in_tokens + dw)
            if not counted:
                self.stats.warmup_decisions += 1
                continue
            self.stats.route_decisions += 1
            if got == recorded:
                self.stats.route_matched += 1
            else:
                self._differ(Difference("route", rid, d.ts_ms, recorded, got, model))

    # -- batching --
    def _actor(self, name: str, rack: str) -> _Actor:
        a = self._actors.get(name)
        if a is None:
            rngs: dict[str, ScriptedRandom] = {}

            def factory(policy: str, seed: str) -> random.Random:
                rngs[policy] = ScriptedRandom(seed)
                return rngs[policy]

            blocks = BlockIndex()
            window, _ = rack_batcher(self.config, rack, factory, blocks=blocks)
            a = self._actors[name] = _Actor(window, rngs, blocks)
        return a

    def _window(self, d: DecisionEvent) -> None:
        a = self._actor(d.actor, d.rack)
        counted = d.ts_ms >= self.count_from_ms
        idle = d.inputs.get(IDLE_KEY)
        if idle:
            replay_idle_closes(a.window, int(idle[0]), idle[1])
        nodes: list[NodeView] = []
        draws: dict[str, tuple[float, ...]] = {}
        blocks: list[str] = []
        for k, v in d.inputs.items():
            if k.startswith(NODE_PREFIX):
                nodes.append(view_from_inputs(k[len(NODE_PREFIX):], v))
            elif k.startswith(DRAWS_PREFIX):
                draws[k[len(DRAWS_PREFIX):]] = v
            elif k.startswith(BLOCKS_PREFIX):
                blocks.append(k)
        for k in sorted(blocks):  # in the order the batcher's index applied them
            apply_block_inputs(a.blocks, k[len(BLOCKS_PREFIX) + 9:], d.inputs[k])
        for rid in d.request_ids:
            enq, version = d.inputs.get(ENQ_PREFIX + rid, (d.ts_ms, 0.0))
            req = self._requests.pop((rid, int(version)), None)
            if req is None:
                if counted:
                    self.stats.missing_requests += 1
                continue
            a.window.offer(PendingRequest(req, f"replay:{rid}", enq))
        # the policies are built lazily on first use: make sure every policy with recorded draws has its source
        for name in draws:
            a.window.policies.get(name)
        for name, rng in a.rngs.items():
            rng.load(draws.get(name, ()) if not self.what_if else ())
        outcome = a.window.close(d.ts_ms, nodes)
        recorded = self._dispatches.pop((d.actor, d.ts_ms), [])
        if not counted:
            self.stats.warmup_decisions += len(recorded)
            return
        self.stats.windows += 1
        self._compare(d, outcome, recorded)

    def _compare(self, d: DecisionEvent, outcome: WindowOutcome, recorded: list[DecisionEvent]) -> None:
        replayed = Counter((c.policy, c.node, tuple(c.request_ids)) for c in outcome.choices)
        for r in recorded:
            self.stats.dispatch_decisions += 1
            key = (r.policy, r.choice, tuple(r.request_ids))
            if replayed[key] > 0:
                replayed[key] -= 1
                self.stats.dispatch_matched += 1
        node_of = {p.request.request_id: plan.node for plan in outcome.plans for p in plan.requests}
        for plan in outcome.plans:
            self.stats.replayed_nodes[plan.node] += len(plan.requests)
        for r in recorded:
            for rid in r.request_ids:
                self.stats.requests_dispatched_recorded += 1
                self.stats.recorded_nodes[r.choice] += 1
                got = node_of.pop(rid, "(waiting)")
                if got == r.choice:
                    self.stats.requests_same_node += 1
                else:
                    self._differ(Difference("dispatch", rid, d.ts_ms, r.choice, got, d.rack))
        for rid, node in node_of.items():  # placed by the replay, left waiting in the recording
            self._differ(Difference("dispatch", rid, d.ts_ms, "(waiting)", node, d.rack))

    def _differ(self, diff: Difference) -> None:
        if len(self.differences) < self.max_differences:
            self.differences.append(diff)


def summary(stats: ReplayStats, differences: Sequence[Difference], what_if: bool, policy: str) -> dict[str, object]:
    """The figures `rackflow replay run --json` prints."""
    by_kind = Counter(d.kind for d in differences)
    return {
        "policy": policy,
        "what_if": what_if,
        "decisions": stats.decisions,
        "matched": stats.matched,
        "match_rate": round(stats.match_rate, 6),
        "route_decisions": stats.route_decisions,
        "route_matched": stats.route_matched,
        "dispatch_decisions": stats.dispatch_decisions,
        "dispatch_matched": stats.dispatch_matched,
        "windows": stats.windows,
        "requests_dispatched": stats.requests_dispatched_recorded,
        "requests_same_node": stats.requests_same_node,
        "differences": len(differences),
        "route_differences": by_kind.get("route", 0),
        "dispatch_differences": by_kind.get("dispatch", 0),
        "missing_requests": stats.missing_requests,
        "warmup_decisions": stats.warmup_decisions,
        "recorded_requests_per_node": dict(sorted(stats.recorded_nodes.items())),
        "replayed_requests_per_node": dict(sorted(stats.replayed_nodes.items())),
    }
