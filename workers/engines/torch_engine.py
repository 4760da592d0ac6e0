"""`torch` engine: a real Qwen2-architecture transformer with continuous batching over its KV cache.

One concern in one file (over 500 lines on purpose): one engine, its model, its scheduler and its KV cache.

Owns the model (built from a config shape with a fixed seed, or loaded from a local checkpoint; nothing is
downloaded), the per-sequence KV cache (L0), admission against `kv_capacity_mb`, swap-out of the least recently used
sequence to a lower tier through callbacks, and KV export/import as `KvSnapshot`s that resume exactly in another
process. It never reads the clock itself (`now_ms` is injected), never touches Redis or etcd, never downloads.

One iteration (`step`):
  1. admission: swapped-out sequences resume first (FIFO), then waiting ones FCFS while the running set stays within
     `max_batch` and the KV reserved by the running set (prompt + max_tokens per sequence, capped at the context)
     stays within `kv_capacity_mb`; a waiting sequence that does not fit swaps out the least recently used running
     sequences when a swap callback is set (never one admitted in this iteration, and never while another swapped-out
     sequence still waits to come back, so swapping cannot thrash), else it waits (also after the swap store
     refused one, until a running sequence leaves). `stats().kv_used_kb` is the KV actually held, which grows
     into the reservation;
  2. decode: ONE forward for every running sequence that has its KV: the per-sequence caches are stacked LEFT-padded
     into a `DynamicCache`, with a 2-D attention mask that is 0 on the padding and per-sequence position ids (the
     rotary position of the new token is the sequence's own length), then split back per sequence (padding
     stripped);
  3. prefill: each newly admitted prompt gets its own forward, which yields its first token; it joins the decode
     batch at the next iteration.
Sampling is greedy (temperature 0: argmax over the tokenizer's real ids), so a run is a deterministic function of the
weights and the prompt: this is what makes "resume exactly" testable. With `threads=1` results are bit-identical
across processes. Batching changes the shapes of the matmuls, so logits of a sequence decoded in a batch may differ
from the same sequence decoded alone in the last bits (measured: ~2e-7 in float32); greedy tokens only differ on an
exact near-tie. Export/import and swap restore the K/V bytes exactly, so a resumed sequence computes what it would
have computed had it never left.

Threads: `step` runs the model in a worker thread (`asyncio.to_thread`) so the worker's event loop keeps streaming
and acknowledging. `submit`/`import_kv` only append to an inbox; `abort` never waits for an iteration in flight (it
is applied when that iteration ends); `export_kv` waits for it (at most one iteration). Swap callbacks are called
from the compute thread.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline.config import ModelSpec, TorchEngineConfig
from pipeline.costmodel.online import SpeedBelief
from pipeline.events import RequestEvent
from pipeline.kv.snapshot import KvSnapshot
from pipeline.sampling import Sampling
from pipeline.sampling import decode as decode_sampling
from workers.engines.base import EngineError, EngineStats, SeqFinished, StepOutput, StepWindow, TokenOut
from workers.engines.tokenizer import BOS, BYTE_VOCAB, EOS, PAD, StreamDecoder, TextTokenizer, load_tokenizer

if TYPE_CHECKING:
    from pipeline.routing.node_policies.base import StepTime

log = logging.getLogger(__name__)

ENGINE = "torch"
KV_LAYOUT = "per layer: K then V, each [kv_heads, kv_tokens, head_dim] C-order raw bytes"
_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
_FULL_HASH_NUMEL = 1 << 24
"""Models up to this many parameters are fingerprinted over every weight; larger ones over a sample of each."""

KvLayers = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (K, V), each [kv_heads, kv_tokens, head_dim]."""
SwapPut = Callable[[KvSnapshot], "bool | None"]
SwapGet = Callable[[str], KvSnapshot | None]
LogitsHook = Callable[[str, int, torch.Tensor], None]


@dataclass(slots=True, eq=False)
class _Seq:
    req: RequestEvent
    prompt: list[int]
    decoder: StreamDecoder
    generated: list[int] = field(default_factory=list)
    kv: KvLayers | None = None
    """KV of `tokens[:-1]` once decoding (the last token is pending: it is the next decode input); None: not held
    here (waiting for prefill, swapped out, or to be recomputed)."""
    start_ms: float = 0.0
    first_token_ms: float = 0.0
    last_used: int = 0
    """Iteration that last decoded (or admitted) it: the LRU key."""
    admitted: int = 0
    """Admission counter: the LRU tie-break (earliest admitted first)."""
    reserved: int = 0
    """KV bytes reserved in L0 while running."""
    sampling: Sampling | None = None
    """What the client asked of the sampler (None: greedy)."""

    @property
    def rid(self) -> str:
        return self.req.request_id

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def kv_len(self) -> int:
        return 0 if self.kv is None else int(self.kv[0][0].shape[1])


@dataclass(frozen=True, slots=True)
class _Gauges:
    """What `stats()` reports, published by the compute thread at the end of each change (one atomic assignment)."""

    running: int = 0
    waiting: int = 0
    swapped: int = 0
    kv_bytes: int = 0
    avg_step_ms: float = 0.0


def _weights_fingerprint(model: torch.nn.Module, extra: dict[str, Any]) -> str:
    """A short hash of the weights (and shape config), so a snapshot resumes only on identical weights."""
    h = hashlib.sha256(json.dumps(extra, sort_keys=True, default=str).encode())
    params = sorted(model.state_dict().items())
    full = sum(t.numel() for _, t in params) <= _FULL_HASH_NUMEL
    for name, t in params:
        flat = t.detach().reshape(-1)
        if not full:
            flat = flat[:4096]
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(flat.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _cache_rows(cache: Any, row: int, start: int) -> KvLayers:
    """Row `row` of a (batched) DynamicCache, per layer (K, V) from position `start` on (views, no copy)."""
    return [(layer.keys[row, :, start:], layer.values[row, :, start:]) for layer in cache.layers]


class TorchEngine:
    """The Engine protocol on a real transformer (see the module docstring for the iteration and its guarantees)."""

    name = ENGINE
    kv_in_estimate_units = False
    """Its KV figures are the stand-in model's real bytes, not the served model's estimates the batcher budgets
    with: the worker reports the node's budget and its sequences' estimates instead (`Worker.health_event`)."""

    def __init__(
        self,
        config: TorchEngineConfig,
        spec: ModelSpec | None,
        now_ms: Callable[[], float],
        *,
        prefill_budget_tokens: int = 8192,
        logits_hook: LogitsHook | None = None,
        cost: StepTime | None = None,
    ) -> None:
        """`spec`: the shape of `config.model` (a key of `config.models`); ignored when `config.checkpoint` is set.
        `prefill_budget_tokens`: most prompt tokens prefilled in one iteration (at least one prompt always is), so a
        burst of long prompts does not stall the running sequences. `logits_hook(request_id, index, logits)` sees
        the raw logits of every token chosen (tests, analysis); it runs in the compute thread. `cost`: the control
        plane's price of this node's iterations, the prior that the speed belief corrects from each iteration it runs
        (None: no belief, `slowdown` stays 1)."""
        if config.dtype not in _DTYPES:
            raise EngineError(f"torch engine dtype {config.dtype!r} is not supported; use one of {sorted(_DTYPES)}")
        self.config = config
        self.now_ms = now_ms
        self.cost = cost
        self.belief = SpeedBelief()
        """This node's speed against `cost`, from the iterations it runs (their exact shapes: prompt tokens
        prefilled, sequences decoded, the KV they read): the simulator's estimator, reported as `slowdown` and
        `prefill_slowdown`."""
        self.prefill_budget_tokens = max(1, prefill_budget_tokens)
        self.logits_hook = logits_hook
        self.dtype = _DTYPES[config.dtype]
        torch.set_num_threads(config.threads)
        self.model, label = self._build_model(config, spec)
        mc = self.model.config
        if any(t != "full_attention" for t in getattr(mc, "layer_types", None) or ()):
            raise EngineError(f"{label}: sliding-window layers are not supported by the torch engine's KV handling")
        self.layers = int(mc.num_hidden_layers)
        self.kv_heads = int(mc.num_key_value_heads)
        self.head_dim = int(getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads)
        self.context = int(mc.max_position_embeddings)
        self.vocab = int(mc.vocab_size)
        self.tokenizer: TextTokenizer = self._build_tokenizer(config, mc)
        if self.tokenizer.vocab_size > self.vocab:
            raise EngineError(
                f"{label}: tokenizer {self.tokenizer.name} has {self.tokenizer.vocab_size} ids but the model only "
                f"{self.vocab} rows"
            )
        eos = set()
        if config.stop_at_eos:
            eos_cfg = getattr(self.model.generation_config, "eos_token_id", None) or self.tokenizer.eos_id
            eos = set(eos_cfg if isinstance(eos_cfg, list) else [eos_cfg] if eos_cfg is not None else [])
        self.eos_ids = frozenset(int(e) for e in eos)
        banned = torch.zeros(self.vocab, dtype=torch.bool)
        banned[self.tokenizer.vocab_size :] = True  # padding rows of the embedding: never real tokens
        for special in (self.tokenizer.bos_id, self.tokenizer.pad_id):
            if special is not None and special not in self.eos_ids:
                banned[special] = True
        self._banned = banned
        self.elem_bytes = torch.empty((), dtype=self.dtype).element_size()
        self.kv_bytes_per_token = 2 * self.layers * self.kv_heads * self.head_dim * self.elem_bytes
        self.kv_capacity_bytes = int(config.kv_capacity_mb * 1e6)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        fp = _weights_fingerprint(self.model, {
            "layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "vocab": self.vocab,
            "rope": getattr(mc, "rope_parameters", None), "eps": getattr(mc, "rms_norm_eps", None),
            "tokenizer": self.tokenizer.name,
        })
        self.model_id = f"{label}:{config.dtype}:{fp}"
        """What a snapshot must carry to import here: model, seed or checkpoint, dtype and a hash of the weights."""

        self._lock = threading.Lock()
        self._inbox: collections.deque[RequestEvent | _Seq] = collections.deque()
        self._pending_aborts: set[str] = set()
        self.waiting: collections.deque[_Seq] = collections.deque()
        self.running: dict[str, _Seq] = {}
        self.swapped: collections.OrderedDict[str, _Seq] = collections.OrderedDict()
        self._reserved = 0
        self._swap_put: SwapPut | None = None
        self._swap_get: SwapGet | None = None
        self._swap_blocked = False
        """The swap store refused or failed: no swap-out until a running sequence leaves (no retry every step)."""
        self._admit_counter = 0
        self._now = 0.0
        """The clock at the start of the iteration in progress."""
        self._step_times = StepWindow(10_000.0)  # step times of the last 10 s
        self._gauges = _Gauges()
        self.steps = 0
        self.tokens = 0
        self.swaps_total = 0
        """Swap-outs since start (stats().swapped_out is how many are out now)."""
        self.last_decode_batch = 0
        """How many sequences the last iteration decoded in its one batched forward."""

    # -- construction ------------------------------------------------------------------------------------------
    def _build_model(self, config: TorchEngineConfig, spec: ModelSpec | None) -> tuple[Any, str]:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        if config.checkpoint:
            path = Path(config.checkpoint)
            if not (path / "config.json").is_file():
                raise EngineError(f"torch engine checkpoint {path} has no config.json (a local Hugging Face "
                                  f"checkpoint directory is expected; nothing is downloaded)")
            try:
                model = Qwen2ForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=self.dtype)
            except (OSError, ValueError) as e:
                raise EngineError(f"torch engine cannot load checkpoint {path}: {e}") from e
            label = f"ckpt-{path.resolve().name}"
        else:
            if spec is None:
                raise EngineError(f"torch engine model {config.model!r}: no shape given (a key of `models`)")
            qcfg = Qwen2Config(
                vocab_size=max(spec.vocab, BYTE_VOCAB), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                max_position_embeddings=spec.context, tie_word_embeddings=False, attn_implementation="sdpa",
                bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
            )  # type: ignore[call-arg]  # attn_implementation: a PreTrainedConfig kwarg the stub does not list
            with torch.random.fork_rng(devices=[]):  # seed the init without touching the process's global RNG
                torch.manual_seed(config.seed)
                model = Qwen2ForCausalLM(qcfg)  # type: ignore[no-untyped-call]
            model = model.to(self.dtype)  # type: ignore[arg-type]
            label = f"{config.model}-seed{config.seed}"
        model.eval()  # type: ignore[no-untyped-call]
        for p in model.parameters():
            p.requires_grad_(False)
        return model, label

    def _build_tokenizer(self, config: TorchEngineConfig, mc: Any) -> TextTokenizer:
        if not config.checkpoint:
            return load_tokenizer(None)
        eos = getattr(mc, "eos_token_id", None)
        return load_tokenizer(
            config.checkpoint,
            bos_id=getattr(mc, "bos_token_id", None) if getattr(mc, "add_bos_token", False) else None,
            eos_id=eos[0] if isinstance(eos, list) else eos,
            pad_id=getattr(mc, "pad_token_id", None),
        )

    # -- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Nothing to do: the model is built by the constructor (so a bad checkpoint fails at worker start)."""
        return None

    async def stop(self) -> None:
        await asyncio.to_thread(self._clear)

    def _clear(self) -> None:
        with self._lock:
            self._inbox.clear()
            self.waiting.clear()
            self.running.clear()
            self.swapped.clear()
            self._reserved = 0
            self._publish()

    def set_swap(self, put: SwapPut | None, get: SwapGet | None) -> None:
        """Where swapped-out sequences go (L1/L2): `put(snapshot)` stores one (returning False or raising: not
        stored, the sequence stays), `get(request_id)` returns it (None: lost; the sequence is then rebuilt by
        re-prefilling its tokens). Both are synchronous and called from the compute thread, never from the event
        loop, so an async store fits behind `asyncio.run_coroutine_threadsafe(manager.put(s), loop).result()`.
        Without them the engine never admits beyond `kv_capacity_mb`: new sequences wait."""
        if (put is None) != (get is None):
            raise ValueError("set_swap needs both put and get (or neither)")
        self._swap_put, self._swap_get = put, get

    # -- intake ------------------------------------------------------------------------------------------------
    def submit(self, req: RequestEvent) -> None:
        self._inbox.append(req)

    def has_work(self) -> bool:
        return bool(self._inbox or self.waiting or self.running or self.swapped)

    def _holds(self, rid: str) -> bool:
        return (
            rid in self.running or rid in self.swapped or any(s.rid == rid for s in list(self.waiting))
            or any((x.request_id if isinstance(x, RequestEvent) else x.rid) == rid for x in list(self._inbox))
        )

    def abort(self, request_id: str) -> bool:
        """Drop a sequence (waiting, running or swapped out) and free its KV; False when it is not here. During an
        iteration in flight the abort is applied when that iteration ends (its tokens are not reported)."""
        if self._lock.acquire(blocking=False):
            try:
                self._drain_inbox()
                found = self._abort_locked(request_id)
                self._publish()
                return found
            finally:
                self._lock.release()
        known = self._holds(request_id)
        self._pending_aborts.add(request_id)
        return known

    def _abort_locked(self, rid: str) -> bool:
        seq = self.running.pop(rid, None)
        if seq is not None:
            self._swap_blocked = False  # room changed: a swap-out may succeed again
            self._reserved -= seq.reserved
            seq.kv = None
            return True
        if self.swapped.pop(rid, None) is not None:
            return True
        for s in list(self.waiting):
            if s.rid == rid:
                self.waiting.remove(s)
                return True
        return False

    def _drain_inbox(self) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            seq = self._new_seq(item) if isinstance(item, RequestEvent) else item
            if seq.rid in self.running or seq.rid in self.swapped or any(s.rid == seq.rid for s in self.waiting):
                log.warning("torch engine: sequence %s submitted again while held; ignoring the duplicate", seq.rid)
                continue
            if not seq.req.priority and self.waiting and self.waiting[-1].req.priority:
                # an interactive sequence waits ahead of every batch one (pipeline/priority.py)
                k = next(k for k, s in enumerate(self.waiting) if s.req.priority)
                self.waiting.insert(k, seq)
            else:
                self.waiting.append(seq)

    def _apply_aborts(self) -> set[str]:
        done: set[str] = set()
        while self._pending_aborts:
            rid = self._pending_aborts.pop()
            self._abort_locked(rid)
            done.add(rid)
        return done

    def prompt_ids(self, req: RequestEvent) -> list[int]:
        """The prompt's token ids: the tokenized `prompt`; for an empty prompt (trace-driven requests) `in_tokens`
        deterministic byte tokens derived from the request id, so the prefill does the work of the right length.
        At most `context - 1` tokens (the last ones are kept), at least one."""
        limit = max(1, self.context - 1)
        if req.prompt:
            ids = self.tokenizer.encode(req.prompt)
        else:
            n = max(1, min(req.in_tokens, limit))
            bos = self.tokenizer.bos_id
            head = [] if bos is None else [bos]
            ids = [*head, *hashlib.shake_256(req.request_id.encode()).digest(n - len(head))]
        if not ids:
            ids = [self.tokenizer.bos_id if self.tokenizer.bos_id is not None else 0]
        if len(ids) > limit:
            log.warning("torch engine: prompt of %s has %d tokens; keeping the last %d (context %d)",
                        req.request_id, len(ids), limit, self.context)
            ids = ids[-limit:]
        return ids

    def _new_seq(self, req: RequestEvent) -> _Seq:
        return _Seq(req=req, prompt=self.prompt_ids(req), decoder=self.tokenizer.stream(),
                    sampling=decode_sampling(req.sampling) if req.sampling else None)

    # -- KV export/import --------------------------------------------------------------------------------------
    def export_kv(self, request_id: str, version: int, remove: bool = False) -> KvSnapshot:
        """Snapshot a sequence's KV (raw bytes of the per-layer K/V tensors, shapes and dtype in `meta`); with
        `remove=True` the sequence leaves this engine (migration, swap-out). Waits for an iteration in flight."""
        with self._lock:
            self._drain_inbox()
            snap = self._export_locked(request_id, version, remove)
            self._publish()
            return snap

    def _export_locked(self, rid: str, version: int, remove: bool) -> KvSnapshot:
        seq = self.running.get(rid)
        if seq is not None:
            snap = self._snapshot(seq, version)
            if remove:
                self._abort_locked(rid)
            return snap
        seq = self.swapped.get(rid)
        if seq is not None:
            stored = self._swap_get(rid) if self._swap_get is not None else None
            if stored is not None and stored.token_ids == tuple(seq.tokens) and stored.model == self.model_id:
                snap = KvSnapshot(
                    seq_id=rid, version=version, model=stored.model, engine=stored.engine,
                    token_ids=stored.token_ids, prompt_len=stored.prompt_len, generated=stored.generated,
                    max_tokens=stored.max_tokens, data=stored.data, meta=dict(stored.meta),
                )
            else:  # lost from the tiers: a snapshot without KV (the importer re-prefills the tokens)
                snap = self._snapshot(seq, version, with_kv=False)
            if remove:
                del self.swapped[rid]
            return snap
        for s in self.waiting:
            if s.rid == rid:
                snap = self._snapshot(s, version, with_kv=s.kv is not None)
                if remove:
                    self.waiting.remove(s)
                return snap
        raise EngineError(f"torch engine holds no sequence {rid}")

    def _snapshot(self, seq: _Seq, version: int, with_kv: bool = True) -> KvSnapshot:
        kv = seq.kv if with_kv else None
        data = b"".join(
            t.contiguous().view(torch.uint8).numpy().tobytes() for layer in (kv or []) for t in layer
        )
        return KvSnapshot(
            seq_id=seq.rid, version=version, model=self.model_id, engine=ENGINE,
            token_ids=tuple(seq.tokens), prompt_len=len(seq.prompt), generated=tuple(seq.generated),
            max_tokens=seq.req.max_tokens, data=data,
            meta={
                "kv_tokens": 0 if kv is None else seq.kv_len, "layers": self.layers, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "dtype": self.config.dtype, "byteorder": sys.byteorder,
                "layout": KV_LAYOUT, "tokenizer": self.tokenizer.name,
                "start_ms": seq.start_ms, "first_token_ms": seq.first_token_ms,
            },
        )

    def _kv_from_snapshot(self, snap: KvSnapshot) -> KvLayers | None:
        """The K/V tensors of a snapshot made by this model (None when it carries none); EngineError otherwise."""
        if snap.engine != ENGINE or snap.model != self.model_id:
            raise EngineError(
                f"KV snapshot of {snap.seq_id} was made by {snap.engine}/{snap.model}; this engine is "
                f"{ENGINE}/{self.model_id}: a snapshot only resumes on the same engine and weights "
                f"(model, seed or checkpoint, dtype)"
            )
        m = snap.meta
        n = int(m.get("kv_tokens", 0))
        if n == 0:
            if snap.data:
                raise EngineError(f"KV snapshot of {snap.seq_id}: kv_tokens is 0 but it carries {len(snap.data)} bytes")
            return None
        shape = (m.get("layers"), m.get("kv_heads"), m.get("head_dim"), m.get("dtype"), m.get("byteorder"))
        mine = (self.layers, self.kv_heads, self.head_dim, self.config.dtype, sys.byteorder)
        if shape != mine:
            raise EngineError(f"KV snapshot of {snap.seq_id}: layout (layers, kv_heads, head_dim, dtype, byteorder) "
                              f"{shape} does not match this engine's {mine}")
        if n != len(snap.token_ids) - 1:
            raise EngineError(f"KV snapshot of {snap.seq_id}: KV of {n} tokens for {len(snap.token_ids)} token ids; "
                              f"expected the KV of all but the last (pending) token")
        per = self.kv_heads * n * self.head_dim
        if len(snap.data) != 2 * self.layers * per * self.elem_bytes:
            raise EngineError(f"KV snapshot of {snap.seq_id}: {len(snap.data)} bytes of KV, expected "
                              f"{2 * self.layers * per * self.elem_bytes} for {n} tokens")
        buf = bytearray(snap.data)  # writable, so the tensors can view it without a copy each
        kv: KvLayers = []
        off = 0
        step = per * self.elem_bytes
        for _ in range(self.layers):
            k = torch.frombuffer(buf, dtype=self.dtype, count=per, offset=off).view(self.kv_heads, n, self.head_dim)
            off += step
            v = torch.frombuffer(buf, dtype=self.dtype, count=per, offset=off).view(self.kv_heads, n, self.head_dim)
            off += step
            kv.append((k, v))
        return kv

    def resume_snapshot(
        self, req: RequestEvent, generated: tuple[int, ...], start_ms: float = 0.0, first_token_ms: float = 0.0
    ) -> KvSnapshot:
        """A snapshot without KV for a sequence that moved here with no usable KV: importing it re-prefills the
        prompt + the tokens the client already has, then generation continues after them."""
        prompt = self.prompt_ids(req)
        return KvSnapshot(
            seq_id=req.request_id, version=req.version, model=self.model_id, engine=ENGINE,
            token_ids=(*prompt, *generated), prompt_len=len(prompt), generated=tuple(generated),
            max_tokens=req.max_tokens, data=b"",
            meta={"kv_tokens": 0, "start_ms": start_ms, "first_token_ms": first_token_ms},
        )

    def import_kv(self, snapshot: KvSnapshot, req: RequestEvent) -> None:
        """Resume a sequence from a snapshot: it continues with exactly the tokens an uninterrupted greedy run on the
        same weights gives. A snapshot without KV is rebuilt by re-prefilling its tokens (exact up to rounding)."""
        if snapshot.seq_id != req.request_id:
            raise EngineError(f"KV snapshot of {snapshot.seq_id} offered for request {req.request_id}")
        kv = self._kv_from_snapshot(snapshot)
        if not 0 < snapshot.prompt_len <= len(snapshot.token_ids) or tuple(
            snapshot.token_ids[snapshot.prompt_len :]
        ) != tuple(snapshot.generated):
            raise EngineError(f"KV snapshot of {snapshot.seq_id}: token_ids are not prompt + generated")
        if self._holds(req.request_id):
            raise EngineError(f"torch engine already holds sequence {req.request_id}")
        seq = _Seq(
            req=req, prompt=list(snapshot.token_ids[: snapshot.prompt_len]), decoder=self.tokenizer.stream(),
            generated=list(snapshot.generated), kv=kv,
            start_ms=float(snapshot.meta.get("start_ms", 0.0)),
            first_token_ms=float(snapshot.meta.get("first_token_ms", 0.0)),
            sampling=decode_sampling(req.sampling) if req.sampling else None,
        )
        for t in seq.generated:  # the client has seen this text: bring the decoder to the same (partial) state
            seq.decoder.feed(t)
        self._inbox.append(seq)

    # -- iteration ---------------------------------------------------------------------------------------------
    async def step(self) -> StepOutput:
        return await asyncio.to_thread(self._step_sync)

    def _reserve_bytes(self, seq: _Seq) -> int:
        total = min(len(seq.prompt) + max(seq.req.max_tokens, len(seq.generated) + 1), self.context)
        return total * self.kv_bytes_per_token

    def _admit(self, seq: _Seq) -> None:
        if not seq.start_ms:
            seq.start_ms = self._now
        seq.reserved = self._reserve_bytes(seq)
        self._reserved += seq.reserved
        self._admit_counter += 1
        seq.admitted = self._admit_counter
        seq.last_used = self.steps
        self.running[seq.rid] = seq

    def _fits(self, need: int) -> bool:
        return not self.running or self._reserved + need <= self.kv_capacity_bytes

    def _swap_out(self, need: int, protected: set[str]) -> bool:
        """Swap out least recently used running sequences until `need` more bytes fit; False (nothing moved) when
        that is impossible or the swap store refuses."""
        if self._swap_put is None or self._swap_blocked:
            return False
        victims = sorted((s for s in self.running.values() if s.rid not in protected),
                         key=lambda s: (s.last_used, s.admitted))
        deficit = self._reserved + need - self.kv_capacity_bytes
        chosen: list[_Seq] = []
        for s in victims:
            if deficit <= 0:
                break
            chosen.append(s)
            deficit -= s.reserved
        if deficit > 0:
            return False
        for s in chosen:
            snap = self._snapshot(s, s.req.version)
            try:
                stored = self._swap_put(snap)
            except Exception as e:
                log.error("torch engine: swap-out of %s failed (%r); no swapping until a sequence leaves", s.rid, e)
                self._swap_blocked = True
                return False
            if stored is False:
                log.warning("torch engine: the swap store refused %s; no swapping until a sequence leaves", s.rid)
                self._swap_blocked = True
                return False
            del self.running[s.rid]
            self._reserved -= s.reserved
            s.kv = None
            s.reserved = 0
            self.swapped[s.rid] = s
            self.swaps_total += 1
            log.info("torch engine: swapped out %s (%d tokens) to make room", s.rid, len(s.tokens))
        return True

    def _swap_in(self, seq: _Seq) -> None:
        snap = self._swap_get(seq.rid) if self._swap_get is not None else None
        kv = None
        if snap is not None and snap.token_ids == tuple(seq.tokens):
            try:
                kv = self._kv_from_snapshot(snap)
            except EngineError as e:
                log.warning("torch engine: swapped KV of %s unusable (%s); re-prefilling", seq.rid, e)
        else:
            log.warning("torch engine: swapped KV of %s %s; re-prefilling its %d tokens", seq.rid,
                        "lost" if snap is None else "stale", len(seq.tokens))
        seq.kv = kv

    def _schedule(self) -> tuple[list[_Seq], list[_Seq]]:
        """Admission (see the module docstring). Returns (sequences to prefill this iteration, admitted ones)."""
        admitted: list[_Seq] = []
        prefill: list[_Seq] = []
        budget = self.prefill_budget_tokens

        def prefill_len(s: _Seq) -> int:
            return 0 if s.kv is not None else (len(s.prompt) if not s.generated else len(s.tokens) - 1)

        while self.swapped and len(self.running) < self.config.max_batch:
            seq = next(iter(self.swapped.values()))
            if not self._fits(self._reserve_bytes(seq)):
                break
            del self.swapped[seq.rid]
            self._swap_in(seq)
            n = prefill_len(seq)
            self._admit(seq)
            admitted.append(seq)
            if n:
                budget -= n
                prefill.append(seq)
        while self.waiting and len(self.running) < self.config.max_batch:
            seq = self.waiting[0]
            n = prefill_len(seq)
            if n and prefill and n > budget:
                break
            need = self._reserve_bytes(seq)
            if not self._fits(need) and (self.swapped or not self._swap_out(need, {s.rid for s in admitted})):
                break
            self.waiting.popleft()
            self._admit(seq)
            admitted.append(seq)
            if n:
                budget -= n
                prefill.append(seq)
        return prefill, admitted

    def _decode_forward(self, seqs: list[_Seq]) -> torch.Tensor:
        """One forward for all `seqs` (each with the KV of all but its last token): left-padded batched cache,
        attention mask 0 on the padding, position ids = each sequence's own length. Returns logits [B, vocab] and
        leaves each sequence's KV one token longer (padding stripped)."""
        from transformers import DynamicCache

        lens = [s.kv_len for s in seqs]
        width = max(lens)
        b = len(seqs)
        layers = []
        for li in range(self.layers):
            k = torch.zeros((b, self.kv_heads, width, self.head_dim), dtype=self.dtype)
            v = torch.zeros_like(k)
            for i, s in enumerate(seqs):
                assert s.kv is not None
                k[i, :, width - lens[i] :] = s.kv[li][0]
                v[i, :, width - lens[i] :] = s.kv[li][1]
            layers.append((k, v))
        cache = DynamicCache(layers, config=self.model.config)
        mask = None
        if min(lens) != width:
            mask = torch.ones((b, width + 1), dtype=torch.long)
            for i, n in enumerate(lens):
                mask[i, : width - n] = 0
        out = self.model(
            input_ids=torch.tensor([[s.tokens[-1]] for s in seqs]),
            attention_mask=mask,
            position_ids=torch.tensor([[n] for n in lens]),
            past_key_values=cache,
            use_cache=True,
        )
        for i, s in enumerate(seqs):
            s.kv = _cache_rows(cache, i, width - lens[i])
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits

    def _prefill_forward(self, ids: list[int]) -> tuple[KvLayers, torch.Tensor]:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits: torch.Tensor = out.logits[0, -1, :]
        return _cache_rows(cache, 0, 0), logits

    def _done_reason(self, s: _Seq) -> str:
        if s.generated and s.generated[-1] in self.eos_ids:
            return "stop"
        if len(s.generated) >= s.req.max_tokens or len(s.prompt) + len(s.generated) >= self.context:
            return "length"
        return ""

    def _pick(self, s: _Seq, row: torch.Tensor) -> int:
        """The next token of a sequence whose client asked for sampling: the penalties (OpenAI's: presence once per
        token seen in the answer, frequency per occurrence), then greedy at temperature 0 (or none given), else a
        draw from softmax(logits / temperature) cut to the nucleus `top_p`, by a generator seeded with the client's
        seed (else the request id) and the position, so a moved sequence draws what it would have drawn."""
        sp = s.sampling
        assert sp is not None
        x = row.float().masked_fill(self._banned, float("-inf"))
        if (sp.presence_penalty or sp.frequency_penalty) and s.generated:
            counts = torch.bincount(torch.tensor(s.generated), minlength=x.shape[-1])[: x.shape[-1]].float()
            x = x - (sp.frequency_penalty or 0.0) * counts - (sp.presence_penalty or 0.0) * (counts > 0).float()
        if not sp.temperature:
            return int(x.argmax())
        probs = torch.softmax(x / sp.temperature, dim=-1)
        if sp.top_p is not None and sp.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = idx[(sorted_p.cumsum(-1) - sorted_p) < sp.top_p]
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[keep] = True
            probs = probs * mask
            probs = probs / probs.sum()
        key = f"{sp.seed if sp.seed is not None else s.rid}:{len(s.generated)}"
        seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), "big")
        gen = torch.Generator().manual_seed(seed)
        return int(torch.multinomial(probs, 1, generator=gen))

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        """Greedy sampling (temperature 0): argmax over the tokenizer's real ids (ties: the lowest id)."""
        masked = logits.masked_fill(self._banned, float("-inf"))
        return [int(t) for t in masked.argmax(dim=-1)]

    def _step_sync(self) -> StepOutput:
        wall0 = time.perf_counter()
        with self._lock, torch.inference_mode():
            self._now = self.now_ms()
            self._drain_inbox()
            self._apply_aborts()
            prefill, admitted = self._schedule()
            finished: list[SeqFinished] = []
            for s in admitted:  # imported at (or past) its end: nothing left to generate
                reason = self._done_reason(s)
                if reason:
                    self._abort_locked(s.rid)
                    finished.append(SeqFinished(s.rid, len(s.generated), s.start_ms, s.first_token_ms, self._now,
                                                reason))
            fresh = {s.rid for s in prefill}
            decode = [s for s in self.running.values() if s.rid not in fresh]
            prefill = [s for s in prefill if s.rid in self.running]
            shape = ([len(s.tokens) - 1 if s.generated else len(s.prompt) for s in prefill], len(decode),
                     sum(s.kv_len for s in decode))
            chosen: list[tuple[_Seq, int]] = []
            self.last_decode_batch = len(decode)
            if decode:
                logits = self._decode_forward(decode)
                for s, tid, row in zip(decode, self._greedy(logits), logits, strict=True):
                    if self.logits_hook is not None:
                        self.logits_hook(s.rid, len(s.generated), row)
                    chosen.append((s, tid if s.sampling is None else self._pick(s, row)))
            for s in prefill:
                if s.generated:  # resumed without KV: rebuild the KV of all but the pending token, emit nothing
                    s.kv, _ = self._prefill_forward(s.tokens[:-1])
                    continue
                s.kv, row = self._prefill_forward(s.prompt)
                if self.logits_hook is not None:
                    self.logits_hook(s.rid, 0, row)
                chosen.append((s, self._greedy(row.unsqueeze(0))[0] if s.sampling is None else self._pick(s, row)))
            end = self.now_ms()
            aborted = self._apply_aborts()
            tokens: list[TokenOut] = []
            for s, tid in chosen:
                if s.rid in aborted:
                    continue
                if not s.generated:
                    s.first_token_ms = end
                s.generated.append(tid)
                s.last_used = self.steps + 1
                reason = self._done_reason(s)
                text = s.decoder.feed(tid)
                if reason:
                    text += s.decoder.flush()
                tokens.append(TokenOut(s.rid, len(s.generated) - 1, tid, text))
                if reason:
                    self._abort_locked(s.rid)
                    finished.append(SeqFinished(s.rid, len(s.generated), s.start_ms, s.first_token_ms, end, reason))
            self.steps += 1
            self.tokens += len(tokens)
            step_ms = (time.perf_counter() - wall0) * 1000.0
            self._learn_speed(step_ms, *shape)
            self._step_times.add(end, step_ms)
            self._publish()
            return StepOutput(tuple(tokens), tuple(finished), step_ms)

    def _learn_speed(self, step_ms: float, prefill: list[int], decode_seqs: int, kv_tokens: int) -> None:
        """One iteration for the belief: its time against the prior's price of its shape, split into the prefill
        part and the decode part (the same iteration without its prompts)."""
        if self.cost is None or (not prefill and not decode_seqs):
            return
        dec_ms = self.cost.step_ms((), decode_seqs, kv_tokens) if decode_seqs else 0.0
        total = self.cost.step_ms(prefill, decode_seqs, kv_tokens) if prefill else dec_ms
        if total > 0:
            self.belief.observe(step_ms, max(0.0, total - dec_ms), dec_ms)

    # -- status ------------------------------------------------------------------------------------------------
    def _publish(self) -> None:
        self._gauges = _Gauges(
            running=len(self.running),
            waiting=len(self.waiting),
            swapped=len(self.swapped),
            kv_bytes=sum(s.kv_len for s in self.running.values()) * self.kv_bytes_per_token,
            avg_step_ms=self._step_times.mean(),
        )

    def stats(self) -> EngineStats:
        """KV in KB of 1000 bytes (the logical bytes of the K/V tensors held), capacity = `kv_capacity_mb`;
        `gpu_mem_*`: the engine's own budget (weights + KV capacity), since it may run on a CPU."""
        g = self._gauges
        total = self.weight_bytes + self.kv_capacity_bytes
        return EngineStats(
            running=g.running,
            waiting=g.waiting + len(self._inbox),
            kv_capacity_kb=self.kv_capacity_bytes / 1000.0,
            kv_used_kb=g.kv_bytes / 1000.0,
            gpu_mem_total_gb=total / 1e9,
            gpu_mem_free_gb=max(0.0, total - self.weight_bytes - g.kv_bytes) / 1e9,
            avg_step_ms=g.avg_step_ms,
            steps=self.steps,
            tokens=self.tokens,
            swapped_out=g.swapped,
            slowdown=self.belief.decode, prefill_slowdown=self.belief.prefill if self.belief.n_pre else 0.0,
        )
