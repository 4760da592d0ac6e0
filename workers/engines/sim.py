"""`sim` engine: continuous batching with iteration times from the roofline cost model, placeholder tokens.

Not a mock: it schedules like vLLM (FCFS admission while KV memory and the running limit allow, prefill of new
sequences in the same iteration as one decode token for the running ones) and takes the time the cost model gives
for the node's GPU and model. Tokens are deterministic placeholders (a hash of request id and position).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.costmodel import IterationCostModel
from pipeline.events import RequestEvent
from pipeline.routing.hashring import stable_hash64
from workers.engines.base import EngineStats, SeqFinished, StepOutput, TokenOut

_WORDS = (
    "the of and to in is for on that with as it by at from this be are or an was not which have but can all "
    "cluster rack node token batch cache memory stream request model window budget weight latency health"
).split()


def placeholder_token(request_id: str, index: int, vocab: int) -> tuple[int, str]:
    tid = stable_hash64(f"{request_id}:{index}") % vocab
    return tid, _WORDS[tid % len(_WORDS)] + " "


@dataclass(slots=True)
class _Seq:
    req: RequestEvent
    generated: int = 0
    prefilled: bool = False
    start_ms: float = 0.0
    first_token_ms: float = 0.0


class SimEngine:
    name = "sim"

    def __init__(
        self,
        cost: IterationCostModel,
        kv_capacity_kb: float,
        max_running: int,
        now_ms: Callable[[], float],
        sleep: Callable[[float], object] | None = None,
    ) -> None:
        self.cost = cost
        self.kv_capacity_kb = kv_capacity_kb
        self.max_running = max_running
        self.now_ms = now_ms
        self._sleep = sleep or asyncio.sleep
        self.waiting: collections.deque[_Seq] = collections.deque()
        self.running: dict[str, _Seq] = {}
        self.kv_used_kb = 0.0
        self._steps: collections.deque[tuple[float, float]] = collections.deque()  # (end wall ms, step ms)
        self.steps = 0
        self.tokens = 0

    def submit(self, req: RequestEvent) -> None:
        self.waiting.append(_Seq(req))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> bool:
        seq = self.running.pop(request_id, None)
        if seq is not None:
            self.kv_used_kb -= seq.req.mem_est_kb
            return True
        for s in list(self.waiting):
            if s.req.request_id == request_id:
                self.waiting.remove(s)
                return True
        return False

    def _admit(self, now: float) -> list[_Seq]:
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            head = self.waiting[0]
            fits = self.kv_used_kb + head.req.mem_est_kb <= self.kv_capacity_kb
            if not fits and self.running:
                break  # FCFS: wait for memory instead of letting smaller ones overtake forever
            self.waiting.popleft()
            head.start_ms = now
            self.running[head.req.request_id] = head
            self.kv_used_kb += head.req.mem_est_kb
            admitted.append(head)
        return admitted

    async def step(self) -> StepOutput:
        t0 = self.now_ms()
        wall0 = time.perf_counter()
        new = self._admit(t0)
        decoding = [s for s in self.running.values() if s.prefilled]
        kv_tokens = sum(s.req.in_tokens + s.generated for s in decoding)
        step_ms = self.cost.step_ms([s.req.in_tokens for s in new], len(decoding), kv_tokens)
        # Sleep the remainder of the iteration time not already spent on our own bookkeeping.
        spent = (time.perf_counter() - wall0) * 1000.0
        await self._sleep(max(0.0, step_ms - spent) / 1000.0)  # type: ignore[misc]
        end = self.now_ms()
        tokens: list[TokenOut] = []
        finished: list[SeqFinished] = []
        vocab = self.cost.model.vocab
        for s in [*decoding, *new]:
            tid, text = placeholder_token(s.req.request_id, s.generated, vocab)
            tokens.append(TokenOut(s.req.request_id, s.generated, tid, text))
            if s.generated == 0:
                s.first_token_ms = end
                s.prefilled = True
            s.generated += 1
            if s.generated >= s.req.max_tokens:
                del self.running[s.req.request_id]
                self.kv_used_kb -= s.req.mem_est_kb
                finished.append(SeqFinished(s.req.request_id, s.generated, s.start_ms, s.first_token_ms, end))
        self.steps += 1
        self.tokens += len(tokens)
        actual = end - t0
        self._steps.append((end, actual))
        while self._steps and self._steps[0][0] < end - 10_000:
            self._steps.popleft()
        return StepOutput(tuple(tokens), tuple(finished), actual)

    def stats(self) -> EngineStats:
        m = self.cost.model
        total_gb = self.cost.gpu.memory_gb * self.cost.tp
        kv_bytes = sum((s.req.in_tokens + s.generated) * m.kv_bytes_per_token for s in self.running.values())
        free_gb = max(0.0, total_gb - m.weight_bytes / 1e9 - kv_bytes / 1e9)
        avg = sum(ms for _, ms in self._steps) / len(self._steps) if self._steps else 0.0
        return EngineStats(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_capacity_kb=self.kv_capacity_kb,
            kv_used_kb=self.kv_used_kb,
            gpu_mem_total_gb=total_gb,
            gpu_mem_free_gb=free_gb,
            avg_step_ms=avg,
            steps=self.steps,
            tokens=self.tokens,
        )
