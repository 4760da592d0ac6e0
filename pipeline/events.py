"""Events: the frozen dataclasses every stream carries, and their validation from plain (wire) data.

Owns the shape of RequestEvent, BatchEvent, TokenEvent, ResultEvent, HealthEvent and DecisionEvent, and the one
check that turns untrusted plain data into them (`from_wire`). It never encodes bytes (that is `streams.codec`)
and never reads a clock: every timestamp is given by the caller, in milliseconds since the Unix epoch.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin


class EventValidationError(ValueError):
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
    """`ok` or `error`."""
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


@dataclass(frozen=True, slots=True)
class DecisionEvent:
    """A routing or dispatch decision with what it was based on, so replay can reproduce and explain it."""

    TYPE: ClassVar[str] = "decision"
    kind: str
    """`route` (request -> rack) or `dispatch` (batch -> node)."""
    policy: str
    choice: str
    request_ids: tuple[str, ...]
    ts_ms: float
    scores: dict[str, float] = field(default_factory=dict)
    draw: float = -1.0
    """The random draw used, or -1 when the decision was deterministic."""
    batch_id: str = ""


Event = RequestEvent | BatchEvent | TokenEvent | ResultEvent | HealthEvent | DecisionEvent
EVENT_TYPES: dict[str, type[Any]] = {
    cls.TYPE: cls for cls in (RequestEvent, BatchEvent, TokenEvent, ResultEvent, HealthEvent, DecisionEvent)
}
E = TypeVar("E")

_HINTS: dict[type[Any], dict[str, Any]] = {}


def _hints(cls: type[Any]) -> dict[str, Any]:
    h = _HINTS.get(cls)
    if h is None:
        h = typing.get_type_hints(cls)
        _HINTS[cls] = h
    return h


def to_wire(event: Any) -> dict[str, Any]:
    """Plain data (dicts, lists, str, int, float, bool, None) for an event; nested events become dicts."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(event):
        v = getattr(event, f.name)
        if isinstance(v, tuple):
            v = [to_wire(x) if dataclasses.is_dataclass(x) else x for x in v]
        elif isinstance(v, dict):
            v = dict(v)
        out[f.name] = v
    return out


def _check(tname: str, path: str, value: Any, ann: Any) -> Any:
    origin = get_origin(ann)
    if origin in (Union, types.UnionType):
        args = get_args(ann)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        return _check(tname, path, value, non_none[0])
    if ann is str:
        if not isinstance(value, str):
            raise EventValidationError(tname, path, f"expected a string, got {type(value).__name__}")
        if len(value) > MAX_STR:
            raise EventValidationError(tname, path, f"string longer than {MAX_STR} characters")
        return value
    if ann is bool:
        if not isinstance(value, bool):
            raise EventValidationError(tname, path, f"expected a boolean, got {type(value).__name__}")
        return value
    if ann is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise EventValidationError(tname, path, f"expected an integer, got {type(value).__name__}")
        if not -(2**63) <= value < 2**63:
            raise EventValidationError(tname, path, "integer out of the 64-bit range")
        return value
    if ann is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise EventValidationError(tname, path, f"expected a number, got {type(value).__name__}")
        fv = float(value)
        if not math.isfinite(fv):
            raise EventValidationError(tname, path, "expected a finite number")
        return fv
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise EventValidationError(tname, path, f"expected a list, got {type(value).__name__}")
        if len(value) > MAX_ITEMS:
            raise EventValidationError(tname, path, f"more than {MAX_ITEMS} items")
        (item_ann, _ellipsis) = get_args(ann)
        return tuple(_check(tname, f"{path}[{i}]", x, item_ann) for i, x in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise EventValidationError(tname, path, f"expected a mapping, got {type(value).__name__}")
        if len(value) > MAX_ITEMS:
            raise EventValidationError(tname, path, f"more than {MAX_ITEMS} items")
        k_ann, v_ann = get_args(ann)
        return {
            _check(tname, f"{path}.<key>", k, k_ann): _check(tname, f"{path}[{k!r}]", v, v_ann)
            for k, v in value.items()
        }
    if isinstance(ann, type) and dataclasses.is_dataclass(ann):
        try:
            return from_wire(ann, value)
        except EventValidationError as e:
            raise EventValidationError(tname, f"{path}.{e.path}" if e.path else path, e.reason) from None
    raise TypeError(f"events: unsupported annotation {ann!r} at {tname}.{path}")  # our mistake, not the sender's


def from_wire(cls: type[E], data: Any) -> E:
    """Validate plain data into an event of type `cls`; raises EventValidationError naming the bad field."""
    tname: str = cls.TYPE  # type: ignore[attr-defined]
    if not isinstance(data, Mapping):
        raise EventValidationError(tname, "", f"expected a mapping, got {type(data).__name__}")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in data:
            kwargs[f.name] = _check(tname, f.name, data[f.name], hints[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise EventValidationError(tname, f.name, "required field is missing")
    # Unknown keys are ignored: a newer producer may add fields within the same codec version.
    return cls(**kwargs)
