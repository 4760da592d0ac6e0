"""The engine interface: a continuous-batching engine driven one iteration at a time (like vLLM's
`LLMEngine.step()`).

`start`/`stop` own its resources; `submit` queues a sequence; `step` runs one iteration and returns the tokens it
produced and the sequences that finished; `abort` drops one; `export_kv` snapshots a live sequence's KV state (and,
with `remove=True`, takes it out of the engine: swap-out or migration); `import_kv` resumes a sequence from a
snapshot so that it continues with exactly the tokens an uninterrupted run would give (greedy decoding); `stats`
reports its load for the node status. Engines: `sim` (cost-model timing), `torch` (a real small transformer),
`vllm` (vLLM, on a GPU or its CPU build).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Protocol

from pipeline.errors import RackflowError
from pipeline.events import RequestEvent
from pipeline.kv.snapshot import KvSnapshot


class StepWindow:
    """The mean iteration time over the last `span_ms` of wall time, kept in O(1) per step and per read (a deque
    with a running sum). A zero-time engine steps thousands of times in that span: rebuilding a list of them on
    every step and every status read was 14% of a worker's CPU under `rackflow bench gateway` (py-spy)."""

    __slots__ = ("_sum", "_times", "span_ms")

    def __init__(self, span_ms: float = 10_000.0) -> None:
        self.span_ms = span_ms
        self._times: collections.deque[tuple[float, float]] = collections.deque()  # (end wall ms, step ms)
        self._sum = 0.0

    def add(self, end_ms: float, step_ms: float) -> None:
        self._times.append((end_ms, step_ms))
        self._sum += step_ms
        self._expire(end_ms)

    def _expire(self, now_ms: float) -> None:
        times, edge = self._times, now_ms - self.span_ms
        while times and times[0][0] < edge:
            self._sum -= times.popleft()[1]
        if not times:
            self._sum = 0.0  # no drift left behind by the float additions

    def mean(self, now_ms: float | None = None) -> float:
        """Mean step time of the steps that ended in the window (to `now_ms`, else to the last step); 0 without."""
        if now_ms is not None:
            self._expire(now_ms)
        return max(0.0, self._sum / len(self._times)) if self._times else 0.0

    def __len__(self) -> int:
        return len(self._times)


class EngineError(RackflowError, RuntimeError):
    """The engine cannot do what was asked (unknown sequence, snapshot for another model, ...)."""


@dataclass(frozen=True, slots=True)
class TokenOut:
    request_id: str
    index: int
    token_id: int
    text: str
    logprob: tuple[float, str, tuple[tuple[str, float], ...]] | None = None
    """When the client asked for log probabilities (an engine that computes them): the token's, its own text, and
    the most likely alternatives' (text, log probability), best first."""


@dataclass(frozen=True, slots=True)
class SeqFinished:
    request_id: str
    out_tokens: int
    start_ms: float
    first_token_ms: float
    finish_ms: float
    reason: str = "length"
    """`length` (max_tokens reached) or `stop` (end-of-sequence token)."""
    error: str = ""
    """Set when the engine refused or failed the sequence (e.g. a prompt longer than the model's context): its
    result is an `error` with this message, never an `ok` of the tokens it had."""


@dataclass(frozen=True, slots=True)
class StepOutput:
    tokens: tuple[TokenOut, ...]
    finished: tuple[SeqFinished, ...]
    step_ms: float


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int
    waiting: int
    kv_capacity_kb: float
    kv_used_kb: float
    gpu_mem_total_gb: float
    gpu_mem_free_gb: float
    avg_step_ms: float
    """Mean iteration time over the last 10 s (the node's inter-token latency)."""
    steps: int
    tokens: int
    swapped_out: int = 0
    """Sequences whose KV the engine moved to a lower tier (L1/L2) to make room."""
    prefill_tokens: int = 0
    batch_prefill_tokens: int = -1
    """Of `prefill_tokens`, the batch-class sequences' (-1: the engine does not tell them apart; the worker counts
    the prompts of its batch sequences that have no token yet)."""
    """Prompt tokens queued and not prefilled yet (waiting sequences' whole prompts, the rest of those prefilling)."""
    decode_seqs: int = 0
    decode_tokens: int = 0
    """KV tokens of the decoding sequences."""
    kv_usage: float = 0.0
    """The engine's own KV-cache use, 0..1."""
    slowdown: float = 1.0
    """Observed iteration time over the cost model's for the same iterations (1: as the GPU type should run)."""
    max_seqs: int = 0
    """Sequences it runs at once (0: not bounded by the engine)."""
    prefill_slowdown: float = 0.0
    """The prefill part's ratio, learned apart from the decode part's `slowdown` (0: not measured)."""
    prefix_hit_tokens: int = 0
    """Prompt tokens its prefix cache saved since it started (of `prompt_tokens`)."""
    prompt_tokens: int = 0
    kv_blocks_total: int = 0
    """Paged KV-cache blocks the engine allocated (vLLM's num_gpu_blocks; 0: not a paged engine)."""
    kv_blocks_free: int = 0
    kv_block_tokens: int = 0
    """Tokens per KV block."""
    preempted: int = 0
    """Sequences the engine preempted (recomputed or swapped) since it started."""


class Engine(Protocol):
    name: str

    async def start(self) -> None: ...

    def submit(self, req: RequestEvent) -> None: ...

    def has_work(self) -> bool: ...

    async def step(self) -> StepOutput: ...

    def abort(self, request_id: str) -> bool: ...

    def export_kv(self, request_id: str, version: int, remove: bool = False) -> KvSnapshot: ...

    def import_kv(self, snapshot: KvSnapshot, req: RequestEvent) -> None: ...

    def resume_snapshot(
        self, req: RequestEvent, generated: tuple[int, ...], start_ms: float = 0.0, first_token_ms: float = 0.0
    ) -> KvSnapshot:
        """A snapshot without KV for a sequence moved here whose KV is not in the tiers: importing it re-prefills
        prompt + `generated` and continues after them."""
        ...

    def stats(self) -> EngineStats: ...

    async def stop(self) -> None: ...
