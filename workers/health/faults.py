"""Fault injection for simulated nodes: what `rackflow fault ...` writes and what the sim health agent reads.

A node's faults live in the hash `rf:node:{N}:faults`: field = kind, value = JSON {"id", "at_ms", "until_ms",
"factor"}. One fault per kind per node: injecting a kind again replaces it (with a new id). Kinds:
- `xid`: the node's Xid counter goes up once per injected fault id;
- `overheat`: 95 °C and the thermal throttle bits while active;
- `nvlink-crc`: NVLink CRC errors grow by 500 x factor per sample while active;
- `slow`: the engine is `factor` times slower while active (the worker applies it; the agent reports it);
- `kill`: one-shot: the agent SIGKILLs the node's worker process and removes the fault.
Expired faults are ignored and removed by the reader. Also the loader (and player) of a fault schedule file for
demos. It never decides what a fault does to a node (that is `workers.health.sim_source` and the worker).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import yaml

from pipeline.errors import RackflowError
from streams import keys

log = logging.getLogger(__name__)

KINDS = ("xid", "overheat", "nvlink-crc", "slow", "kill")
ONE_SHOT = frozenset({"kill"})
DEFAULT_FACTOR = {"slow": 3.0}
"""Factor of a kind when none is given (others: 1.0)."""
DEFAULT_DURATION_S = 30.0

# Delete a field only if it still holds the value we read: a fault re-injected meanwhile survives.
_DEL_IF_SAME = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


class FaultError(RackflowError):
    """A fault or a schedule is invalid (the caller's mistake); the message says what to change."""


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    id: str
    at_ms: float
    until_ms: float
    factor: float = 1.0
    raw: str = field(default="", compare=False, repr=False)
    """The stored JSON as read (a compare-and-delete needs it byte for byte)."""

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "at_ms": self.at_ms, "until_ms": self.until_ms, "factor": self.factor},
                          sort_keys=True)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "id": self.id, "at_ms": self.at_ms, "until_ms": self.until_ms,
                "factor": self.factor}

    @classmethod
    def from_json(cls, kind: str, raw: str | bytes) -> Fault:
        text = raw.decode() if isinstance(raw, bytes) else raw
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        return cls(kind, str(d["id"]), float(d["at_ms"]), float(d["until_ms"]), float(d.get("factor", 1.0)), text)

    def active_at(self, now_ms: float) -> bool:
        return self.at_ms <= now_ms < self.until_ms


def check(kind: str, duration_s: float, factor: float) -> None:
    """FaultError naming the bad argument and what is allowed."""
    if kind not in KINDS:
        raise FaultError(f"unknown fault kind {kind!r}; allowed: {', '.join(KINDS)}")
    if not 0 < duration_s <= 86_400:
        raise FaultError(f"fault duration {duration_s:g} s: must be in (0, 86400]")
    if not 0 < factor <= 1e6:
        raise FaultError(f"fault factor {factor:g}: must be in (0, 1e6]")
    if kind == "slow" and factor < 1:
        raise FaultError(f"slow fault factor {factor:g}: must be >= 1 (how many times slower)")


async def inject(
    r: aioredis.Redis, node: str, kind: str, duration_s: float = DEFAULT_DURATION_S, factor: float | None = None,
    *, now_ms: float,
) -> Fault:
    """Start a fault on `node` now, for `duration_s` (a one-shot `kill` is dropped if no agent acts on it within
    that time). Replaces an earlier fault of the same kind."""
    f = DEFAULT_FACTOR.get(kind, 1.0) if factor is None else factor
    check(kind, duration_s, f)
    fault = Fault(kind, uuid.uuid4().hex, now_ms, now_ms + duration_s * 1000.0, f)
    fault = Fault.from_json(kind, fault.to_json())  # with `raw`, as a reader would see it
    await r.hset(keys.node_faults(node), kind, fault.raw)
    log.info("node %s: fault %s injected (id %s, %.1f s, factor %g)", node, kind, fault.id, duration_s, f)
    return fault


async def clear(r: aioredis.Redis, node: str) -> int:
    """Remove every fault of `node`; returns how many there were."""
    n = int(await r.hlen(keys.node_faults(node)))
    await r.delete(keys.node_faults(node))
    return n


async def listing(r: aioredis.Redis, node: str) -> dict[str, Fault]:
    """Every fault stored for `node`, expired or not (malformed entries are skipped)."""
    raw = await r.hgetall(keys.node_faults(node))
    out: dict[str, Fault] = {}
    for k, v in raw.items():
        kind = k.decode() if isinstance(k, bytes) else str(k)
        try:
            out[kind] = Fault.from_json(kind, v)
        except (ValueError, KeyError, TypeError) as e:
            log.warning("node %s: malformed fault %s=%r (%s)", node, kind, v[:200], e)
    return out


async def remove(r: aioredis.Redis, node: str, fault: Fault) -> bool:
    """Remove `fault` unless it was replaced meanwhile (a one-shot fault acted on, an expired one)."""
    value = fault.raw or fault.to_json()
    return bool(await r.eval(_DEL_IF_SAME, 1, keys.node_faults(node), fault.kind, value))


async def active(r: aioredis.Redis, node: str, now_ms: float) -> dict[str, Fault]:
    """The faults of `node` in force at `now_ms`, by kind; expired and malformed ones are removed."""
    key = keys.node_faults(node)
    raw = await r.hgetall(key)
    out: dict[str, Fault] = {}
    for k, v in raw.items():
        kind = k.decode() if isinstance(k, bytes) else str(k)
        try:
            fault = Fault.from_json(kind, v)
            if kind not in KINDS:
                raise ValueError(f"unknown kind (allowed: {', '.join(KINDS)})")
        except (ValueError, KeyError, TypeError) as e:
            log.warning("node %s: dropping malformed fault %s=%r (%s)", node, kind, v[:200], e)
            await r.eval(_DEL_IF_SAME, 1, key, kind, v)
            continue
        if now_ms >= fault.until_ms:
            await r.eval(_DEL_IF_SAME, 1, key, kind, v)
        elif fault.at_ms <= now_ms:
            out[kind] = fault
    return out


# -- schedules (demos) -------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ScheduledFault:
    at_s: float
    """Seconds after the schedule starts."""
    node: str
    kind: str
    duration_s: float = DEFAULT_DURATION_S
    factor: float | None = None


def parse_schedule(data: Any, source: str = "schedule") -> list[ScheduledFault]:
    """Validate a schedule (a list of {at_s, node, kind, duration_s?, factor?}), ordered by (at_s, node, kind)."""
    if not isinstance(data, list):
        raise FaultError(f"{source}: expected a list of faults, got {type(data).__name__}")
    allowed = {"at_s", "node", "kind", "duration_s", "factor"}
    out: list[ScheduledFault] = []
    for i, item in enumerate(data):
        where = f"{source}[{i}]"
        if not isinstance(item, dict):
            raise FaultError(f"{where}: expected a mapping, got {type(item).__name__}")
        unknown = sorted(set(item) - allowed)
        if unknown:
            raise FaultError(f"{where}: unknown keys {unknown}; allowed: {', '.join(sorted(allowed))}")
        missing = [k for k in ("at_s", "node", "kind") if k not in item]
        if missing:
            raise FaultError(f"{where}: missing {', '.join(missing)}")
        try:
            at_s = float(item["at_s"])
            duration_s = float(item.get("duration_s", DEFAULT_DURATION_S))
            factor = None if item.get("factor") is None else float(item["factor"])
        except (TypeError, ValueError) as e:
            raise FaultError(f"{where}: at_s, duration_s and factor must be numbers ({e})") from None
        if at_s < 0:
            raise FaultError(f"{where}.at_s: {at_s:g} must be >= 0")
        kind, node = str(item["kind"]), str(item["node"])
        try:
            check(kind, duration_s, DEFAULT_FACTOR.get(kind, 1.0) if factor is None else factor)
        except FaultError as e:
            raise FaultError(f"{where}: {e}") from None
        out.append(ScheduledFault(at_s, node, kind, duration_s, factor))
    return sorted(out, key=lambda s: (s.at_s, s.node, s.kind))


def load_schedule(path: Path) -> list[ScheduledFault]:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise FaultError(f"cannot read fault schedule {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise FaultError(f"{path}: not valid YAML: {e}") from None
    return parse_schedule(data or [], source=str(path))


async def play_schedule(
    r: aioredis.Redis, schedule: list[ScheduledFault], stop: asyncio.Event, now_ms: Callable[[], float],
) -> int:
    """Inject each scheduled fault at its time after the start; returns how many were injected before `stop`."""
    start = now_ms()
    done = 0
    for item in schedule:
        delay = (start + item.at_s * 1000.0 - now_ms()) / 1000.0
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
            except TimeoutError:
                pass
        if stop.is_set():
            break
        await inject(r, item.node, item.kind, item.duration_s, item.factor, now_ms=now_ms())
        done += 1
    return done
