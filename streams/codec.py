"""Versioned msgpack codec of stream entries.

An entry is three fields: `v` (codec version), `t` (event type) and `d` (msgpack of the event's plain data). A
consumer accepts the versions in SUPPORTED_VERSIONS; anything else, any undecodable payload and any payload that
does not validate raises DecodeError with a reason, which the runner sends to the dead-letter stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

from pipeline.events import EVENT_TYPES, Event, EventValidationError, from_wire, to_wire
from streams.errors import DecodeError

CODEC_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})
MAX_PAYLOAD = 64 * 1024 * 1024

_V = str(CODEC_VERSION).encode()


def encode(event: Event) -> dict[bytes, bytes]:
    return {
        b"v": _V,
        b"t": event.TYPE.encode(),
        b"d": msgpack.packb(to_wire(event), use_bin_type=True),
    }


def _field(fields: Mapping[Any, Any], name: str) -> bytes:
    v = fields.get(name.encode(), fields.get(name))
    if v is None:
        raise DecodeError(f"missing field {name!r} (fields present: {sorted(map(repr, fields))[:8]})")
    if isinstance(v, str):
        v = v.encode()
    if not isinstance(v, bytes):
        raise DecodeError(f"field {name!r} is {type(v).__name__}, expected bytes")
    return v


def decode(fields: Mapping[Any, Any]) -> Event:
    """Decode a stream entry's fields into an event; raises DecodeError with the reason."""
    raw_v = _field(fields, "v")
    try:
        version = int(raw_v)
    except ValueError:
        raise DecodeError(f"codec version {raw_v[:20]!r} is not an integer") from None
    if version not in SUPPORTED_VERSIONS:
        raise DecodeError(f"codec version {version} not supported (supported: {sorted(SUPPORTED_VERSIONS)})")
    t = _field(fields, "t").decode("utf-8", "replace")
    cls = EVENT_TYPES.get(t)
    if cls is None:
        raise DecodeError(f"unknown event type {t[:40]!r}; known: {', '.join(sorted(EVENT_TYPES))}")
    payload = _field(fields, "d")
    if len(payload) > MAX_PAYLOAD:
        raise DecodeError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise DecodeError(f"payload is not valid msgpack: {type(e).__name__}: {e}") from None
    overlay = fields.get(b"o", fields.get("o"))
    if overlay is not None:
        # fields a forwarding hop set without re-encoding the payload (the router: rack, routed_ms, ...)
        try:
            extra = msgpack.unpackb(overlay if isinstance(overlay, bytes) else overlay.encode(), raw=False)
        except Exception as e:
            raise DecodeError(f"overlay is not valid msgpack: {type(e).__name__}: {e}") from None
        if not isinstance(extra, dict) or not isinstance(data, dict):
            raise DecodeError("overlay and payload must both be mappings")
        data = {**data, **extra}
    try:
        return from_wire(cls, data)  # type: ignore[no-any-return]
    except EventValidationError as e:
        raise DecodeError(f"invalid {t}: {e}") from None
    except (TypeError, ValueError) as e:  # e.g. unhashable keys inside a mapping
        raise DecodeError(f"invalid {t}: {type(e).__name__}: {e}") from None


def with_overlay(fields: Mapping[bytes, bytes], **changes: Any) -> dict[bytes, bytes]:
    """The same entry with some fields changed, without decoding and re-encoding its payload: a forwarding hop
    (the router) pays for the few fields it sets, not for the whole request (and its prompt)."""
    out = {k if isinstance(k, bytes) else str(k).encode(): v for k, v in fields.items() if k not in (b"o", "o")}
    old = fields.get(b"o", fields.get("o"))
    merged = dict(msgpack.unpackb(old, raw=False)) if isinstance(old, bytes) else {}
    merged.update(changes)
    out[b"o"] = msgpack.packb(merged, use_bin_type=True)
    return out


def encode_fields_for_dlq(fields: Mapping[Any, Any]) -> bytes:
    """The original entry's fields, byte for byte, as one msgpack map (for the dead-letter stream)."""
    def b(x: Any) -> bytes:
        return x if isinstance(x, bytes) else str(x).encode()

    return msgpack.packb({b(k): b(v) for k, v in fields.items()}, use_bin_type=True)
