"""`sim` engine: the simulator's engine model (`pipeline.sim.node.SimNode`) run in real time, with placeholder tokens.

Not a mock: it is the very engine model the simulator runs, so a live cluster of `sim` workers and `rackflow sim`
schedule alike. It behaves like vLLM v1 (with `--scheduling-policy priority` where batch-class requests are present:
interactive sequences first, a batch one preempted for an interactive one that finds no slot or KV room): FCFS
admission within the iteration's token budget (chunked prefill, 8,192
tokens counting the decode tokens) while KV blocks and the sequence limit allow, automatic prefix caching in blocks
of chained prefix hashes with a host-memory tier below it, recompute preemption of the youngest sequence when KV runs
out; each iteration takes the time the calibrated cost model gives for the node's GPU and model (times an injected
`slow` factor), slept in real time. Here each decode phase is one step, so that every iteration hands out its tokens.
Tokens are deterministic placeholders (a hash of request id and position), so a sequence that moves to another sim
engine continues with the same tokens. The prefix cache's block events (stored / removed) are kept for the worker,
which publishes them for the batchers' and the router's prefix indexes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.config import ModelSpec
from pipeline.costmodel import IterationCostModel
from pipeline.costmodel.online import SpeedBelief
from pipeline.events import RequestEvent
from pipeline.kv.snapshot import KvSnapshot
from pipeline.routing.hashring import stable_hash64
from pipeline.sampling import decode as decode_sampling
from pipeline.sim.node import SimNode, SimSeq
from pipeline.sim.world import NodeWorld
from workers.engines.base import EngineError, EngineStats, SeqFinished, StepOutput, StepWindow, TokenOut

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
    rid: int
    seed: int
    generated: int = 0
    start_ms: float = 0.0
    first_token_ms: float = 0.0
    natural: int = 0
    """Where the answer ends on its own ("stop"; 0: at max_tokens)."""


def token_seed(req: RequestEvent) -> int:
    """The placeholder sampler's seed: the client's `seed` (with the prompt: the same seed and prompt give the same
    answer), the prompt alone at temperature 0 (greedy: one answer per prompt), else the request's id (a fresh
    draw per request)."""
    if req.sampling:
        s = decode_sampling(req.sampling)
        if s.seed is not None:
            return stable_hash64(f"seed:{s.seed}:{req.prompt}")
        if s.temperature == 0:
            return stable_hash64(f"greedy:{req.prompt}")
    return stable_hash64(req.request_id)


def natural_end(req: RequestEvent, model: ModelSpec, seed: int) -> int:
    """Where the placeholder model's answer ends on its own: a replayed trace's true length (`sim_out_tokens`);
    for a request whose cap is the whole room left in the context (a client that sent no max_tokens), a length drawn
    by the seed from 0.5-1.5x the model's default output, as a real model ends at its end-of-sequence token;
    otherwise 0 (the answer runs to max_tokens, as a benchmark asks)."""
    if req.sim_out_tokens > 0:
        return req.sim_out_tokens
    if req.max_tokens >= model.context - max(1, req.in_tokens):
        return max(1, round(model.default_out_tokens * (0.5 + ((seed >> 11) & ((1 << 53) - 1)) / 2.0**53)))
    return 0


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
        *,
        block_size: int = 16,
        max_batched_tokens: int = 8192,
        prefix_block_tokens: int = 512,
        host_cache_blocks: int = 0,
        world: NodeWorld | None = None,
        preempt_batch: bool = True,
        batch_reserve: int = 0,
    ) -> None:
        self.cost = cost
        self.zero_time = zero_time
        """Iterations take no time: the control plane alone is measured (`rackflow bench pipeline`)."""
        self.kv_capacity_kb = kv_capacity_kb
        self.max_running = max_running
        self.now_ms = now_ms
        self._sleep = sleep or asyncio.sleep
        m = cost.model
        total_gb = cost.gpu.memory_gb * cost.tp
        self.block_events: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        """(stored, removed) prefix-block hashes since the worker last took them."""
        self.node = SimNode(
            "sim", "", cost,  # type: ignore[arg-type]
            kv_capacity_tokens=max(block_size, int(kv_capacity_kb * 1000 // m.kv_bytes_per_token)),
            block_size=block_size, max_num_seqs=max_running, max_batched_tokens=max_batched_tokens,
            mem_cap_kb=kv_capacity_kb, vram_total_gb=total_gb, weights_gb=m.weight_bytes / 1e9,
            kv_bytes_per_token=m.kv_bytes_per_token, prefix_block_tokens=prefix_block_tokens,
            host_cache_blocks=host_cache_blocks, host_link_gbps=cost.gpu.pcie_gbps / 2 * cost.tp,
            block_listener=lambda stored, removed: self.block_events.append((stored, removed)),
            max_stretch_steps=1, world=world, preempt_batch=preempt_batch, batch_reserve=batch_reserve,
        )
        self.belief = SpeedBelief()
        """What the node's iterations say of its speed against the cost model (reported as `slowdown` and
        `prefill_slowdown` in the node status): the estimator the simulator's control plane uses."""
        self._seqs: dict[str, _Seq] = {}
        self._by_rid: dict[int, _Seq] = {}
        self._next_rid = 0
        self._stepping = False
        self._abort_after_step: set[str] = set()
        self.steps = 0
        self.tokens = 0
        self._recent = StepWindow(10_000.0)  # step times of the last 10 s

    @property
    def slow_factor(self) -> float:
        """An injected `slow` fault: iterations take this many times longer."""
        return self.node.slow_factor

    @slow_factor.setter
    def slow_factor(self, factor: float) -> None:
        self.node.slow_factor = max(1.0, factor)

    @property
    def kv_used_kb(self) -> float:
        """What the batcher reserved for the sequences here (its memory estimates)."""
        return self.node.mem_est_used

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def _model_id(self) -> str:
        return f"sim:{self.cost.model.layers}x{self.cost.model.hidden}"

    def _add(self, req: RequestEvent, generated: int, resident: bool, start_ms: float = 0.0,
             first_token_ms: float = 0.0) -> None:
        if req.request_id in self._seqs:
            raise EngineError(f"sim engine already holds sequence {req.request_id}")
        rid = self._next_rid
        self._next_rid += 1
        seed = token_seed(req)
        seq = _Seq(req, rid, seed, generated, start_ms, first_token_ms, natural_end(req, self.cost.model, seed))
        self._seqs[req.request_id] = seq
        self._by_rid[rid] = seq
        prompt = max(1, req.in_tokens) + generated
        prefix = req.prefix_hashes if req.prefix_cache else ()
        # the answer's own end, where it comes before max_tokens: the sequence ends there ("stop")
        stop_at = min(req.max_tokens, seq.natural) if seq.natural > 0 else req.max_tokens
        self.node.submit(SimSeq(rid, prompt, max(1, stop_at - generated), req.mem_est_kb, prefix,
                                resident=resident, priority=req.priority))

    def submit(self, req: RequestEvent) -> None:
        self._add(req, 0, resident=False)

    def export_kv(self, request_id: str, version: int, remove: bool = False) -> KvSnapshot:
        """The sim engine holds no real KV: a snapshot carries the position (and token ids) so another sim engine
        resumes with the same placeholder tokens, its KV resident there."""
        seq = self._seqs.get(request_id)
        if seq is None or request_id in self._abort_after_step:
            raise EngineError(f"sim engine holds no sequence {request_id}")
        vocab = self.cost.model.vocab
        generated = tuple(placeholder_token(request_id, i, vocab, seq.seed)[0] for i in range(seq.generated))
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
        """A snapshot for a sequence that moved here without KV: it re-prefills prompt + generated and continues
        at token len(generated)."""
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
        self._add(req, len(snapshot.generated), resident="kv_bytes" in snapshot.meta,
                  start_ms=float(snapshot.meta.get("start_ms", 0.0)),
                  first_token_ms=float(snapshot.meta.get("first_token_ms", 0.0)))

    def has_work(self) -> bool:
        return len(self._seqs) > len(self._abort_after_step)

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.get(request_id)
        if seq is None or request_id in self._abort_after_step:
            return False
        if self._stepping:  # the iteration in progress still holds it: it gets no token and goes after the step
            self._abort_after_step.add(request_id)
            return True
        self._drop(seq)
        return True

    def _drop(self, seq: _Seq) -> None:
        self.node.abort(seq.rid)
        del self._seqs[seq.req.request_id]
        del self._by_rid[seq.rid]

    async def step(self) -> StepOutput:
        node = self.node
        t0 = self.now_ms()
        wall0 = time.perf_counter()
        end = node.schedule(t0)
        if end is None:
            return StepOutput((), (), 0.0)
        decoding = list(node.decoding)  # they get a token from this iteration, whatever it also prefills
        self._stepping = True
        try:
            if self.zero_time:
                await asyncio.sleep(0)  # yield to the worker's other tasks, take no simulated time
            else:
                spent = (time.perf_counter() - wall0) * 1000.0
                await self._sleep(max(0.0, end - t0 - spent) / 1000.0)  # type: ignore[misc]
        finally:
            self._stepping = False
        now = t0 if self.zero_time else max(end, self.now_ms())
        res = node.finish_phase(now)
        if node.last_report is not None:
            self.belief.observe(*node.last_report)
            node.last_report = None
        gone = self._abort_after_step
        tokens: list[TokenOut] = []
        vocab = self.cost.model.vocab
        for rid in (*decoding, *(r for r, _ in res.first_tokens)):
            seq = self._by_rid.get(rid)
            if seq is None or seq.req.request_id in gone:
                continue
            tid, text = placeholder_token(seq.req.request_id, seq.generated, vocab, seq.seed)
            tokens.append(TokenOut(seq.req.request_id, seq.generated, tid, text))
            if seq.generated == 0:
                seq.first_token_ms = now
            if not seq.start_ms:
                seq.start_ms = t0
            seq.generated += 1
        finished: list[SeqFinished] = []
        for f in res.finished:
            seq = self._by_rid.get(f.rid)
            if seq is None:
                continue
            del self._seqs[seq.req.request_id]
            del self._by_rid[seq.rid]
            if seq.req.request_id in gone:
                gone.discard(seq.req.request_id)
                continue
            r = seq.req
            reason = "stop" if 0 < seq.natural < r.max_tokens and seq.generated >= seq.natural else "length"
            finished.append(SeqFinished(r.request_id, seq.generated, seq.start_ms, seq.first_token_ms, now, reason))
        for request_id in list(gone):
            seq = self._seqs.get(request_id)
            if seq is not None:
                self._drop(seq)
        gone.clear()
        self.steps += 1
        self.tokens += len(tokens)
        actual = now - t0
        self._recent.add(now, actual)
        return StepOutput(tuple(tokens), tuple(finished), actual)

    def take_block_events(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        out, self.block_events = self.block_events, []
        return out

    def stats(self) -> EngineStats:
        node = self.node
        return EngineStats(
            running=node.running,
            waiting=len(node.waiting),
            kv_capacity_kb=self.kv_capacity_kb,
            kv_used_kb=node.mem_est_used,
            gpu_mem_total_gb=node.vram_total_gb,
            gpu_mem_free_gb=node.free_vram_gb(),
            avg_step_ms=self._recent.mean(self.now_ms()),
            steps=self.steps,
            tokens=self.tokens,
            prefill_tokens=node.prefill_backlog,
            batch_prefill_tokens=node.batch_prefill(),
            decode_seqs=len(node.decoding),
            decode_tokens=node.kv_decoding,
            kv_usage=node.kv_usage,
            slowdown=node.slowdown if node.world is None else self.belief.decode,
            prefill_slowdown=0.0 if node.world is None else self.belief.prefill,
            max_seqs=node.max_num_seqs,
            prefix_hit_tokens=node.cached_tokens,
            prompt_tokens=node.prompt_tokens,
        )
