"""The engine interface: a continuous-batching engine driven one iteration at a time (like vLLM's
`LLMEngine.step()`): `submit` queues a sequence, `step` runs one iteration and returns the tokens it produced and
the sequences that finished, `abort` drops one, `stats` reports its load for the node status."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pipeline.events import RequestEvent


@dataclass(frozen=True, slots=True)
class TokenOut:
    request_id: str
    index: int
    token_id: int
    text: str


@dataclass(frozen=True, slots=True)
class SeqFinished:
    request_id: str
    out_tokens: int
    start_ms: float
    first_token_ms: float
    finish_ms: float
    reason: str = "length"


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


class Engine(Protocol):
    name: str

    def submit(self, req: RequestEvent) -> None: ...

    def has_work(self) -> bool: ...

    async def step(self) -> StepOutput: ...

    def abort(self, request_id: str) -> bool: ...

    def stats(self) -> EngineStats: ...
