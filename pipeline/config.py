"""Configuration: typed, bounded, documented models of everything in `configs/*.yaml`.

One concern in one file (over 500 lines on purpose): the whole schema, so one file documents every setting.

Owns the schema of the cluster topology, GPU types, model shapes and policy parameters, and the loader that
merges the YAML files and reports a bad value with its field path and what is allowed. It must never read
tunables from the environment (connection URLs and secrets are the shell's business, not the config's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from pipeline.errors import RackflowError

DEFAULT_CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
TOP_LEVEL_KEYS = ("gpus", "models", "cluster", "policies", "gateway", "batches")
"""The sections of a configuration: one file each in the config directory, and the only keys an overlay may have."""
CONFIG_FILES = tuple(f"{k}.yaml" for k in TOP_LEVEL_KEYS)
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}


class ConfigError(RackflowError, ValueError):
    """A configuration value is wrong; the message names the field path and what is allowed."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class GpuSpec(_Strict):
    arch: Literal["ampere", "hopper", "blackwell"] = "hopper"
    """Architecture: the cost model's calibrated efficiencies are per architecture, so a GPU that was never
    profiled (e.g. H200) is predicted from its own peak numbers with its architecture's efficiencies."""
    memory_gb: float = Field(gt=0, le=4096)
    """Device memory in GB (10^9 bytes)."""
    bf16_tflops: float = Field(gt=0, le=100_000)
    """Dense BF16 tensor-core throughput, TFLOP/s."""
    hbm_tbps: float = Field(gt=0, le=100)
    """HBM bandwidth, TB/s."""
    pcie_gbps: float = Field(default=64, gt=0, le=10_000)
    """Host link bandwidth, GB/s (the denominator of PCIe utilisation)."""
    nvlink_gbps: float = Field(default=0, ge=0, le=100_000)
    """NVLink bandwidth per GPU, GB/s (0: none)."""
    price_per_hour: float = Field(default=0, ge=0, le=1_000)
    """Price of one GPU-hour in USD (cost comparisons only)."""
    step_profile: str | None = None
    """A measured step profile of the engines on this GPU type (the JSON `python -m workers.engines.vllm_profile -o
    PATH` writes; its linear `fit`): the control plane prices nodes of this type with it instead of the calibrated
    model, for an engine the committed calibration does not cover (vLLM's CPU build). None: the calibrated model."""


class TokenRates(_Strict):
    """Characters per token of the fast token estimator, by kind of text."""

    cjk: float = Field(default=1.4, gt=0, le=16)
    """CJK (Chinese, Japanese, Korean) characters per token."""
    latin: float = Field(default=4.0, gt=0, le=32)
    """Characters per token of natural-language text in Latin and other scripts."""
    code: float = Field(default=3.0, gt=0, le=32)
    """Characters per token of source code (more symbols and whitespace runs than prose)."""


class ModelSpec(_Strict):
    layers: int = Field(gt=0, le=1024)
    """Transformer layers."""
    hidden: int = Field(gt=0, le=131_072)
    """Hidden size."""
    heads: int = Field(gt=0, le=1024)
    """Attention (query) heads."""
    kv_heads: int = Field(gt=0, le=1024)
    """Key/value heads (GQA); equals `heads` for multi-head attention."""
    intermediate: int = Field(gt=0, le=1_048_576)
    """MLP intermediate size (gated MLP: three matrices of hidden x intermediate)."""
    vocab: int = Field(gt=0, le=10_000_000)
    """Vocabulary size."""
    context: int = Field(default=32768, gt=0, le=10_000_000)
    """Maximum context length in tokens (prompt + output)."""
    dtype: Literal["bf16", "fp16", "fp8", "fp32"] = "bf16"
    """Weight and KV-cache dtype."""
    mem_in_kb_per_token: float = Field(default=200, gt=0, le=1_000_000)
    """Seed memory coefficient for prompt tokens, KB per token (mem_est_kb = in*a + out*b)."""
    mem_out_kb_per_token: float = Field(default=1500, gt=0, le=1_000_000)
    """Seed memory coefficient for output tokens, KB per token."""
    default_out_tokens: int = Field(default=256, gt=0, le=1_000_000)
    """Output length assumed when neither the request nor the user's history gives one."""
    gpu_pool: tuple[str, ...] = ()
    """GPU types this model may be placed on (model-aware placement, e.g. 7B on A100, 72B on H100); empty: any."""
    tokenizer: str | None = None
    """Path of the model's `tokenizer.json`; when it exists, prompts are counted exactly instead of estimated."""
    token_rates: TokenRates | None = None
    """Calibrated characters-per-token rates of this model's tokenizer (`rackflow tokens calibrate`); default: the
    profiling policy's rates."""

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V cached per token over all layers: 2 * layers * kv_heads * head_dim * dtype_bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def params(self) -> int:
        """Parameter count from the shape (attention with GQA, gated MLP, untied embeddings)."""
        kv_dim = self.kv_heads * self.head_dim
        attn = self.hidden * self.hidden * 2 + self.hidden * kv_dim * 2
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + 2 * self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes


class NodeTemplate(_Strict):
    gpu: str
    """GPU type, a key of `gpus`."""
    tp: int = Field(default=1, ge=1, le=64)
    """Tensor-parallel degree: GPUs per engine instance (one node = one engine instance)."""
    models: tuple[str, ...] = Field(min_length=1)
    """Models this node serves, keys of `models`."""


class NodeSpec(NodeTemplate):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Node id, unique in the cluster."""


class RackSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Rack id; it becomes the `{rack}` hash tag of the rack's stream keys."""
    node_count: int | None = Field(default=None, ge=1, le=4096)
    """Number of identical nodes built from `node` (ids `<rack>-n<i>`)."""
    node: NodeTemplate | None = None
    """Template for `node_count` nodes."""
    nodes: tuple[NodeSpec, ...] = ()
    """Explicit nodes (mixed GPU types); used instead of `node_count` + `node`."""

    @model_validator(mode="after")
    def _one_form(self) -> RackSpec:
        if self.nodes and (self.node_count or self.node):
            raise ValueError("give either `nodes` or `node_count` + `node`, not both")
        if not self.nodes and not (self.node_count and self.node):
            raise ValueError("a rack needs `nodes` or both `node_count` and `node`")
        return self

    def expanded(self) -> tuple[NodeSpec, ...]:
        if self.nodes:
            return self.nodes
        assert self.node is not None and self.node_count is not None
        return tuple(
            NodeSpec(name=f"{self.name}-n{i}", **self.node.model_dump()) for i in range(self.node_count)
        )


class ClusterSpec(_Strict):
    racks: tuple[RackSpec, ...] = Field(min_length=1)
    """Racks of the cluster, each a list of nodes."""

    @model_validator(mode="after")
    def _unique(self) -> ClusterSpec:
        names = [r.name for r in self.racks]
        if len(set(names)) != len(names):
            raise ValueError(f"rack names must be unique, got {names}")
        node_names = [n.name for r in self.racks for n in r.expanded()]
        dup = sorted({n for n in node_names if node_names.count(n) > 1})
        if dup:
            raise ValueError(f"node names must be unique across racks, duplicated: {dup}")
        return self


class ProfilingPolicy(_Strict):
    estimator: Literal["seed", "shape"] = "shape"
    """Memory estimate: `shape` (KV bytes per token from the model shape, over prompt + output, times
    `shape_margin`; the default) or `seed` (the field report's in*200 + out*1500 KB)."""
    shape_margin: float = Field(default=1.0, gt=0, le=100)
    """Multiplier of the `shape` estimate. 1.0 reserves the KV a sequence holds when it ends at its expected output:
    measured in the simulator at saturation, oracle-free, KV use peaks at 0.80-0.87 with no preemption (0.85-0.91
    with at most 0.27% preempted at 0.9, which cost the decision matrix's Mooncake cells at 1.5x most of their
    goodput: docs/SIMULATOR.md, window-batching); below 1 the batcher overcommits memory and the engines preempt."""
    token_rates: TokenRates = TokenRates()
    """Default rates of the fast token estimator (a model's own `token_rates` override them)."""
    prefix_block_tokens: int = Field(default=512, ge=16, le=65_536)
    """Tokens per prefix block; a prompt's chained block hashes are what the kv_aware policy matches on."""
    ewma_alpha: float = Field(default=0.2, gt=0, le=1)
    """Weight of the newest completion in a user's output-length EWMA."""


class PrefixCacheRule(_Strict):
    """Seed rule: a long prompt that leaves its affinity rack for load runs with prefix caching off (its prefix is
    not cached there, and caching it would evict what the rack's own users reuse). A request sent to another rack
    because its prefix is cached there keeps caching. Off by default: measured in the simulator on the Mooncake trace
    at capacity, turning caching off for walked requests took the prefix hit rate from 0.58 to 0.50 and P99 TTFT up
    35% (docs/SIMULATOR.md), since a walked conversation's next turn finds its history cached nowhere."""

    enabled: bool = False
    """Apply the rule."""
    min_tokens: int = Field(default=512, ge=0, le=10_000_000)
    """Prompts longer than this lose prefix caching when routed away from their affinity rack."""


class RouterPolicy(_Strict):
    policy: Literal["rack_affinity"] = "rack_affinity"
    """Rack choice: consistent hash of user_id over the racks serving the model, with bounded load."""
    virtual_nodes: int = Field(default=160, ge=1, le=10_000)
    """Points per rack on the hash ring."""
    load_bound: float = Field(default=1.25, ge=1.0, le=100.0)
    """(1 + epsilon): a rack whose load exceeds load_bound x the mean rack load + load_slack is skipped (walk the
    ring)."""
    load_slack: float = Field(default=16.0, ge=0, le=1e9)
    """Requests a rack may be above the bound before it is skipped: at small absolute loads a pure (1+eps) bound
    would throw away affinity (and its KV cache) over a difference of two or three requests."""
    prefix_cache_rule: PrefixCacheRule = PrefixCacheRule()
    """When to turn prefix caching off for a request (ARCHITECTURE §2)."""
    prefix_aware: bool = True
    """Weigh where a request's leading prefix blocks are cached (the racks' block index) and how much work each rack
    has queued against user affinity; off: the user's hash rack unless it is over the load bound (the seed)."""
    affinity_tokens: float = Field(default=8192.0, ge=0, le=1e9)
    """What keeping a user on its own rack is worth, in prompt tokens: another rack must save more than this (cached
    prefix tokens plus less work queued per node) to take the request."""
    decode_weight_tokens: float = Field(default=256.0, ge=0, le=1e9)
    """Work of one queued or running sequence, in prompt tokens, in a rack's work figure (next to its queued
    prefill tokens)."""
    work_slack_tokens: float = Field(default=32768.0, ge=0, le=1e12)
    """Work per node (prompt tokens) a rack may be above load_bound x the mean before affinity is given up, when
    the racks' work is known (the work form of `load_slack`)."""
    share_bound: float = Field(default=1.15, ge=0, le=100.0)
    """(1 + epsilon) of the share guard (0: off): a rack that has been sent more than share_bound x the healthy
    racks' mean of the router's recent requests per node is skipped (walk the ring), as Mirrokni et al.'s bounded
    loads skip a full bin. The bounds above compare work outstanding now, which stays far under their slack below
    capacity, so they let the hash split of a few heavy (Zipf) users stand: on the default cluster and the Azure conv
    trace one rack of two got 1.35x the mean work per node (2x the other's requests), 1.08-1.11x with the guard.
    Under 1.25 so that the work (tokens, not requests) a rack receives stays within 1.25x the mean."""
    share_slack: float = Field(default=2.0, ge=0, le=1e9)
    """Requests per node a rack may be above the share bound (its ceil: at the start of a run, or on a cluster with
    few requests per rack, a pure (1+eps) bound would walk over one or two requests)."""
    share_window_requests: int = Field(default=512, ge=1, le=10_000_000)
    """Half-life of the share ledger, in routed requests per rack: older requests count less, so a rack back from a
    failure is not flooded to make up for what it missed (deterministic: it decays per request, not per second)."""
    share_heavy_user: float = Field(default=0.05, ge=0, le=1.0)
    """A user with at least this fraction of a rack's fair share of the recent requests is heavy: heavy users walk
    off an over-full rack from halfway to share_bound (1 + epsilon/2), the others only at share_bound, so that the
    few Zipf-heavy users are split and the many light ones keep their rack (and its cache). 0: all walk alike."""
    share_hit_tokens: float = Field(default=2048.0, ge=0, le=1e12)
    """A rack that holds at least this many prompt tokens of a request (its cached prefix) is held to share_bound for
    it even when its user is heavy: the imbalance that buys a prefix hit is allowed up to the bound. Measured on the
    Mooncake trace (3000 requests, work_aware, 6 seeds): without it the guard cost 0.017 of prefix hit rate (0.434
    to 0.418); with it none (0.437); 512 to 8192 tokens alike."""


NodePolicyName = Literal[
    "round_robin", "random", "least_outstanding", "power_of_two", "static_weight", "weighted", "kv_aware",
    "work_aware", "llm_d", "dynamo", "sglang", "lmetric",
]
ALL_NODE_POLICIES: tuple[NodePolicyName, ...] = (
    "round_robin", "random", "least_outstanding", "power_of_two", "static_weight", "weighted", "kv_aware",
    "work_aware", "llm_d", "dynamo", "sglang", "lmetric",
)


class KvAwareParams(_Strict):
    decode_weight_tokens: float = Field(default=256.0, ge=0, le=1e9)
    """Cost of one outstanding sequence on a node, in prompt tokens to prefill (cost = uncached tokens + this x
    outstanding sequences)."""
    index_blocks_per_node: int = Field(default=65_536, ge=1, le=100_000_000)
    """Prefix blocks remembered per node (LRU) by the approximate prefix index."""


class WorkAwareParams(_Strict):
    """Constants of the `work_aware` policy (rackflow's default): a request goes where its predicted cost, in
    milliseconds of the node's own cost model, is lowest (see pipeline/routing/node_policies/work_aware.py)."""

    e2e_weight: float = Field(default=0.1, ge=0, le=100)
    """Weight of the request's own decode time ((out - 1) x the node's decode step with it added) next to its time to
    first token; 0 prices the first token alone. Tuned on the tuning traces with the late-binding hold on
    (`rackflow sim matrix`, docs/SIMULATOR.md): 0.1 puts the default within 3% of the best in 30 of 36 cells on
    goodput and 22 of 27 on P99 TTFT, against 28 and 22 with 0.3 and 24 and 23 with 0."""
    others_weight: float = Field(default=0.06, ge=0, le=100)
    """Weight of what the request's prefill costs the sequences already decoding on the node (their iterations
    stretch while its chunks run)."""
    queue_weight: float = Field(default=0.0, ge=0, le=100)
    """Requests waiting in the node's engine count this much each next to its decoding ones in that term: under
    overload they stand for the work queued behind the request, and recomputing a prefix there delays them all."""
    slot_weight: float = Field(default=1.0, ge=0, le=100)
    """Weight of the expected wait for a sequence slot on a node whose engine already runs its most sequences
    (WorkAware.slot_wait_ms) in its time to first token; 0: a full node is priced as if it started the request
    now."""
    kv_soft_limit: float = Field(default=0.9, ge=0, lt=1)
    """KV use (reserved + this request, over capacity) above which a node is priced up for memory pressure."""
    kv_weight_ms: float = Field(default=0.0, ge=0, le=1e9)
    """Cost added when the node would be full (linear from the soft limit to 100% KV use), ms; 0 (the default): no
    KV-pressure term. The batcher's memory budget already keeps a node's KV from overflowing, and the term priced the
    memory estimate (the expected output, a cap at or above the true length without the oracle) in fixed
    milliseconds next to predicted ones: measured oracle-free (`rackflow sim matrix`, docs/SIMULATOR.md), 2,000 ms
    left 22 matrix shortfalls and 0 leaves 17 (Mooncake at 1.5x healthy: goodput 5.3 -> 8.4 req/s, the best; DeepSeek-R1
    with a node dying at 0.8x: P99 TTFT 1,056 -> 596 ms, the best 593) with no cell preempting more, and where memory
    binds at saturation (`rackflow sim experiment window-batching`, 9x) the KV peak is 0.853 against 0.841."""
    use_slowdown: bool = True
    """Multiply a node's times by its measured slowdown (observed / modelled iteration time), the health term."""
    index: Literal["precise", "approximate"] = "precise"
    """Prefix hits from the engines' block events (`precise`, where the batcher is fed them) or from this policy's
    own dispatches (`approximate`, an LRU per node as llm-d's approximate scorer keeps)."""
    wait_margin_ms: float = Field(default=0.0, ge=0, le=1e9)
    """When every node that has room for the request costs more than this above its cheapest node (which has none
    now: its memory budget or its queue is full), the request waits in the batcher for that one, up to
    `max_wait_ms` (where a node with room has nothing to prefill, the margin is `idle_margin_ms` instead)."""
    idle_margin_ms: float = Field(default=1000.0, ge=0, le=1e9)
    """The same margin where a node with room has nothing queued for prefill: the request waits for its cheapest node
    only when that beats the node with room by more than this (before, never: a node without prefill took any
    request, and held requests went to the node that had just drained, where the sequences it had just prefilled
    were decoding). Tuned on the tuning traces (`rackflow sim matrix --repeats 2`, docs/SIMULATOR.md): 1,000 ms; with
    100 ms and 0 ms fewer cells within 3% (46, 47 of 63 against 49) at about the same mean goodput (those runs
    with `batcher.late_binding: policy`; without it, the default, 38 tuning cells of 63 within 3% in one seed's run)."""
    max_wait_ms: float = Field(default=20_000.0, ge=0, le=1e9)
    """The longest a request waits in the batcher for its cheapest node; then it goes wherever there is room. Above
    capacity every request waits that long anyway (the gateway bounds the queue): measured on the Mooncake trace at
    1.5x load, 20 s keeps 0.47 of prompt tokens cached against 0.34 with 2 s, and serves 17% more."""
    temperature_ms: float = Field(default=0.0, ge=0, le=1e9)
    """0: the cheapest node. Above 0: sample a softmax over -cost / temperature_ms (several batchers per rack placing
    from views a refresh apart would otherwise all pick the same node)."""


class NodeSelectionPolicy(_Strict):
    policy: NodePolicyName = "work_aware"
    """Node choice inside a rack; `work_aware` prices each request in predicted milliseconds per node (the default),
    `weighted` is the seed's W-weighted random."""
    allow_request_override: bool = True
    """Let a request pick its policy with the `X-Route-Policy` header."""
    allowed_overrides: tuple[NodePolicyName, ...] = ALL_NODE_POLICIES
    """Policies a request may ask for."""
    refresh_ms: int = Field(default=200, ge=10, le=60_000)
    """How often node weights are refreshed from the nodes' live status."""
    room_refresh_ms: int = Field(default=10, ge=1, le=60_000)
    """While a batcher holds requests, how often it re-reads its own rack's node statuses (one round trip, no
    etcd), backing off to `refresh_ms` while none changes: a node that finished sequences says so in its status hash
    within `worker.room_status_ms`, and the window closes on that room instead of waiting for the next full refresh.
    The worker also announces it on the rack's room channel (`rf:room:{R}`), which wakes the batcher at once between
    polls (measured: polled alone, the back-off held requests that waited for a slot up to 200 ms after it freed:
    the live TTFT P99 of `rackflow sim validate`'s run was 445-563 ms, 281 ms with the room seen at once). Measured:
    `rackflow bench pipeline`'s flood was bound by the 200 ms refresh (docs/GUIDE.md, Benchmarks)."""
    stale_ms: int = Field(default=3000, ge=50, le=600_000)
    """A node whose status is older than this is unavailable (never routed on an old weight)."""
    latency_decay_per_ms: float = Field(default=0.05, ge=0, le=10)
    """The 0.05 of exp(-0.05 * avg_latency_ms) in W."""
    static_weights: dict[str, Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]] = Field(
        default_factory=dict
    )
    """`static_weight` policy: weight per node name or GPU type (node name wins); default 1."""
    kv_aware: KvAwareParams = KvAwareParams()
    """Parameters of the `kv_aware` policy."""
    work_aware: WorkAwareParams = WorkAwareParams()
    """Parameters of the `work_aware` policy (the default)."""


class BatcherPolicy(_Strict):
    window_ms: int = Field(default=100, ge=1, le=60_000)
    """Window length; a bound, not a forced wait (windows close early when a node is idle or the budget is full)."""
    mem_budget_fraction: float = Field(default=0.9, gt=0, le=1.0)
    """Cap of a batch's estimated memory as a fraction of the node's GPU memory (72 GB of 80 GB = 0.9)."""
    age_after_windows: int = Field(default=5, ge=1, le=10_000)
    """A request that waited this many windows is packed first and may reserve a node (no starvation)."""
    close_when_node_idle: bool = True
    """Close the window at once when a node of the rack has no running sequence."""
    max_queued_prefill_tokens: int = Field(default=8192, ge=0, le=100_000_000)
    """Late binding (`late_binding`): a node with this many prompt tokens queued for prefill (its engine's queue plus
    what was sent to it and not admitted yet) gets no more late-bound work until it drains below: the queue waits in
    the batcher, where any node that frees up can take it (0: no bound, only memory and slots). One iteration's
    token budget (8,192): tuned on the tuning traces, 4,096 / 8,192 / 12,288 / 16,384 / 32,768 put the default within
    3% of the best goodput in 29 / 28 / 25 / 23 / 21 of 36 cells (with `work_aware.e2e_weight` 0.3); a horizon in
    milliseconds of the node's own prefill (150-300 ms; tried and not kept) did worse than 8,192 tokens (29-31 of 36
    against 34, with `others_weight` 0.1)."""
    late_binding: Literal["none", "policy", "all"] = "policy"
    """Which requests wait in the batcher until a node can start them now (under `max_queued_prefill_tokens` of
    queued prefill): `none` (every request goes out as soon as a node has memory and a slot for it, as the anchors'
    routers do), `policy` (requests of policies that ask for it: work_aware, for a request whose prefix no node has
    cached; the default), `all` (every node policy). A held request is placed smallest first (the batcher's memory
    order), so under a burst short prompts are not queued behind long ones in an engine's FIFO, until it has waited
    `late_age_after_windows` windows; then it ages (oldest first) and goes wherever memory and a slot allow. The
    queue in front of the engines is llm-d's flow control's (requests held in the gateway while the pool is
    saturated); the order is shortest-job-first with aging. Measured oracle-free with `rackflow sim matrix`
    (docs/SIMULATOR.md, "The decision matrix"): with the 8,192-token horizon and `work_aware.e2e_weight` 0.1,
    `policy` puts the default within 3% of the best goodput in 30 of 36 tuning cells (20 with `none` and the earlier
    constants) and of the best P99 TTFT in 22 of 27 (18); on the held-out conversation trace 11 of 12 and 9 of 9 (12
    and 9), on the held-out DeepSeek-R1 hour (added later, never tuned on) 8 of 12 and 4 of 9.
    Where memory binds (`rackflow sim experiment window-batching`, Mooncake at saturation) the KV peak is 0.853
    with 0 preempted (0.80-0.87 over four seeds and two rates)."""
    late_age_after_windows: int = Field(default=40, ge=1, le=10_000)
    """A late-bound request held this many windows ages: it is placed first, oldest first, and no longer waits for
    a node under its prefill horizon (the bound on how long shortest-first can hold a long prompt back). Tuned on
    the tuning traces: 40 (4 s at the 100 ms window); 80 and 150 win goodput in 27 and 30 of 36 cells but P99 TTFT in
    only 19 and 17 of 27 (measured before `work_aware.idle_margin_ms`)."""
    close_when_room: bool = True
    """Close the window at once when a waiting request fits a node that can start it now (budget and a free
    sequence slot): the window only ever holds requests no node could take."""
    mode: Literal["window", "fixed"] = "window"
    """`window`: the memory-budget sliding window; `fixed`: batches of `fixed_batch` requests (the baseline)."""
    fixed_batch: int = Field(default=32, ge=1, le=100_000)
    """Requests per batch in `fixed` mode (a partial batch leaves after `window_ms`)."""
    consumers_per_rack: int = Field(default=1, ge=1, le=64)
    """Batcher processes per rack started by `rackflow up` (one consumer group: any of them can die)."""
    batch_yield: Literal["preempt", "hold"] = "preempt"
    """How `batch`-class work (pipeline/priority.py) yields to interactive work. Either way a window places
    interactive requests first and batch ones only on a node with a free sequence slot, so batch work waits here,
    not in an engine's queue. `preempt`: an interactive request may be placed on a node whose slots and memory batch
    sequences hold, and the engine preempts them for it (the `sim` engine, vLLM with `scheduling_policy: priority`);
    `hold`: batch work is held back further, to nodes with `batch_hold_slots` of their slots free after it, and
    never preempted."""
    batch_hold_slots: float = Field(default=0.25, ge=0.0, lt=1.0)
    """With `batch_yield: hold`, the share of a node's sequence slots (rounded up) that batch work leaves free for
    interactive arrivals: a window places batch work only below it, and an engine admits a waiting batch sequence
    only below it."""
    batch_preempt_slots: float = Field(default=0.1, ge=0.0, lt=1.0)
    """With `batch_yield: preempt`, the share of a node's sequence slots (rounded down) that batch work leaves free
    all the same, so that most interactive arrivals find a slot and only the bursts beyond preempt: without it, on a
    node of 256 slots nearly every arrival preempted a batch sequence, which came back at once to re-prefill and was
    preempted again (`rackflow sim experiment priority`: P99 TTFT 10.7x alone, batch work used 0.48 of the idle
    capacity; with 0.1: see docs/PRIORITY.md). Rounded down, a node of few slots (4) keeps none."""
    fair_share: bool = True
    """Within a class, requests of several tenants waiting in a window are placed in virtual-token-counter order
    (pipeline/priority.py, OSDI '24): the tenant least served so far first. Off: smallest memory first, whoever
    sent it."""
    vtc_out_weight: float = Field(default=2.0, ge=0.0, le=100.0)
    """A generated token's weight in the tenants' counters, a prompt token's being 1 (the paper's ratio)."""


class TorchEngineConfig(_Strict):
    model: str = "tiny-qwen2"
    """Shape (a key of `models`) of the Qwen2-architecture model built from config with a fixed seed; the torch
    engine serves every model name of its node with it (a laptop stand-in for the real weights)."""
    checkpoint: str | None = None
    """A local Hugging Face checkpoint directory (Qwen2 architecture) to load instead; nothing is downloaded."""
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    """Weights and KV dtype."""
    threads: int = Field(default=1, ge=1, le=256)
    """torch intra-op threads (1 keeps results bit-identical across processes)."""
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    """Seed of the random weights."""
    max_batch: int = Field(default=16, ge=1, le=4096)
    """Most sequences decoded together in one step."""
    kv_capacity_mb: float = Field(default=64.0, gt=0, le=1e7)
    """L0: KV memory the engine may hold; above it the least recently used sequences are swapped out to L1/L2."""
    stop_at_eos: bool = True
    """End a sequence when the model emits the end-of-sequence token (else always run to max_tokens)."""


class VllmEngineConfig(_Strict):
    model: str | None = None
    """Local Hugging Face checkpoint directory vLLM serves (required; `rackflow up --engine vllm --model-dir DIR`
    sets it). Nothing is downloaded."""
    tensor_parallel_size: int | None = Field(default=None, ge=1, le=64)
    """Default: the node's `tp` (1 on vLLM's CPU build)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and KV dtype (auto: the checkpoint's)."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """vLLM's share of GPU memory for weights + KV cache (GPU only)."""
    cpu_kvcache_space_gb: float = Field(default=1.0, gt=0, le=1e5)
    """KV-cache size on vLLM's CPU build, GiB (its VLLM_CPU_KVCACHE_SPACE; a value already in the environment
    wins)."""
    max_model_len: int | None = Field(default=None, ge=16, le=10_000_000)
    """Context limit (default: the model's)."""
    max_num_seqs: int = Field(default=64, ge=1, le=8192)
    """Sequences vLLM runs at once."""
    block_size: int | None = Field(default=None, ge=1, le=4096)
    """Tokens per KV block (default: vLLM's for the platform: 16 on a GPU, 128 on the CPU build)."""
    enforce_eager: bool | None = None
    """Eager mode, no CUDA graphs or torch.compile (default: on for the CPU build, off on a GPU)."""
    enable_prefix_caching: bool = True
    """vLLM's automatic prefix caching (a request with prefix_cache=false gets its own cache salt)."""
    kv_events: bool = True
    """With prefix caching on, vLLM publishes what its prefix cache stores and evicts (its `kv_events_config`, a
    ZMQ socket per engine), and the worker turns those blocks into the prefix hashes the batchers' precise index
    holds (`workers.engines.vllm_kv_events`), as Dynamo's KV router and llm-d's precise scorer consume them. Off,
    the precise index has nothing from this node, and the policies that read it (work_aware's `precise` index,
    dynamo, lmetric) see no prefix cached there."""
    ignore_eos: bool = False
    """Run every sequence to max_tokens even past the end-of-sequence token (benchmarks)."""
    scheduling_policy: Literal["priority", "fcfs"] = "priority"
    """vLLM's `--scheduling-policy`. `priority`: each request carries its class (pipeline/priority.py: 0
    interactive, 1 batch) and vLLM's scheduler admits the interactive ones first and, when KV blocks run out,
    preempts the lowest class first. `fcfs`: vLLM's default, every request alike."""
    cpu_nice: int = Field(default=10, ge=0, le=19)
    """On vLLM's CPU build, how far below normal the worker and vLLM's processes run, so that the control plane
    beside them on the same cores is never starved (0: normal priority; no effect on a GPU). Measured on a 2-core
    host: two vLLM CPU workers, each its own session, kept every other process off the CPU for 20-40 s at a time
    (a `sleep(0.1)` beside them woke 20.7 s late; an etcd lease of 15 s expired and a healthy node was drained); at
    10 the longest wake-up delay was 0.6 s, and decode speed was unchanged (2 x 8,000 tokens in 11.5 s)."""
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    kv_connector: Literal["auto", "OffloadingConnector", "LMCacheConnectorV1"] | None = "auto"
    """KV offloading to CPU memory (L1) through vLLM's KV-connector interface; auto: OffloadingConnector on a GPU,
    none on the CPU build (which refuses it); None disables it."""
    cpu_offload_gb: float = Field(default=16.0, ge=0, le=1e6)
    """CPU memory for offloaded KV blocks (OffloadingConnector's cpu_bytes_to_use)."""
    extra_engine_args: dict[str, Any] = Field(default_factory=dict)
    """Passed through to vLLM's AsyncEngineArgs as they are."""


class KvTierConfig(_Strict):
    host_prefix_gb_per_gpu: float = Field(default=128.0, ge=0, le=1e6)
    """Host memory per GPU that keeps prefix KV blocks evicted from GPU memory (vLLM's OffloadingConnector, LMCache's
    CPU backend): a prompt whose prefix is there loads it back over PCIe instead of prefilling it again. 128 GB is
    half of a DGX H100's 2 TB per GPU; 0 keeps the prefix cache in GPU memory only."""
    l1_capacity_mb: float = Field(default=1024.0, ge=0, le=1e9)
    """L1: node-local host memory (shared by the node's processes) for KV snapshots; 0 disables L1."""
    l1_dir: str = "/dev/shm/rackflow-kv"
    """Where L1 keeps its blobs (a RAM-backed directory; one subdirectory per node)."""
    l2: Literal["valkey", "none"] = "valkey"
    """L2 backend: the stream server itself (binary values) or none."""
    l2_capacity_mb: float = Field(default=16_384.0, ge=0, le=1e12)
    """L2 capacity; beyond it the least recently used snapshots are dropped."""
    l2_ttl_s: int = Field(default=86_400, ge=60, le=90 * 86_400)
    """L2 snapshots expire after this long without use."""


class WorkerPolicy(_Strict):
    engine: Literal["sim", "torch", "vllm"] = "sim"
    """Default engine of `rackflow worker`."""
    zero_time: bool = False
    """`sim` engine: iterations take no time (measures the control plane alone, `rackflow bench pipeline`)."""
    sim_world: bool = True
    """`sim` engine: the node runs a hidden world cost model (`pipeline.sim.world`: a factor per operator class,
    noise, stalls, seeded by `policies.seed` and the node's name), as the simulator's oracle-free nodes do, so that
    the control plane meets a node that is not exactly its cost model; False: exactly the cost model."""
    token_flush_ms: int = Field(default=50, ge=0, le=10_000)
    """Tokens generated within this interval are sent to the client stream as one entry (0: every step)."""
    lease_ttl_s: int = Field(default=3, ge=1, le=600)
    """TTL of the worker's etcd registration lease (refreshed every third of it): a worker that misses it is taken
    for dead and its sequences move. 3 s detects a kill -9 fast on a dedicated host; a CPU-only machine whose cores
    run vLLM's CPU build at full load needs more (measured on 2 cores: leases of two decoding vLLM workers expired
    at 3 s, and healthy nodes were marked dead)."""
    status_interval_ms: int = Field(default=200, ge=10, le=60_000)
    """How often the worker publishes its live status (HealthEvent + status hash)."""
    idle_status_interval_ms: int = Field(default=1000, ge=10, le=60_000)
    """While the worker is idle (no sequence in its engine, no batch for it), its status interval doubles, up to
    this; each heartbeat says when the next one is due (`HealthEvent.next_ms`), so the monitor judges the node's
    silence against that. A batch brings it back to `status_interval_ms` at once, with a status published on
    arrival. Kept under a third of `node_selection.stale_ms`, so an idle node's status never goes stale. Measured
    (`rackflow bench idle`): the heartbeats and their readers were most of what an idle cluster burns."""
    room_status_ms: int = Field(default=10, ge=1, le=60_000)
    """After a step that finished sequences (room for new ones), the worker rewrites its status hash and announces
    it on its rack's room channel (`rf:room:{R}`), at most this often (the hash only: the heartbeat on `rf:health`
    keeps its own schedule)."""
    max_running: int = Field(default=256, ge=1, le=100_000)
    """Most sequences an engine runs at once (vLLM's max_num_seqs)."""
    max_batched_tokens: int = Field(default=8192, ge=16, le=10_000_000)
    """Tokens one engine iteration takes, decode tokens and prefill chunks together (vLLM's
    max_num_batched_tokens; the `sim` engine and the simulator schedule with it)."""
    torch: TorchEngineConfig = TorchEngineConfig()
    """The `torch` engine."""
    vllm: VllmEngineConfig = VllmEngineConfig()
    """The `vllm` engine."""


class StreamsPolicy(_Strict):
    retention_s: int = Field(default=86_400, ge=60, le=90 * 86_400)
    """Streams are trimmed by age (XADD MINID) to this retention."""
    output_ttl_s: int = Field(default=3600, ge=10, le=90 * 86_400)
    """A request's own output stream (`rf:out:{id}`: its token chunks and result, read by a client that reconnects
    or asks `GET /v1/results/{id}`) expires this long after its last write."""
    claim_idle_ms: int = Field(default=10_000, ge=100, le=3_600_000)
    """A pending entry idle this long (its consumer died) is claimed by another consumer."""
    max_deliveries: int = Field(default=5, ge=1, le=1000)
    """An entry delivered more often than this goes to the dead-letter stream."""
    read_count: int = Field(default=128, ge=1, le=100_000)
    """Entries per XREADGROUP."""
    block_ms: int = Field(default=200, ge=1, le=60_000)
    """XREADGROUP BLOCK timeout."""


class HealthWeights(_Strict):
    """Weight of each penalty in the health score (score = 1 - sum(weight x penalty), penalties in [0, 1])."""

    xid: float = Field(default=0.6, ge=0, le=1)
    """New Xid events in the window (GPU faults: a single one is serious)."""
    ecc: float = Field(default=0.5, ge=0, le=1)
    """New uncorrectable ECC errors."""
    nvlink: float = Field(default=0.3, ge=0, le=1)
    """NVLink CRC / replay errors per window, relative to `nvlink_errors_limit`."""
    temperature: float = Field(default=0.3, ge=0, le=1)
    """Temperature between `temp_warn_c` and `temp_limit_c`."""
    latency: float = Field(default=0.4, ge=0, le=1)
    """Step latency above the node's baseline, up to `slow_factor` x baseline."""
    heartbeat: float = Field(default=1.0, ge=0, le=1)
    """Missing heartbeat (lease expired): the node is gone."""


class HealthPolicy(_Strict):
    weights: HealthWeights = HealthWeights()
    """Penalty weights."""
    agent_heartbeat_ttl_s: int = Field(default=2, ge=1, le=600)
    """TTL of a health agent's etcd heartbeat lease (refreshed every half of it): a node whose agent misses it is
    drained. 2 s is for dedicated hosts; a CPU-only machine whose cores also run the engines (vLLM's CPU build
    loading two workers on 2 cores) needs more, or the agents starve past it and healthy nodes are drained."""
    drain_below: float = Field(default=0.5, ge=0, le=1)
    """A node whose score falls below this is drained (no new work; live sequences migrate)."""
    recover_above: float = Field(default=0.8, ge=0, le=1)
    """A drained node comes back only when its score is above this ... (hysteresis)"""
    recover_samples: int = Field(default=25, ge=1, le=100_000)
    """... for this many consecutive samples (25 x 200 ms = 5 s), so a flapping node does not bounce."""
    temp_warn_c: float = Field(default=80.0, ge=0, le=150)
    """Temperature where the penalty starts."""
    temp_limit_c: float = Field(default=90.0, ge=0, le=150)
    """Temperature of the full penalty."""
    nvlink_errors_limit: float = Field(default=100.0, gt=0, le=1e12)
    """NVLink CRC/replay errors per sample that count as a full penalty."""
    slow_factor: float = Field(default=3.0, gt=1, le=1000)
    """Step latency this many times the node's baseline is a full latency penalty."""
    interval_ms: int = Field(default=200, ge=10, le=60_000)
    """Health sample interval of the agent."""
    worker_heartbeat_timeout_ms: int | None = Field(default=None, ge=0, le=600_000)
    """A worker heartbeats on `rf:health` every `worker.status_interval_ms` (its status event); the monitor takes a
    node whose heartbeats stop for this long for dead: it revokes the worker's etcd lease (the lease is what owns
    the node's registration, so ownership is still settled in etcd, now at once instead of at the TTL) and moves
    its sequences. Time is the stream's own (the entries' ids), so a monitor that falls behind, or a Valkey
    outage that silences every writer at once, never makes a node look dead. `None` (default): 4 heartbeats
    (800 ms at 200 ms: three missed beats plus one of slack) while `worker.lease_ttl_s` is at most 3 s; off when
    the lease was raised above that for a starved host (vLLM's CPU build), whose heartbeats starve with it.
    0: off (the lease's expiry alone detects a dead worker)."""
    heartbeat_settle_ms: int = Field(default=3000, ge=0, le=600_000)
    """After the health stream as a whole was silent (a Valkey outage or restart, every writer stalled at once),
    no node is judged on its heartbeats until the stream has flowed again this long: the writers' reconnect backoff
    (up to 2 s) staggers when each one comes back. The worker lease still detects a death meanwhile."""

    @model_validator(mode="after")
    def _ordered(self) -> HealthPolicy:
        # inverted, the hysteresis becomes a bounce: a steady score between the two is drained, recovers after
        # recover_samples samples and is drained again at once, forever
        if self.drain_below > self.recover_above:
            raise ValueError(f"drain_below ({self.drain_below}) must not be above recover_above "
                             f"({self.recover_above}): a node would be drained and recovered over and over")
        if self.temp_limit_c <= self.temp_warn_c:
            raise ValueError(f"temp_limit_c ({self.temp_limit_c}) must be above temp_warn_c ({self.temp_warn_c}): "
                             "the temperature penalty ramps from the first to the second")
        return self


class AuthConfig(_Strict):
    mode: Literal["none", "hs256", "rs256"] = "hs256"
    """`hs256` (shared secret), `rs256` (public key) or `none` (local runs only; the gateway warns at start)."""
    secret_env: str = "RACKFLOW_JWT_SECRET"
    """Environment variable holding the HS256 secret (secrets never live in config files)."""
    public_key_file: str | None = None
    """PEM file of the RS256 public key."""
    audience: str | None = None
    """Required `aud` claim, if set."""
    issuer: str | None = None
    """Required `iss` claim, if set."""
    leeway_s: int = Field(default=5, ge=0, le=600)
    """Clock skew tolerated on `exp`/`nbf`."""
    default_tenant: str = "local"
    """Tenant of unauthenticated requests (mode `none`)."""


class TenantPolicy(_Strict):
    """What a tenant's requests get by default (`gateway.tenants.{name}`); its tokens' claims may narrow it."""

    priority: Literal["interactive", "batch"] | None = None
    """The class of the tenant's requests when neither the request (`X-Priority`, `service_tier`) nor its token's
    `priority` claim says (pipeline/priority.py); None: interactive."""
    tpm: int | None = Field(default=None, ge=1, le=10**12)
    """Tokens per minute the tenant's interactive requests may be charged (prompt + expected output), across every
    gateway (workers/stores/rate_limit.py); a token's `tpm` claim takes precedence. None: no limit."""


class GatewayConfig(_Strict):
    host: str = "127.0.0.1"
    """Address the HTTP server binds."""
    port: int = Field(default=8000, ge=0, le=65_535)
    """HTTP port (0: any free port, printed at start)."""
    auth: AuthConfig = AuthConfig()
    """Bearer-token verification."""
    tenants: dict[str, TenantPolicy] = Field(default_factory=dict)
    """Per tenant: its default priority class and its tokens-per-minute limit (docs/PRIORITY.md)."""
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, le=1024**3)
    """Larger request bodies get 413."""
    max_ingress_backlog: int = Field(default=20_000, ge=1, le=100_000_000)
    """Requests waiting for the router (rf:ingress lag + pending) above which new requests get 429."""
    retry_after_s: int = Field(default=1, ge=1, le=3600)
    """`Retry-After` of a 429 for the ingress bound, and the least `Retry-After` of any 429/503."""
    max_rack_queue: int = Field(default=2000, ge=1, le=100_000_000)
    """Requests queued in a rack (its batcher's lag + pending on `rf:rack:{R}:req`, plus the requests waiting in
    its nodes' engines) above which the rack is saturated: a new request gets 429 when the rack the router would
    choose for it (affinity hash + bounded-load walk, predicted by the gateway) is saturated."""
    max_queue_s: float = Field(default=5.0, ge=0, le=86_400)
    """A new request also gets 429 when the queue of the rack it would go to holds more than this many seconds of
    work: its queued requests over the rack's completions per second in the last few seconds (0: only the
    `max_rack_queue` count bound). Above capacity this holds the queue, and so the wait before a first token, near
    this bound instead of letting it grow (pipeline/admission.py; the simulator sheds the same way)."""
    max_retry_after_s: int = Field(default=30, ge=1, le=3600)
    """Cap of the `Retry-After` computed from the queue ahead and the recent completion rate."""
    saturation_refresh_ms: int = Field(default=200, ge=10, le=60_000)
    """How often the gateway re-reads the rack queues (cached in between: no per-request reads)."""
    routing: Literal["router", "inline"] = "inline"
    """Who chooses a request's rack. `router`: the gateway appends it to `rf:ingress` and a router process routes
    it. `inline`: the gateway routes it itself, with the router's policy and prefix feed over the views it reads for
    admission, and writes it straight to its rack's stream (the record on `rf:admitted`, the decision on
    `rf:decisions`) in one round trip; a request for which no rack is healthy still goes to the router, which waits
    for one (workers/stores/rack_routing.py). Celery jobs and the demo's replay always go through the router."""
    user_history_cache_s: float = Field(default=2.0, ge=0, le=3600)
    """How long the gateway keeps a user's output-length history (the EWMA the workers update on completion) before
    it reads it again: a user sending many requests costs one read per interval, not one round trip per request
    (0: read it for every request). The EWMA moves by a fifth of a completion's difference, so a value this old is
    the estimate of one or two completions ago."""
    files_dir: str = ".rackflow/files"
    """Where `/v1/files` keeps uploaded batch inputs and the batches' output and error files (a local directory;
    gateways that share files need a shared volume). Relative paths are from the working directory."""
    max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1024, le=1024**4)
    """Largest file `POST /v1/files` takes (OpenAI's batch input limit: 200 MB); larger gets 413."""
    request_timeout_s: float = Field(default=600.0, gt=0, le=86_400)
    """How long the gateway waits for a request's final result before answering with a timeout error."""
    max_n: int = Field(default=16, ge=1, le=128)
    """Most completions per request (`n`): each is its own sequence, routed and batched as a request of its own
    (the later ones find the prompt's prefix cached), so n counts n times against admission."""
    redis_max_connections: int = Field(default=32, ge=4, le=100_000)
    """Connections to Redis/Valkey of one gateway process. An open request holds none while it waits: one reader
    serves every open request through the gateway's reply stream (`reply_queue_events`); admission and result
    reads take a pooled connection for one round trip."""
    reply_queue_events: int = Field(default=256, ge=4, le=100_000)
    """Events (token chunks, the result) buffered in the gateway per open request. A slow client that lets its
    buffer fill is not given more memory: it catches up from its request's own stream when it reads again."""
    reply_sweep_ms: int = Field(default=1000, ge=50, le=60_000)
    """How often the gateway checks, in one read, whether a quiet open request's result was written but never
    reached its reply stream (then it reads it from the request's own stream)."""
    reply_ttl_s: int = Field(default=120, ge=10, le=86_400)
    """A gateway's reply stream expires this long after the gateway stopped refreshing it (a crashed gateway)."""
    shutdown_grace_s: int = Field(default=10, ge=0, le=3600)
    """On SIGTERM, open streams get this long to finish."""
    http_parser: Literal["httptools", "h11"] = "httptools"
    """uvicorn's HTTP/1.1 parser: `httptools` (C, llhttp; a dependency) or `h11` (pure Python). Measured side by
    side with `rackflow bench gateway --http-parser h11|httptools` (docs/GUIDE.md, Benchmarks)."""
    backlog: int = Field(default=16384, ge=64, le=1_000_000)
    """The listening socket's accept queue (uvicorn's default is 2048; the kernel caps it at net.core.somaxconn):
    thousands of clients connecting at once must wait in it rather than be reset."""
    keep_alive_s: int = Field(default=75, ge=1, le=3600)
    """How long an idle HTTP keep-alive connection stays open. Keep it LONGER than the idle timeout of whatever
    holds connections to the gateway (load balancer: AWS ALB 60 s; HTTP client pools: httpx 5 s): when both sides
    time out together, the client can send a request on a connection the server is closing and get a reset."""


class BatchesConfig(_Strict):
    """The OpenAI Batch API's runner (workers/control/batches.py, docs/BATCH.md): how a batch's lines go through the
    cluster, as `batch`-class requests (pipeline/priority.py)."""

    max_in_flight: int = Field(default=256, ge=1, le=100_000)
    """Lines of one batch admitted and not finished at a time: the batch's share of the queues. More gives the
    batchers more to fill idle slots with; the batch class already keeps it behind interactive work."""
    admit_concurrency: int = Field(default=32, ge=1, le=1024)
    """Lines admitted together (one round of `Gateway.admit` calls at once) while the batch fills its
    `max_in_flight`."""
    poll_ms: int = Field(default=200, ge=10, le=60_000)
    """How often the runner reads its lines' final-result markers (one MGET of every line in flight)."""
    slice_s: float = Field(default=20.0, ge=1.0, le=3600.0)
    """How long one run of the task works on a batch before it hands the batch to its next run (a new task
    message). Keep it well under the Celery broker's visibility timeout (60 s, workers/control/app.py): a task held
    longer than that is delivered a second time while it still runs."""
    lease_s: float = Field(default=15.0, ge=1.0, le=3600.0)
    """The runner's lease on its batch (renewed at every poll): a second delivery of the task waits for it, and a
    runner killed outright gives the batch up when it runs out."""
    line_timeout_s: float = Field(default=3600.0, gt=0, le=86_400 * 7)
    """A line admitted this long ago without a final result is cancelled and ends in the error file (504,
    `timeout`): a request the cluster lost cannot hold its batch forever."""
    max_requests: int = Field(default=50_000, ge=1, le=50_000)
    """Requests in one batch (OpenAI's limit, 50,000, is the most)."""
    retention_s: int = Field(default=7 * 86_400, ge=3600, le=365 * 86_400)
    """How long a batch's record and its lines' results stay in Valkey after its completion window (24 h) ends.
    Its output and error files stay in the file store (`gateway.files_dir`) until deleted."""


class TracingConfig(_Strict):
    enabled: bool = False
    """OpenTelemetry spans of each request across gateway -> router -> batcher -> worker (needs the `otel` extra;
    the shell's RACKFLOW_TRACING=1 turns it on as well). Off: no span is made and nothing is allocated for it."""
    exporter: Literal["none", "console", "otlp"] = "otlp"
    """Where finished spans go: `otlp` (OTLP over HTTP to `otlp_endpoint`), `console` (stdout), `none` (spans are
    made and propagated but not exported)."""
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    """OTLP/HTTP traces endpoint of the collector."""
    sample_ratio: float = Field(default=1.0, ge=0, le=1)
    """Fraction of requests traced; decided once at the gateway, every later hop follows that decision."""


class ObservabilityPolicy(_Strict):
    tracing: TracingConfig = TracingConfig()
    """OpenTelemetry tracing of requests (off by default)."""
    log_json: bool = False
    """Logs as one JSON object per line (also `--log-json` or RACKFLOW_LOG_JSON=1)."""


class Policies(_Strict):
    profiling: ProfilingPolicy = ProfilingPolicy()
    router: RouterPolicy = RouterPolicy()
    node_selection: NodeSelectionPolicy = NodeSelectionPolicy()
    batcher: BatcherPolicy = BatcherPolicy()
    worker: WorkerPolicy = WorkerPolicy()
    streams: StreamsPolicy = StreamsPolicy()
    health: HealthPolicy = HealthPolicy()
    kv: KvTierConfig = KvTierConfig()
    observability: ObservabilityPolicy = ObservabilityPolicy()
    seed: int = Field(default=20231116, ge=0, le=2**63 - 1)
    """Seed of every random choice (weighted random dispatch); replay reproduces decisions with it."""

    def idle_pace_ms(self) -> float:
        """The slowest pace of an idle node's heartbeats and health samples: `worker.idle_status_interval_ms`, capped
        at a third of `node_selection.stale_ms` (an idle node's status must never look stale)."""
        return min(float(self.worker.idle_status_interval_ms), self.node_selection.stale_ms / 3.0)

    def worker_heartbeat_timeout_ms(self) -> int:
        """The heartbeat window in force (`health.worker_heartbeat_timeout_ms`, its default resolved); 0: off."""
        t = self.health.worker_heartbeat_timeout_ms
        if t is None:
            return 4 * self.worker.status_interval_ms if self.worker.lease_ttl_s <= 3 else 0
        return t

    @model_validator(mode="after")
    def _heartbeat_window(self) -> Policies:
        t = self.health.worker_heartbeat_timeout_ms
        if t and t < 2 * self.worker.status_interval_ms:
            raise ValueError(
                f"health.worker_heartbeat_timeout_ms ({t}) must be at least twice worker.status_interval_ms "
                f"({self.worker.status_interval_ms}): a worker would be taken for dead between two heartbeats")
        return self


class RackflowConfig(_Strict):
    gpus: dict[str, GpuSpec]
    models: dict[str, ModelSpec]
    cluster: ClusterSpec
    policies: Policies = Policies()
    gateway: GatewayConfig = GatewayConfig()
    batches: BatchesConfig = BatchesConfig()

    @model_validator(mode="after")
    def _references(self) -> RackflowConfig:
        for name, model in self.models.items():
            for g in model.gpu_pool:
                if g not in self.gpus:
                    raise ValueError(
                        f"models.{name}.gpu_pool: unknown gpu {g!r}; allowed: {', '.join(sorted(self.gpus))}"
                    )
        for i, rack in enumerate(self.cluster.racks):
            for j, node in enumerate(rack.expanded()):
                where = f"cluster.racks.{i}.nodes.{j}" if rack.nodes else f"cluster.racks.{i}.node"
                if node.gpu not in self.gpus:
                    raise ValueError(
                        f"{where}.gpu (rack {rack.name}, node {node.name}): unknown gpu {node.gpu!r}; "
                        f"allowed: {', '.join(sorted(self.gpus))}"
                    )
                for m in node.models:
                    if m not in self.models:
                        raise ValueError(
                            f"{where}.models (rack {rack.name}, node {node.name}): unknown model {m!r}; "
                            f"allowed: {', '.join(sorted(self.models))}"
                        )
                    pool = self.models[m].gpu_pool
                    if pool and node.gpu not in pool:
                        raise ValueError(
                            f"{where}.gpu (rack {rack.name}, node {node.name}): {m} is placed on "
                            f"{', '.join(pool)} only (models.{m}.gpu_pool), not {node.gpu}"
                        )
                    need = self.models[m].weight_bytes / node.tp
                    have = self.gpus[node.gpu].memory_gb * 1e9
                    usable = have * self.policies.batcher.mem_budget_fraction
                    if need >= usable:
                        min_tp = math.floor(self.models[m].weight_bytes / usable) + 1
                        raise ValueError(
                            f"{where}.tp (node {node.name}): {m} needs {need / 1e9:.0f} GB of weights per GPU "
                            f"at tp={node.tp} "
                            f"but {node.gpu} has {usable / 1e9:.0f} GB usable "
                            f"({self.policies.batcher.mem_budget_fraction:g} of {have / 1e9:.0f} GB); "
                            f"raise tp to at least {min_tp}"
                        )
        return self

    # -- derived views (memoized: the config is frozen, and these sit on every request's path) ------------------
    _memo: dict[tuple[Any, ...], Any] = PrivateAttr(default_factory=dict)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> RackflowConfig:
        copy = super().model_copy(update=update, deep=deep)
        copy._memo = {}  # a copy with other fields must not inherit derived views of the original
        return copy

    def _cached(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        # the private-attribute dict directly: `self._memo` goes through pydantic's __getattr__ on every call (1.2% of
        # the gateway's CPU under `rackflow bench gateway`, these lookups 3%)
        memo: dict[tuple[Any, ...], Any] = self.__pydantic_private__["_memo"]  # type: ignore[index]
        v = memo.get(key, _MISSING)
        if v is _MISSING:
            v = make()
            memo[key] = v
        return v

    def nodes(self) -> tuple[NodeSpec, ...]:
        return self._cached(("nodes",), lambda: tuple(n for r in self.cluster.racks for n in r.expanded()))  # type: ignore[no-any-return]

    def _node_index(self) -> dict[str, tuple[str, NodeSpec]]:
        return self._cached(  # type: ignore[no-any-return]
            ("node_index",), lambda: {n.name: (r.name, n) for r in self.cluster.racks for n in r.expanded()}
        )

    def rack_of(self, node: str) -> str:
        hit = self._node_index().get(node)
        if hit is None:
            raise KeyError(f"unknown node {node!r}; nodes: {', '.join(n.name for n in self.nodes())}")
        return hit[0]

    def node(self, name: str) -> NodeSpec:
        hit = self._node_index().get(name)
        if hit is None:
            raise KeyError(f"unknown node {name!r}; nodes: {', '.join(n.name for n in self.nodes())}")
        return hit[1]

    def rack_names(self) -> tuple[str, ...]:
        return self._cached(("rack_names",), lambda: tuple(r.name for r in self.cluster.racks))  # type: ignore[no-any-return]

    def token_rates(self, model: str) -> TokenRates:
        return self.models[model].token_rates or self.policies.profiling.token_rates

    def nodes_serving(self, model: str, rack: str | None = None) -> tuple[str, ...]:
        return self._cached(  # type: ignore[no-any-return]
            ("nodes_serving", model, rack),
            lambda: tuple(
                n.name
                for r in self.cluster.racks
                if rack is None or r.name == rack
                for n in r.expanded()
                if model in n.models
            ),
        )

    def racks_serving(self, model: str) -> tuple[str, ...]:
        return self._cached(  # type: ignore[no-any-return]
            ("racks_serving", model),
            lambda: tuple(r.name for r in self.cluster.racks if any(model in n.models for n in r.expanded())),
        )

    def node_kv_capacity_kb(self, node: str) -> float:
        """The KV cache of one node's engine, KB: mem_budget_fraction (vLLM's gpu_memory_utilization) of its GPU
        memory x tp, less the weights of the model it serves (its first). What the batcher's budget is measured
        against when the engine reports nothing else."""
        spec = self.node(node)
        gpu = self.gpus[spec.gpu]
        usable = gpu.memory_gb * 1e9 * spec.tp * self.policies.batcher.mem_budget_fraction
        return max(0.0, usable - self.models[spec.models[0]].weight_bytes) / 1000.0

    def node_mem_budget_kb(self, node: str) -> float:
        """The batcher's memory cap for one node: mem_budget_fraction of its GPU memory x tp, in KB."""
        spec = self.node(node)
        gpu = self.gpus[spec.gpu]
        return gpu.memory_gb * 1e6 * spec.tp * self.policies.batcher.mem_budget_fraction


_MISSING = object()


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def overlay(raw: Mapping[str, Any], over: Mapping[str, Any], source: str = "overlay") -> dict[str, Any]:
    """`raw` with `over` merged on top (mappings merge key by key, anything else replaces), as a new dict: how an
    override file applies, and how code builds a small variant of a config without writing a temporary file:
    `parse_config(overlay(raw_config(), {"cluster": {...}, "policies": {"seed": 3}}))`. `over` may only have the
    top-level keys of TOP_LEVEL_KEYS; `source` names it in the error otherwise."""
    unknown = sorted(set(over) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise ConfigError(f"{source}: unknown top-level keys {unknown}; allowed: {', '.join(TOP_LEVEL_KEYS)}")
    return _deep_merge(dict(raw), over)


def read_yaml(path: Path) -> dict[str, Any]:
    """One YAML file as a mapping (an empty file is {}); ConfigError naming the file when it is not."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def raw_config(config_dir: Path = DEFAULT_CONFIG_DIR, overrides: Iterable[Path] = ()) -> dict[str, Any]:
    """The merged YAML as plain data: `config_dir/{gpus,models,cluster,policies,gateway}.yaml`, then each override
    file (a YAML with any of the TOP_LEVEL_KEYS) merged on top (`overlay`)."""
    raw: dict[str, Any] = {}
    for name in CONFIG_FILES:
        path = config_dir / name
        if path.exists():
            raw[name.removesuffix(".yaml")] = read_yaml(path)
    for path in overrides:
        raw = overlay(raw, read_yaml(Path(path)), source=str(path))
    return raw


def parse_config(raw: Mapping[str, Any], source: str = "config") -> RackflowConfig:
    """Validate plain data into a RackflowConfig; errors name every bad field path and what is allowed."""
    try:
        return RackflowConfig.model_validate(raw)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            path = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            got = err.get("input")
            shown = "" if isinstance(got, dict | list | tuple) or got is None or not path else f" (got {got!r})"
            lines.append(f"  {path}: {msg}{shown}" if path else f"  {msg}")
        raise ConfigError(f"invalid {source}:\n" + "\n".join(lines)) from None


def load_config(config_dir: Path = DEFAULT_CONFIG_DIR, overrides: Iterable[Path] = ()) -> RackflowConfig:
    overrides = list(overrides)
    src = ", ".join([str(config_dir), *map(str, overrides)])
    return parse_config(raw_config(config_dir, overrides), source=f"config ({src})")
