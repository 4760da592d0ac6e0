"""The incident recording (`.rfr`): every stream entry of a time window plus the config in force, in one file.

Layout: the magic `RFR1`, a 4-byte big-endian header length, the header (msgpack: format version, time range,
lead-in, counts per stream, the config), then a gzip stream of msgpack records `[stream, entry id, fields]` in
export order (per stream, in id order; the decisions stream last, so a reader has seen every request before the
decisions that use it). Export and import stream entries through in chunks: a recording of millions of entries is
never held in memory.
"""

from __future__ import annotations

import gzip
import os
import shutil
import struct
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
import redis.asyncio as aioredis

from pipeline.errors import RackflowError
from streams import keys

MAGIC = b"RFR1"
FORMAT_VERSION = 1
CHUNK = 2000
Progress = Callable[[int], None]


class RecordingError(RackflowError, ValueError):
    """The file is not a rackflow recording, or is damaged; the message says which."""


@dataclass
class Header:
    since_ms: float
    until_ms: float
    lead_in_ms: float
    counts: dict[str, int] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    created_ms: float = 0.0
    version: int = FORMAT_VERSION
    source: str = ""

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_plain(self) -> dict[str, Any]:
        return {
            "version": self.version, "since_ms": self.since_ms, "until_ms": self.until_ms,
            "lead_in_ms": self.lead_in_ms, "counts": self.counts, "total": self.total, "config": self.config,
            "created_ms": self.created_ms, "source": self.source,
        }

    @classmethod
    def from_plain(cls, d: Mapping[str, Any]) -> Header:
        try:
            return cls(
                since_ms=float(d["since_ms"]), until_ms=float(d["until_ms"]), lead_in_ms=float(d["lead_in_ms"]),
                counts={str(k): int(v) for k, v in d["counts"].items()}, config=dict(d.get("config") or {}),
                created_ms=float(d.get("created_ms", 0.0)), version=int(d["version"]), source=str(d.get("source", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RecordingError(f"recording header is damaged: {e!r}") from None


class RecordingWriter:
    """Write records as they come (to a compressed temporary body), then the header with the final counts."""

    def __init__(self, path: Path, header: Header) -> None:
        self.path = Path(path)
        self.header = header
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".body", dir=self.path.parent)
        os.close(fd)
        self._tmp = Path(tmp)
        self._gz = gzip.open(self._tmp, "wb", compresslevel=6)  # noqa: SIM115 - closed in close()/abort()
        self._packer = msgpack.Packer(use_bin_type=True)

    def add(self, stream: str, entry_id: str, fields: Mapping[bytes, bytes]) -> None:
        self._gz.write(self._packer.pack([stream, entry_id, dict(fields)]))
        self.header.counts[stream] = self.header.counts.get(stream, 0) + 1

    def close(self) -> Header:
        self._gz.close()
        head = msgpack.packb(self.header.to_plain(), use_bin_type=True)
        part = self.path.with_name(self.path.name + ".part")
        with open(part, "wb") as out, open(self._tmp, "rb") as body:
            out.write(MAGIC + struct.pack(">I", len(head)) + head)
            shutil.copyfileobj(body, out, 1 << 20)
        os.replace(part, self.path)
        self._tmp.unlink(missing_ok=True)
        return self.header

    def abort(self) -> None:
        self._gz.close()
        self._tmp.unlink(missing_ok=True)


def _read_header(f: BinaryIO, path: Path) -> Header:
    magic = f.read(4)
    if magic != MAGIC:
        raise RecordingError(f"{path} is not a rackflow recording (starts with {magic!r}, expected {MAGIC!r})")
    raw = f.read(4)
    if len(raw) != 4:
        raise RecordingError(f"{path} is truncated (no header length)")
    (n,) = struct.unpack(">I", raw)
    head = f.read(n)
    if len(head) != n:
        raise RecordingError(f"{path} is truncated (header of {n} bytes, {len(head)} present)")
    try:
        plain = msgpack.unpackb(head, raw=False, strict_map_key=False)
    except Exception as e:
        raise RecordingError(f"{path}: header does not decode: {e}") from None
    h = Header.from_plain(plain)
    if h.version != FORMAT_VERSION:
        raise RecordingError(f"{path}: recording format {h.version}, this rackflow reads {FORMAT_VERSION}")
    return h


def read_header(path: Path) -> Header:
    with open(path, "rb") as f:
        return _read_header(f, Path(path))


def read_records(path: Path) -> Iterator[tuple[str, str, dict[bytes, bytes]]]:
    """(stream, entry id, fields) in file order, streamed."""
    path = Path(path)
    with open(path, "rb") as f:
        _read_header(f, path)
        with gzip.GzipFile(fileobj=f, mode="rb") as gz:
            unpacker = msgpack.Unpacker(gz, raw=False, strict_map_key=False, max_buffer_size=256 * 1024 * 1024)
            try:
                for rec in unpacker:
                    if not isinstance(rec, list) or len(rec) != 3:
                        raise RecordingError(f"{path}: a record is not [stream, id, fields]")
                    stream, entry_id, flds = rec
                    yield str(stream), str(entry_id), {
                        (k if isinstance(k, bytes) else str(k).encode()): v for k, v in flds.items()
                    }
            except (EOFError, OSError, gzip.BadGzipFile) as e:
                raise RecordingError(f"{path} is truncated or damaged: {e}") from None


# ---- which streams ---------------------------------------------------------------------------------------------

STREAM_GROUPS = ("ingress", "racks", "nodes", "results", "health", "dlq", "outputs", "decisions")
DEFAULT_GROUPS = ("ingress", "racks", "nodes", "results", "health", "dlq", "decisions")


def stream_group(key: str) -> str | None:
    if key in (keys.INGRESS, keys.ADMITTED):  # the requests as admitted: queued for the router, or routed inline
        return "ingress"
    if key == keys.DECISIONS:
        return "decisions"
    if key == keys.RESULTS:
        return "results"
    if key == keys.HEALTH:
        return "health"
    if key == keys.DLQ:
        return "dlq"
    if key.startswith("rf:rack:"):
        return "racks"
    if key.startswith("rf:node:"):
        return "nodes"
    if key.startswith("rf:out:"):
        return "outputs"
    return None


async def stream_keys(r: aioredis.Redis, groups: tuple[str, ...] = DEFAULT_GROUPS) -> list[str]:
    """The rackflow stream keys of the chosen groups, in export order (decisions last)."""
    unknown = set(groups) - set(STREAM_GROUPS)
    if unknown:
        raise ValueError(f"unknown stream group(s) {', '.join(sorted(unknown))}; valid: {', '.join(STREAM_GROUPS)}")
    found: list[str] = []
    async for k in r.scan_iter(match="rf:*", count=1000, _type="STREAM"):
        key = k.decode() if isinstance(k, bytes) else str(k)
        g = stream_group(key)
        if g in groups:
            found.append(key)
    order = {g: i for i, g in enumerate(STREAM_GROUPS)}
    return sorted(found, key=lambda k: (order[stream_group(k) or "decisions"], k))


async def xrange_chunks(
    r: aioredis.Redis, key: str, lo_ms: float, hi_ms: float
) -> AsyncIterator[list[tuple[bytes, dict[bytes, bytes]]]]:
    start = f"{max(0, int(lo_ms))}-0"
    end = f"{int(hi_ms)}"  # an id without a sequence part as the end means every sequence of that ms
    while True:
        chunk = await r.xrange(key, min=start, max=end, count=CHUNK)
        if not chunk:
            return
        yield chunk
        last = chunk[-1][0]
        start = "(" + (last.decode() if isinstance(last, bytes) else str(last))
        if len(chunk) < CHUNK:
            return


async def export_streams(
    r: aioredis.Redis, path: Path, header: Header, groups: tuple[str, ...] = DEFAULT_GROUPS,
    progress: Progress | None = None,
) -> Header:
    """Write the entries of [since - lead_in, until] of every chosen stream to `path`."""
    writer = RecordingWriter(path, header)
    try:
        for key in await stream_keys(r, groups):
            async for chunk in xrange_chunks(r, key, header.since_ms - header.lead_in_ms, header.until_ms):
                for entry_id, flds in chunk:
                    eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                    writer.add(key, eid, flds)
                if progress is not None:
                    progress(len(chunk))
    except BaseException:
        writer.abort()
        raise
    return writer.close()


async def live_streams(r: aioredis.Redis) -> list[str]:
    """Rackflow stream keys present on a server (import refuses to mix a recording into them)."""
    out = []
    async for k in r.scan_iter(match="rf:*", count=1000, _type="STREAM"):
        out.append(k.decode() if isinstance(k, bytes) else str(k))
        if len(out) >= 10:
            break
    return out


@dataclass
class ImportStats:
    entries: int = 0
    skipped: int = 0
    """Entries whose id was not above the stream's last id (only with --force into a server with data)."""
    streams: set[str] = field(default_factory=set)


async def import_records(
    r: aioredis.Redis, records: Iterator[tuple[str, str, dict[bytes, bytes]]], progress: Progress | None = None,
) -> ImportStats:
    """XADD every record with its original id, pipelined in chunks."""
    stats = ImportStats()
    batch: list[tuple[str, str, dict[bytes, bytes]]] = []

    async def flush() -> None:
        pipe = r.pipeline(transaction=False)
        for key, eid, flds in batch:
            pipe.xadd(key, flds, id=eid)  # type: ignore[arg-type]
        res = await pipe.execute(raise_on_error=False)
        for x in res:
            if isinstance(x, Exception):
                stats.skipped += 1
            else:
                stats.entries += 1
        if progress is not None:
            progress(len(batch))
        batch.clear()

    for rec in records:
        batch.append(rec)
        stats.streams.add(rec[0])
        if len(batch) >= CHUNK:
            await flush()
    if batch:
        await flush()
    return stats
