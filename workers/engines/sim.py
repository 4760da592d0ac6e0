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
from pipeline.kv.snapshot import KvSnapshot
from pipeline.routing.hashring import stable_hash64
from workers.engines.base import EngineError, EngineStats, SeqFinished, StepOutput, TokenOut

_WORDS = (
    "the of and to in is for on that with as it by at from this be are or an was not which have but can all "
    "cluster rack node token batch cache memory stream request model window budget weight latency health"
).split()


_GOLDEN = 0x9E3779B97F4A7C15
_WORD_TEXT = tuple(w + " " for w in _WORDS)


def placeholder_token(request_id: str, index: int, vocab: int, seed: int | None = None) -> tuple[int, str]:
    """Deterministic token `index` of a request: a Weyl sequence from a stable hash of the request id (pass the
    hash as `seed` to skip rehashing it for every token)."""
    h = stable_hash64(request_id) if seed is None else seed
    tid = ((h + (index + 1) * _GOLDEN) & 0xFFFFFFFFFFFFFFFF) % vocab
    return tid, _WORD_TEXT[tid % len(_WORD_TEXT)]


@dataclass(slots=True)
class _Seq:
    req: RequestEvent
    generated: int = 0
    seed: int = -1
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
        zero_time: bool = False,
    ) -> None:
        self.cost = cost
        self.zero_time = zero_time
        """Iterations take no time: the control plane alone is measured (`rackflow bench pipeline`)."""
        self.slow_factor = 1.0
        """An injected `slow` fault: iterations take this many times longer."""
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

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def submit(self, req: RequestEvent) -> None:
        self.waiting.append(_Seq(req))

    def _model_id(self) -> str:
        return f"sim:{self.cost.model.layers}x{self.cost.model.hidden}"

    def export_kv(self, request_id: str, version: int, remove: bool = False) -> KvSnapshot:
        """The sim engine holds no real KV: a snapshot carries the position (and token ids) so another sim engine
        resumes with the same placeholder tokens."""
        seq = self.running.get(request_id) or next((s for s in self.waiting if s.req.request_id == request_id), None)
        if seq is None:
            raise EngineError(f"sim engine holds no sequence {request_id}")
        vocab = self.cost.model.vocab
        generated = tuple(placeholder_token(request_id, i, vocab)[0] for i in range(seq.generated))
        snap = KvSnapshot(
            seq_id=request_id, version=version, model=self._model_id(), engine="sim",
            token_ids=generated, prompt_len=seq.req.in_tokens, generated=generated, max_tokens=seq.req.max_tokens,
            meta={"kv_bytes": (seq.req.in_tokens + seq.generated) * self.cost.model.kv_bytes_per_token,
                  "start_ms": seq.start_ms, "first_token_ms": seq.first_token_ms},
        )
        if remove:
            self.abort(request_id)
        return snap

    def resume_snapshot(
        self, req: RequestEvent, generated: tuple[int, ...], start_ms: float = 0.0, first_token_ms: float = 0.0
    ) -> KvSnapshot:
        """A snapshot for a sequence that moved here without KV: it continues at token len(generated)."""
        return KvSnapshot(
            seq_id=req.request_id, version=req.version, model=self._model_id(), engine="sim",
            token_ids=tuple(generated), prompt_len=req.in_tokens, generated=tuple(generated),
            max_tokens=req.max_tokens, meta={"start_ms": start_ms, "first_token_ms": first_token_ms},
        )

    def import_kv(self, snapshot: KvSnapshot, req: RequestEvent) -> None:
        if snapshot.engine != "sim" or snapshot.model != self._model_id():
            raise EngineError(
                f"snapshot of {snapshot.engine}/{snapshot.model} cannot resume on sim/{self._model_id()}"
            )
        seq = _Seq(req, generated=len(snapshot.generated), prefilled=len(snapshot.generated) > 0,
                   start_ms=float(snapshot.meta.get("start_ms", 0.0)),
                   first_token_ms=float(snapshot.meta.get("first_token_ms", 0.0)))
        self.waiting.append(seq)

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
            if not head.start_ms:
                head.start_ms = now
            self.running[head.req.request_id] = head
            self.kv_used_kb += head.req.mem_est_kb
            admitted.append(head)
        return admitted

    async def step(self) -> StepOutput:
        t0 = self.now_ms()
        wall0 = time.perf_counter()
        # decoding: what ran before this step (a resumed sequence admitted now is prefilled already, and must not
        # be in both lists: it would make two tokens in one step, and crash the loop when it finishes)
        decoding = [s for s in self.running.values() if s.prefilled]
        new = self._admit(t0)
        kv_tokens = sum(s.req.in_tokens + s.generated for s in decoding)
        step_ms = self.cost.step_ms([s.req.in_tokens for s in new], len(decoding), kv_tokens) * self.slow_factor
        # Sleep the remainder of the iteration time not already spent on our own bookkeeping.
        spent = (time.perf_counter() - wall0) * 1000.0
        if self.zero_time:
            await asyncio.sleep(0)  # yield to the worker's other tasks, take no simulated time
        else:
            await self._sleep(max(0.0, step_ms - spent) / 1000.0)  # type: ignore[misc]
        end = self.now_ms()
        tokens: list[TokenOut] = []
        finished: list[SeqFinished] = []
        vocab = self.cost.model.vocab
        for s in [*decoding, *new]:
            if self.running.get(s.req.request_id) is not s:
                continue  # aborted (cancelled, released) while this step ran: no token, and it is not ours to end
            if s.seed < 0:
                s.seed = stable_hash64(s.req.request_id)
            tid, text = placeholder_token(s.req.request_id, s.generated, vocab, s.seed)
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
