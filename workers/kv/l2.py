"""L2 KV tier: snapshot blobs as binary values in Valkey/Redis, shared by every node.

Keys (one Redis Cluster hash tag per sequence, so every key of a sequence lives in one slot and a MULTI over them
is cluster-safe):
- `rf:kv:{<seq_id>}:<version>`: the encoded snapshot, expiring `ttl_s` after its last put or get;
- `rf:kv:{<seq_id>}:versions`: a hash version -> blob size, so finding a sequence's versions is one HGETALL
  instead of a SCAN of the whole keyspace. It is written in the same MULTI as the blob and expires with it; a
  field whose blob expired on its own is removed when a get finds the blob gone.

It must never decide anything (capacity, versions, LRU: the manager's ledger). Redis errors are translated here:
connection/timeout/loading -> `TransientStreamError` (retry), anything else -> `StreamError`.
Keys are snapshot keys `<seq_id>:<version>` (pipeline.kv.tiers.snapshot_key).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from redis.exceptions import BusyLoadingError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.kv.tiers import parse_snapshot_key, snapshot_key
from streams.errors import StreamError, TransientStreamError

PREFIX = "rf:kv:"
_SCAN_COUNT = 1000


def blob_key(seq_id: str, version: int) -> str:
    return f"{PREFIX}{{{seq_id}}}:{int(version)}"


def versions_key(seq_id: str) -> str:
    return f"{PREFIX}{{{seq_id}}}:versions"


def parse_blob_key(key: str) -> tuple[str, int] | None:
    """(seq_id, version) of a blob key; None for the versions hash or anything else."""
    if not key.startswith(PREFIX + "{"):
        return None
    seq_id, sep, version = key[len(PREFIX) + 1 :].rpartition("}:")
    if not sep or not seq_id or not version.lstrip("-").isdigit():
        return None
    return seq_id, int(version)


@asynccontextmanager
async def _translated(what: str) -> AsyncIterator[None]:
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError, BusyLoadingError) as e:
        raise TransientStreamError(f"KV L2 {what}: {type(e).__name__}: {e}") from e
    except RedisError as e:
        raise StreamError(f"KV L2 {what}: {type(e).__name__}: {e}") from e


class ValkeyStore:
    """`KvStore` over a Valkey/Redis client that returns bytes (no `decode_responses`)."""

    def __init__(self, r: aioredis.Redis, ttl_s: int, name: str = "L2") -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s}")
        self.name = name
        self.r = r
        self.ttl_s = int(ttl_s)

    async def put(self, key: str, blob: bytes) -> None:
        seq_id, version = parse_snapshot_key(key)
        idx = versions_key(seq_id)
        async with _translated(f"put {key}"), self.r.pipeline(transaction=True) as p:
            p.set(blob_key(seq_id, version), blob, ex=self.ttl_s)
            p.hset(idx, str(version), len(blob))
            p.expire(idx, self.ttl_s)
            await p.execute()

    async def get(self, key: str) -> bytes | None:
        seq_id, version = parse_snapshot_key(key)
        idx = versions_key(seq_id)
        async with _translated(f"get {key}"):
            async with self.r.pipeline(transaction=True) as p:
                p.getex(blob_key(seq_id, version), ex=self.ttl_s)  # reuse refreshes the TTL
                p.expire(idx, self.ttl_s)
                blob, _ = await p.execute()
            if blob is None:
                await self.r.hdel(idx, str(version))  # the blob expired on its own: forget its size too
                return None
        return bytes(blob)

    async def delete(self, key: str) -> None:
        seq_id, version = parse_snapshot_key(key)
        async with _translated(f"delete {key}"), self.r.pipeline(transaction=True) as p:
            p.delete(blob_key(seq_id, version))
            p.hdel(versions_key(seq_id), str(version))
            await p.execute()

    async def keys(self) -> list[str]:
        out: list[str] = []
        async with _translated("scan"):
            async for k in self.r.scan_iter(match=PREFIX + "*", count=_SCAN_COUNT):
                parsed = parse_blob_key(k.decode() if isinstance(k, bytes) else str(k))
                if parsed is not None:
                    out.append(snapshot_key(*parsed))
        return out

    async def versions(self, seq_id: str) -> dict[int, int]:
        """Versions of `seq_id` held here -> blob size in bytes (one HGETALL)."""
        async with _translated(f"versions of {seq_id}"):
            raw = await self.r.hgetall(versions_key(seq_id))
        out: dict[int, int] = {}
        for v, size in raw.items():
            try:
                out[int(v)] = int(size)
            except ValueError:
                continue
        return out

    async def sizes(self, keys: Sequence[str]) -> dict[str, int]:
        """Size in bytes of each of `keys` that exists (pipelined STRLEN; 0 means missing: blobs are never empty)."""
        out: dict[str, int] = {}
        for i in range(0, len(keys), _SCAN_COUNT):
            chunk = keys[i : i + _SCAN_COUNT]
            async with _translated("strlen"), self.r.pipeline(transaction=False) as p:
                for k in chunk:
                    p.strlen(blob_key(*parse_snapshot_key(k)))
                lens = await p.execute()
            out.update((k, int(n)) for k, n in zip(chunk, lens, strict=True) if int(n) > 0)
        return out

    async def sizes_all(self) -> dict[str, int]:
        """Every key held here -> blob size in bytes (SCAN, then pipelined STRLEN)."""
        return await self.sizes(await self.keys())
