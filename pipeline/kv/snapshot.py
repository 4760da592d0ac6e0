"""KvSnapshot: a live sequence's KV state, portable between engine processes, keyed by (sequence UUID, version).

The engine-specific payload (`data`, e.g. per-layer K/V tensors of the torch engine) travels with what another
engine needs to resume exactly: every token whose KV is in the payload, how many of them were generated, the
position of the next token and the generation limit. `encode`/`decode` give one self-describing byte string
(msgpack header + payload), versioned like the stream codec.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from pipeline.errors import RackflowError

SNAPSHOT_FORMAT = 1


class SnapshotError(RackflowError, ValueError):
    """Bytes that are not a KV snapshot of a supported format, or a snapshot for another model/engine."""


@dataclass(frozen=True, slots=True)
class KvSnapshot:
    seq_id: str
    version: int
    model: str
    """The engine model the KV belongs to (a snapshot only resumes on the same model)."""
    engine: str
    """`torch`, `sim` or `vllm`."""
    token_ids: tuple[int, ...]
    """Prompt + generated tokens whose KV is in `data` (the last generated token's KV may be absent: see
    `pending_token`)."""
    prompt_len: int
    generated: tuple[int, ...]
    """Generated token ids so far (the client has seen them)."""
    max_tokens: int
    data: bytes = b""
    meta: dict[str, Any] = field(default_factory=dict)
    """Engine-specific shape information (layers, heads, dtype, ...)."""

    @property
    def nbytes(self) -> int:
        return len(self.data) + 8 * len(self.token_ids) + 256

    def key(self) -> tuple[str, int]:
        return (self.seq_id, self.version)


def encode(s: KvSnapshot) -> bytes:
    header = {
        "f": SNAPSHOT_FORMAT, "seq_id": s.seq_id, "version": s.version, "model": s.model, "engine": s.engine,
        "token_ids": list(s.token_ids), "prompt_len": s.prompt_len, "generated": list(s.generated),
        "max_tokens": s.max_tokens, "meta": s.meta,
    }
    h: bytes = msgpack.packb(header, use_bin_type=True)
    return len(h).to_bytes(4, "big") + h + s.data


def decode(blob: bytes) -> KvSnapshot:
    if len(blob) < 4:
        raise SnapshotError("too short to be a KV snapshot")
    n = int.from_bytes(blob[:4], "big")
    if n > len(blob) - 4:
        raise SnapshotError("truncated KV snapshot header")
    try:
        h = msgpack.unpackb(blob[4 : 4 + n], raw=False)
    except Exception as e:
        raise SnapshotError(f"KV snapshot header is not msgpack: {e}") from None
    if not isinstance(h, dict) or h.get("f") != SNAPSHOT_FORMAT:
        raise SnapshotError(f"unsupported KV snapshot format {h.get('f') if isinstance(h, dict) else h!r}")
    try:
        return KvSnapshot(
            seq_id=str(h["seq_id"]), version=int(h["version"]), model=str(h["model"]), engine=str(h["engine"]),
            token_ids=tuple(int(t) for t in h["token_ids"]), prompt_len=int(h["prompt_len"]),
            generated=tuple(int(t) for t in h["generated"]), max_tokens=int(h["max_tokens"]),
            data=bytes(blob[4 + n :]), meta=dict(h.get("meta") or {}),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"KV snapshot header is missing or has a bad field: {e}") from None
