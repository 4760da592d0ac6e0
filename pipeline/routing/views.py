"""What routing policies see of the cluster: plain snapshots built by the shell from live status."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(slots=True, unsafe_hash=True)
class RackView:
    name: str
    healthy: bool
    """At least one active node."""
    load: float
    """Outstanding work of the rack (requests queued + running), in requests."""
    work: float = 0.0
    """Outstanding work of the rack in prompt-token units: prefill tokens queued (in its batcher and its engines)
    plus `router.decode_weight_tokens` per sequence queued or running. 0 with `nodes` 0: not known."""
    nodes: int = 0
    """Active nodes of the rack (the work is compared per node); 0: work not known, balance on `load`."""

    def __init__(self, name: str, healthy: bool, load: float, work: float = 0.0, nodes: int = 0) -> None:
        # written out (not the dataclass's): compiled, the generated __init__ stays interpreted (6x slower); the
        # simulator builds millions of these. tests/unit/test_native_init.py keeps it equal to the fields.
        self.name = name
        self.healthy = healthy
        self.load = load
        self.work = work
        self.nodes = nodes

    @property
    def work_per_node(self) -> float:
        return self.work / self.nodes if self.nodes > 0 else 0.0


@dataclass(slots=True, unsafe_hash=True)
class NodeView:
    name: str
    active: bool
    """Registered and not draining."""
    vram_total_gb: float
    free_vram_gb: float
    pcie_util_pct: float
    avg_latency_ms: float
    kv_capacity_kb: float
    kv_free_kb: float
    """Free KV memory for new sequences, after reservations the batcher has not seen admitted yet."""
    running: int
    waiting: int
    prefill_tokens: int = 0
    """Prompt tokens queued on the node that are not prefilled yet: the uncached rest of the prompts it is
    prefilling and the whole prompts of the sequences waiting for admission (and of batches dispatched to it that it
    has not admitted yet). The prefill work ahead of a new request."""
    decode_seqs: int = 0
    """Sequences in their decode phase (each gets one token per iteration)."""
    decode_tokens: int = 0
    """KV tokens of the decoding sequences: what one decode iteration reads."""
    kv_usage: float = 0.0
    """The engine's own KV-cache use, 0..1 of its KV blocks (vLLM's `gpu_cache_usage_perc`), not the batcher's
    estimate."""
    slowdown: float = 1.0
    """Observed iteration time over the cost model's prediction for the same iterations (EWMA); 1: as fast as the
    node's GPU type should be, 1.5: a throttled or degraded node."""
    max_seqs: int = 0
    """Sequences the engine runs at once (vLLM's max_num_seqs); 0: unknown (no slot bound)."""
    prefill_slowdown: float | None = None
    """The same ratio for the prefill part of iterations, learned apart from the decode part's (`slowdown`):
    `pipeline.costmodel.online.SpeedBelief`; None: as `slowdown`."""
    batch_seqs: int = 0
    """Of `running + waiting`, the sequences of the `batch` class: an interactive request takes their slots and
    memory (the engine preempts them, `batcher.batch_yield: preempt`)."""
    batch_kv_kb: float = 0.0
    """The estimated KV memory those batch sequences hold."""
    batch_prefill_tokens: int = 0
    """Of `prefill_tokens`, the batch sequences' (an interactive request's prefill goes first: it does not wait
    behind them)."""

    def __init__(self, name: str, active: bool, vram_total_gb: float, free_vram_gb: float, pcie_util_pct: float,
                 avg_latency_ms: float, kv_capacity_kb: float, kv_free_kb: float, running: int, waiting: int,
                 prefill_tokens: int = 0, decode_seqs: int = 0, decode_tokens: int = 0, kv_usage: float = 0.0,
                 slowdown: float = 1.0, max_seqs: int = 0, prefill_slowdown: float | None = None,
                 batch_seqs: int = 0, batch_kv_kb: float = 0.0, batch_prefill_tokens: int = 0) -> None:
        # written out: see RackView.__init__
        self.name = name
        self.active = active
        self.vram_total_gb = vram_total_gb
        self.free_vram_gb = free_vram_gb
        self.pcie_util_pct = pcie_util_pct
        self.avg_latency_ms = avg_latency_ms
        self.kv_capacity_kb = kv_capacity_kb
        self.kv_free_kb = kv_free_kb
        self.running = running
        self.waiting = waiting
        self.prefill_tokens = prefill_tokens
        self.decode_seqs = decode_seqs
        self.decode_tokens = decode_tokens
        self.kv_usage = kv_usage
        self.slowdown = slowdown
        self.max_seqs = max_seqs
        self.prefill_slowdown = prefill_slowdown
        self.batch_seqs = batch_seqs
        self.batch_kv_kb = batch_kv_kb
        self.batch_prefill_tokens = batch_prefill_tokens

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0

    def with_placed(self, mem_kb: float, prompt_tokens: int, batch: bool = False) -> NodeView:
        """The view after a batcher placed one more request on the node (it waits there: its memory reserved, its
        prompt queued for prefill; `batch`: a batch-class one). `dataclasses.replace` with those fields, without its
        per-call field introspection (a close places every request through this)."""
        return NodeView(
            self.name, self.active, self.vram_total_gb, self.free_vram_gb, self.pcie_util_pct, self.avg_latency_ms,
            self.kv_capacity_kb, max(0.0, self.kv_free_kb - mem_kb), self.running, self.waiting + 1,
            self.prefill_tokens + prompt_tokens, self.decode_seqs, self.decode_tokens, self.kv_usage, self.slowdown,
            self.max_seqs, self.prefill_slowdown, self.batch_seqs + batch,
            self.batch_kv_kb + (mem_kb if batch else 0.0),
            self.batch_prefill_tokens + (prompt_tokens if batch else 0),
        )

    def for_interactive(self, preempt: bool) -> NodeView:
        """The node as an interactive request sees it: the batch sequences' queued prefill left out (an interactive
        prefill goes first); with `preempt`, their slots and memory too (the engine preempts them for it): they are
        taken from the waiting ones first, then from the running ones. Their decoding stays: it slows every
        iteration whatever the class."""
        if not self.batch_seqs and not self.batch_prefill_tokens:
            return self
        if not preempt:
            return replace(self, prefill_tokens=max(0, self.prefill_tokens - self.batch_prefill_tokens),
                           batch_prefill_tokens=0)
        from_waiting = min(self.waiting, self.batch_seqs)
        from_running = min(self.running, self.batch_seqs - from_waiting)
        return replace(self, prefill_tokens=max(0, self.prefill_tokens - self.batch_prefill_tokens),
                       kv_free_kb=self.kv_free_kb + self.batch_kv_kb, waiting=self.waiting - from_waiting,
                       running=self.running - from_running, batch_seqs=0, batch_kv_kb=0.0, batch_prefill_tokens=0)
