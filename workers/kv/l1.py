"""L1 KV tier: snapshot blobs as files in a RAM-backed directory shared by the processes of one node.

Layout: `<root>/<node>/<seq_id>/<version>`, names percent-encoded (every byte outside [A-Za-z0-9_-], so no name
is `.`/`..` or starts with the `.` of a temp file). One directory per sequence makes `versions(seq_id)` one small
listing, however many sequences the node holds. Another process of the same node (a hot-swapped worker) reads
what this one wrote: writes go to a temp file in the same directory and are renamed into place, so a reader sees
the whole old blob or the whole new one, never a torn one.

It must never decide anything: capacity, versions and LRU belong to the manager's ledger (pipeline.kv.tiers).
Keys are snapshot keys `<seq_id>:<version>` (pipeline.kv.tiers.snapshot_key).
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote

from pipeline.kv.tiers import parse_snapshot_key, snapshot_key

_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_MAX_NAME = 240  # bytes; most file systems allow 255
_INLINE_BYTES = 4 << 20
"""Blobs up to this size are copied on the event loop (a thread hop costs more than a few MB of memcpy); larger
ones in a worker thread so the loop keeps serving heartbeats."""
_TMP = ".tmp-"


def encode_name(s: str) -> str:
    """`s` as one safe file name (percent-encoded UTF-8); ValueError when empty or too long."""
    if not s:
        raise ValueError("an empty string is not a KV file name")
    out = "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in s)
    if len(out) > _MAX_NAME:
        raise ValueError(f"{s[:40]!r}... encodes to {len(out)} bytes, more than a file name may hold ({_MAX_NAME})")
    return out


def decode_name(name: str) -> str:
    return unquote(name, errors="strict")


class SharedMemoryStore:
    """`KvStore` over files under `root/<node>/` (default root: /dev/shm/rackflow-kv)."""

    def __init__(self, root: Path, node: str, name: str = "L1") -> None:
        self.name = name
        self.dir = Path(root) / encode_name(node)

    def _path(self, key: str) -> Path:
        seq_id, version = parse_snapshot_key(key)
        return self.dir / encode_name(seq_id) / str(version)

    async def put(self, key: str, blob: bytes) -> None:
        path = self._path(key)
        if len(blob) > _INLINE_BYTES:
            await asyncio.to_thread(_write_atomic, path, blob)
        else:
            _write_atomic(path, blob)

    async def get(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                if os.fstat(f.fileno()).st_size > _INLINE_BYTES:
                    return await asyncio.to_thread(f.read)
                return f.read()
        except FileNotFoundError:
            return None

    async def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        try:
            path.parent.rmdir()  # the sequence's last version: leave no empty directory behind
        except OSError:
            pass  # not empty (another version, a writer's temp file) or already gone

    async def keys(self) -> list[str]:
        return list((await self.sizes_all()).keys())

    async def versions(self, seq_id: str) -> dict[int, int]:
        """Versions of `seq_id` held here -> blob size in bytes (one directory listing)."""
        return _listing(self.dir / encode_name(seq_id))

    async def sizes(self, keys: Sequence[str]) -> dict[str, int]:
        """Size in bytes of each of `keys` that exists."""
        out: dict[str, int] = {}
        for k in keys:
            try:
                out[k] = self._path(k).stat().st_size
            except FileNotFoundError:
                continue
        return out

    async def sizes_all(self) -> dict[str, int]:
        """Every key held here -> blob size in bytes (what a restarted process rebuilds its ledger from)."""
        out: dict[str, int] = {}
        try:
            seq_dirs = list(os.scandir(self.dir))
        except FileNotFoundError:
            return out
        for d in seq_dirs:
            if d.name.startswith(".") or not d.is_dir(follow_symlinks=False):
                continue
            try:
                seq_id = decode_name(d.name)
            except UnicodeDecodeError:
                continue  # not ours
            for version, size in _listing(Path(d.path)).items():
                out[snapshot_key(seq_id, version)] = size
        return out


def _listing(seq_dir: Path) -> dict[int, int]:
    out: dict[int, int] = {}
    try:
        entries = list(os.scandir(seq_dir))
    except (FileNotFoundError, NotADirectoryError):
        return out
    for f in entries:
        if f.name.startswith("."):
            continue  # a writer's temp file
        try:
            out[int(f.name)] = f.stat(follow_symlinks=False).st_size
        except (ValueError, FileNotFoundError):
            continue  # not a version, or deleted while listing
    return out


def _write_atomic(path: Path, blob: bytes) -> None:
    # A concurrent delete of the sequence's last version may remove the directory between mkdir and open: retry.
    for attempt in range(3):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f"{_TMP}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
            return
        except FileNotFoundError:
            if attempt == 2:
                raise
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
