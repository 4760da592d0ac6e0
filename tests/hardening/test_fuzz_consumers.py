"""Fuzzing the stream layer (issue 9): the msgpack codec and every stream consumer, property-based with hypothesis.

- The codec: whatever the fields of an entry (arbitrary bytes, msgpack of random structures, every event type with a
  field missing, of the wrong type, NaN/inf, out of the 64-bit range, over MAX_STR / MAX_ITEMS, a nested event
  broken, a wrong codec version, an unknown type, a broken overlay), `codec.decode` returns a valid event or raises
  DecodeError, never anything else.
- Every consumer, for real against Valkey and etcd (the role objects run in-process, each in its own thread and
  event loop, as `rackflow <role>` would run them): the router (rf:ingress), a batcher (rf:rack:{r0}:req), a worker
  (rf:node:{r0-n0}:batch and its control stream rf:node:{r0-n0}:ctl) and the monitor (rf:health) get batches of bad
  entries with good ones between them. The role stays alive and handles the good ones; every bad entry is in rf:dlq
  with a non-empty reason and its original bytes, and none is left pending in the consumer group.
- reply_to: good and extreme requests name every kind of key in `reply_to` (the live gateway reply stream, a
  well-formed one that does not exist, near misses that exist as streams, keys of other types, the pipeline's own
  streams, random text); afterwards no writer touched anything but the live reply stream (`audit_replies`).

The long tier (`-m long`, in `make test-hardening`) checks the same properties at volume: at least
LONG_STREAM_INPUTS adversarial entries into each of the five streams (100,000 in all), written with pipelined XADDs
a chunk at a time: the fast tier's hypothesis strategies, byte-level mutants of valid and bad entries (`mutant`),
entries over a bound at a fixed rate. Each test counts what it sent and fails below its share.

The number of inputs tried is printed (`pytest -s`) and written to `.rackflow/hardening/fuzz_counts.json`
(sections `consumers`, and `consumers-long` with each stream's counts, wall time and consumer statistics).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import itertools
import json
import math
import random
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pipeline.config import DEFAULT_CONFIG_DIR, RackflowConfig, load_config
from pipeline.events import (
    EVENT_TYPES,
    MAX_ITEMS,
    MAX_STR,
    BatchEvent,
    BlockEvent,
    CancelEvent,
    DecisionEvent,
    HealthEvent,
    ReleaseEvent,
    RequestEvent,
    ResultEvent,
    ResumeEvent,
    TokenEvent,
    to_wire,
)
from streams import codec, keys
from streams.errors import DecodeError
from tests.conftest import REPO
from workers.shell.runtime import WALL

pytestmark = [pytest.mark.integration, pytest.mark.hardening]

COUNTS_FILE = REPO / ".rackflow" / "hardening" / "fuzz_counts.json"
COUNTS: Counter[str] = Counter()


def write_counts(section: str, counts: Counter[str], path: Path = COUNTS_FILE) -> str:
    """Merge `counts` under `section` into the JSON file (the gateway fuzzer writes its own section)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data[section] = dict(sorted(counts.items())) | {"total": sum(counts.values())}
    path.write_text(json.dumps(data, indent=2) + "\n")
    return f"{section}: {sum(counts.values())} inputs tried (" + ", ".join(
        f"{k}={v}" for k, v in sorted(counts.items())) + f"); written to {path}"


@pytest.fixture(scope="module", autouse=True)
def _report_counts() -> Iterator[None]:
    yield
    if COUNTS:
        print("\n" + write_counts("consumers", COUNTS))


# -- valid samples of every event type ---------------------------------------------------------------------------------
NODE = "r0-n0"
RACK = "r0"
MODEL = "qwen2-7b"


def request(rid: str | None = None, **kw: Any) -> RequestEvent:
    base: dict[str, Any] = dict(
        request_id=rid or str(uuid.uuid4()), version=1, tenant="t1", user_id="u1", model=MODEL, in_tokens=8,
        out_tokens=2, max_tokens=2, mem_est_kb=64.0, arrival_ms=WALL.now_ms(), prompt="hello", rack=RACK,
        prefix_hashes=(1, 2, 3),
    )
    base.update(kw)
    return RequestEvent(**base)


def samples() -> dict[str, Any]:
    now = WALL.now_ms()
    req = request("sample-req")
    return {
        "request": req,
        "batch": BatchEvent("b-1", RACK, NODE, (req,), 64.0, 1024.0, now, now),
        "tokens": TokenEvent("sample-req", 1, 0, (1, 2), ("a", "b"), now, NODE),
        "result": ResultEvent("sample-req", 1, "t1", "u1", MODEL, "ok", NODE, RACK, 8, 2, now, now),
        "health": HealthEvent(NODE, RACK, now, "sim", xid_errors=0, temp_c=50.0),
        "decision": DecisionEvent("route", "p", RACK, ("a", "b"), now, scores={"x": 1.0}, inputs={"k": (1.0,)}),
        "resume": ResumeEvent(req, (1, 2), ("a", "b"), "r0-n1"),
        "release": ReleaseEvent("sample-req", 2, "r0-n1", now),
        "cancel": CancelEvent("sample-req", now, "because"),
        "blocks": BlockEvent(NODE, RACK, now, (11, 12), (13,)),
    }


SAMPLES = samples()
assert set(SAMPLES) == set(EVENT_TYPES), "a new event type needs a sample here"


def _field_kinds(cls: type[Any]) -> dict[str, str]:
    """field name -> str|int|float|bool|tuple|dict|event|optional-str, from the event's dataclass."""
    out = {}
    for name, ann in cls.__annotations__.items():
        if name == "TYPE":
            continue
        a = str(ann)
        if a.startswith("tuple[RequestEvent") or a == "RequestEvent":
            out[name] = "event"
        elif a.startswith("tuple"):
            out[name] = "tuple"
        elif a.startswith("dict"):
            out[name] = "dict"
        elif a == "str | None":
            out[name] = "optional-str"
        else:
            out[name] = a
    return out


KINDS = {t: _field_kinds(cls) for t, cls in EVENT_TYPES.items()}


# -- strategies --------------------------------------------------------------------------------------------------------
def is_bad(fields: dict[bytes, bytes]) -> bool:
    """The oracle: True when the codec refuses the entry. Anything but DecodeError propagates (a codec bug)."""
    try:
        codec.decode(fields)
    except DecodeError:
        return True
    return False


ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
"""What msgpack can carry."""
scalars = (
    st.none() | st.booleans() | ints
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20) | st.binary(max_size=20)
)
structures = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | st.binary(max_size=4), inner,
                                                                 max_size=4),
    max_leaves=12,
)
# values of the wrong type for each kind of field
WRONG = {
    "str": st.none() | ints | st.floats() | st.binary(max_size=8) | st.lists(st.text(max_size=3), max_size=2),
    "optional-str": ints | st.floats() | st.binary(max_size=8) | st.booleans(),
    "int": st.none() | st.text(max_size=5) | st.floats() | st.booleans() | st.binary(max_size=4)
    | st.sampled_from([2**63, 2**64 - 1]),
    "float": st.none() | st.text(max_size=5) | st.booleans() | st.binary(max_size=4) | st.lists(st.floats(), max_size=2)
    | st.sampled_from([math.nan, math.inf, -math.inf]),
    "bool": st.none() | st.integers(0, 1) | st.text(max_size=3) | st.floats(),
    "tuple": st.none() | ints | st.text(max_size=5) | st.dictionaries(st.text(max_size=3), ints,
                                                                              max_size=2)
    | st.lists(st.none() | st.floats(allow_nan=True) | st.dictionaries(st.text(max_size=2), ints, max_size=1)
               | st.sampled_from([2**63, 2**64 - 1]), min_size=1, max_size=3),
    "dict": st.none() | ints | st.lists(ints, max_size=2)
    | st.dictionaries(st.text(max_size=3), st.text(max_size=3) | st.none() | st.just(math.nan), min_size=1, max_size=2),
    "event": st.none() | ints | st.text(max_size=5) | st.lists(ints, min_size=1, max_size=2),
}


def entry(t: str, data: Any, v: bytes = b"1") -> dict[bytes, bytes]:
    return {b"v": v, b"t": t.encode(), b"d": msgpack.packb(data, use_bin_type=True)}


HOWS = ("missing", "wrong_type", "huge", "nested", "not_a_map")


def make_huge(data: dict[str, Any], kinds: dict[str, str], pick: Callable[[list[Any]], Any]) -> None:
    """One field of `data` over a bound (a string over MAX_STR, an int over 64 bits, over MAX_ITEMS items); `pick`
    chooses among its arguments (a hypothesis draw, or a seeded random's choice)."""
    by_kind = {k: [f for f in kinds if kinds[f] == k] for k in ("str", "int", "tuple", "dict")}
    k = pick([k for k, v in by_kind.items() if v])
    name = pick(by_kind[k])
    if k == "str":
        data[name] = "x" * (MAX_STR + 1)
    elif k == "int":
        data[name] = pick([2**63, 2**64 - 1])
    elif k == "tuple":
        data[name] = [0] * (MAX_ITEMS + 1)
    else:
        data[name] = {str(i): 0.0 for i in range(MAX_ITEMS + 1)}


@st.composite
def mutated_event(draw: st.DrawFn, hows: tuple[str, ...] = HOWS) -> dict[bytes, bytes]:
    """A valid event of any type with one thing made wrong (`hows`: which kinds of wrong)."""
    t = draw(st.sampled_from(sorted(EVENT_TYPES)))
    data = to_wire(SAMPLES[t])
    kinds = KINDS[t]
    cls = EVENT_TYPES[t]
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    how = draw(st.sampled_from(list(hows)))
    if how == "missing":
        del data[draw(st.sampled_from(required))]
    elif how == "wrong_type":
        name = draw(st.sampled_from(sorted(kinds)))
        data[name] = draw(WRONG[kinds[name]])
    elif how == "huge":
        make_huge(data, kinds, lambda xs: draw(st.sampled_from(xs)))
    elif how == "nested" and t in ("batch", "resume"):
        inner = to_wire(SAMPLES["request"])
        inner_kinds = KINDS["request"]
        name = draw(st.sampled_from(sorted(inner_kinds)))
        if draw(st.booleans()) and name in ("request_id", "version", "tenant", "user_id", "model", "in_tokens"):
            del inner[name]
        else:
            inner[name] = draw(WRONG[inner_kinds[name]])
        if t == "batch":
            data["requests"] = [to_wire(SAMPLES["request"]), inner]
        else:
            data["request"] = inner
    else:
        data = draw(st.sampled_from([[data], "x", 1, None, list(data)]))
    return entry(t, data)


wrong_version = st.builds(
    lambda t, v: {**codec.encode(SAMPLES[t]), b"v": v},
    st.sampled_from(sorted(EVENT_TYPES)),
    st.sampled_from([b"0", b"2", b"-1", b"", b"x", b"1.0", b"\xff", b"1" * 5000, b"99999999999999999999"])
    | st.binary(max_size=6),
)
unknown_type = st.builds(
    lambda t, data: entry(t, data),
    st.text(max_size=12).filter(lambda t: t not in EVENT_TYPES), structures,
)
random_payload = st.builds(
    lambda t, data: entry(t, data),
    st.sampled_from(sorted(EVENT_TYPES)),
    structures | st.dictionaries(st.sampled_from(sorted({f for k in KINDS.values() for f in k})), structures,
                                 max_size=12),
)
raw_payload = st.builds(
    lambda t, d: {b"v": b"1", b"t": t.encode(), b"d": d},
    st.sampled_from(sorted(EVENT_TYPES)),
    st.binary(max_size=64) | st.sampled_from([b"\xc1", b"\x91" * 2000 + b"\x90", b"\xdd\xff\xff\xff\xff",
                                              b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff"]),
)
raw_fields = st.dictionaries(
    st.sampled_from([b"v", b"t", b"d", b"o"]) | st.binary(min_size=1, max_size=6), st.binary(max_size=40),
    min_size=1, max_size=5,
)
bad_overlay = st.builds(
    lambda t, o: {**codec.encode(SAMPLES[t]), b"o": o},
    st.sampled_from(sorted(EVENT_TYPES)),
    st.binary(max_size=20)
    | st.builds(lambda k, v: msgpack.packb({k: v}, use_bin_type=True),
                st.sampled_from(["request_id", "version", "rack", "routed_ms", "prefix_cache", "node", "ts_ms"]),
                st.none() | st.lists(ints, max_size=2) | st.just(math.nan) | st.binary(max_size=3))
    | st.builds(lambda x: msgpack.packb(x, use_bin_type=True), structures),
)
any_entry = st.one_of(mutated_event(), wrong_version, unknown_type, random_payload, raw_payload, raw_fields,
                      bad_overlay)
bad_entry = any_entry.filter(is_bad)


# -- reply_to: a request names its gateway's reply stream; a writer ignores every other key ------------------------
GW_LIVE = keys.gateway_replies("fuzz-live")
"""A running gateway's reply stream (`reply_targets` creates it): requests naming it get their tokens and result
there as well."""
GW_GONE = keys.gateway_replies("fuzz-gone")
"""Well formed, but no such stream (its gateway stopped): a writer must not create it (NOMKSTREAM)."""
NEAR_MISSES = [
    "rf:gw:{fuzz-live}:outx", "rf:gw:{fuzz-live}:out:x", "rf:gw:{fuzz live}:out", "RF:GW:{fuzz-live}:OUT",
    "rf:gw:fuzz-live:out", "rf:gw:{}:out", "rf:gw:{" + "a" * 65 + "}:out", "rf:gw:{fuzz-live}:out\n",
    "rf:gw:{fuzz/live}:out", "rf:gw:{fuzz-live}}:out", " rf:gw:{fuzz-live}:out", "rf:gw:{fuzz\u00e9}:out",
    "rf:gw:{fuzz-live}:out\x00",
]
"""Keys that look like a gateway reply stream and are not one: each exists as a stream (a canary), so NOMKSTREAM
would not stop a writer that took one for a reply stream."""
OTHER_CANARIES: dict[str, Any] = {"fuzz:canary:string": b"untouched", "fuzz:canary:hash": {b"k": b"v"},
                                  "fuzz:canary:list": [b"a", b"b"]}
"""Keys of other types a reply_to may name (an XADD on them would fail with WRONGTYPE, or worse)."""
SYSTEM_STREAMS = [keys.INGRESS, keys.RESULTS, keys.DLQ, keys.HEALTH, keys.DECISIONS, keys.rack_requests(RACK),
                  keys.node_batches(NODE), keys.node_control(NODE)]
"""The pipeline's own streams: no writer may append a request's tokens or result to them."""
ABSENT = [GW_GONE, "fuzz:absent", "*", "\x00", "../..", "{rf:results}", keys.request_out("fuzz-nobody"),
          keys.result_done("fuzz-nobody")]
REPLY_TOS = ["", GW_LIVE, GW_LIVE, *NEAR_MISSES, *OTHER_CANARIES, *SYSTEM_STREAMS, *ABSENT]
reply_tos = (st.sampled_from(REPLY_TOS) | st.from_regex(r"rf:gw:\{[A-Za-z0-9_.-]{1,64}\}:out", fullmatch=True)
             | st.text(max_size=40))
"""What a fuzzed request names in `reply_to`: its gateway's stream, nothing, or any key at all."""
_next_reply_to = itertools.cycle(REPLY_TOS)


def next_reply_to() -> str:
    """The `reply_to` of the next good entry (round the list: every kind of target is named by good ones too)."""
    return next(_next_reply_to)


def reply_tos_of(fields: dict[bytes, bytes]) -> set[str]:
    """The `reply_to` of every request in a (valid) entry."""
    try:
        ev = codec.decode(fields)
    except DecodeError:
        return set()
    if isinstance(ev, RequestEvent):
        return {ev.reply_to}
    if isinstance(ev, BatchEvent):
        return {q.reply_to for q in ev.requests}
    if isinstance(ev, ResumeEvent):
        return {ev.request.reply_to}
    return set()


def _snapshot(r: redis.Redis) -> dict[str, Any]:
    pipe = r.pipeline(transaction=False)
    for k in NEAR_MISSES:
        pipe.xrange(k)
    pipe.get("fuzz:canary:string")
    pipe.hgetall("fuzz:canary:hash")
    pipe.lrange("fuzz:canary:list", 0, -1)
    return dict(zip([*NEAR_MISSES, *OTHER_CANARIES], pipe.execute(), strict=True))


def reply_targets(r: redis.Redis) -> dict[str, Any]:
    """Create the live gateway's reply stream and the canaries; returns the canaries as they are."""
    pipe = r.pipeline(transaction=False)
    pipe.xadd(GW_LIVE, {b"gw": b"1"})
    for k in NEAR_MISSES:
        pipe.xadd(k, {b"canary": k.encode()})
    pipe.set("fuzz:canary:string", OTHER_CANARIES["fuzz:canary:string"])
    pipe.hset("fuzz:canary:hash", mapping=OTHER_CANARIES["fuzz:canary:hash"])
    pipe.rpush("fuzz:canary:list", *OTHER_CANARIES["fuzz:canary:list"])
    pipe.execute()
    return _snapshot(r)


def audit_replies(r: redis.Redis, before: dict[str, Any], named: set[str], consumed: str,
                  expect_live: set[str]) -> dict[str, int]:
    """Every writer kept to the reply streams its requests named (`named`: every reply_to sent): the canaries are
    as they were, no key was created for a name that is not a live reply stream, the pipeline's streams hold no
    token or result copy (`consumed`, the fuzzed stream, is checked by its dead letters instead), rf:results holds
    one result per request, and the live reply stream holds only events that named it, the results of
    `expect_live` among them. Returns what it looked at."""
    problems = [f"canary {k!r} changed: {before[k]!r:.200} -> {v!r:.200}" for k, v in _snapshot(r).items()
                if v != before[k]]
    preset = {GW_LIVE, *NEAR_MISSES, *OTHER_CANARIES, *SYSTEM_STREAMS}
    unnamed = sorted(named - preset)
    for chunk in (unnamed[i:i + 1000] for i in range(0, len(unnamed), 1000)):
        pipe = r.pipeline(transaction=False)
        for k in chunk:
            pipe.exists(k)
        problems += [f"a writer created {k!r:.200}" for k, e in zip(chunk, pipe.execute(), strict=True) if e]
    results: Counter[str] = Counter()
    for k in SYSTEM_STREAMS:
        if k == consumed:
            continue
        for entry_id, f in r.xrange(k):
            try:
                ev = codec.decode(f)
            except DecodeError:
                continue
            if isinstance(ev, ResultEvent) and k == keys.RESULTS:
                results[ev.request_id] += 1
            elif isinstance(ev, TokenEvent | ResultEvent):
                problems.append(f"a {ev.TYPE} of {ev.request_id} (reply_to {ev.reply_to!r:.100}) in {k} ({entry_id!r})")
    problems += [f"{n} results of {rid} in {keys.RESULTS}" for rid, n in results.items() if n > 1]
    live: set[str] = set()
    copies = 0
    for _entry_id, f in r.xrange(GW_LIVE):
        if f == {b"gw": b"1"}:
            continue
        copies += 1
        ev = codec.decode(f)
        if not isinstance(ev, TokenEvent | ResultEvent) or ev.reply_to != GW_LIVE:
            problems.append(f"{GW_LIVE} holds {ev!r:.300}")
        elif isinstance(ev, ResultEvent):
            live.add(ev.request_id)
    problems += [f"the result of {rid} (reply_to {GW_LIVE}) is not on it" for rid in sorted(expect_live - live)]
    assert not problems, f"{len(problems)} reply_to violations: " + "; ".join(problems[:20])
    return {"reply_to_names": len(named), "reply_copies_live": copies, "results_checked": sum(results.values())}


# -- the long tier's inputs: the same families at volume, and byte-level mutants -----------------------------------
volume_bad_entry = st.one_of(mutated_event(tuple(h for h in HOWS if h != "huge")), wrong_version, unknown_type,
                             random_payload, raw_payload, raw_fields, bad_overlay).filter(is_bad)
"""`bad_entry` without its over-the-bound fields (a 4 MB string in one entry of 35 or so): the long tier adds those
at a fixed rate instead (`huge_entry`), or its 100,000 entries would move gigabytes through Valkey."""


def huge_entry(rnd: random.Random) -> dict[bytes, bytes]:
    """A valid event with one field over its bound (what `mutated_event`'s "huge" makes)."""
    t = rnd.choice(sorted(EVENT_TYPES))
    data = to_wire(SAMPLES[t])
    make_huge(data, KINDS[t], rnd.choice)
    return entry(t, data)


MAGIC = [b"\x00", b"\xff", b"\xc1", b"\xc0", b"\xc2", b"\x7f", b"\x80", b"\x90", b"\xa0", b"\xcc\xff",
         b"\xcf" + b"\xff" * 8, b"\xd3\x80" + b"\x00" * 7, b"\xcb\x7f\xf8" + b"\x00" * 6, b"\xcb\xff\xf0" + b"\x00" * 6,
         b"\xdc\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xde\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
         b"\xc6\xff\xff\xff\xff", b"\xd9\xff", b"\xc7\x01\x01", b"\xd4\xff\x00", b"\xd6\xff\x00\x00\x00\x00",
         b"\xa3\xed\xa0\x80", b"\x81\xc0\xc0", b"\x81\x90\x00"]
"""msgpack heads that lie (lengths of 4 GB, a reserved byte, NaN, ext types, a lone surrogate, a nil or array key)."""
TYPE_NAMES = [t.encode() for t in sorted(EVENT_TYPES)]


def havoc(rnd: random.Random, data: bytes) -> bytes:
    """One to four byte-level mutations of `data` (bit flips, random or lying bytes, cuts, repeats)."""
    b = bytearray(data)
    for _ in range(rnd.randint(1, 4)):
        op = rnd.randrange(7)
        pos = rnd.randrange(len(b) + 1)
        if op == 0 and b:
            b[rnd.randrange(len(b))] ^= 1 << rnd.randrange(8)
        elif op == 1 and b:
            b[rnd.randrange(len(b))] = rnd.randrange(256)
        elif op == 2:
            del b[pos:]
        elif op == 3:
            b[pos:pos] = rnd.choice(MAGIC)
        elif op == 4:
            m = rnd.choice(MAGIC)
            b[pos:pos + len(m)] = m
        elif op == 5:
            del b[pos:pos + rnd.randint(1, 8)]
        elif b:
            i = rnd.randrange(len(b))
            b[pos:pos] = b[i:i + rnd.randint(1, 16)]
    return bytes(b)


def mutant(rnd: random.Random, seeds: list[dict[bytes, bytes]]) -> dict[bytes, bytes]:
    """An entry made from one of `seeds` (valid events of every type, and bad entries) by a byte-level mutation of
    its payload, a splice of two payloads, a payload under another type, a broken version or overlay, or a field
    dropped or added. It may still decode: the caller keeps the ones the codec refuses."""
    f = dict(rnd.choice(seeds))
    op = rnd.randrange(10)
    if op < 6 or not isinstance(f.get(b"d"), bytes):
        f[b"d"] = havoc(rnd, f.get(b"d") or b"")
    elif op == 6:
        other = rnd.choice(seeds).get(b"d") or b""
        f[b"d"] = f[b"d"][:rnd.randrange(len(f[b"d"]) + 1)] + other[rnd.randrange(len(other) + 1):]
    elif op == 7:
        f[b"t"] = rnd.choice(TYPE_NAMES)
        f[b"d"] = havoc(rnd, f[b"d"]) if rnd.random() < 0.5 else f[b"d"]
    elif op == 8:
        k = rnd.choice([b"v", b"o", b"t"])
        f[k] = havoc(rnd, f.get(k) or b"")
    elif len(f) > 1 and rnd.random() < 0.5:
        del f[rnd.choice(sorted(f))]
    else:
        f[rnd.choice([b"x", b"o", b"\x00", b"d2", b"T", b"v "])] = havoc(rnd, rnd.choice(MAGIC))
    return f


def mutation_seeds() -> list[dict[bytes, bytes]]:
    """Every event type's valid encoding, with and without a reply_to (the seeds of `mutant`)."""
    req = dataclasses.replace(SAMPLES["request"], reply_to=GW_LIVE)
    more = [req, dataclasses.replace(SAMPLES["tokens"], reply_to=GW_LIVE),
            dataclasses.replace(SAMPLES["result"], reply_to="rf:ingress"),
            dataclasses.replace(SAMPLES["batch"], requests=(req, SAMPLES["request"])),
            dataclasses.replace(SAMPLES["resume"], request=req)]
    return [codec.encode(ev) for ev in (*SAMPLES.values(), *more)]

EXTREME = {
    "str": st.sampled_from(["", "\x00", "é" * 1000, "x" * 100_000, "../..", "{rf:results}", "\ud7ff\U0010ffff"]),
    "optional-str": st.sampled_from([None, "", "no-such-rack"]),
    "int": st.sampled_from([-(2**63), 2**63 - 1, 0, -1]),
    "float": st.sampled_from([-1e308, 1e308, 0.0, -0.0, 5e-324, -1.0]),
    "bool": st.booleans(),
    "tuple": st.just([]),
    "dict": st.just({}),
}


@st.composite
def extreme_data(draw: st.DrawFn, t: str) -> dict[str, Any]:
    """The sample of type `t` (fresh ids) with one to four fields set to extreme values that still validate."""
    data = to_wire(SAMPLES[t])
    for f in ("request_id", "seq_id", "batch_id"):
        if f in data:
            data[f] = str(draw(st.uuids()))
    if t == "batch":
        data["requests"] = [draw(extreme_data("request"))]
    elif t == "resume":
        data["request"] = draw(extreme_data("request"))
    kinds = KINDS[t]
    for name in draw(st.lists(st.sampled_from(sorted(kinds)), min_size=1, max_size=4, unique=True)):
        if name == "reply_to":
            data[name] = draw(reply_tos)
        elif kinds[name] in EXTREME:
            data[name] = draw(EXTREME[kinds[name]])
    return data


def weird_entry(types: list[str]) -> st.SearchStrategy[dict[bytes, bytes]]:
    """Valid events of the stream's own types with extreme values: the role must not crash on them either."""
    return st.sampled_from(types).flatmap(lambda t: extreme_data(t).map(lambda d: entry(t, d))).filter(
        lambda f: not is_bad(f))


# -- the codec ---------------------------------------------------------------------------------------------------------
@settings(max_examples=1500, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(fields=any_entry)
def test_codec_decodes_or_raises_decode_error(fields: dict[bytes, bytes]) -> None:
    COUNTS["codec"] += 1
    try:
        ev = codec.decode(fields)
    except DecodeError as e:
        assert str(e), "a DecodeError must say why"
        return
    # accepted: it is a valid event of its type, and it survives a round trip
    assert type(ev) is EVENT_TYPES[fields[b"t"].decode()]
    assert codec.decode(codec.encode(ev)) == ev


@settings(max_examples=300, deadline=None, database=None)
@given(fields=st.dictionaries(st.text(max_size=4) | st.binary(max_size=4),
                              st.text(max_size=8) | st.binary(max_size=8), max_size=4))
def test_codec_on_str_or_bytes_fields(fields: dict[Any, Any]) -> None:
    """Decoded with decode_responses=True a client hands str fields: same contract."""
    COUNTS["codec"] += 1
    try:
        codec.decode(fields)
    except DecodeError:
        pass


def test_codec_rejects_every_bound() -> None:
    """The deterministic corner cases, once each (hypothesis may or may not draw them)."""
    req = to_wire(SAMPLES["request"])
    cases = {
        "huge string": {**req, "prompt": "x" * (MAX_STR + 1)},
        "too many items": {**req, "prefix_hashes": list(range(MAX_ITEMS + 1))},
        "int over 64 bits": {**req, "version": 2**63},
        "nan": {**req, "mem_est_kb": math.nan},
        "inf": {**req, "arrival_ms": math.inf},
        "bool for int": {**req, "version": True},
        "nested missing": {**to_wire(SAMPLES["resume"]), "request": {"request_id": "x"}},
    }
    for name, data in cases.items():
        COUNTS["codec"] += 1
        with pytest.raises(DecodeError):
            codec.decode(entry("request" if "nested" not in name else "resume", data))
    big = to_wire(SAMPLES["decision"]) | {"scores": {str(i): 1.0 for i in range(MAX_ITEMS + 1)}}
    COUNTS["codec"] += 1
    with pytest.raises(DecodeError, match="more than"):
        codec.decode(entry("decision", big))


# -- consumers ---------------------------------------------------------------------------------------------------------
STREAMS_CFG = {"claim_idle_ms": 300, "max_deliveries": 2, "block_ms": 20, "read_count": 64}
LONG_STREAMS_CFG = {"claim_idle_ms": 10_000, "max_deliveries": 5, "block_ms": 20, "read_count": 128}
"""The long tier's: configs/policies.yaml's claim idle time, delivery bound and read size. At the fast tier's 300 ms
a read of entries that waits its turn for a busy machine's CPU (the fuzzer draws in the same process) is claimed
again, and after two claims a good entry among them is dead-lettered for its delivery count, which says nothing
about the role."""


def small_config(tmp_path: Path, streams: dict[str, Any] | None = None) -> RackflowConfig:
    p = tmp_path / "fuzz.yaml"
    cluster = {
        "cluster": {"racks": [{"name": "r0", "node_count": 2,
                               "node": {"gpu": "h100-80gb", "tp": 1, "models": [MODEL]}}]},
        "policies": {"streams": streams or STREAMS_CFG},
    }
    p.write_text(yaml.safe_dump(cluster))
    return load_config(DEFAULT_CONFIG_DIR, [p])


class RoleThread:
    """A role's `run(stop)` in its own thread and event loop (the test drives it from outside with a sync client)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make
        self.role: Any = None
        self.error: BaseException | None = None
        self.rc: int | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True, name="role")

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            self.role = self.make()
        except BaseException as e:
            self.error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self.rc = await self.role.run(self._stop)
        except BaseException as e:  # the role died: the test fails on it
            self.error = e

    def __enter__(self) -> RoleThread:
        self.thread.start()
        assert self._ready.wait(30), "role did not start"
        if self.error is not None:
            raise self.error
        return self

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None and self.rc is None

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None and self.thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(60)
        assert not self.thread.is_alive(), f"role did not stop in 60 s; its tasks:\n{self._task_stacks()}"

    def _task_stacks(self) -> str:
        """Where the role's thread is now and where each of its asyncio tasks waits (for a role that does not stop:
        the test says where; a loop stuck in synchronous code shows in the thread's frame)."""
        loop = self._loop
        if loop is None:
            return "(no loop)"
        frame = sys._current_frames().get(self.thread.ident or -1)
        now = "".join(traceback.format_stack(frame, limit=12)) if frame is not None else "(no frame)"
        out = [f"thread now:\n{now}"]
        for task in list(asyncio.all_tasks(loop)):
            buf = io.StringIO()
            task.print_stack(limit=8, file=buf)
            out.append(buf.getvalue())
        return "\n".join(out)


def _sid(x: bytes | str) -> tuple[int, int]:
    s = x.decode() if isinstance(x, bytes) else x
    a, _, b = s.partition("-")
    return int(a), int(b or 0)


def wait_for(cond: Callable[[], bool], timeout_s: float, what: Callable[[], str], poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout_s}s: {what()}")
        time.sleep(poll_s)


class Stream:
    """The fuzzing side of one consumed stream: what was sent, what reached the dead-letter stream."""

    def __init__(self, r: redis.Redis, stream: str, group: str) -> None:
        self.r = r
        self.stream = stream
        self.group = group
        self.dlq: dict[str, dict[bytes, bytes]] = {}
        self.dlq_entry: dict[str, str] = {}
        """Original entry id -> its dead letter's id in rf:dlq."""
        self.dead_letters = 0
        """Dead letters read for this stream (more than len(dlq) when an entry was dead-lettered twice)."""
        self._dlq_cursor = "-"

    def read_dlq(self) -> None:
        while True:
            rows = self.r.xrange(keys.DLQ, min=self._dlq_cursor, max="+", count=2000)
            for rid, f in rows:
                self._dlq_cursor = "(" + rid.decode()
                if f[b"stream"].decode() == self.stream:
                    self.dlq[f[b"id"].decode()] = f
                    self.dlq_entry[f[b"id"].decode()] = rid.decode()
                    self.dead_letters += 1
            if len(rows) < 2000:
                return

    def pending_ids(self) -> set[str]:
        try:
            rows = self.r.xpending_range(self.stream, self.group, min="-", max="+", count=100_000)
        except redis.ResponseError:  # the group is not created yet
            return set()
        return {row["message_id"].decode() for row in rows}

    def acked_many(self, entry_ids: list[str]) -> list[bool]:
        """Each: delivered to the group and no longer pending (one round trip for the lot)."""
        try:
            groups = {g["name"].decode(): g for g in self.r.xinfo_groups(self.stream)}
        except redis.ResponseError:
            return [False] * len(entry_ids)
        g = groups.get(self.group)
        if g is None:
            return [False] * len(entry_ids)
        last = _sid(g["last-delivered-id"])
        pending = self.pending_ids()
        return [_sid(i) <= last and i not in pending for i in entry_ids]

    def acked(self, entry_id: str) -> bool:
        """Delivered to the group and no longer pending."""
        return self.acked_many([entry_id])[0]


def exist_many(r: redis.Redis, names: list[str]) -> list[bool]:
    pipe = r.pipeline(transaction=False)
    for n in names:
        pipe.exists(n)
    return [bool(x) for x in pipe.execute()]


Entries = list[tuple[str, dict[bytes, bytes]]]


@dataclasses.dataclass
class Target:
    """One fuzzed stream and the role that consumes it, for both tiers."""

    label: str
    stream: str
    group: str
    make: Callable[[RackflowConfig, Any], Any]
    """(config, endpoints) -> the role."""
    own: tuple[str, ...]
    """The event types the stream carries: every other type is a bad entry on it."""
    good: Callable[[], dict[bytes, bytes]]
    handled: Callable[[redis.Redis, Stream, Any, Entries], list[bool]]
    """(client, stream, role, good entries) -> whether each was handled as it should be."""
    consumer: Callable[[Any], Any]
    """The role's StreamConsumer of this stream."""
    answers_live: bool = False
    """Good entries naming the live reply stream get their result there."""
    ready: Callable[[Any], bool] = lambda _role: True

    @property
    def wrong_types(self) -> list[str]:
        return [t for t in EVENT_TYPES if t not in self.own]


def _request_ids(items: Entries) -> list[str]:
    out = []
    for _i, f in items:
        ev = codec.decode(f)
        out.append(ev.requests[0].request_id if isinstance(ev, BatchEvent) else ev.request_id)  # type: ignore[union-attr]
    return out


def _results_written(r: redis.Redis, s: Stream, _role: Any, items: Entries) -> list[bool]:
    done = exist_many(r, [keys.result_done(rid) for rid in _request_ids(items)])
    acked = s.acked_many([i for i, _ in items])
    return [d and a for d, a in zip(done, acked, strict=True)]


def _held_or_answered(r: redis.Redis, s: Stream, role: Any, items: Entries) -> list[bool]:
    # no node is registered: the batcher holds the request in its window (pending, deferred)
    answered = _results_written(r, s, role, items)
    return [i in role._held or a for (i, _f), a in zip(items, answered, strict=True)]


def _released(r: redis.Redis, s: Stream, _role: Any, items: Entries) -> list[bool]:
    evs = [codec.decode(f) for _i, f in items]
    marked = exist_many(r, [keys.seq_released(ev.seq_id, ev.version) for ev in evs])  # type: ignore[union-attr]
    acked = s.acked_many([i for i, _ in items])
    return [m and a for m, a in zip(marked, acked, strict=True)]


def _router(config: RackflowConfig, ep: Any) -> Any:
    from workers.roles.router import Router

    return Router(config, ep.redis_url, ep.etcd_url, no_rack_wait_s=0.0)


def _batcher(config: RackflowConfig, ep: Any) -> Any:
    from workers.roles.batcher import Batcher

    return Batcher(config, RACK, ep.redis_url, ep.etcd_url)


def _worker(config: RackflowConfig, ep: Any) -> Any:
    from workers.roles.worker import Worker

    return Worker(config, NODE, "sim", ep.redis_url, ep.etcd_url, grace_s=2.0)


def _monitor(config: RackflowConfig, ep: Any) -> Any:
    from workers.roles.monitor import Monitor

    return Monitor(config, ep.redis_url, ep.etcd_url, redrive_ms=60_000)


def _good_batch() -> dict[bytes, bytes]:
    now = WALL.now_ms()
    return codec.encode(BatchEvent(str(uuid.uuid4()), RACK, NODE, (request(reply_to=next_reply_to()),), 64.0, 1e6,
                                   now, now))


TARGETS = {t.label: t for t in [
    # no worker is registered: the router answers with an error result at once (no_rack_wait_s=0)
    Target("router", keys.INGRESS, keys.GROUP_ROUTER, _router, ("request",),
           good=lambda: codec.encode(request(rack=None, reply_to=next_reply_to())), handled=_results_written,
           consumer=lambda role: role.consumer, answers_live=True),
    Target("batcher", keys.rack_requests(RACK), keys.GROUP_BATCHER, _batcher, ("request",),
           good=lambda: codec.encode(request(reply_to=next_reply_to())), handled=_held_or_answered,
           consumer=lambda role: role.consumer),
    Target("worker-batch", keys.node_batches(NODE), keys.GROUP_WORKER, _worker, ("batch", "resume"),
           good=_good_batch, handled=_results_written, consumer=lambda role: role.consumer, answers_live=True),
    Target("worker-ctl", keys.node_control(NODE), keys.GROUP_WORKER, _worker, ("release", "cancel"),
           good=lambda: codec.encode(ReleaseEvent(str(uuid.uuid4()), 2, "r0-n1", WALL.now_ms())),
           handled=_released, consumer=lambda role: role.control),
    Target("monitor", keys.HEALTH, "failover", _monitor, ("health",),
           good=lambda: codec.encode(HealthEvent(NODE, RACK, WALL.now_ms(), "sim", temp_c=50.0)),
           handled=lambda _r, s, _role, items: s.acked_many([i for i, _ in items]),
           consumer=lambda role: role.consumer, ready=lambda role: bool(role.leader)),
]}


def fuzz_stream(
    role: RoleThread, s: Stream, *, label: str, wrong_types: list[str], good: Callable[[], dict[bytes, bytes]],
    handled: Callable[[str, dict[bytes, bytes]], bool], examples: int, timeout_s: float = 20.0,
    consumer: Callable[[], Any], record: Callable[[dict[bytes, bytes]], None] = lambda _f: None,
) -> None:
    """Feed hypothesis-drawn batches of bad entries (with good ones every few, and valid ones with extreme values)
    into the running role's stream (`record` sees every valid entry sent)."""
    wrong = st.sampled_from(wrong_types).map(lambda t: codec.encode(SAMPLES[t])) if wrong_types else st.nothing()
    own = [t for t in EVENT_TYPES if t not in wrong_types]
    weird = weird_entry(own)

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate])  # no shrinking: an example costs a second against Valkey
    @given(bad=st.lists(bad_entry | wrong, min_size=20, max_size=50), extreme=st.lists(weird, max_size=10))
    def fuzz(bad: list[dict[bytes, bytes]], extreme: list[dict[bytes, bytes]]) -> None:
        sent_bad: dict[str, dict[bytes, bytes]] = {}
        sent_good: dict[str, dict[bytes, bytes]] = {}
        sent_weird: dict[str, dict[bytes, bytes]] = {}
        for i, fields in enumerate(bad):
            if i % 10 == 0:
                g = good()
                sent_good[s.r.xadd(s.stream, g).decode()] = g  # type: ignore[arg-type]
                record(g)
            if i % 5 == 2 and extreme:
                w = extreme.pop()
                sent_weird[s.r.xadd(s.stream, w).decode()] = w  # type: ignore[arg-type]
                record(w)
            sent_bad[s.r.xadd(s.stream, fields).decode()] = fields  # type: ignore[arg-type]
        COUNTS[f"{label}:bad"] += len(sent_bad)
        COUNTS[f"{label}:good"] += len(sent_good)
        COUNTS[f"{label}:extreme"] += len(sent_weird)

        def all_dead_lettered() -> bool:
            s.read_dlq()
            return set(sent_bad) <= set(s.dlq) or not role.alive

        wait_for(all_dead_lettered, timeout_s, lambda: f"{len(set(sent_bad) - set(s.dlq))} of {len(sent_bad)} "
                 f"bad entries not dead-lettered, e.g. {[sent_bad[i] for i in list(set(sent_bad) - set(s.dlq))[:2]]}")
        assert role.alive, f"{label} died: {role.error!r} (rc {role.rc})"
        for entry_id, fields in sent_bad.items():
            dl = s.dlq[entry_id]
            assert dl[b"reason"].strip(), f"empty reason for {fields!r}"
            if not is_bad(fields):  # a valid event of a type this stream does not carry
                assert dl[b"reason"].startswith(b"unexpected event type"), dl[b"reason"]
            assert msgpack.unpackb(dl[b"fields"], raw=True) == fields, "the dead letter lost the original bytes"
        wait_for(lambda: all(handled(i, f) for i, f in sent_good.items()) or not role.alive, timeout_s,
                 lambda: f"good entries not handled: {[i for i, f in sent_good.items() if not handled(i, f)]}")
        assert role.alive, f"{label} died: {role.error!r} (rc {role.rc})"
        assert not set(sent_bad) & s.pending_ids(), "bad entries left pending"
        for entry_id in sent_good:
            assert entry_id not in s.dlq, f"a good entry was dead-lettered: {s.dlq[entry_id][b'reason']!r}"

        def settled(entry_id: str) -> bool:
            """Handled (acked), held by the role on purpose (deferred), or dead-lettered: not stuck failing."""
            c = consumer()
            return entry_id in s.dlq or entry_id in c._deferred or s.acked(entry_id)

        def weird_settled() -> bool:
            s.read_dlq()
            return all(settled(i) for i in sent_weird) or not role.alive

        wait_for(weird_settled, timeout_s, lambda: "entries with extreme values neither handled nor dead-lettered: "
                 f"{[f for i, f in sent_weird.items() if not settled(i)]!r:.2000}")
        assert role.alive, f"{label} died: {role.error!r} (rc {role.rc})"

    fuzz()


def _live_ids(t: Target, good: list[dict[bytes, bytes]]) -> set[str]:
    """The good requests that named the live reply stream (their result must be on it)."""
    if not t.answers_live:
        return set()
    return {rid for f, rid in zip(good, _request_ids([("", f) for f in good]), strict=True)
            if GW_LIVE in reply_tos_of(f)}


@pytest.fixture
def env(clean_services, tmp_path):  # type: ignore[no-untyped-def]
    r = redis.Redis.from_url(clean_services.redis_url)
    yield clean_services, small_config(tmp_path), r
    r.close()


EXAMPLES = 15


def fuzz_target(env: Any, t: Target) -> None:
    """The fast tier: EXAMPLES hypothesis examples of bad entries (with good and extreme ones) into `t`'s role."""
    ep, config, r = env
    canaries = reply_targets(r)
    s = Stream(r, t.stream, t.group)
    named: set[str] = set()
    good: list[dict[bytes, bytes]] = []

    def record(f: dict[bytes, bytes]) -> None:
        named.update(reply_tos_of(f))

    def good_one() -> dict[bytes, bytes]:
        g = t.good()
        good.append(g)
        return g

    with RoleThread(lambda: t.make(config, ep)) as role:
        wait_for(lambda: t.ready(role.role), 15, lambda: f"{t.label} never became ready")
        fuzz_stream(role, s, label=t.label, wrong_types=t.wrong_types, good=good_one,
                    handled=lambda i, f: t.handled(r, s, role.role, [(i, f)])[0], examples=EXAMPLES,
                    consumer=lambda: t.consumer(role.role), record=record)
    audit_replies(r, canaries, named, t.stream, _live_ids(t, good))


def test_router_survives_bad_entries(env) -> None:  # type: ignore[no-untyped-def]
    fuzz_target(env, TARGETS["router"])


def test_batcher_survives_bad_entries(env) -> None:  # type: ignore[no-untyped-def]
    fuzz_target(env, TARGETS["batcher"])


def test_worker_survives_bad_batches(env) -> None:  # type: ignore[no-untyped-def]
    fuzz_target(env, TARGETS["worker-batch"])


def test_worker_survives_bad_control_messages(env) -> None:  # type: ignore[no-untyped-def]
    fuzz_target(env, TARGETS["worker-ctl"])


def test_monitor_survives_bad_health_samples(env) -> None:  # type: ignore[no-untyped-def]
    fuzz_target(env, TARGETS["monitor"])


GW_WRONG_TYPE = keys.gateway_replies("fuzz-wrong-type")


@pytest.mark.parametrize("label", ["router", "worker-batch"])
def test_a_reply_to_naming_a_non_stream_key_kills_no_writer(env, label: str) -> None:  # type: ignore[no-untyped-def]
    """A request whose reply_to names a gateway reply key holding a string: its result is written, the role stays
    up and serves the requests after it, the entry is not dead-lettered, and the string is left as it was."""
    ep, config, r = env
    t = TARGETS[label]
    r.set(GW_WRONG_TYPE, b"not a stream")
    s = Stream(r, t.stream, t.group)
    rack = None if label == "router" else RACK
    reqs = [request(reply_to=GW_WRONG_TYPE, rack=rack), *(request(rack=rack) for _ in range(3))]
    with RoleThread(lambda: t.make(config, ep)) as role:
        ids = []
        for q in reqs:
            if label == "router":
                ids.append(r.xadd(t.stream, codec.encode(q)).decode())  # type: ignore[arg-type]
            else:
                now = WALL.now_ms()
                ids.append(r.xadd(t.stream, codec.encode(BatchEvent(str(uuid.uuid4()), RACK, NODE, (q,), 64.0, 1e6,
                                                                    now, now))).decode())  # type: ignore[arg-type]

        def served() -> bool:
            return all(exist_many(r, [keys.result_done(q.request_id) for q in reqs])) and all(s.acked_many(ids))

        wait_for(lambda: served() or not role.alive, 20, lambda: "requests not served")
        assert role.alive, f"{label} died: {role.error!r}"
        s.read_dlq()
        assert not s.dlq, f"a valid request was dead-lettered: {list(s.dlq.values())!r:.500}"
        assert t.consumer(role.role).stats.handler_errors == 0
    assert r.get(GW_WRONG_TYPE) == b"not a stream"


def test_worker_refuses_a_prompt_no_context_holds(env) -> None:  # type: ignore[no-untyped-def]
    """A prompt longer than the context, with a negative max_tokens: refused with an error result, and the
    requests after it are served."""
    ep, config, r = env
    hostile = request(in_tokens=2**63 - 1, max_tokens=-(2**63))
    fine = [request() for _ in range(3)]
    with RoleThread(lambda: _worker(config, ep)) as role:
        now = WALL.now_ms()
        for reqs in ((hostile,), tuple(fine)):
            r.xadd(keys.node_batches(NODE), codec.encode(BatchEvent(str(uuid.uuid4()), RACK, NODE, reqs, 64.0, 1e6,
                                                                   now, now)))
        ids = [q.request_id for q in (hostile, *fine)]
        wait_for(lambda: all(exist_many(r, [keys.result_done(i) for i in ids])) or not role.alive, 8,
                 lambda: f"{sum(not e for e in exist_many(r, [keys.result_done(i) for i in ids]))} of 4 requests "
                 f"without a result; engine {role.role.engine.stats()}")
        assert role.alive
    results = {ev.request_id: ev for _e, f in r.xrange(keys.RESULTS) if isinstance(ev := codec.decode(f),
                                                                                   ResultEvent)}
    assert results[hostile.request_id].status == "error", results[hostile.request_id]
    assert all(results[q.request_id].status == "ok" for q in fine)


# -- the long tier: the same properties, at volume --------------------------------------------------------------------
LONG_STREAM_INPUTS = 20_000
"""Adversarial entries (malformed, of a wrong type, byte-mutated, over a bound, or valid with extreme values) per
consumed stream; the five streams make the long tier's >= 100,000."""
MUTANTS_PER_BAD = 2
"""Byte-level mutants tried per hypothesis-drawn bad entry (cheap to make; the refused ones are sent)."""
HUGE_EVERY = 25
"""One entry with a field over its bound every this many examples."""
CHUNK = 2500
"""Entries per pipelined write; a chunk is checked while the next one is drawn and sent."""
LONG_COUNTS: dict[str, Counter[str]] = {}
LONG_FACTS: dict[str, dict[str, Any]] = {}


@pytest.fixture
def long_env(clean_services, tmp_path):  # type: ignore[no-untyped-def]
    """As `env`, with the long tier's stream settings; the dead-letter warning (one log line per bad entry, 100,000
    of them) is kept out of the captured log, errors still go in."""
    import logging

    runner_log = logging.getLogger("streams.runner")
    level = runner_log.level
    runner_log.setLevel(logging.ERROR)
    r = redis.Redis.from_url(clean_services.redis_url)
    try:
        yield clean_services, small_config(tmp_path, LONG_STREAMS_CFG), r
    finally:
        r.close()
        runner_log.setLevel(level)


@dataclasses.dataclass
class _Chunk:
    bad: dict[str, dict[bytes, bytes]] = dataclasses.field(default_factory=dict)
    good: dict[str, dict[bytes, bytes]] = dataclasses.field(default_factory=dict)
    weird: dict[str, dict[bytes, bytes]] = dataclasses.field(default_factory=dict)


class VolumeFuzz:
    """The long tier against one running role: hypothesis-drawn bad entries (the fast tier's strategies), byte-level
    mutants of valid and bad entries, entries over a bound at a fixed rate, valid ones with extreme values, and a
    good one every ten, written with pipelined XADDs a chunk at a time. Each chunk is checked (every bad entry
    dead-lettered with a reason and its bytes, none pending, the good ones handled, the extreme ones settled, the
    role alive) while the next is drawn, then its bad entries and their dead letters are deleted (Valkey's memory
    and this process's stay bounded)."""

    def __init__(self, role: RoleThread, s: Stream, t: Target, counts: Counter[str], timeout_s: float = 300.0) -> None:
        self.role = role
        self.s = s
        self.t = t
        self.counts = counts
        self.timeout_s = timeout_s
        self.buf: list[tuple[str, dict[bytes, bytes]]] = []
        self.unchecked: list[_Chunk] = []
        self.sent_ids: set[str] = set()
        self.named: set[str] = set()
        self.live: set[str] = set()
        self.examples = 0
        self.checked = 0
        self.seeds = mutation_seeds()

    @property
    def adversarial(self) -> int:
        c = self.counts
        return c["bad"] + c["wrong"] + c["mutant"] + c["huge"] + c["extreme"] + sum(
            k != "good" for k, _f in self.buf)

    def alive(self) -> None:
        assert self.role.alive, f"{self.t.label} died: {self.role.error!r} (rc {self.role.rc})"

    def add_example(self, bad: list[dict[bytes, bytes]], extreme: list[dict[bytes, bytes]],
                    rnd: random.Random) -> None:
        """One hypothesis example: its bad entries, their mutants (`rnd`, seeded by hypothesis with one draw: what
        it picks is no part of the example's choices, so the rate of over-bound entries may follow a counter)."""
        self.examples += 1
        tagged = [("wrong" if not is_bad(f) else "bad", f) for f in bad]
        for _ in range(MUTANTS_PER_BAD * len(bad)):
            m = mutant(rnd, self.seeds + bad)
            self.counts["mutants_tried"] += 1
            if is_bad(m):  # the codec's contract at volume too: DecodeError or a valid event, nothing else
                tagged.append(("mutant", m))
        if self.examples % HUGE_EVERY == 1:
            tagged.append(("huge", huge_entry(rnd)))
        rnd.shuffle(tagged)
        for i, (kind, fields) in enumerate(tagged):
            if i % 10 == 0:
                self.buf.append(("good", self.t.good()))
            if i % 5 == 2 and extreme:
                self.buf.append(("extreme", extreme.pop()))
            self.buf.append((kind, fields))
        self.buf.extend(("extreme", w) for w in extreme)
        if len(self.buf) >= CHUNK:
            self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        ids: list[bytes] = []
        for i in range(0, len(self.buf), 500):
            pipe = self.s.r.pipeline(transaction=False)
            for _kind, f in self.buf[i:i + 500]:
                pipe.xadd(self.s.stream, f)  # type: ignore[arg-type]
            ids += pipe.execute()
        chunk = _Chunk()
        for (kind, f), raw in zip(self.buf, ids, strict=True):
            entry_id = raw.decode()
            self.sent_ids.add(entry_id)
            self.counts[kind] += 1
            if kind == "good":
                chunk.good[entry_id] = f
            elif kind == "extreme":
                chunk.weird[entry_id] = f
            else:
                chunk.bad[entry_id] = f
            if kind in ("good", "extreme"):
                self.named |= reply_tos_of(f)
        self.live |= _live_ids(self.t, list(chunk.good.values()))
        self.buf = []
        # the previous chunk had the time this one took to be drawn: check it now, this one next time
        while self.unchecked:
            self.check(self.unchecked.pop(0))
        self.unchecked.append(chunk)

    def check(self, c: _Chunk) -> None:
        s, t, role = self.s, self.t, self.role
        bad = set(c.bad)

        def dead_lettered() -> bool:
            s.read_dlq()
            return (bad <= s.dlq.keys() and not bad & s.pending_ids()) or not role.alive

        wait_for(dead_lettered, self.timeout_s, lambda: f"{len(bad - s.dlq.keys())} of {len(bad)} bad entries not "
                 f"dead-lettered (or still pending), e.g. {[c.bad[i] for i in list(bad - s.dlq.keys())[:2]]!r:.1000}",
                 poll_s=0.2)
        self.alive()
        for entry_id, fields in c.bad.items():
            dl = s.dlq[entry_id]
            assert dl[b"reason"].strip(), f"empty reason for {fields!r:.500}"
            if not is_bad(fields):  # a valid event of a type this stream does not carry
                assert dl[b"reason"].startswith(b"unexpected event type"), (dl[b"reason"], fields)
            assert msgpack.unpackb(dl[b"fields"], raw=True) == fields, "the dead letter lost the original bytes"
        good = list(c.good.items())

        def unhandled() -> list[str]:
            return [i for (i, _f), ok in zip(good, t.handled(s.r, s, role.role, good), strict=True) if not ok]

        def held() -> str:
            """The valid entries of this chunk the role still holds (the likely culprits of a stall)."""
            deferred = t.consumer(role.role)._deferred
            return f"{[c.weird[i] for i in c.weird if i in deferred][:5]!r:.3000}"

        wait_for(lambda: not unhandled() or not role.alive, self.timeout_s,
                 lambda: f"good entries not handled: {unhandled()[:20]}; extreme entries of this chunk the role "
                 f"still holds: {held()}", poll_s=0.2)
        self.alive()
        s.read_dlq()
        for entry_id in c.good:
            assert entry_id not in s.dlq, f"a good entry was dead-lettered: {s.dlq[entry_id][b'reason']!r}"

        def unsettled() -> list[str]:
            """Not handled (acked), nor held by the role on purpose (deferred), nor dead-lettered: stuck failing."""
            s.read_dlq()
            deferred = t.consumer(role.role)._deferred
            ids = [i for i in c.weird if i not in s.dlq and i not in deferred]
            return [i for i, ok in zip(ids, s.acked_many(ids), strict=True) if not ok]

        wait_for(lambda: not unsettled() or not role.alive, self.timeout_s,
                 lambda: "entries with extreme values neither handled nor dead-lettered: "
                 f"{[c.weird[i] for i in unsettled()]!r:.2000}", poll_s=0.2)
        self.alive()
        foreign = [i for i in s.dlq if i not in self.sent_ids]
        assert not foreign, f"dead letters of entries the test never wrote (a writer appended to {s.stream}?): " \
                            f"{[s.dlq[i] for i in foreign[:3]]!r:.1000}"
        # checked: the bad entries (acked) and their dead letters go
        ids = sorted(bad)
        for i in range(0, len(ids), 1000):
            part = ids[i:i + 1000]
            pipe = s.r.pipeline(transaction=False)
            pipe.xdel(s.stream, *part)
            pipe.xdel(keys.DLQ, *(s.dlq_entry[x] for x in part))
            pipe.execute()
        for x in ids:
            del s.dlq[x]
        self.checked += len(c.bad) + len(c.good) + len(c.weird)

    def run(self, min_inputs: int) -> None:
        own = list(self.t.own)
        wrong = (st.sampled_from(self.t.wrong_types).map(lambda x: codec.encode(SAMPLES[x]))
                 | weird_entry(self.t.wrong_types))
        while self.adversarial < min_inputs:
            per_example = max(40.0, (self.adversarial / self.examples) if self.examples else 80.0)
            n = max(5, min(400, int((min_inputs - self.adversarial) / per_example) + 1))

            @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                      phases=[Phase.generate])  # no shrinking: what fails is reported with its input, as drawn
            @given(bad=st.lists(volume_bad_entry | wrong, min_size=20, max_size=50),
                   extreme=st.lists(weird_entry(own), max_size=10), rnd=st.randoms(use_true_random=True))
            def draw(bad: list[dict[bytes, bytes]], extreme: list[dict[bytes, bytes]], rnd: random.Random) -> None:
                self.add_example(bad, extreme, rnd)

            draw()
        self.flush()
        while self.unchecked:
            self.check(self.unchecked.pop(0))


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("label", list(TARGETS))
def test_consumers_survive_bad_entries_at_volume(long_env, label: str) -> None:  # type: ignore[no-untyped-def]
    """>= LONG_STREAM_INPUTS adversarial entries into each consumed stream (five streams: >= 100,000 in all), with
    the fast tier's properties checked on every one of them, and the reply_to audit at the end."""
    ep, config, r = long_env
    t = TARGETS[label]
    canaries = reply_targets(r)
    s = Stream(r, t.stream, t.group)
    counts: Counter[str] = Counter()
    t0 = time.monotonic()
    cpu0 = time.process_time()
    with RoleThread(lambda: t.make(config, ep)) as role:
        wait_for(lambda: t.ready(role.role), 15, lambda: f"{label} never became ready")
        fuzz = VolumeFuzz(role, s, t, counts)
        fuzz.run(LONG_STREAM_INPUTS)
        stats = t.consumer(role.role).stats
        consumer_stats = dataclasses.asdict(stats)
    audit = audit_replies(r, canaries, fuzz.named, t.stream, fuzz.live)
    wall = time.monotonic() - t0
    adversarial = counts["bad"] + counts["wrong"] + counts["mutant"] + counts["huge"] + counts["extreme"]
    total = adversarial + counts["good"]
    assert adversarial >= LONG_STREAM_INPUTS, f"only {adversarial} adversarial entries sent to {label}"
    assert fuzz.checked == total, f"{total} sent, {fuzz.checked} checked"
    assert stats.dead_lettered >= counts["bad"] + counts["wrong"] + counts["mutant"] + counts["huge"], consumer_stats
    LONG_COUNTS[label] = counts
    LONG_FACTS[label] = {"wall_s": round(wall, 1), "cpu_s_test_process": round(time.process_time() - cpu0, 1),
                         "examples": fuzz.examples, "dead_letters_read": s.dead_letters,
                         "consumer": consumer_stats, **audit}
    print(f"\nfuzzed {total} stream inputs into {label} ({t.stream}): {adversarial} adversarial (bad={counts['bad']}, "
          f"wrong-type={counts['wrong']}, mutants={counts['mutant']} of {counts['mutants_tried']} tried, "
          f"over-bound={counts['huge']}, extreme={counts['extreme']}), good={counts['good']}; "
          f"{fuzz.examples} hypothesis examples, {wall:.0f} s; 0 crashes, every bad entry dead-lettered; "
          f"consumer {consumer_stats}; reply_to audit {audit}")
    write_long_counts()


def write_long_counts(path: Path = COUNTS_FILE) -> None:
    """The long tier's section of the counts file: per stream, and the total across the streams."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    section = data.get("consumers-long", {})
    for label, counts in LONG_COUNTS.items():
        adversarial = sum(v for k, v in counts.items() if k not in ("good", "mutants_tried"))
        section[label] = dict(sorted(counts.items())) | {"adversarial": adversarial,
                                                         "total": adversarial + counts["good"]} | LONG_FACTS[label]
    section["all"] = {"adversarial": sum(v["adversarial"] for k, v in section.items() if k != "all"),
                      "total": sum(v["total"] for k, v in section.items() if k != "all")}
    data["consumers-long"] = section
    path.write_text(json.dumps(data, indent=2) + "\n")


def test_sim_engine_resumed_sequence_one_token_from_the_end(tmp_path: Path) -> None:
    """Found by the worker fuzzing: a resumed sequence (prefilled, `generated` tokens already out) was stepped twice
    in its first step, once as new and once as decoding; when it was one token from `max_tokens` the second pass
    deleted it from `running` again (KeyError) and the worker's engine loop died, taking the worker down."""
    from workers.roles.worker import build_engine

    engine = build_engine(small_config(tmp_path), NODE, "sim")
    req = request("resumed", max_tokens=3)
    engine.import_kv(engine.resume_snapshot(req, (7, 8)), req)
    out = asyncio.run(engine.step())
    assert [(t.request_id, t.index) for t in out.tokens] == [("resumed", 2)]
    assert [f.out_tokens for f in out.finished] == [3]
    assert not engine.has_work()


def test_worker_refuses_a_request_no_memory_budget_holds(env) -> None:  # type: ignore[no-untyped-def]
    """Found by the worker fuzzing (a full-suite run): `mem_est_kb` 1e308 passes the codec (finite) and the sim
    engine admitted it into an empty engine; two of them overflowed its memory ledger to inf, and from then on it
    ran one sequence at a time, so good batches waited past the test's deadline. The worker now refuses sizes no
    node budget holds, with an error result, and the engine stays as it was."""
    from workers.roles.worker import Worker

    ep, config, r = env
    huge = [request(mem_est_kb=1e308), request(mem_est_kb=-1.0), request(mem_est_kb=1e308)]
    fine = [request(max_tokens=4) for _ in range(6)]
    now = WALL.now_ms()
    with RoleThread(lambda: Worker(config, NODE, "sim", ep.redis_url, ep.etcd_url, grace_s=2.0)) as role:
        r.xadd(keys.node_batches(NODE), codec.encode(BatchEvent(str(uuid.uuid4()), RACK, NODE, (*huge, *fine), 64.0,
                                                               1e6, now, now)))
        ids = [q.request_id for q in (*huge, *fine)]
        wait_for(lambda: all(r.exists(keys.result_done(i)) for i in ids), 20,
                 lambda: f"{sum(not r.exists(keys.result_done(i)) for i in ids)} requests without a result")
        assert role.alive
        results = {ev.request_id: ev for _e, f in r.xrange(keys.RESULTS) if isinstance(ev := codec.decode(f),
                                                                                       ResultEvent)}
        assert all(results[q.request_id].status == "error" and "mem_est_kb" in (results[q.request_id].error or "")
                   for q in huge), [results[q.request_id] for q in huge]
        assert all(results[q.request_id].status == "ok" for q in fine)
        engine = role.role.engine
        assert engine.kv_used_kb == 0.0 and not engine.has_work(), engine.kv_used_kb
        # several at once again, as before: the engine was not left one sequence at a time
        more = [request(max_tokens=40) for _ in range(4)]
        now = WALL.now_ms()
        r.xadd(keys.node_batches(NODE), codec.encode(BatchEvent(str(uuid.uuid4()), RACK, NODE, tuple(more), 64.0, 1e6,
                                                               now, now)))
        seen: list[int] = []
        wait_for(lambda: seen.append(engine.stats().running) or all(r.exists(keys.result_done(q.request_id))
                                                                  for q in more), 20, lambda: "the 4 did not finish")
        assert max(seen) >= 2, f"one sequence at a time: {seen}"
