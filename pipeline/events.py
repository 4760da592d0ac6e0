"""Events: the frozen dataclasses every stream carries, and their validation from plain (wire) data.

Owns the shape of RequestEvent, BatchEvent, TokenEvent, ResultEvent, HealthEvent and DecisionEvent, and the one
check that turns untrusted plain data into them (`from_wire`). It never encodes bytes (that is `streams.codec`)
and never reads a clock: every timestamp is given by the caller, in milliseconds since the Unix epoch.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin

from pipeline.errors import RackflowError

REQUEST_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
"""What a request (or job) id looks like: a lowercase UUID, as the gateway mints them (`uuid4()`)."""


class EventValidationError(RackflowError, ValueError):
    """Plain data does not form a valid event; `path` names the offending field."""

    def __init__(self, event_type: str, path: str, reason: str) -> None:
        super().__init__(f"{event_type}.{path}: {reason}" if path else f"{event_type}: {reason}")
        self.event_type = event_type
        self.path = path
        self.reason = reason


# Bounds that keep a hostile entry from allocating without limit once decoded.
MAX_STR = 4 * 1024 * 1024
MAX_ITEMS = 100_000


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """One client request after profiling; `request_id` is also the sequence UUID, `version` its migration count."""

    TYPE: ClassVar[str] = "request"
    request_id: str
    version: int
    tenant: str
    user_id: str
    model: str
    in_tokens: int
    out_tokens: int
    """Expected output length (request's max_tokens, else the user's EWMA, else the model default)."""
    max_tokens: int
    """Hard limit of generated tokens."""
    mem_est_kb: float
    arrival_ms: float
    prompt: str = ""
    priority: int = 0
    prefix_cache: bool = True
    rack: str | None = None
    """Set by the router."""
    routed_ms: float = 0.0
    route_policy: str = ""
    """Node policy the client asked for (X-Route-Policy); empty: the configured default."""
    prefix_hashes: tuple[int, ...] = ()
    """Chained hashes of the prompt's prefix blocks (63-bit), for prefix-aware placement."""
    trace: str = ""
    """W3C `traceparent` of the request's trace when tracing is on (empty: not traced)."""
    reply_to: str = ""
    """The admitting gateway's reply stream (`rf:gw:{ID}:out`): its tokens and result are delivered there too, so
    that one reader per gateway serves every open request. Empty: the per-request stream `rf:out:{id}` only."""
    sim_out_tokens: int = 0
    """For an engine replaying a trace alone (`sim`; `vllm`, whose random-weight test models have no natural end):
    the request's true output length (a trace's), where it stops with
    `finish_reason: "stop"`, as a real model stops at its end-of-sequence token. Profiling, routing and batching
    never read it (they see `out_tokens`, the expected length). 0: it runs to max_tokens."""
    sampling: str = ""
    """What the client asked of the sampler (`pipeline.sampling`: stop strings, seed, temperature, ...), compact JSON
    read by the worker that runs the sequence alone; empty: the engine's defaults."""


@dataclass(frozen=True, slots=True)
class BatchEvent:
    """A window's requests packed for one node."""

    TYPE: ClassVar[str] = "batch"
    batch_id: str
    rack: str
    node: str
    requests: tuple[RequestEvent, ...]
    mem_est_kb: float
    mem_budget_kb: float
    window_open_ms: float
    created_ms: float


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Tokens of one request generated since the previous TokenEvent; `index` is the first token's position."""

    TYPE: ClassVar[str] = "tokens"
    request_id: str
    version: int
    index: int
    token_ids: tuple[int, ...]
    texts: tuple[str, ...]
    """The decoded text of each token (same length as token_ids)."""
    ts_ms: float
    node: str
    reply_to: str = ""
    """The request's `reply_to` (its gateway's reply stream), copied so that the writer needs no lookup."""
    logprobs: str = ""
    """When the client asked for log probabilities: compact JSON, one `[logprob, token text, [[alternative text,
    logprob], ...]]` per token of `token_ids` (`pipeline.sampling.decode_logprobs`); "" otherwise."""

    @property
    def text(self) -> str:
        return "".join(self.texts)


@dataclass(frozen=True, slots=True)
class ResultEvent:
    """The final outcome of one request, written once per (request_id, version)."""

    TYPE: ClassVar[str] = "result"
    request_id: str
    version: int
    tenant: str
    user_id: str
    model: str
    status: str
    """`ok`, `error`, or `cancelled` (aborted on request: a revoked job; `text` holds what was generated)."""
    node: str
    rack: str
    in_tokens: int
    out_tokens: int
    arrival_ms: float
    finish_ms: float
    batch_id: str = ""
    text: str = ""
    error: str = ""
    batched_ms: float = 0.0
    start_ms: float = 0.0
    first_token_ms: float = 0.0
    routed_ms: float = 0.0
    """When the router placed the request on its rack (batched_ms - routed_ms is the window's wait)."""
    finish_reason: str = ""
    """Why an `ok` sequence ended, as its engine reported it: `stop` (the engine stopped on its own: an
    end-of-sequence token) or `length` (max_tokens or the context reached); empty when not known (a failed or
    cancelled request, or a result written before this field existed)."""
    reply_to: str = ""
    """The request's `reply_to` (its gateway's reply stream), copied from the request."""

    @classmethod
    def of(cls, req: RequestEvent, status: str, node: str, rack: str, finish_ms: float, **fields: Any) -> ResultEvent:
        """The final result of `req`, its identity (id, version, tenant, user, model, sizes, times) copied from the
        request: the one constructor of every result a role writes (ok, error, cancelled)."""
        fields.setdefault("out_tokens", 0)
        fields.setdefault("routed_ms", req.routed_ms)
        fields.setdefault("reply_to", req.reply_to)
        return cls(request_id=req.request_id, version=req.version, tenant=req.tenant, user_id=req.user_id,
                   model=req.model, status=status, node=node, rack=rack, in_tokens=req.in_tokens,
                   arrival_ms=req.arrival_ms, finish_ms=finish_ms, **fields)


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """A node's live status: GPU metrics (from NVML or a model of the node) and its engine's load."""

    TYPE: ClassVar[str] = "health"
    node: str
    rack: str
    ts_ms: float
    source: str
    """`worker`, `nvml` or `sim`."""
    gpu_mem_total_gb: float = 0.0
    gpu_mem_free_gb: float = 0.0
    kv_capacity_kb: float = 0.0
    kv_used_kb: float = 0.0
    gpu_util_pct: float = 0.0
    pcie_util_pct: float = 0.0
    temp_c: float = 0.0
    power_w: float = 0.0
    nvlink_crc_errors: int = 0
    xid_errors: int = 0
    ecc_errors: int = 0
    avg_latency_ms: float = 0.0
    """Mean engine step (inter-token) latency over the last 10 s."""
    running: int = 0
    waiting: int = 0
    last_batch_entry: str = ""
    """Stream id of the last batch entry the worker admitted (batchers release their reservations up to it)."""
    pcie_tx_mb_s: float = 0.0
    pcie_rx_mb_s: float = 0.0
    throttle_reasons: int = 0
    """NVML clocks-throttle-reason bit mask (0: not throttled)."""
    gpus: int = 0
    """GPUs the sample covers (a node is one engine instance, possibly tensor-parallel over several)."""
    prefill_tokens: int = 0
    """Prompt tokens queued in the engine and not prefilled yet (the prefill work ahead of a new request)."""
    decode_seqs: int = 0
    """Sequences decoding."""
    decode_tokens: int = 0
    """KV tokens of the decoding sequences."""
    kv_usage: float = 0.0
    """The engine's own KV-cache use, 0..1 (vLLM's kv_cache_usage_perc)."""
    slowdown: float = 1.0
    """Observed iteration time over the cost model's for the same iterations (EWMA)."""
    max_seqs: int = 0
    """Sequences the engine runs at once (0: unknown)."""
    prefill_slowdown: float = 0.0
    """The same ratio for the prefill part of iterations, learned apart (`pipeline.costmodel.online`); 0: not
    measured (as `slowdown`)."""
    prefix_hit_tokens: int = 0
    """Prompt tokens the engine's prefix cache saved since it started."""
    prompt_tokens: int = 0
    """Prompt tokens the engine admitted since it started."""
    kv_blocks_total: int = 0
    """Paged KV blocks the engine allocated (vLLM's num_gpu_blocks; 0: the engine is not paged)."""
    kv_blocks_free: int = 0
    """Of those, blocks free now."""
    kv_block_tokens: int = 0
    """Tokens per KV block."""
    next_ms: float = 0.0
    """A worker's heartbeat: the next one comes within this many ms (it beats slower while idle:
    `worker.idle_status_interval_ms`), and the monitor judges its silence against it; 0: the configured
    `worker.status_interval_ms`."""
    batch_seqs: int = 0
    """Of the sequences running or waiting in the engine, those of the `batch` class (pipeline/priority.py)."""
    batch_kv_kb: float = 0.0
    """Their estimated KV memory (the batcher's units): what an interactive request may take from them."""
    batch_prefill_tokens: int = 0
    """Of `prefill_tokens`, the batch sequences' (interactive prefills go first)."""


@dataclass(frozen=True, slots=True)
class DecisionEvent:
    """A routing or dispatch decision with what it was based on, so replay can reproduce and explain it."""

    TYPE: ClassVar[str] = "decision"
    kind: str
    """`route` (request -> rack), `dispatch` (batch -> node), `window` (a batcher's window closed: replay inputs) or
    `migration` (a live sequence moved)."""
    policy: str
    choice: str
    request_ids: tuple[str, ...]
    ts_ms: float
    scores: dict[str, float] = field(default_factory=dict)
    draw: float = -1.0
    """The random draw used, or -1 when the decision was deterministic."""
    batch_id: str = ""
    choices: tuple[str, ...] = ()
    """For a decision over several requests made in order (a router batch): the choice for each of
    `request_ids`; `scores` is then what the policy saw before the first of them."""
    rack: str = ""
    """The rack of a `dispatch` or `window` decision."""
    actor: str = ""
    """The process instance that decided (a batcher's consumer name): replay runs one policy state per actor."""
    inputs: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Replay inputs of a `window` record: node views the window saw, requests offered since the last close with
    their enqueue times, and the random draws the close used (see `pipeline.replay`)."""


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """What a node's prefix cache gained and lost (vLLM's KV events BlockStored / BlockRemoved): chained hashes of
    prefix blocks. `cleared`: the node lost everything before these changes (its engine started or restarted)."""

    TYPE: ClassVar[str] = "blocks"
    node: str
    rack: str
    ts_ms: float
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    cleared: bool = False


@dataclass(frozen=True, slots=True)
class ResumeEvent:
    """A live sequence moved to this node (failover): continue it from `generated`, at `request.version`."""

    TYPE: ClassVar[str] = "resume"
    request: RequestEvent
    """The request, with the version the new owner runs it under."""
    generated: tuple[int, ...]
    """Token ids the client has already received (the new owner continues after them)."""
    texts: tuple[str, ...]
    src: str
    """The node it moved from."""
    first_token_ms: float = 0.0
    start_ms: float = 0.0
    snapshot_version: int = 0
    """The version of a KV snapshot in the tiers to import (0: none, re-prefill prompt + generated)."""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ReleaseEvent:
    """Control message to a node: stop running `seq_id` (it is being moved away at `version`), export what it has
    to the KV tiers, and confirm by setting the release marker."""

    TYPE: ClassVar[str] = "release"
    seq_id: str
    version: int
    dst: str
    ts_ms: float


@dataclass(frozen=True, slots=True)
class CancelEvent:
    """Control message to a node: abort `request_id` (a revoked job, a client that asked to cancel) and write its
    final result as cancelled."""

    TYPE: ClassVar[str] = "cancel"
    request_id: str
    ts_ms: float
    reason: str = ""


Event = (RequestEvent | BatchEvent | TokenEvent | ResultEvent | HealthEvent | DecisionEvent | ResumeEvent
         | ReleaseEvent | CancelEvent | BlockEvent)
EVENT_TYPES: dict[str, type[Any]] = {
    cls.TYPE: cls for cls in (RequestEvent, BatchEvent, TokenEvent, ResultEvent, HealthEvent, DecisionEvent,
                              ResumeEvent, ReleaseEvent, CancelEvent, BlockEvent)
}
E = TypeVar("E")

def to_wire(event: Any) -> dict[str, Any]:
    """Plain data (dicts, lists, str, int, float, bool, None) for an event; nested events become dicts."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(event):
        v = getattr(event, f.name)
        if isinstance(v, tuple):
            v = [to_wire(x) if dataclasses.is_dataclass(x) else x for x in v]
        elif isinstance(v, dict):
            v = dict(v)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            v = to_wire(v)
        out[f.name] = v
    return out


Checker = Callable[[str, str, Any], Any]


def _bad(tname: str, path: str, reason: str) -> EventValidationError:
    return EventValidationError(tname, path, reason)


def _compile(ann: Any) -> Checker:
    """A checker for one annotation, built once per event class (decoding is on every consumer's hot path)."""
    origin = get_origin(ann)
    if origin in (Union, types.UnionType):
        args = get_args(ann)
        inner = _compile(next(a for a in args if a is not type(None)))
        nullable = type(None) in args

        def check_union(t: str, p: str, v: Any) -> Any:
            if v is None and nullable:
                return None
            return inner(t, p, v)

        return check_union
    if ann is str:
        def check_str(t: str, p: str, v: Any) -> Any:
            if type(v) is not str:
                raise _bad(t, p, f"expected a string, got {type(v).__name__}")
            if len(v) > MAX_STR:
                raise _bad(t, p, f"string longer than {MAX_STR} characters")
            return v

        return check_str
    if ann is bool:
        def check_bool(t: str, p: str, v: Any) -> Any:
            if type(v) is not bool:
                raise _bad(t, p, f"expected a boolean, got {type(v).__name__}")
            return v

        return check_bool
    if ann is int:
        def check_int(t: str, p: str, v: Any) -> Any:
            if type(v) is not int:
                raise _bad(t, p, f"expected an integer, got {type(v).__name__}")
            if not -(2**63) <= v < 2**63:
                raise _bad(t, p, "integer out of the 64-bit range")
            return v

        return check_int
    if ann is float:
        def check_float(t: str, p: str, v: Any) -> Any:
            tv = type(v)
            if tv is float:
                if v != v or v in (math.inf, -math.inf):
                    raise _bad(t, p, "expected a finite number")
                return v
            if tv is int:
                return float(v)
            raise _bad(t, p, f"expected a number, got {tv.__name__}")

        return check_float
    if origin is tuple:
        item_ann, _ellipsis = get_args(ann)
        item = _compile(item_ann)
        fast = item_ann in (int, str)

        def check_tuple(t: str, p: str, v: Any) -> Any:
            if not isinstance(v, list | tuple):
                raise _bad(t, p, f"expected a list, got {type(v).__name__}")
            if len(v) > MAX_ITEMS:
                raise _bad(t, p, f"more than {MAX_ITEMS} items")
            if fast and all(type(x) is item_ann for x in v) and (
                item_ann is str or all(-(2**63) <= x < 2**63 for x in v)
            ):
                return tuple(v)
            return tuple(item(t, f"{p}[{i}]", x) for i, x in enumerate(v))

        return check_tuple
    if origin is dict:
        k_ann, v_ann = get_args(ann)
        kc, vc = _compile(k_ann), _compile(v_ann)

        def check_dict(t: str, p: str, v: Any) -> Any:
            if not isinstance(v, dict):
                raise _bad(t, p, f"expected a mapping, got {type(v).__name__}")
            if len(v) > MAX_ITEMS:
                raise _bad(t, p, f"more than {MAX_ITEMS} items")
            return {kc(t, f"{p}.<key>", k): vc(t, f"{p}[{k!r}]", x) for k, x in v.items()}

        return check_dict
    if isinstance(ann, type) and dataclasses.is_dataclass(ann):
        cls = ann

        def check_event(t: str, p: str, v: Any) -> Any:
            try:
                return from_wire(cls, v)
            except EventValidationError as e:
                raise _bad(t, f"{p}.{e.path}" if e.path else p, e.reason) from None

        return check_event
    raise TypeError(f"events: unsupported annotation {ann!r}")  # our mistake, not the sender's


_PLANS: dict[type[Any], tuple[str, list[tuple[str, Checker, bool]]]] = {}


def _plan(cls: type[Any]) -> tuple[str, list[tuple[str, Checker, bool]]]:
    plan = _PLANS.get(cls)
    if plan is None:
        hints = typing.get_type_hints(cls)
        fields = [
            (f.name, _compile(hints[f.name]),
             f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)
        ]
        plan = (cls.TYPE, fields)
        _PLANS[cls] = plan
    return plan


def from_wire(cls: type[E], data: Any) -> E:
    """Validate plain data into an event of type `cls`; raises EventValidationError naming the bad field."""
    tname, fields = _plan(cls)
    if not isinstance(data, Mapping):
        raise EventValidationError(tname, "", f"expected a mapping, got {type(data).__name__}")
    kwargs: dict[str, Any] = {}
    for name, check, required in fields:
        if name in data:
            kwargs[name] = check(tname, name, data[name])
        elif required:
            raise EventValidationError(tname, name, "required field is missing")
    # Unknown keys are ignored: a newer producer may add fields within the same codec version.
    return cls(**kwargs)
