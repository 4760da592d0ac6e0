"""`vllm` engine: vLLM's V1 async engine (`vllm.v1.engine.async_llm.AsyncLLM`) behind rackflow's Engine interface.

Optional (`pip install .[vllm]`, a CUDA GPU). vLLM runs its own continuous batching; this adapter turns its
per-request output streams (RequestOutputKind.DELTA) into the step-wise interface the worker drives: `submit` starts
a generation task per request, `step` waits briefly for whatever tokens arrived and returns them.
- abort: `AsyncLLM.abort(request_id)`;
- per-request prefix-cache control: a request with `prefix_cache=False` gets a unique `cache_salt`, so it neither
  reads nor seeds the shared prefix cache (vLLM >= 0.9);
- KV offloading to CPU memory (our L1) through vLLM's KV-connector configuration (`OffloadingConnector`, or
  `LMCacheConnectorV1` when LMCache is installed), set from `policies.kv`;
- export_kv / import_kv: vLLM exposes no per-sequence KV tensors through its public API, so a snapshot carries the
  token ids and a resume re-prefills them (cheap with the prefix cache, and the KV connector may restore the blocks
  from CPU); with greedy sampling the continuation equals the uninterrupted run up to vLLM's batch-dependent
  numerics (vLLM is not bitwise batch-invariant unless run with its batch-invariant mode).
Untested on this CPU-only machine; `tests/gpu/run_vllm_check.sh` exercises it on a GPU host.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.events import RequestEvent
from pipeline.kv.snapshot import KvSnapshot
from workers.engines.base import EngineError, EngineStats, SeqFinished, StepOutput, TokenOut

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Live:
    req: RequestEvent
    prompt_ids: list[int]
    generated: list[int] = field(default_factory=list)
    start_ms: float = 0.0
    first_token_ms: float = 0.0
    task: asyncio.Task[None] | None = None


class VllmEngine:
    name = "vllm"

    def __init__(
        self,
        model: str,
        now_ms: Callable[[], float],
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        cpu_offload_gb: float = 0.0,
        kv_connector: str | None = None,
        extra_engine_args: dict[str, Any] | None = None,
        kv_capacity_kb: float = 0.0,
    ) -> None:
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise EngineError(
                "the vllm engine needs vLLM and a CUDA GPU: pip install '.[vllm]' (or use --engine sim|torch)"
            ) from e
        self.model = model
        self.now_ms = now_ms
        self.kv_capacity_kb = kv_capacity_kb
        """The batcher's budget for this node; `kv_used_kb` is the sum of its live requests' estimates (vLLM
        manages the real blocks and preempts when they run out)."""
        self.args: dict[str, Any] = {
            "model": model,
            "tensor_parallel_size": tensor_parallel_size,
            "gpu_memory_utilization": gpu_memory_utilization,
            "enable_prefix_caching": enable_prefix_caching,
            **({"max_model_len": max_model_len} if max_model_len else {}),
            **(extra_engine_args or {}),
        }
        if kv_connector:
            from vllm.config import KVTransferConfig

            blocks = max(1, int(cpu_offload_gb * 1e9 // (16 * 1024 * 1024)))  # of ~16 MB (model dependent)
            extra = {"num_cpu_blocks": blocks} if cpu_offload_gb else {}
            self.args["kv_transfer_config"] = KVTransferConfig(
                kv_connector=kv_connector, kv_role="kv_both", kv_connector_extra_config=extra
            )
        self.engine: Any = None
        self.tokenizer: Any = None
        self.live: dict[str, _Live] = {}
        self._outbox: asyncio.Queue[tuple[str, list[int], str, bool, str]] = asyncio.Queue()
        self._steps: collections.deque[tuple[float, float]] = collections.deque()
        self.steps = 0
        self.tokens = 0

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.args))
        self.tokenizer = await self.engine.get_tokenizer()
        log.info("vllm engine ready: %s", self.args)

    async def stop(self) -> None:
        for live in list(self.live.values()):
            if live.task is not None:
                live.task.cancel()
        if self.engine is not None:
            self.engine.shutdown()

    # -- intake ------------------------------------------------------------------------------------------------
    def _prompt_ids(self, req: RequestEvent) -> list[int]:
        if req.prompt:
            return list(self.tokenizer.encode(req.prompt))
        # trace-driven requests carry only a length: deterministic filler tokens of that length
        vocab = int(getattr(self.tokenizer, "vocab_size", 32000))
        seed = uuid.UUID(req.request_id).int if len(req.request_id) == 36 else hash(req.request_id)
        return [(seed + 7919 * i) % vocab for i in range(max(1, req.in_tokens))]

    def submit(self, req: RequestEvent) -> None:
        self._start(req, self._prompt_ids(req), [])

    def _start(self, req: RequestEvent, prompt_ids: list[int], generated: list[int]) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        live = _Live(req, prompt_ids, list(generated), start_ms=self.now_ms())
        self.live[req.request_id] = live
        params = SamplingParams(
            max_tokens=max(1, req.max_tokens - len(generated)), temperature=0.0,
            output_kind=RequestOutputKind.DELTA,
        )
        prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids + list(generated)}
        if not req.prefix_cache:
            prompt["cache_salt"] = f"rackflow-nocache-{req.request_id}"
        live.task = asyncio.ensure_future(self._pump(req.request_id, prompt, params))

    async def _pump(self, rid: str, prompt: dict[str, Any], params: Any) -> None:
        try:
            async for out in self.engine.generate(prompt, params, request_id=f"{rid}-{uuid.uuid4().hex[:8]}"):
                c = out.outputs[0]
                await self._outbox.put((rid, list(c.token_ids), c.text, bool(out.finished), c.finish_reason or ""))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # reported as a finished sequence with an error reason
            log.exception("vllm request %s failed", rid)
            await self._outbox.put((rid, [], "", True, f"error: {e}"))

    def has_work(self) -> bool:
        return bool(self.live) or not self._outbox.empty()

    async def step(self) -> StepOutput:
        t0 = time.perf_counter()
        items = []
        try:
            items.append(await asyncio.wait_for(self._outbox.get(), timeout=0.05))
            while not self._outbox.empty():
                items.append(self._outbox.get_nowait())
        except TimeoutError:
            pass
        now = self.now_ms()
        tokens: list[TokenOut] = []
        finished: list[SeqFinished] = []
        for rid, ids, text, done, reason in items:
            live = self.live.get(rid)
            if live is None:
                continue
            for k, tid in enumerate(ids):
                index = len(live.generated)
                if index == 0:
                    live.first_token_ms = now
                live.generated.append(tid)
                tokens.append(TokenOut(rid, index, tid, text if k == len(ids) - 1 else ""))
            if done:
                del self.live[rid]
                finished.append(SeqFinished(rid, len(live.generated), live.start_ms, live.first_token_ms, now,
                                            "stop" if reason == "stop" else "length"))
        dt = (time.perf_counter() - t0) * 1000.0
        self.steps += 1
        self.tokens += len(tokens)
        self._steps.append((now, dt))
        while self._steps and self._steps[0][0] < now - 10_000:
            self._steps.popleft()
        return StepOutput(tuple(tokens), tuple(finished), dt)

    def abort(self, request_id: str) -> bool:
        live = self.live.pop(request_id, None)
        if live is None:
            return False
        if live.task is not None:
            live.task.cancel()  # closing the generator aborts the request inside vLLM
        return True

    def export_kv(self, request_id: str, version: int, remove: bool = False) -> KvSnapshot:
        live = self.live.get(request_id)
        if live is None:
            raise EngineError(f"vllm engine holds no sequence {request_id}")
        snap = KvSnapshot(
            seq_id=request_id, version=version, model=f"vllm:{self.model}", engine="vllm",
            token_ids=tuple(live.prompt_ids + live.generated), prompt_len=len(live.prompt_ids),
            generated=tuple(live.generated), max_tokens=live.req.max_tokens,
            meta={"start_ms": live.start_ms, "first_token_ms": live.first_token_ms, "kv": "re-prefill"},
        )
        if remove:
            self.abort(request_id)
        return snap

    def resume_snapshot(
        self, req: RequestEvent, generated: tuple[int, ...], start_ms: float = 0.0, first_token_ms: float = 0.0
    ) -> KvSnapshot:
        prompt = self._prompt_ids(req)
        return KvSnapshot(
            seq_id=req.request_id, version=req.version, model=f"vllm:{self.model}", engine="vllm",
            token_ids=(*prompt, *generated), prompt_len=len(prompt), generated=tuple(generated),
            max_tokens=req.max_tokens,
            meta={"start_ms": start_ms, "first_token_ms": first_token_ms, "kv": "re-prefill"},
        )

    def import_kv(self, snapshot: KvSnapshot, req: RequestEvent) -> None:
        if snapshot.engine not in ("vllm", "sim") or (snapshot.engine == "vllm" and
                                                       snapshot.model != f"vllm:{self.model}"):
            raise EngineError(f"snapshot of {snapshot.engine}/{snapshot.model} cannot resume on vllm:{self.model}")
        prompt = list(snapshot.token_ids[: snapshot.prompt_len])
        self._start(req, prompt, list(snapshot.generated))
        live = self.live[req.request_id]
        live.first_token_ms = float(snapshot.meta.get("first_token_ms", 0.0))

    def stats(self) -> EngineStats:
        avg = sum(ms for _, ms in self._steps) / len(self._steps) if self._steps else 0.0
        used = sum(live.req.mem_est_kb for live in self.live.values())
        total_gb = free_gb = 0.0
        try:
            import torch

            if torch.cuda.is_available():
                free, total = torch.cuda.mem_get_info()
                total_gb, free_gb = total / 1e9, free / 1e9
        except Exception:  # stats must never fail the worker
            pass
        return EngineStats(
            running=len(self.live), waiting=0, kv_capacity_kb=self.kv_capacity_kb, kv_used_kb=used,
            gpu_mem_total_gb=total_gb,
            gpu_mem_free_gb=max(free_gb, total_gb * (1 - used / max(1.0, self.kv_capacity_kb))),
            avg_step_ms=avg, steps=self.steps, tokens=self.tokens,
        )
