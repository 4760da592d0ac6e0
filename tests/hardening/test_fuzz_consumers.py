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

The number of inputs tried is printed (`pytest -s`) and written to `.rackflow/hardening/fuzz_counts.json`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading
import time
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


@st.composite
def mutated_event(draw: st.DrawFn) -> dict[bytes, bytes]:
    """A valid event of any type with one thing made wrong."""
    t = draw(st.sampled_from(sorted(EVENT_TYPES)))
    data = to_wire(SAMPLES[t])
    kinds = KINDS[t]
    cls = EVENT_TYPES[t]
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    how = draw(st.sampled_from(["missing", "wrong_type", "huge", "nested", "not_a_map"]))
    if how == "missing":
        del data[draw(st.sampled_from(required))]
    elif how == "wrong_type":
        name = draw(st.sampled_from(sorted(kinds)))
        data[name] = draw(WRONG[kinds[name]])
    elif how == "huge":
        by_kind = {k: [f for f in kinds if kinds[f] == k] for k in ("str", "int", "tuple", "dict")}
        k = draw(st.sampled_from([k for k, v in by_kind.items() if v]))
        name = draw(st.sampled_from(by_kind[k]))
        if k == "str":
            data[name] = "x" * (MAX_STR + 1)
        elif k == "int":
            data[name] = draw(st.sampled_from([2**63, 2**64 - 1]))
        elif k == "tuple":
            data[name] = [0] * (MAX_ITEMS + 1)
        else:
            data[name] = {str(i): 0.0 for i in range(MAX_ITEMS + 1)}
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
        if kinds[name] in EXTREME:
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
CLUSTER = {
    "cluster": {"racks": [{"name": "r0", "node_count": 2,
                           "node": {"gpu": "h100-80gb", "tp": 1, "models": [MODEL]}}]},
    "policies": {"streams": STREAMS_CFG},
}


def small_config(tmp_path: Path) -> RackflowConfig:
    p = tmp_path / "fuzz.yaml"
    p.write_text(yaml.safe_dump(CLUSTER))
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
        assert not self.thread.is_alive(), "role did not stop"


def _sid(x: bytes | str) -> tuple[int, int]:
    s = x.decode() if isinstance(x, bytes) else x
    a, _, b = s.partition("-")
    return int(a), int(b or 0)


def wait_for(cond: Callable[[], bool], timeout_s: float, what: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout_s}s: {what()}")
        time.sleep(0.05)


class Stream:
    """The fuzzing side of one consumed stream: what was sent, what reached the dead-letter stream."""

    def __init__(self, r: redis.Redis, stream: str, group: str) -> None:
        self.r = r
        self.stream = stream
        self.group = group
        self.dlq: dict[str, dict[bytes, bytes]] = {}
        self._dlq_cursor = "-"

    def read_dlq(self) -> None:
        rows = self.r.xrange(keys.DLQ, min=self._dlq_cursor, max="+")
        for rid, f in rows:
            self._dlq_cursor = "(" + rid.decode()
            if f[b"stream"].decode() == self.stream:
                self.dlq[f[b"id"].decode()] = f

    def pending_ids(self) -> set[str]:
        try:
            rows = self.r.xpending_range(self.stream, self.group, min="-", max="+", count=100_000)
        except redis.ResponseError:  # the group is not created yet
            return set()
        return {row["message_id"].decode() for row in rows}

    def acked(self, entry_id: str) -> bool:
        """Delivered to the group and no longer pending."""
        try:
            groups = {g["name"].decode(): g for g in self.r.xinfo_groups(self.stream)}
        except redis.ResponseError:
            return False
        g = groups.get(self.group)
        if g is None or _sid(g["last-delivered-id"]) < _sid(entry_id):
            return False
        return entry_id not in self.pending_ids()


def fuzz_stream(
    role: RoleThread, s: Stream, *, label: str, wrong_types: list[str], good: Callable[[], dict[bytes, bytes]],
    handled: Callable[[str, dict[bytes, bytes]], bool], examples: int, timeout_s: float = 20.0,
    consumer: Callable[[], Any],
) -> None:
    """Feed hypothesis-drawn batches of bad entries (with good ones every few, and valid ones with extreme values)
    into the running role's stream."""
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
            if i % 5 == 2 and extreme:
                w = extreme.pop()
                sent_weird[s.r.xadd(s.stream, w).decode()] = w  # type: ignore[arg-type]
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


@pytest.fixture
def env(clean_services, tmp_path):  # type: ignore[no-untyped-def]
    r = redis.Redis.from_url(clean_services.redis_url)
    yield clean_services, small_config(tmp_path), r
    r.close()


EXAMPLES = 15


def test_router_survives_bad_entries(env) -> None:  # type: ignore[no-untyped-def]
    from workers.roles.router import Router

    ep, config, r = env
    s = Stream(r, keys.INGRESS, keys.GROUP_ROUTER)

    def good() -> dict[bytes, bytes]:
        return codec.encode(request(rack=None))

    def handled(_id: str, f: dict[bytes, bytes]) -> bool:
        # no worker is registered: the router answers with an error result at once (no_rack_wait_s=0)
        rid = codec.decode(f).request_id  # type: ignore[union-attr]
        return bool(r.exists(keys.result_done(rid))) and s.acked(_id)

    with RoleThread(lambda: Router(config, ep.redis_url, ep.etcd_url, no_rack_wait_s=0.0)) as role:
        fuzz_stream(role, s, label="router", wrong_types=[t for t in EVENT_TYPES if t != "request"], good=good,
                    handled=handled, examples=EXAMPLES,
                    consumer=lambda: role.role.consumer)


def test_batcher_survives_bad_entries(env) -> None:  # type: ignore[no-untyped-def]
    from workers.roles.batcher import Batcher

    ep, config, r = env
    s = Stream(r, keys.rack_requests(RACK), keys.GROUP_BATCHER)

    def handled(entry_id: str, _f: dict[bytes, bytes]) -> bool:
        # no node is registered: the batcher holds the request in its window (pending, deferred)
        return entry_id in role.role._held

    with RoleThread(lambda: Batcher(config, RACK, ep.redis_url, ep.etcd_url)) as role:
        fuzz_stream(role, s, label="batcher", wrong_types=[t for t in EVENT_TYPES if t != "request"],
                    good=lambda: codec.encode(request()), handled=handled, examples=EXAMPLES,
                    consumer=lambda: role.role.consumer)


def test_worker_survives_bad_batches(env) -> None:  # type: ignore[no-untyped-def]
    from workers.roles.worker import Worker

    ep, config, r = env
    s = Stream(r, keys.node_batches(NODE), keys.GROUP_WORKER)

    def good() -> dict[bytes, bytes]:
        now = WALL.now_ms()
        return codec.encode(BatchEvent(str(uuid.uuid4()), RACK, NODE, (request(),), 64.0, 1e6, now, now))

    def handled(entry_id: str, f: dict[bytes, bytes]) -> bool:
        rid = codec.decode(f).requests[0].request_id  # type: ignore[union-attr]
        return bool(r.exists(keys.result_done(rid))) and s.acked(entry_id)

    with RoleThread(lambda: Worker(config, NODE, "sim", ep.redis_url, ep.etcd_url, grace_s=2.0)) as role:
        fuzz_stream(role, s, label="worker-batch", wrong_types=[t for t in EVENT_TYPES if t not in ("batch", "resume")],
                    good=good, handled=handled, examples=EXAMPLES,
                    consumer=lambda: role.role.consumer)


def test_worker_survives_bad_control_messages(env) -> None:  # type: ignore[no-untyped-def]
    from workers.roles.worker import Worker

    ep, config, r = env
    s = Stream(r, keys.node_control(NODE), keys.GROUP_WORKER)

    def good() -> dict[bytes, bytes]:
        return codec.encode(ReleaseEvent(str(uuid.uuid4()), 2, "r0-n1", WALL.now_ms()))

    def handled(entry_id: str, f: dict[bytes, bytes]) -> bool:
        ev = codec.decode(f)
        return bool(r.exists(keys.seq_released(ev.seq_id, ev.version))) and s.acked(entry_id)  # type: ignore[union-attr]

    with RoleThread(lambda: Worker(config, NODE, "sim", ep.redis_url, ep.etcd_url, grace_s=2.0)) as role:
        fuzz_stream(role, s, label="worker-ctl", wrong_types=[t for t in EVENT_TYPES if t not in ("release", "cancel")],
                    good=good, handled=handled, examples=EXAMPLES,
                    consumer=lambda: role.role.control)


def test_monitor_survives_bad_health_samples(env) -> None:  # type: ignore[no-untyped-def]
    from workers.roles.monitor import Monitor

    ep, config, r = env
    s = Stream(r, keys.HEALTH, "failover")

    def good() -> dict[bytes, bytes]:
        return codec.encode(HealthEvent(NODE, RACK, WALL.now_ms(), "sim", temp_c=50.0))

    with RoleThread(lambda: Monitor(config, ep.redis_url, ep.etcd_url, redrive_ms=60_000)) as role:
        wait_for(lambda: role.role.leader, 15, lambda: "the monitor never became the leader")
        fuzz_stream(role, s, label="monitor", wrong_types=[t for t in EVENT_TYPES if t != "health"], good=good,
                    handled=lambda i, _f: s.acked(i), examples=EXAMPLES,
                    consumer=lambda: role.role.consumer)


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
