"""The discrete-event simulator: a cluster of racks x nodes driven by the live pipeline's own policy objects.

One concern in one file (over 500 lines on purpose): the event loop and its handlers; nodes are `node.py`, reports
`report.py`, traces `traces.py`.

Events are ordered by (time, type precedence, sequence number); precedence, lowest first at equal times:
  0 FAULT        a node dies, slows down, gets an Xid burst, or recovers (faults act before anything else)
  1 NODE_END     an engine iteration / decode stretch ends (frees memory before new work is placed)
  2 BATCH        a batch (or a migrated sequence) reaches its node
  3 ARRIVAL      a request reaches the router (not on the heap: the trace is read in order)
  4 WINDOW       a rack's batching window times out
Per request: the router (RackAffinityRouter) picks the rack, the rack's WindowBatcher with its NodePolicySet packs
windows into node budgets, the node's engine model (SimNode) runs continuous batching on the cost model, the
HealthScorer judges fault samples, and plan_migrations moves live sequences off a failed node. These are the very
classes the live router, batcher and monitor use.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from pipeline.admission import RATE_WINDOW_S, Admission
from pipeline.batching.fixed import FixedBatcher
from pipeline.batching.window import CloseReason, PendingRequest, WindowBatcher, batch_reserve
from pipeline.config import NodeSpec, RackflowConfig
from pipeline.costmodel.online import SpeedBelief
from pipeline.events import RequestEvent
from pipeline.failover import LiveSequence, plan_migrations
from pipeline.health import HealthSample, HealthScorer
from pipeline.profiling import estimate_mem_kb, expected_out_tokens
from pipeline.replay import policy_context
from pipeline.routing.prefix_index import BlockIndex
from pipeline.routing.rack_affinity import RackIndex, RackSummary, keeps_prefix_cache, rack_cached_tokens
from pipeline.routing.registry import NodePolicySet, build_router
from pipeline.routing.views import NodeView, RackView
from pipeline.sim.control_plane import ControlPlaneCosts, Station
from pipeline.sim.node import SimNode, SimSeq, StepCost
from pipeline.sim.traces import TraceRequest
from pipeline.sim.world import WorldSpec

FAULT, NODE_END, BATCH, ARRIVAL, WINDOW = 0, 1, 2, 3, 4
SHED_REASON = "shed (429)"
"""The drop reason of a request the gateway's admission shed."""


@dataclass(frozen=True, slots=True)
class Fault:
    at_ms: float
    node: str
    kind: str
    """`death` (the node is gone for good), `xid` (an Xid burst: health drops, the node is drained, its sequences
    migrate, it recovers after `duration_ms`), `slow` (iterations take `factor` x longer for `duration_ms`)."""
    duration_ms: float = 0.0
    factor: float = 1.0

    def __reduce__(self) -> tuple[type[Fault], tuple[float, str, str, float, float]]:
        # by its fields: the compiled simulator's frozen slots class has no __setstate__ that pickle can use (the
        # matrix sends its faults to worker processes)
        return (Fault, (self.at_ms, self.node, self.kind, self.duration_ms, self.factor))


@dataclass(frozen=True, slots=True)
class SimParams:
    block_size: int = 16
    max_num_seqs: int | None = None
    """Sequences an engine runs at once; None: the config's worker.max_running (what the live engines run)."""
    max_batched_tokens: int | None = None
    """Tokens per iteration; None: the config's worker.max_batched_tokens."""
    dispatch_latency_ms: float = 1.0
    """Batcher -> node (stream hop)."""
    migration_latency_ms: float = 5.0
    """Control-plane latency of a migration (monitor -> Celery task -> target), before the re-prefill."""
    check_invariants: bool = False
    """Assert after every engine event that no node holds more KV than it has (tests)."""
    batching: str = "window"
    """`window` (memory-budget sliding window) or `fixed` (fixed batch of `fixed_batch` requests)."""
    fixed_batch: int = 32
    prefix_cache: bool = True
    prefix_shares_kv: bool = False
    """The engines' cached prefix blocks share the KV pool with their running sequences, as vLLM's do
    (`SimNode.prefix_shares_kv`); off: a node caches its whole KV capacity in prefix blocks besides them."""
    host_prefix_cache: bool = True
    """Keep prefix blocks evicted from GPU memory in host memory (`policies.kv.host_prefix_gb_per_gpu`)."""
    util_bin_ms: float = 10_000.0
    """Width of the time bins of KV utilisation (the peak is the fullest bin)."""
    admission: bool = True
    """Shed requests as the gateway does (`pipeline.admission`: rack queue bound in requests and in seconds of
    work); off: every request is let in and queues."""
    world: WorldSpec = field(default_factory=WorldSpec)
    """What the control plane cannot see (`pipeline.sim.world`): the clients' max_tokens, each node's hidden speed;
    unused with `oracle`."""
    inflight_views: bool = True
    """Batches dispatched to a node and not received yet count in its view (memory, waiting requests, queued prompt
    tokens), as the live batcher's ReservationLedger keeps them until the node's status shows them admitted; False:
    the view shows only what the node has (the simulator before this, which let two closes inside one dispatch
    latency both see the same free node)."""
    oracle: bool = False
    """True: the control plane is handed what no live one has (each request's true output length as its expected
    output and in its memory estimate; each node's exact speed, the world cost model equal to its belief). False
    (default): it sees what it would see live (`pipeline.sim.world`)."""
    control_plane: ControlPlaneCosts | None = None
    """Routers, per-rack batchers, Valkey shards, etcd and node links as service stations with measured costs
    (`pipeline.sim.control_plane`); None (default): the control plane costs nothing but the two constant hops
    above, as before."""


@dataclass
class _Rack:
    name: str
    nodes: list[int]
    batcher: WindowBatcher | FixedBatcher
    policies: NodePolicySet
    timer_at: float | None = None
    outstanding: int = 0
    station: Station | None = None
    """The rack's batcher processes (control-plane costs on)."""
    ready_at: float = -math.inf
    """When the batcher has processed every request offered so far (control-plane costs on)."""


@dataclass
class SimResult:
    arrival: list[float]
    first_token: list[float]
    finish: list[float]
    node_of: list[int]
    in_tokens: list[int]
    out_tokens: list[int]
    dropped: list[bool]
    node_names: list[str]
    node_gpus: list[str]
    mem_util: list[float]
    """Per node: time-averaged (weights + KV) / memory over the run."""
    kv_util: list[float]
    """Per node: time-averaged KV used / KV capacity."""
    concurrency: list[float]
    """Per node: time-averaged running sequences."""
    busy_ms: list[float]
    preemptions: int
    prompt_tokens: int
    cached_tokens: int
    migrations: int
    batch_mem_util: list[float]
    batch_sizes: list[int]
    end_ms: float
    events: int
    drop_reasons: dict[str, int] = field(default_factory=dict)
    kv_bins: list[list[float]] = field(default_factory=list)
    """Per node: per `util_bin_ms` of simulated time, the integral (ms) of KV used / KV capacity in the bin."""
    util_bin_ms: float = 10_000.0
    preempted: int = 0
    """Requests preempted at least once."""
    shed: int = 0
    """Requests the gateway's admission shed (429)."""
    host_hit_tokens: int = 0
    """Of `cached_tokens`, those loaded back from host memory."""
    control_plane: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per station (control-plane costs on): utilisation, waits, backlog at the end."""
    oracle: bool = False
    belief_error_tenth: list[float] = field(default_factory=list)
    """Oracle-free runs: per node, the learned speed belief's error against the world (the larger of its two
    operator classes) at the end of the first tenth of the arrivals' span."""
    belief_error_end: list[float] = field(default_factory=list)
    """The same at the end of the run."""
    expected_out: list[int] = field(default_factory=list)
    """Per request, the output length the control plane expected (oracle: the true one)."""
    max_tokens: list[int | None] = field(default_factory=list)
    """Per request, the max_tokens its client sent (None: unset)."""
    tenant: list[str] = field(default_factory=list)
    """Per request, its tenant (the trace's; empty: the simulation's one tenant)."""
    priority: list[int] = field(default_factory=list)
    """Per request, its class (pipeline/priority.py: 0 interactive, 1 batch)."""
    drop_reason: list[str] = field(default_factory=list)
    """Per request, why it was dropped (a key of `drop_reasons`; the first reason where there were several); empty:
    not dropped."""
    priority_preemptions: int = 0
    """Of `preemptions`, those of a batch sequence for an interactive one (`batch_yield: preempt`)."""


class Simulator:
    def __init__(
        self,
        config: RackflowConfig,
        requests: Sequence[TraceRequest],
        cost_for: Callable[[NodeSpec], StepCost],
        *,
        params: SimParams = SimParams(),
        faults: Sequence[Fault] = (),
        default_model: str | None = None,
        progress: Callable[[float, int, int], None] | None = None,
    ) -> None:
        self.config = config
        self.params = params
        self.progress = progress
        pol = config.policies
        self.reqs = list(requests)
        served = [m for m in config.models if config.racks_serving(m)]
        if not served:
            raise ValueError("no rack serves any model")
        self.default_model = default_model or served[0]
        self._serving = {m: config.racks_serving(m) for m in config.models}
        self.router = build_router(config)
        self.nodes: list[SimNode] = []
        self.node_index: dict[str, int] = {}
        self.node_models: dict[str, frozenset[str]] = {}
        self.racks: dict[str, _Rack] = {}
        self.blocks = BlockIndex()
        """Which node holds which prefix blocks, from the engines' block events (what the live batchers and router
        read off the KV event stream)."""
        self.preempted: set[int] = set()
        bt = pol.profiling.prefix_block_tokens
        self.oracle = params.oracle
        world = params.world
        all_names = [spec.name for rack in config.cluster.racks for spec in rack.expanded()]
        slow = set() if self.oracle else world.slow_nodes(all_names, pol.seed)
        for rack in config.cluster.racks:
            idx = []
            specs = rack.expanded()
            costs: dict[str, StepCost] = {}
            for spec in specs:
                self.node_index[spec.name] = len(self.nodes)
                idx.append(len(self.nodes))
                costs[spec.name] = cost_for(spec)
                self.nodes.append(self._make_node(spec, rack.name, costs[spec.name]))
                if not self.oracle:
                    self.nodes[-1].world = world.node(spec.name, pol.seed, spec.name in slow)
                self.node_models[spec.name] = frozenset(spec.models)
            ctx = policy_context(config, rack.name, self.blocks, _lookup(costs))
            policies = NodePolicySet(pol.node_selection, pol.seed, rack.name, ctx.node_gpus, bt, context=ctx)
            caps = {n.name: config.node_kv_capacity_kb(n.name) for n in specs}
            models = {n.name: frozenset(n.models) for n in specs}
            batcher: WindowBatcher | FixedBatcher
            if params.batching == "fixed":
                batcher = FixedBatcher(pol.batcher, policies, caps, models, params.fixed_batch)
            else:
                batcher = WindowBatcher(pol.batcher, policies, caps, models)
            self.racks[rack.name] = _Rack(rack.name, idx, batcher, policies)
        self._inflight: list[list[float]] = [[0.0, 0.0, 0.0, 0.0, 0.0, 0.0] for _ in self.nodes]
        """Per node: the memory, requests and prompt tokens of batches dispatched to it that it has not received yet
        (what the live batcher's ReservationLedger adds to the node's view until its status shows them admitted)."""
        self._views: list[NodeView | None] = [None] * len(self.nodes)
        """Per node: its view as the batcher last read it, dropped wherever the node changes (an iteration scheduled or
        finished, a batch submitted, a drain, a recovery); a view depends only on the node's state, so a close
        rebuilds only the views of the nodes that changed since the last one. With `check_invariants` every cached
        view is compared with a fresh one."""
        self.rack_views = {r: RackView(r, True, 0.0) for r in self.racks}
        self._rack_index: dict[str, RackIndex] = {
            m: self.router.index(m, self.rack_views) for m in self.router.models()}
        """Per model, the router's view of its racks kept as they change (`_set_rack_view`): a route reads a few
        racks, not all 160 of a 10 k GPU cluster, and decides the same (`RackIndex`)."""
        self._indexes_of: dict[str, list[RackIndex]] = {
            r: [ix for ix in self._rack_index.values() if r in ix.order] for r in self.racks}
        self.node_rack = {spec.name: r.name for r in config.cluster.racks for spec in r.expanded()}
        self._views_at = -math.inf
        self._refresh_ms = float(pol.node_selection.refresh_ms)
        # read on every arrival: kept here, not looked up through the config's models each time
        self._decode_weight = pol.router.decode_weight_tokens
        self._pc_rule = pol.router.prefix_cache_rule
        self._block_tokens = pol.profiling.prefix_block_tokens
        self._window_ms = pol.batcher.window_ms
        self.admission = Admission(config.gateway) if params.admission else None
        self._horizon = pol.batcher.max_queued_prefill_tokens or math.inf
        # the gateway's own prediction of the rack (the router's policy without the prefix index, over request
        # counts), and the completions of the last few seconds it measures its rate on
        self.gateway_router = build_router(config, prefix_aware=False)
        self._done_at: deque[float] = deque()
        self._first_done = 0.0
        self._queued_since: dict[str, float] = {}
        """Per rack, since when it has had a queue (as the gateway sees it at its reads)."""
        self._gw_at = -math.inf
        self._gw_refresh_ms = float(config.gateway.saturation_refresh_ms)
        self._gw_queued: dict[str, int] = {}
        self._gw_batch: dict[str, int] = {}
        """Per rack, of its queue as the gateway read it, the batch-class requests (in its batcher, waiting in its
        engines)."""
        self._gw_tenants: dict[str, dict[str, int]] = {}
        """Per rack, its window's interactive requests per tenant (read only when the trace has several tenants and
        `batcher.fair_share` is on: the admission's fair share)."""
        self._multi_tenant = config.policies.batcher.fair_share and len({r.tenant for r in self.reqs}) > 1
        self._gw_views: dict[str, RackView] = {}
        self._gw_summary: dict[str, RackSummary] = {}
        """Per model, the gateway router's summary of `_gw_views` (they change only at the gateway's reads)."""
        self.shed = 0
        self.scorer = HealthScorer(pol.health)
        for name in self.node_index:  # the agents' first (clean) samples: later counters are compared to them
            self.scorer.observe(HealthSample(name, 0.0))
        self.faults = sorted(faults, key=lambda f: (f.at_ms, f.node, f.kind))
        self.heap: list[tuple[float, int, int, int, object]] = []
        self.seq = 0
        n = len(self.reqs)
        self.first_token = [-1.0] * n
        self.finish = [-1.0] * n
        self.node_of = [-1] * n
        self.dropped = [False] * n
        self.drop_reasons: dict[str, int] = {}
        self.drop_reason = [""] * n
        self.n_dropped = 0
        self.mem_est = [0.0] * n
        self.beliefs = [SpeedBelief() for _ in self.nodes]
        """Per node, the control plane's learned speed (oracle-free runs; the node views carry it)."""
        crng = random.Random(pol.seed * 7919 + 17)
        self.max_tokens: list[int | None] = [
            r.max_tokens if r.max_tokens is not None or self.oracle else world.client.draw(r.out_tokens, crng)
            for r in self.reqs]
        """What each request's client sends as max_tokens (the trace's, else the client model's draw)."""
        self.expected_out = [0] * n
        self.user_out: dict[str, float] = {}
        """The gateway's EWMA of each user's output lengths, updated at each completion (what it reads live)."""
        self._ewma_alpha = pol.profiling.ewma_alpha
        span = (self.reqs[-1].arrival_ms - self.reqs[0].arrival_ms) if n > 1 else 0.0
        self._tenth_at = (self.reqs[0].arrival_ms + span / 10.0) if n and not self.oracle else math.inf
        self.belief_error_tenth: list[float] = []
        self.migrations = 0
        self.requeued: dict[int, tuple[int, int]] = {}
        """rid -> (tokens to prefill, tokens left) of a migrated sequence sent back through a batcher."""
        self.batch_mem_util: list[float] = []
        self.batch_sizes: list[int] = []
        self.events = 0
        self.completed = 0
        self._cp = params.control_plane
        self._routing: deque[tuple[float, int]] = deque()
        """Requests whose routing decision is out at the given time (in order: FIFO stations, constant service)."""
        if self._cp is not None:
            cp = self._cp
            self._st_router = Station(cp.routers)
            self._st_global = Station(1)
            self._st_spread = Station(cp.valkey_shards)
            self._st_etcd = Station(cp.etcd_concurrency)
            self._links: dict[int, Station] = {}
            """Per node, its outbound link (a migration's KV leaves over it)."""
            self._links_in: dict[int, Station] = {}
            """Per node, its inbound link, shared with its host-tier loads (SimNode.host_link)."""
            self._uplinks: dict[tuple[str, bool], Station] = {}
            """Per (rack, outbound): the rack's uplink to the spine, one station per direction."""
            self._rack_gbps: dict[str, float] = {}
            for r in self.racks.values():
                r.station = Station(cp.batchers_per_rack)
                if cp.spine_oversubscription > 0:
                    self._rack_gbps[r.name] = len(r.nodes) * cp.node_link_gbps / cp.spine_oversubscription
            if cp.fabric:
                for i, node in enumerate(self.nodes):
                    node.host_link = self._links_in[i] = Station(1)
            n_nodes = len(self.nodes)
            self._rec_issue = [-math.inf] * n_nodes
            """Per node, when its recorder's next transaction goes to etcd (the changes before it ride on it)."""
            self._rec_fin = [-math.inf] * n_nodes
            """Per node, when that transaction is committed."""
            self._rec_txns = 0
            self._rec_changes = 0
            self._rec_lag_sum = 0.0
            self._rec_lag_max = 0.0
            self._xfers = 0
            self._xfers_cross = 0
            self._xfer_bytes = 0.0

    def _make_node(self, spec: NodeSpec, rack: str, cost: StepCost) -> SimNode:
        gpu = self.config.gpus[spec.gpu]
        model = self.config.models[spec.models[0]]
        total_gb = gpu.memory_gb * spec.tp
        weights_gb = model.weight_bytes / 1e9
        kv_kb = self.config.node_kv_capacity_kb(spec.name)
        if kv_kb <= 0:
            raise ValueError(f"node {spec.name}: {spec.models[0]} does not fit {spec.gpu} x{spec.tp}")
        kv_tokens = int(kv_kb * 1000 // model.kv_bytes_per_token)
        bt = self.config.policies.profiling.prefix_block_tokens
        host_gb = self.config.policies.kv.host_prefix_gb_per_gpu * spec.tp if self.params.host_prefix_cache else 0.0
        name = spec.name
        blocks = self.blocks

        def events(stored: tuple[int, ...], removed: tuple[int, ...]) -> None:
            if removed:
                blocks.removed(name, removed)
            if stored:
                blocks.stored(name, stored)

        wp = self.config.policies.worker
        return SimNode(
            spec.name, rack, cost, kv_capacity_tokens=kv_tokens, block_size=self.params.block_size,
            max_num_seqs=self.params.max_num_seqs or wp.max_running,
            max_batched_tokens=self.params.max_batched_tokens or wp.max_batched_tokens,
            mem_cap_kb=kv_kb, vram_total_gb=total_gb, weights_gb=weights_gb,
            kv_bytes_per_token=model.kv_bytes_per_token, prefix_block_tokens=bt,
            prefix_cache=self.params.prefix_cache,
            host_cache_blocks=int(host_gb * 1e9 // model.kv_bytes_per_token) // bt,
            host_link_gbps=gpu.pcie_gbps / 2 * spec.tp, block_listener=events,
            util_bin_ms=self.params.util_bin_ms, preempted=self.preempted,
            prefix_shares_kv=self.params.prefix_shares_kv,
            preempt_batch=self.config.policies.batcher.batch_yield == "preempt",
            batch_reserve=batch_reserve(self.config.policies.batcher, self.params.max_num_seqs or wp.max_running),
        )

    # -- event plumbing --------------------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, kind, payload))

    def _schedule_node(self, i: int, now: float) -> None:
        node = self.nodes[i]
        end = node.schedule(now)
        self._views[i] = None
        if self.params.check_invariants:
            self._check(node)
        if end is not None:
            self._push(end, NODE_END, (i, node.epoch))

    # -- views -----------------------------------------------------------------------------------------------------
    def _node_view(self, i: int) -> NodeView:
        v = self._views[i]
        if v is not None:
            if self.params.check_invariants:
                self._views[i] = None
                fresh = self._node_view(i)
                if fresh != v:
                    raise AssertionError(f"{v.name}: stale cached view {v} != {fresh}")
            return v
        n = self.nodes[i]
        fl = self._inflight[i]
        f_mem, f_n, f_tok = max(0.0, fl[0]), max(0, int(fl[1])), max(0, int(fl[2]))
        f_b, f_bkb = max(0, int(fl[3])), max(0.0, fl[4])
        f_bp = (n.batch_prefill() + max(0, int(fl[5]))) if n.batch_seqs or f_b else 0
        v = self._views[i] = NodeView(
            n.name, n.accepting, n.vram_total_gb, n.free_vram_gb(), 0.0, n.avg_step_ms, n.mem_cap_kb,
            max(0.0, n.mem_cap_kb - n.mem_est_used - f_mem), n.running, len(n.waiting) + f_n,
            prefill_tokens=n.prefill_backlog + f_tok, decode_seqs=len(n.decoding), decode_tokens=n.kv_decoding,
            kv_usage=n.kv_usage, slowdown=n.slowdown, max_seqs=n.max_num_seqs,
            batch_seqs=n.batch_seqs + f_b, batch_kv_kb=n.batch_mem_kb + f_bkb, batch_prefill_tokens=f_bp,
        ) if self.oracle else NodeView(
            n.name, n.accepting, n.vram_total_gb, n.free_vram_gb(), 0.0, n.avg_step_ms, n.mem_cap_kb,
            max(0.0, n.mem_cap_kb - n.mem_est_used - f_mem), n.running, len(n.waiting) + f_n,
            prefill_tokens=n.prefill_backlog + f_tok, decode_seqs=len(n.decoding), decode_tokens=n.kv_decoding,
            kv_usage=n.kv_usage, slowdown=self.beliefs[i].decode, max_seqs=n.max_num_seqs,
            prefill_slowdown=self.beliefs[i].prefill, batch_seqs=n.batch_seqs + f_b,
            batch_kv_kb=n.batch_mem_kb + f_bkb, batch_prefill_tokens=f_bp,
        )
        return v

    def _set_rack_view(self, v: RackView) -> None:
        """A rack's view as the router reads it is now `v` (every change goes through here: the indexes follow)."""
        self.rack_views[v.name] = v
        for ix in self._indexes_of[v.name]:
            ix.update(v)

    def _rack_load(self, rack: _Rack, delta: int) -> None:
        rack.outstanding += delta
        healthy = any(self.nodes[i].accepting for i in rack.nodes)
        v = self.rack_views[rack.name]
        self._set_rack_view(RackView(rack.name, healthy, float(rack.outstanding), v.work, v.nodes))

    def _refresh_rack_work(self, now: float) -> None:
        """The racks' work as the live router sees it: re-read every `refresh_ms` (in between, the router adds what
        it routes itself)."""
        if now - self._views_at < self._refresh_ms:
            return
        self._views_at = now
        dw = self.config.policies.router.decode_weight_tokens
        for rack in self.racks.values():
            work = 0.0
            active = 0
            for i in rack.nodes:
                n = self.nodes[i]
                if n.accepting:
                    active += 1
                    work += n.prefill_backlog + dw * n.outstanding
            for p in rack.batcher.pending:
                work += p.request.in_tokens + dw
            v = self.rack_views[rack.name]
            self._set_rack_view(RackView(rack.name, v.healthy, v.load, work, active))

    # -- requests --------------------------------------------------------------------------------------------------
    def _arrive(self, rid: int, now: float) -> None:
        tr = self.reqs[rid]
        model_name = tr.model or self.default_model
        model = self.config.models.get(model_name)
        if model is None or not self._serving.get(model_name):
            self._drop(rid, "model not served")
            return
        prof = self.config.policies.profiling
        if self.oracle:
            expected = tr.out_tokens
        else:  # what the gateway expects live: max_tokens, the user's history under it, the model default
            expected = expected_out_tokens(model, self.max_tokens[rid], self.user_out.get(tr.user_id or f"anon-{rid}"))
        self.expected_out[rid] = expected
        mem = estimate_mem_kb(model, tr.in_tokens, expected, prof.estimator, prof.shape_margin)
        self.mem_est[rid] = mem
        self._refresh_rack_work(now)
        if self.admission is not None and not self._admit(tr.user_id or f"anon-{rid}", model_name, now, tr.priority,
                                                          tr.tenant):
            self.shed += 1
            self._drop(rid, SHED_REASON)
            return
        cp = self._cp
        if cp is None:
            self._route(rid, now)
            return
        # ingress XADD + the router's read + its decision XADD on the global streams' shard, then a router process
        t = self._st_global.serve(now, cp.ingress_global_ms)
        self._routing.append((self._st_router.serve(t, cp.router_ms), rid))

    def _route(self, rid: int, now: float) -> None:
        tr = self.reqs[rid]
        model_name = tr.model or self.default_model
        mem = self.mem_est[rid]
        cp = self._cp
        if cp is not None:
            self._refresh_rack_work(now)
        cached = None
        if self.router.prefix_aware and tr.prefix_hashes and self.params.prefix_cache:
            cached = rack_cached_tokens(self.blocks.matches(tr.prefix_hashes), self.node_rack,
                                        self._block_tokens, tr.in_tokens)
        d = self.router.route(tr.user_id or f"anon-{rid}", model_name, self.rack_views, cached,
                              index=self._rack_index.get(model_name))
        if d.rack is None:
            self._drop(rid, "no healthy rack")
            return
        v = self.rack_views[d.rack]
        self._set_rack_view(RackView(
            v.name, v.healthy, v.load, v.work + tr.in_tokens + self._decode_weight,
            v.nodes))
        rule = self._pc_rule
        keep = keeps_prefix_cache(rule.enabled, rule.min_tokens, tr.in_tokens, d, True)
        expected = self.expected_out[rid]
        mt = self.max_tokens[rid]
        req = RequestEvent(
            str(rid), 1, tr.tenant or "sim", tr.user_id, model_name, tr.in_tokens, expected,
            mt if mt is not None else expected, mem, tr.arrival_ms,
            priority=tr.priority, prefix_cache=keep, rack=d.rack, prefix_hashes=tr.prefix_hashes,
        )
        rack = self.racks[d.rack]
        self._rack_load(rack, +1)
        if cp is not None:
            self._st_spread.charge(now, cp.xadd_ms)  # the rack request's XADD
            assert rack.station is not None
            done = rack.station.serve(now, cp.batcher_ms)
            if done > rack.ready_at:
                rack.ready_at = done
        rack.batcher.offer(PendingRequest(req, str(rid), now))
        self._try_close(rack, now)

    def _gateway_views(self, now: float) -> tuple[dict[str, int], dict[str, RackView]]:
        """The racks' queues as the gateway reads them: at most every `gateway.saturation_refresh_ms`, the same
        figures in between (batcher backlog + requests waiting in the engines; load = that + running)."""
        if now - self._gw_at < self._gw_refresh_ms:
            return self._gw_queued, self._gw_views
        self._gw_at = now
        queued: dict[str, int] = {}
        views: dict[str, RackView] = {}
        batch = self._gw_batch
        for name, rack in self.racks.items():
            waiting = running = 0
            in_engines = 0
            for i in rack.nodes:
                n = self.nodes[i]
                waiting += len(n.waiting)
                running += len(n.prefilling) + len(n.decoding)
                if n.batch_seqs:
                    in_engines += min(len(n.waiting), n.batch_seqs)
            queued[name] = rack.batcher.pending_count + waiting
            batch[name] = rack.batcher.batch_waiting + in_engines
            if self._multi_tenant:
                self._gw_tenants[name] = rack.batcher.tenant_waiting()
            views[name] = RackView(name, self.rack_views[name].healthy, float(queued[name] + running))
        since = self._queued_since
        for name, q in queued.items():
            if q <= 0:
                since.pop(name, None)
            else:
                since.setdefault(name, now)
        self._gw_queued, self._gw_views = queued, views
        self._gw_summary = {}
        return queued, views

    def _admit(self, user: str, model: str, now: float, priority: int = 0, tenant: str = "") -> bool:
        """The gateway's admission (pipeline.admission): the rack it predicts for the request, that rack's queue
        (batcher backlog + requests waiting in its engines) and the cluster's completion rate of the last 3 s, one
        share of it per rack."""
        assert self.admission is not None
        queued, views = self._gateway_views(now)
        summary = self._gw_summary.get(model)
        if summary is None:
            summary = self._gw_summary[model] = self.gateway_router.summarize(model, views)
        target = self.gateway_router.route(user, model, views, summary=summary).rack
        if target is None:
            return True  # the router answers it (no healthy rack)
        done = self._done_at
        while done and done[0] < now - RATE_WINDOW_S * 1000.0:
            done.popleft()
        rate = None
        span = min(RATE_WINDOW_S * 1000.0, now - self._first_done) if done else 0.0
        if len(done) >= 2 and span > 0:
            rate = len(done) * 1000.0 / span / max(1, len(self.racks))
        since = self._queued_since
        queued_for = (now - since[target]) / 1000.0 if target in since else 0.0
        per = self._gw_tenants.get(target) if self._multi_tenant else None
        return self.admission.decide(queued[target], rate, queued_for, self._gw_batch.get(target, 0), priority,
                                     per.get(tenant, 0) if per is not None else None,
                                     len(per) + (tenant not in per) if per is not None else 1).admit

    def _drop(self, rid: int, reason: str) -> None:
        if not self.dropped[rid]:
            self.n_dropped += 1
            self.drop_reason[rid] = reason
        self.dropped[rid] = True
        self.drop_reasons[reason] = self.drop_reasons.get(reason, 0) + 1

    def _try_close(self, rack: _Rack, now: float) -> None:
        b = rack.batcher
        if not b.pending_count:
            return
        views = [self._node_view(i) for i in rack.nodes]
        reason = b.close_reason(now, views)
        if reason == CloseReason.NOT_YET:
            if b.window_open_ms is None:
                return  # batch work alone, and no node has a slot for it: a node's end (a slot freed) tries again
            due = b.window_open_ms + self._window_ms
            if rack.timer_at is None or rack.timer_at > due:
                rack.timer_at = due
                self._push(due, WINDOW, rack.name)
            return
        if reason == CloseReason.EMPTY:
            return
        out = b.close(now, views)
        for rej in out.rejections:
            rid = int(rej.pending.entry_id)
            self._drop(rid, "larger than any node budget")
            self._rack_load(rack, -1)
        for plan in out.plans:
            self.batch_mem_util.append(plan.utilisation)
            self.batch_sizes.append(len(plan.requests))
            i = self.node_index[plan.node]
            seqs = []
            for p in plan.requests:
                rid = int(p.entry_id)
                tr = self.reqs[rid]
                prefix = tr.prefix_hashes if p.request.prefix_cache else ()
                prompt, remaining = self.requeued.pop(rid, (tr.in_tokens, tr.out_tokens))
                seqs.append(SimSeq(rid, prompt, remaining, self.mem_est[rid], prefix, priority=tr.priority))
            # in flight until the worker has it: the live batcher's ReservationLedger keeps it in the node's view
            # (memory reserved, requests waiting, prompts queued) until the node's status shows it admitted
            cp = self._cp
            if cp is None:
                self._send(now + self.params.dispatch_latency_ms, i, seqs)
                continue
            # the batcher has read its requests (one read each), XADDs the batch, the worker reads it
            t = self._st_spread.serve(now, len(seqs) * cp.read_ms + cp.xadd_ms + cp.read_ms)
            if rack.ready_at > t:
                t = rack.ready_at
            self._send(t + self.params.dispatch_latency_ms, i, seqs)
        if b.pending_count and b.window_open_ms is not None:
            due = b.window_open_ms + self._window_ms
            if rack.timer_at is None or rack.timer_at > due or rack.timer_at <= now:
                rack.timer_at = due
                self._push(due, WINDOW, rack.name)

    def _send(self, at: float, i: int, seqs: list[SimSeq]) -> None:
        """Sequences on their way to node `i`, arriving at `at`: in flight until then (`inflight_views`), as the
        live batcher's ReservationLedger keeps a dispatched batch in the node's view until its status shows it."""
        if self.params.inflight_views:
            fl = self._inflight[i]
            fl[0] += sum(q.mem_est_kb for q in seqs)
            fl[1] += len(seqs)
            fl[2] += sum(q.prompt for q in seqs)
            for q in seqs:
                if q.priority:
                    fl[3] += 1
                    fl[4] += q.mem_est_kb
                    fl[5] += q.prompt
            self._views[i] = None
        self._push(at, BATCH, (i, seqs))

    def _batch_arrives(self, i: int, seqs: list[SimSeq], now: float) -> None:
        node = self.nodes[i]
        if self.params.inflight_views:
            fl = self._inflight[i]
            fl[0] -= sum(q.mem_est_kb for q in seqs)
            fl[1] -= len(seqs)
            fl[2] -= sum(q.prompt for q in seqs)
            for q in seqs:
                if q.priority:
                    fl[3] -= 1
                    fl[4] -= q.mem_est_kb
                    fl[5] -= q.prompt
            self._views[i] = None
        if not node.alive:  # it died while the batch was in flight: fail over like its other sequences
            self._migrate(i, seqs, now)
            return
        for s in seqs:
            self.node_of[s.rid] = i
            node.submit(s)
        self._views[i] = None
        cp = self._cp
        if cp is not None and cp.record_flush_ms > 0:
            self._record(i, now, len(seqs))
        if node.phase is None:
            self._schedule_node(i, now)
        elif node.advance_to(now):
            end = node.phase_end()
            assert end is not None
            self._push(end, NODE_END, (i, node.epoch))

    def _node_end(self, i: int, epoch: int, now: float) -> None:
        node = self.nodes[i]
        if epoch != node.epoch or node.phase is None:
            return  # stale: the stretch was shortened or the node died
        cp = self._cp
        if cp is not None and node.decoding and cp.token_flush_ms > 0:
            # the tokens of this iteration / stretch go out as one XADD per decoding sequence per flush interval
            # (per step where a step is longer): charged as they are made, not at the end of the request
            ph = node.phase
            t0, steps = (cast(float, ph[3]), 1) if ph[0] == "prefill" else (cast(float, ph[1]), cast(int, ph[4]))
            per_seq = min(float(steps), (now - t0) / cp.token_flush_ms)
            self._st_spread.charge(now, len(node.decoding) * per_seq * cp.xadd_ms)
        res = node.finish_phase(now)
        self._views[i] = None
        rep = node.last_report
        if rep is not None:  # what the worker reports of the phase: the control plane's belief learns from it
            node.last_report = None
            self.beliefs[i].observe(*rep)
        if now >= self._tenth_at:
            self._tenth_at = math.inf
            self.belief_error_tenth = self._belief_errors()
        if self.params.check_invariants:
            self._check(node)
        for rid, t in res.first_tokens:
            if self.first_token[rid] < 0:
                self.first_token[rid] = t
        rack = self.racks[node.rack]
        for f in res.finished:
            self.finish[f.rid] = f.finish_ms
            if not self.oracle:  # the result's output length feeds the gateway's EWMA of the user's lengths
                tr = self.reqs[f.rid]
                user = tr.user_id or f"anon-{f.rid}"
                old = self.user_out.get(user)
                a = self._ewma_alpha
                self.user_out[user] = float(tr.out_tokens) if old is None else a * tr.out_tokens + (1 - a) * old
            if cp is not None:  # the result's XADD + read; the first token's XADD
                self._st_global.charge(now, cp.result_global_ms)
                self._st_spread.charge(now, cp.xadd_ms)
            self.completed += 1
            if not self._done_at and self.completed == 1:
                self._first_done = f.finish_ms
            self._done_at.append(f.finish_ms)
            self._rack_load(rack, -1)
        if cp is not None and res.finished and cp.record_flush_ms > 0:  # the releases
            self._record(i, now, len(res.finished))
        self._schedule_node(i, now)
        if rack.batcher.pending_count and (res.freed or node.prefill_backlog < self._horizon):
            self._try_close(rack, now)

    def _belief_errors(self) -> list[float]:
        """Per live node: the learned belief's error against the world it runs (the larger class error)."""
        out = []
        for node, belief in zip(self.nodes, self.beliefs, strict=True):
            w = node.world
            if w is None or not node.alive:
                continue
            out.append(belief.error(w.prefill * node.slow_factor, w.decode * node.slow_factor))
        return out

    def _check(self, node: SimNode) -> None:
        if node.kv_tokens > node.capacity_tokens:
            raise AssertionError(f"{node.name}: {node.kv_tokens} KV tokens > capacity {node.capacity_tokens}")
        if node.kv_tokens < 0 or node.kv_decoding < 0 or node.mem_est_used < -1e-6:
            raise AssertionError(f"{node.name}: negative accounting kv={node.kv_tokens} dec={node.kv_decoding} "
                                 f"mem_est={node.mem_est_used}")
        if node.running > node.max_num_seqs:
            raise AssertionError(f"{node.name}: {node.running} running > max_num_seqs {node.max_num_seqs}")

    # -- faults ----------------------------------------------------------------------------------------------------
    def _migrate(self, src: int, seqs: list[SimSeq], now: float) -> None:
        node = self.nodes[src]
        rack = self.racks[node.rack]
        same = [self._node_view(i) for i in rack.nodes if i != src]
        others = [self._node_view(i) for r in self.racks.values() if r is not rack for i in r.nodes]
        live = [LiveSequence(str(s.rid), 1, self.reqs[s.rid].model or self.default_model, s.mem_est_kb)
                for s in seqs]
        by_id = {str(s.rid): s for s in seqs}
        for m in plan_migrations(node.name, live, same, others, self.node_models):
            s = by_id[m.seq_id]
            self.migrations += 1
            if m.dst is None:  # nowhere to go now: back through the rack's batcher
                tr = self.reqs[s.rid]
                self.requeued[s.rid] = (s.prompt, s.remaining)
                req = RequestEvent(m.seq_id, 2, tr.tenant or "sim", tr.user_id, tr.model or self.default_model,
                                   s.prompt, s.remaining, s.remaining, s.mem_est_kb, tr.arrival_ms,
                                   priority=tr.priority, rack=node.rack)
                rack.batcher.offer(PendingRequest(req, m.seq_id, now))
                self._try_close(rack, now)
                continue
            dst = self.node_index[m.dst]
            if self.nodes[dst].rack != node.rack:
                self._rack_load(rack, -1)
                self._rack_load(self.racks[self.nodes[dst].rack], +1)
            cp = self._cp
            if cp is None:
                self._send(now + self.params.migration_latency_ms, dst, [s])
                continue
            # the ownership compare-and-swap on etcd, then the sequence's KV over the fabric
            t = self._st_etcd.serve(now, cp.etcd_txn_ms)
            kv = s.prompt * self.config.models[self.reqs[s.rid].model or self.default_model].kv_bytes_per_token
            self._send(self._transfer(src, dst, t, kv), dst, [s])

    def _transfer(self, src: int, dst: int, t: float, nbytes: float) -> float:
        """When `nbytes` of KV sent at `t` from node `src` have reached node `dst`: cut-through over each link of the
        path (the source's outbound link; between racks, the source rack's uplink out and the target rack's uplink
        in; the target's inbound link, shared with its host-tier loads), each a FIFO station at its bandwidth; the
        transfer is done when its slowest hop is."""
        cp = self._cp
        assert cp is not None
        link = self._links.get(src)
        if link is None:
            link = self._links[src] = Station(1)
        done = link.serve(t, nbytes / (cp.node_link_gbps * 1e6))
        self._xfers += 1
        self._xfer_bytes += nbytes
        if not cp.fabric:
            return done
        a, b = self.nodes[src].rack, self.nodes[dst].rack
        if a != b:
            self._xfers_cross += 1
        if a != b and self._rack_gbps:
            for rack, out in ((a, True), (b, False)):
                up = self._uplinks.get((rack, out))
                if up is None:
                    up = self._uplinks[(rack, out)] = Station(1)
                done = max(done, up.serve(t, nbytes / (self._rack_gbps[rack] * 1e6)))
        return max(done, self._links_in[dst].serve(t, nbytes / (cp.node_link_gbps * 1e6)))

    def _record(self, i: int, now: float, changes: int) -> None:
        """`changes` sequence records (claims or releases) of node `i` to write at `now`, as the worker's
        `SeqRecorder` does: it wakes, waits `record_flush_ms` for more, and writes them all in one etcd transaction;
        while one is in flight the next waits for it. Changes before the next transaction's start ride on it. No
        event is needed: the transaction's start and commit are known when its first change comes."""
        cp = self._cp
        assert cp is not None
        if now > self._rec_issue[i]:  # no transaction pending: the next starts after the one in flight
            fin = self._rec_fin[i]
            self._rec_issue[i] = issue = (now if now > fin else fin) + cp.record_flush_ms
            self._rec_fin[i] = self._st_etcd.serve(issue, cp.record_ms)
            self._rec_txns += 1
        lag = self._rec_fin[i] - now
        self._rec_changes += changes
        self._rec_lag_sum += lag * changes
        if lag > self._rec_lag_max:
            self._rec_lag_max = lag

    def _fault(self, f: Fault, now: float) -> None:
        i = self.node_index.get(f.node)
        if i is None:
            raise ValueError(f"fault for unknown node {f.node!r}")
        node = self.nodes[i]
        if f.kind == "death":
            self.scorer.observe(HealthSample(f.node, now, heartbeat_ok=False))
            seqs = node.drain_all(now)
            self._views[i] = None
            self._rack_load(self.racks[node.rack], 0)
            self._migrate(i, seqs, now)
        elif f.kind == "xid":
            last = self.scorer.nodes.get(f.node)
            xid = (last.last.xid_errors if last and last.last else 0) + 1
            verdict = self.scorer.observe(HealthSample(f.node, now, xid_errors=xid))
            if verdict.draining and node.alive:
                seqs = node.drain_all(now)
                self._views[i] = None
                self._rack_load(self.racks[node.rack], 0)
                self._migrate(i, seqs, now)
            # after the burst the agent reports clean samples; the node returns once hysteresis allows
            interval = self.config.policies.health.interval_ms
            back = now + f.duration_ms + interval * self.config.policies.health.recover_samples
            self._push(back, FAULT, Fault(back, f.node, "recover"))
        elif f.kind == "recover":
            st = self.scorer.nodes.get(f.node)
            xid = st.last.xid_errors if st and st.last else 0
            interval = self.config.policies.health.interval_ms
            verdict = None
            for k in range(self.config.policies.health.recover_samples):
                verdict = self.scorer.observe(HealthSample(f.node, now - interval * k, xid_errors=xid))
            if verdict is not None and not verdict.draining:
                node.alive = node.accepting = True
                self._views[i] = None
                self._rack_load(self.racks[node.rack], 0)
        elif f.kind == "slow":
            node.slow_factor = max(1.0, f.factor)
            self._push(now + f.duration_ms, FAULT, Fault(now + f.duration_ms, f.node, "slow-end"))
        elif f.kind == "slow-end":
            node.slow_factor = 1.0
        else:
            raise ValueError(f"unknown fault kind {f.kind!r}; allowed: death, xid, slow")

    # -- main loop -------------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        for f in self.faults:
            self._push(f.at_ms, FAULT, f)
        n = len(self.reqs)
        nxt = 0
        now = 0.0
        report_every = max(1, n // 200)
        heap = self.heap
        routing = self._routing
        while nxt < n or heap or routing:
            if nxt == n and self.completed + self.n_dropped >= n:
                break  # every request is accounted for: what is left on the heap are faults with nothing to act on
            if routing:  # control-plane costs on: a routing decision out of a router (it acts as an arrival)
                tr_ = routing[0][0]
                if ((nxt == n or tr_ <= self.reqs[nxt].arrival_ms)
                        and (not heap or tr_ < heap[0][0] or (tr_ == heap[0][0] and heap[0][1] > ARRIVAL))):
                    now, rid = routing.popleft()
                    self._route(rid, now)
                    self.events += 1
                    continue
            if nxt < n and (not heap or self.reqs[nxt].arrival_ms < heap[0][0]
                            or (self.reqs[nxt].arrival_ms == heap[0][0] and heap[0][1] > ARRIVAL)):
                now = self.reqs[nxt].arrival_ms
                self._arrive(nxt, now)
                nxt += 1
                self.events += 1
                if self.progress is not None and nxt % report_every == 0:
                    self.progress(now, nxt, self.completed + self.n_dropped)
                continue
            t, kind, _s, _k, payload = heapq.heappop(heap)
            now = t
            self.events += 1
            if kind == NODE_END:
                ni, epoch = cast(tuple[int, int], payload)
                self._node_end(ni, epoch, now)
            elif kind == BATCH:
                bi, seqs = cast(tuple[int, list[SimSeq]], payload)
                self._batch_arrives(bi, seqs, now)
            elif kind == WINDOW:
                rack = self.racks[cast(str, payload)]
                if rack.timer_at is not None and rack.timer_at <= now:
                    rack.timer_at = None
                self._try_close(rack, now)
            elif kind == FAULT:
                assert isinstance(payload, Fault)
                self._fault(payload, now)
        for node in self.nodes:
            node._account_mem(now)
        for rid in range(n):
            if self.finish[rid] < 0 and not self.dropped[rid]:
                self._drop(rid, "never finished")
        if self.progress is not None:  # every request settled: a progress bar ends at 100%, shed ones included
            self.progress(now, n, self.completed + self.n_dropped)
        span = max(now, 1e-9)
        return SimResult(
            arrival=[r.arrival_ms for r in self.reqs], first_token=self.first_token, finish=self.finish,
            node_of=self.node_of, in_tokens=[r.in_tokens for r in self.reqs],
            out_tokens=[r.out_tokens for r in self.reqs], dropped=self.dropped,
            node_names=[x.name for x in self.nodes],
            node_gpus=[self.config.node(x.name).gpu for x in self.nodes],
            mem_util=[x.mem_integral / span for x in self.nodes], kv_util=[x.kv_integral / span for x in self.nodes],
            concurrency=[x.seq_integral / span for x in self.nodes], busy_ms=[x.busy_ms for x in self.nodes],
            preemptions=sum(x.preemptions for x in self.nodes), prompt_tokens=sum(x.prompt_tokens for x in self.nodes),
            cached_tokens=sum(x.cached_tokens for x in self.nodes), migrations=self.migrations,
            batch_mem_util=self.batch_mem_util, batch_sizes=self.batch_sizes, end_ms=now, events=self.events,
            drop_reasons=self.drop_reasons, kv_bins=[x.kv_bins for x in self.nodes],
            util_bin_ms=self.params.util_bin_ms, preempted=len(self.preempted), shed=self.shed,
            host_hit_tokens=sum(x.host_hit_tokens for x in self.nodes),
            control_plane=self._control_plane_report(span), oracle=self.oracle,
            belief_error_tenth=self.belief_error_tenth, belief_error_end=self._belief_errors(),
            expected_out=self.expected_out, max_tokens=self.max_tokens,
            tenant=[r.tenant for r in self.reqs], priority=[r.priority for r in self.reqs],
            drop_reason=self.drop_reason, priority_preemptions=sum(x.priority_preemptions for x in self.nodes),
        )

    def _control_plane_report(self, span: float) -> dict[str, dict[str, float]]:
        if self._cp is None:
            return {}
        out = {"router": self._st_router.report(span), "valkey_global_shard": self._st_global.report(span),
               "valkey_spread_shards": self._st_spread.report(span), "etcd": self._st_etcd.report(span)}
        racks = [r.station.report(span) for r in self.racks.values() if r.station is not None]
        if racks:
            worst = max(racks, key=lambda x: x["utilisation"])
            out["batcher_busiest_rack"] = worst
        cp = self._cp
        out["etcd_records"] = {
            "transactions": float(self._rec_txns), "changes": float(self._rec_changes),
            "mean_lag_ms": round(self._rec_lag_sum / self._rec_changes, 3) if self._rec_changes else 0.0,
            "max_lag_ms": round(self._rec_lag_max, 3)}
        for name, stations in (("node_link_out_busiest", list(self._links.values())),
                               ("node_link_in_busiest", [st for st in self._links_in.values() if st.busy_ms > 0]),
                               ("rack_uplink_busiest", list(self._uplinks.values()))):
            reps = [st.report(span) for st in stations]
            if reps:
                out[name] = max(reps, key=lambda x: x["utilisation"])
        if cp.fabric:
            waited = sum(st.wait_ms for st in self._links_in.values())
            out["fabric"] = {"transfers": float(self._xfers), "cross_rack_transfers": float(self._xfers_cross),
                             "transfer_gb": round(self._xfer_bytes / 1e9, 3),
                             "inbound_link_wait_ms_total": round(waited, 3)}
        return out


def _lookup(costs: dict[str, StepCost]) -> Callable[[NodeSpec], StepCost]:
    return lambda n: costs[n.name]
