"""Where the Batch API keeps its files (`/v1/files`: batch inputs, outputs and error files): a configurable store, a
local directory by default.

`LocalFileStore` keeps each file as two entries under its tenant's directory: `{id}.data` (the bytes) and
`{id}.json` (its OpenAI file object: id, bytes, created_at, filename, purpose, plus the owning tenant). Both are
written to a temporary name, flushed to disk (fsync) and renamed into place, the data before the metadata, and the
directory is synced: a file is there once its metadata is, whole, and a kill -9 at any moment leaves either the
whole file or nothing visible (a stray temporary or a data file without metadata is never listed, and is swept by
`sweep`). Deletion removes the metadata first. A tenant sees only its own files: any other tenant's id is unknown
to it, as an id that does not exist. The calls block on the disk: an event loop runs them in a thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")
"""Our file ids (OpenAI's shape: `file-` and an opaque suffix); anything else is unknown, never a path."""
PURPOSES = ("batch", "batch_output")
"""`batch`: an uploaded batch input; `batch_output`: an output or error file the cluster wrote."""


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class FileMeta:
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int | None = None

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's file object (without the tenant)."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "expires_at": self.expires_at, "filename": self.filename, "purpose": self.purpose,
                "status": "processed", "status_details": None}


class FileStore(Protocol):
    def put(self, tenant: str, filename: str, purpose: str, data: bytes, file_id: str | None = None) -> FileMeta: ...

    def meta(self, tenant: str, file_id: str) -> FileMeta | None: ...

    def read(self, tenant: str, file_id: str) -> bytes | None: ...

    def delete(self, tenant: str, file_id: str) -> bool: ...

    def list(self, tenant: str, purpose: str | None = None) -> list[FileMeta]: ...


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class LocalFileStore:
    """A directory on the gateway's disk (module docstring). Several gateways share files only if they share the
    directory (a network filesystem); otherwise point `batch.files_dir` of each at one volume."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _dir(self, tenant: str) -> Path:
        # a tenant name is the token's claim: hashed, so that no name is a path
        return self.root / hashlib.sha256(tenant.encode()).hexdigest()[:32]

    def put(self, tenant: str, filename: str, purpose: str, data: bytes, file_id: str | None = None) -> FileMeta:
        if purpose not in PURPOSES:
            raise ValueError(f"unknown file purpose {purpose!r}; one of {', '.join(PURPOSES)}")
        fid = file_id or new_file_id()
        if not FILE_ID.match(fid):
            raise ValueError(f"not a file id: {fid!r}")
        d = self._dir(tenant)
        d.mkdir(parents=True, exist_ok=True)
        meta = FileMeta(fid, tenant, filename, purpose, len(data), int(time.time()))
        _write_atomic(d / f"{fid}.data", data)
        _write_atomic(d / f"{fid}.json", json.dumps(dataclasses.asdict(meta)).encode())
        _fsync_dir(d)
        return meta

    def meta(self, tenant: str, file_id: str) -> FileMeta | None:
        if not FILE_ID.match(file_id):
            return None
        try:
            raw = (self._dir(tenant) / f"{file_id}.json").read_bytes()
        except FileNotFoundError:
            return None
        m = FileMeta(**json.loads(raw))
        return m if m.tenant == tenant else None

    def read(self, tenant: str, file_id: str) -> bytes | None:
        if self.meta(tenant, file_id) is None:
            return None
        try:
            return (self._dir(tenant) / f"{file_id}.data").read_bytes()
        except FileNotFoundError:  # deleted between the two reads
            return None

    def delete(self, tenant: str, file_id: str) -> bool:
        if self.meta(tenant, file_id) is None:
            return False
        d = self._dir(tenant)
        (d / f"{file_id}.json").unlink(missing_ok=True)
        (d / f"{file_id}.data").unlink(missing_ok=True)
        _fsync_dir(d)
        return True

    def list(self, tenant: str, purpose: str | None = None) -> list[FileMeta]:
        """The tenant's files, newest first (OpenAI's default order)."""
        d = self._dir(tenant)
        if not d.is_dir():
            return []
        out = []
        for p in d.glob("file-*.json"):
            m = self.meta(tenant, p.stem)
            if m is not None and (purpose is None or m.purpose == purpose):
                out.append(m)
        return sorted(out, key=lambda m: (m.created_at, m.id), reverse=True)

    def sweep(self) -> int:
        """Remove what a crash left half-written: temporaries, and data files without metadata. Returns how many.
        Run it when the store starts, before it serves: a put in progress has its data without metadata for a moment."""
        n = 0
        for d in self.root.iterdir():
            if not d.is_dir():
                continue
            for p in d.iterdir():
                stray = p.name.endswith(".tmp") or (p.suffix == ".data" and not p.with_suffix(".json").exists())
                if stray:
                    p.unlink(missing_ok=True)
                    n += 1
        return n
