"""streams.codec: every event survives encode -> decode, and every malformed entry raises DecodeError with a reason."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.events import EVENT_TYPES, BatchEvent, RequestEvent, TokenEvent, to_wire
from streams.codec import decode, encode, encode_fields_for_dlq
from streams.errors import DecodeError
from tests.unit.builders import request, token_event

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
FLOATS = st.floats(allow_nan=False, allow_infinity=False)
TEXT = st.text(max_size=12)


def strategy_for(ann: Any) -> st.SearchStrategy[Any]:
    """A strategy of valid values for one field annotation of an event (fails loudly on a new kind of field)."""
    origin = typing.get_origin(ann)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(st.none() if a is type(None) else strategy_for(a) for a in typing.get_args(ann)))
    if ann is str:
        return TEXT
    if ann is bool:
        return st.booleans()
    if ann is int:
        return INT64
    if ann is float:
        return FLOATS
    if origin is tuple:
        return st.lists(strategy_for(typing.get_args(ann)[0]), max_size=3).map(tuple)
    if origin is dict:
        k, v = typing.get_args(ann)
        return st.dictionaries(strategy_for(k), strategy_for(v), max_size=3)
    if isinstance(ann, type) and dataclasses.is_dataclass(ann):
        return event_strategy(ann)
    raise AssertionError(f"no strategy for annotation {ann!r}: extend strategy_for")


def event_strategy(cls: type[Any]) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{f.name: strategy_for(hints[f.name]) for f in dataclasses.fields(cls)})


def required_fields(cls: type[Any]) -> list[str]:
    return [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]


def entry(event_type: str, payload: Any, *, raw: bytes | None = None) -> dict[bytes, bytes]:
    data = raw if raw is not None else msgpack.packb(payload, use_bin_type=True)
    return {b"v": b"1", b"t": event_type.encode(), b"d": data}


def reason(fields: dict[Any, Any]) -> str:
    with pytest.raises(DecodeError) as exc:
        decode(fields)
    return str(exc.value)


# -- round trip --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", sorted(EVENT_TYPES))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_decode_of_encode_is_identity_for_every_event_type(type_name: str, data: st.DataObject) -> None:
    ev = data.draw(event_strategy(EVENT_TYPES[type_name]))
    fields = encode(ev)
    assert set(fields) == {b"v", b"t", b"d"}
    assert all(isinstance(v, bytes) for v in fields.values())
    assert decode(fields) == ev


def test_round_trip_of_batch_keeps_nested_requests_as_request_events() -> None:
    reqs = (request(rack="r0"), request(prompt="你好", priority=3, prefix_cache=False))
    batch = BatchEvent("b1", "r0", "r0-n1", reqs, 1.5, 2.0, 10.0, 11.0)
    out = decode(encode(batch))
    assert out == batch
    assert isinstance(out, BatchEvent)
    assert all(type(r) is RequestEvent for r in out.requests)


@settings(max_examples=40, deadline=None)
@given(ev=event_strategy(RequestEvent))
def test_decode_accepts_str_keys_and_str_values_for_v_and_t(ev: RequestEvent) -> None:
    fields = encode(ev)
    assert decode({k.decode(): v for k, v in fields.items()}) == ev
    assert decode({"v": "1", "t": "request", "d": fields[b"d"]}) == ev


def test_request_routing_fields_survive_the_round_trip() -> None:
    ev = request(route_policy="kv_aware", prefix_hashes=(0, 1, 2**63 - 1))
    assert decode(encode(ev)) == ev


def test_request_from_a_producer_without_route_policy_or_prefix_hashes_gets_their_defaults() -> None:
    wire = to_wire(request(route_policy="kv_aware", prefix_hashes=(5,)))
    del wire["route_policy"], wire["prefix_hashes"]
    ev = decode(entry("request", wire))
    assert isinstance(ev, RequestEvent)
    assert (ev.route_policy, ev.prefix_hashes) == ("", ())


def test_token_event_keeps_one_text_per_token_and_joins_them_as_text() -> None:
    ev = token_event(token_ids=(1, 2, 3), texts=("你", "好", "!"))
    out = decode(encode(ev))
    assert out == ev
    assert isinstance(out, TokenEvent)
    assert out.texts == ("你", "好", "!") and out.text == "你好!"
    assert "text" not in to_wire(ev)  # a property, not a wire field


def test_token_event_texts_must_be_a_list_of_strings() -> None:
    wire = to_wire(token_event())
    wire["texts"] = "Hello world"
    assert "tokens.texts: expected a list, got str" in reason(entry("tokens", wire))
    wire["texts"] = ["Hello", 7]
    assert "tokens.texts[1]: expected a string, got int" in reason(entry("tokens", wire))


def test_decode_ignores_unknown_payload_keys_from_newer_producers() -> None:
    ev = request()
    wire = to_wire(ev) | {"added_in_a_later_release": [1, 2, 3]}
    assert decode(entry("request", wire)) == ev


# -- envelope errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["v", "t", "d"])
def test_missing_envelope_field_is_a_decode_error_naming_it(missing: str) -> None:
    fields = encode(request())
    del fields[missing.encode()]
    assert f"missing field {missing!r}" in reason(fields)


def test_envelope_field_of_wrong_python_type_is_a_decode_error() -> None:
    fields: dict[Any, Any] = dict(encode(request()))
    fields[b"v"] = 1
    assert "expected bytes" in reason(fields)


@pytest.mark.parametrize(("version", "expect"), [(b"2", "not supported"), (b"0", "not supported"),
                                                 (b"x", "not an integer"), (b"", "not an integer")])
def test_unsupported_codec_version_is_a_decode_error(version: bytes, expect: str) -> None:
    fields = encode(request())
    fields[b"v"] = version
    assert expect in reason(fields)


def test_unknown_event_type_is_a_decode_error_listing_known_types() -> None:
    fields = encode(request())
    fields[b"t"] = b"telemetry"
    msg = reason(fields)
    assert "unknown event type 'telemetry'" in msg
    assert all(t in msg for t in EVENT_TYPES)


# -- payload errors ----------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(type_name=st.sampled_from(sorted(EVENT_TYPES)), payload=st.binary(max_size=64))
def test_arbitrary_payload_bytes_decode_to_an_event_or_raise_decode_error(type_name: str, payload: bytes) -> None:
    try:
        ev = decode(entry(type_name, None, raw=payload))
    except DecodeError:
        return
    assert isinstance(ev, EVENT_TYPES[type_name])


@settings(max_examples=100, deadline=None)
@given(type_name=st.sampled_from(sorted(EVENT_TYPES)),
       value=st.recursive(st.none() | st.booleans() | INT64 | FLOATS | TEXT | st.binary(max_size=8),
                          lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3), max_leaves=8))
def test_arbitrary_msgpack_values_decode_to_an_event_or_raise_decode_error(type_name: str, value: Any) -> None:
    try:
        ev = decode(entry(type_name, value))
    except DecodeError:
        return
    assert isinstance(ev, EVENT_TYPES[type_name])


def test_payload_that_is_not_msgpack_is_a_decode_error() -> None:
    assert "not valid msgpack" in reason(entry("request", None, raw=b"\xc1"))  # 0xc1 is never used by msgpack
    assert "not valid msgpack" in reason(entry("request", None, raw=b"\x92\x01"))  # array of 2, one item


@pytest.mark.parametrize(("payload", "got"), [([1, 2], "list"), (7, "int"), ("x", "str"), (None, "NoneType")])
def test_payload_of_wrong_shape_is_a_decode_error(payload: Any, got: str) -> None:
    msg = reason(entry("request", payload))
    assert f"expected a mapping, got {got}" in msg


@pytest.mark.parametrize("type_name", sorted(EVENT_TYPES))
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_missing_required_field_is_a_decode_error_naming_the_field(type_name: str, data: st.DataObject) -> None:
    cls = EVENT_TYPES[type_name]
    ev = data.draw(event_strategy(cls))
    name = data.draw(st.sampled_from(required_fields(cls)))
    wire = to_wire(ev)
    del wire[name]
    msg = reason(entry(type_name, wire))
    assert f"{type_name}.{name}: required field is missing" in msg


@pytest.mark.parametrize(
    ("field", "value", "expect"),
    [
        ("in_tokens", "12", "in_tokens: expected an integer, got str"),
        ("in_tokens", True, "in_tokens: expected an integer, got bool"),
        ("in_tokens", 1.0, "in_tokens: expected an integer, got float"),
        ("version", 2**63, "version: integer out of the 64-bit range"),
        ("arrival_ms", "now", "arrival_ms: expected a number, got str"),
        ("arrival_ms", False, "arrival_ms: expected a number, got bool"),
        ("arrival_ms", math.nan, "arrival_ms: expected a finite number"),
        ("mem_est_kb", math.inf, "mem_est_kb: expected a finite number"),
        ("mem_est_kb", -math.inf, "mem_est_kb: expected a finite number"),
        ("prefix_cache", 1, "prefix_cache: expected a boolean, got int"),
        ("user_id", b"u1", "user_id: expected a string, got bytes"),
        ("user_id", None, "user_id: expected a string, got NoneType"),
        ("rack", 3, "rack: expected a string, got int"),
    ],
)
def test_field_of_wrong_type_is_a_decode_error_naming_field_and_expected_type(
    field: str, value: Any, expect: str
) -> None:
    wire = to_wire(request()) | {field: value}
    assert expect in reason(entry("request", wire))


def test_float_field_accepts_an_integer_and_decodes_it_as_float() -> None:
    wire = to_wire(request()) | {"arrival_ms": 5}
    ev = decode(entry("request", wire))
    assert isinstance(ev, RequestEvent)
    assert ev.arrival_ms == 5.0
    assert type(ev.arrival_ms) is float


def test_non_string_mapping_keys_are_a_decode_error() -> None:
    from pipeline.events import DecisionEvent

    wire = to_wire(DecisionEvent("dispatch", "weighted-random", "n1", ("a",), 1.0))
    wire["scores"] = {1: 0.5}
    assert "int is not allowed for map key" in reason(entry("decision", wire))
    wire["scores"] = {b"n1": 0.5}
    assert "scores.<key>: expected a string, got bytes" in reason(entry("decision", wire))
    wire["scores"] = {"n1": "high"}
    assert "scores['n1']: expected a number" in reason(entry("decision", wire))


def test_bad_nested_request_in_batch_is_a_decode_error_naming_requests_index() -> None:
    batch = BatchEvent("b1", "r0", "r0-n0", (request(), request()), 1.0, 2.0, 0.0, 0.0)
    wire = to_wire(batch)
    wire["requests"][1]["in_tokens"] = "many"
    assert "batch.requests[1].in_tokens: expected an integer" in reason(entry("batch", wire))
    wire = to_wire(batch)
    del wire["requests"][0]["model"]
    assert "batch.requests[0].model: required field is missing" in reason(entry("batch", wire))
    wire = to_wire(batch)
    wire["requests"][0] = 5
    assert "requests[0]" in reason(entry("batch", wire))
    wire["requests"] = {"not": "a list"}
    assert "batch.requests: expected a list, got dict" in reason(entry("batch", wire))


def test_nested_request_that_is_not_a_mapping_is_reported_at_its_exact_path() -> None:
    batch = BatchEvent("b1", "r0", "r0-n0", (request(),), 1.0, 2.0, 0.0, 0.0)
    wire = to_wire(batch)
    wire["requests"][0] = 5
    assert "batch.requests[0]: expected a mapping, got int" in reason(entry("batch", wire))


# -- dead-letter encoding ----------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(fields=st.dictionaries(st.binary(max_size=8), st.binary(max_size=32), max_size=5))
def test_dlq_encoding_unpacks_to_the_original_bytes(fields: dict[bytes, bytes]) -> None:
    assert msgpack.unpackb(encode_fields_for_dlq(fields), raw=False) == fields


def test_dlq_encoding_turns_str_keys_and_values_into_utf8_bytes() -> None:
    fields = {"v": "1", b"t": b"request", "d": "é"}
    assert msgpack.unpackb(encode_fields_for_dlq(fields)) == {b"v": b"1", b"t": b"request", b"d": "é".encode()}


def test_dlq_encoding_of_a_real_entry_round_trips_to_a_decodable_entry() -> None:
    ev = request()
    back = msgpack.unpackb(encode_fields_for_dlq(encode(ev)))
    assert decode(back) == ev
