"""KvTierManager: the shell that applies the tier ledger's decisions (pipeline.kv.tiers) to the KV stores.

What it owns: moving bytes between L1 (`SharedMemoryStore`) and L2 (`ValkeyStore`, or any `KvStore`) exactly as the
ledger decides: a put writes where the ledger places the snapshot after making the room it asks for (demotions
copy-then-delete, drops delete), then deletes the superseded copy; a get reads the newest version, L1 first, and a
hit in L2 is promoted to L1 with the bytes already in hand. It never decides anything itself.

The stores are the truth, the ledger is this process's view of them. Several processes of one node share L1 (and
every node shares L2), each with its own ledger, so before each put/get/drop the manager lists that sequence's
versions in every store (one directory listing in L1, one HGETALL in L2) and reconciles: a newer version another
process wrote wins, so a stale put is refused even across processes and a get never returns an older version than
the stores hold. What remains racy is a check and a write of two processes at the same instant; as every version has
its own key, the stale blob then sits beside the newer one (never over it) and the next reconcile deletes it.

A newly started process calls `rebuild()` once: its ledger is rebuilt from `keys()` of L1 and L2 with their sizes
read cheaply (file sizes; STRLEN in Valkey). Recency is not persisted: the rebuilt LRU order puts L2 entries before
L1 entries, each by key. Entries other processes write later are learned when this process touches their sequence;
until then its ledger undercounts a shared tier, which a periodic `rebuild()` bounds.

Operations of one manager are serialized by one asyncio lock (a decision and the moves that apply it must not
interleave with another's). An error from a store mid-way leaves the stores behind the ledger for the sequences
involved; the next operation on such a sequence reconciles it.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Protocol, runtime_checkable

import redis.asyncio as aioredis

from pipeline.config import KvTierConfig
from pipeline.kv.snapshot import KvSnapshot, SnapshotError, decode, encode
from pipeline.kv.tiers import (
    TIERS,
    Placement,
    TierLedger,
    TierStats,
    parse_snapshot_key,
    snapshot_key,
)
from workers.kv.l1 import SharedMemoryStore
from workers.kv.l2 import ValkeyStore
from workers.kv.store import KvStore

log = logging.getLogger(__name__)

MB = 1_000_000
"""Capacities in config are decimal megabytes."""


@runtime_checkable
class ListedKvStore(KvStore, Protocol):
    """A store that can list cheaply (both shipped stores); plain `KvStore`s are listed through keys()/get()."""

    async def versions(self, seq_id: str) -> dict[int, int]: ...

    async def sizes_all(self) -> dict[str, int]: ...


async def _versions(store: KvStore, seq_id: str) -> dict[int, int]:
    if isinstance(store, ListedKvStore):
        return await store.versions(seq_id)
    out: dict[int, int] = {}
    for k in await store.keys():
        s, v = parse_snapshot_key(k)
        if s == seq_id and (blob := await store.get(k)) is not None:
            out[v] = len(blob)
    return out


async def _sizes_all(store: KvStore) -> dict[str, int]:
    if isinstance(store, ListedKvStore):
        return await store.sizes_all()
    out: dict[str, int] = {}
    for k in await store.keys():
        if (blob := await store.get(k)) is not None:
            out[k] = len(blob)
    return out


class KvTierManager:
    def __init__(self, l1: KvStore | None, l2: KvStore | None, config: KvTierConfig) -> None:
        self.config = config
        self._stores: dict[str, KvStore] = {}
        caps: dict[str, int] = {}
        for tier, store, mb in (("L1", l1, config.l1_capacity_mb), ("L2", l2, config.l2_capacity_mb)):
            if store is not None and mb > 0:
                self._stores[tier] = store
                caps[tier] = int(mb * MB)
        self.ledger = TierLedger(caps)
        self._lock = asyncio.Lock()

    @classmethod
    def for_node(cls, config: KvTierConfig, node: str, r: aioredis.Redis | None) -> KvTierManager:
        """L1 under `config.l1_dir/<node>/` when l1_capacity_mb > 0; L2 in Valkey (`r`) when l2 == "valkey"."""
        l1 = SharedMemoryStore(Path(config.l1_dir), node) if config.l1_capacity_mb > 0 else None
        l2: ValkeyStore | None = None
        if config.l2 == "valkey" and config.l2_capacity_mb > 0:
            if r is None:
                raise ValueError("policies.kv.l2 is 'valkey': pass the Redis client (or set l2: none)")
            l2 = ValkeyStore(r, config.l2_ttl_s)
        return cls(l1, l2, config)

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers in use, fast first."""
        return tuple(self._stores)

    # ------------------------------------------------------------------------------------------ operations

    async def put(self, snapshot: KvSnapshot, tier: str = "L1") -> bool:
        """Store `snapshot` in `tier` (or the first deeper tier that can hold it). False when refused: a newer
        version of the sequence is held (here or by another process), or it is larger than every tier."""
        blob = encode(snapshot)
        async with self._lock:
            await self._sync(snapshot.seq_id)
            p = self.ledger.place(snapshot.seq_id, snapshot.version, len(blob), tier)
            if not p.accepted:
                log.info("kv put refused seq=%s version=%s: %s (%s)", snapshot.seq_id, snapshot.version,
                         p.refusal.value if p.refusal else "", p.detail)
                return False
            await self._apply(p, blob)
            return True

    async def get(self, seq_id: str) -> KvSnapshot | None:
        """The newest version of `seq_id`, L1 first, then L2 (an L2 hit is promoted to L1); None when no tier
        holds it."""
        async with self._lock:
            for _attempt in range(2):  # a blob deleted between the listing and the read: list again, once
                await self._sync(seq_id)
                e = self.ledger.entry(seq_id)
                if e is None:
                    break
                blob = await self._stores[e.tier].get(e.key)
                if blob is None:
                    continue
                try:
                    snap = decode(blob)
                    if snap.key() != (e.seq_id, e.version):
                        raise SnapshotError(f"holds {snap.key()} under the key of {(e.seq_id, e.version)}")
                except SnapshotError as err:
                    log.warning("kv get seq=%s: %s copy of version %s is unreadable, deleted: %s", seq_id, e.tier,
                                e.version, err)
                    await self._stores[e.tier].delete(e.key)
                    self.ledger.remove(seq_id)
                    continue
                for t in self._stores:
                    if t == e.tier:
                        break
                    self.ledger.on_miss(t)
                await self._apply(self.ledger.on_hit(seq_id, e.tier), cache={e.key: blob})
                return snap
            for t in self._stores:
                self.ledger.on_miss(t)
            return None

    async def get_from(self, tier: str, seq_id: str) -> KvSnapshot | None:
        """The newest version of `seq_id` in `tier` alone: no promotion, no ledger change (tests, benchmarks)."""
        if tier not in TIERS:
            raise ValueError(f"unknown KV tier {tier!r}; valid tiers: {', '.join(TIERS)}")
        store = self._stores.get(tier)
        if store is None:
            return None
        versions = await _versions(store, seq_id)
        if not versions:
            return None
        blob = await store.get(snapshot_key(seq_id, max(versions)))
        return None if blob is None else decode(blob)

    async def drop(self, seq_id: str) -> None:
        """Delete every version of `seq_id` from every tier (the sequence finished or was cancelled)."""
        async with self._lock:
            for store in self._stores.values():
                for v in await _versions(store, seq_id):
                    await store.delete(snapshot_key(seq_id, v))
            self.ledger.remove(seq_id)

    async def rebuild(self) -> int:
        """Rebuild the ledger from what the stores hold (a newly started process); returns the entries held."""
        async with self._lock:
            found: dict[str, dict[str, dict[int, int]]] = {}
            for tier, store in self._stores.items():
                for key, size in (await _sizes_all(store)).items():
                    seq_id, version = parse_snapshot_key(key)
                    found.setdefault(seq_id, {}).setdefault(tier, {})[version] = size
            for e in self.ledger.entries():
                found.setdefault(e.seq_id, {})  # held here but gone from the stores: forgotten

            def shallowest_of_newest(seq_id: str) -> tuple[int, str]:
                copies = found[seq_id]
                newest = max((v for vs in copies.values() for v in vs), default=0)
                tiers = [i for i, t in enumerate(TIERS) if newest in copies.get(t, {})]
                return (-min(tiers, default=0), seq_id)

            for seq_id in sorted(found, key=shallowest_of_newest):  # deeper first: taken as least recently used
                await self._apply(self.ledger.reconcile(seq_id, found[seq_id]))
            log.info("kv ledger rebuilt: %s", {t: self.ledger.stats().entries[t] for t in self._stores})
            return len(self.ledger)

    def stats(self) -> TierStats:
        return self.ledger.stats()

    # ------------------------------------------------------------------------------------------ internals

    async def _sync(self, seq_id: str) -> None:
        found = {t: await _versions(store, seq_id) for t, store in self._stores.items()}
        await self._apply(self.ledger.reconcile(seq_id, found))

    async def _apply(self, p: Placement, blob: bytes | None = None, cache: dict[str, bytes] | None = None) -> None:
        for m in p.moves:
            src = self._stores[m.src]
            if m.dst is None:
                await src.delete(m.key)
                continue
            data = (cache or {}).get(m.key)
            if data is None:
                data = await src.get(m.key)
            if data is None:  # deleted or expired by someone else meanwhile: nothing to move
                log.info("kv %s of seq=%s version=%s: gone from %s", m.kind.value, m.seq_id, m.version, m.src)
                held = self.ledger.entry(m.seq_id)
                if held is not None and (held.version, held.tier) == (m.version, m.dst):
                    self.ledger.remove(m.seq_id)
                continue
            await self._stores[m.dst].put(m.key, data)
            await src.delete(m.key)
        if p.write:
            assert p.entry is not None and blob is not None, "a placement to write comes with an entry and a blob"
            await self._stores[p.entry.tier].put(p.entry.key, blob)
        for m in p.deletes:
            await self._stores[m.src].delete(m.key)
