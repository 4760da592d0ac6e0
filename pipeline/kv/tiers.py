"""The KV tier policy (ARCHITECTURE §4): which snapshot lives in which tier, and what has to move when one arrives.

Rules (one ledger, one sequence = at most one held version, in one tier):
- Tiers are ordered, fast and small first: L1 (node-local RAM), L2 (remote pool). A tier with capacity 0 is off.
- `place` of an OLDER version than the one held is refused (STALE) and changes nothing but the refused counter:
  a snapshot of an older version never overwrites a newer one. An EQUAL version replaces the held one; a NEWER
  version supersedes it (the shell deletes the old copy once the new one is written).
- A snapshot larger than the requested tier's capacity goes to the next tier that can hold it (never up); if none
  can, it is refused (TOO_LARGE) with the sizes in the detail.
- When an arrival puts a tier over capacity, its least recently used entries leave, oldest first, until it fits:
  to the next tier that can hold them (DEMOTE) or, when none can, out of the ledger (DROP). Tiers settle in order,
  so an entry demoted into L2 competes there by its own last use; if it is L2's oldest it is dropped at once and
  the decision says DROP from L1 (nothing is copied for nothing).
- Recency is a logical clock: every `place`, hit, `touch` and adoption advances it; demotion keeps an entry's time.
- A hit in a deeper tier promotes the entry to the shallowest tier that can hold it, which may demote others.
- `reconcile` adopts what the stores actually hold (another process's writes, a restart, an expired TTL): the newest
  version found wins even if this ledger remembered a newer one that is gone; every other copy is to be deleted.

Decisions are data (`Placement` of `Move`s); the shell applies one in order: `moves` (each copy-then-delete, so a
crash never loses a blob; they free room in the shallower tiers before anything enters them), then the write of the
placed blob when `write` is set, then `deletes`. Capacity holds for the ledger after each decision; while the shell
applies one, a deeper tier may briefly hold one blob too many.

Pure: no I/O, no clock, no randomness; the shell owns the stores and calls in here.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

Tier = Literal["L1", "L2"]
TIERS: tuple[Tier, ...] = ("L1", "L2")
"""Fast and small first."""


def _tier_index(tier: str) -> int:
    try:
        return TIERS.index(tier)
    except ValueError:
        raise ValueError(f"unknown KV tier {tier!r}; valid tiers: {', '.join(TIERS)}") from None


def snapshot_key(seq_id: str, version: int) -> str:
    """The store key of one snapshot: `<seq_id>:<version>` (a store may map it to its own naming)."""
    if not seq_id:
        raise ValueError("a KV snapshot needs a non-empty seq_id")
    return f"{seq_id}:{int(version)}"


def parse_snapshot_key(key: str) -> tuple[str, int]:
    """Inverse of `snapshot_key`; ValueError for anything else (the seq_id may itself contain ':')."""
    seq_id, sep, version = key.rpartition(":")
    if not sep or not seq_id:
        raise ValueError(f"not a KV snapshot key (want '<seq_id>:<version>'): {key!r}")
    try:
        return seq_id, int(version)
    except ValueError:
        raise ValueError(f"not a KV snapshot key (version is not an integer): {key!r}") from None


class MoveKind(enum.Enum):
    DEMOTE = "demote"
    """To a deeper tier: its tier was over capacity and this was its least recently used entry."""
    PROMOTE = "promote"
    """To a shallower tier: it was hit."""
    DROP = "drop"
    """Out of every tier: over capacity and no deeper tier can hold it."""
    SUPERSEDE = "supersede"
    """An older version (or a duplicate copy) of a sequence whose newer copy is held elsewhere."""


class Refusal(enum.Enum):
    STALE = "a newer version of the sequence is already held"
    TOO_LARGE = "larger than every tier it may go to"


@dataclass(frozen=True, slots=True)
class Entry:
    seq_id: str
    version: int
    size: int
    """Bytes of the stored blob."""
    tier: Tier
    last_used: int
    """Logical time of the last place/hit/touch (unique per ledger)."""

    @property
    def key(self) -> str:
        return snapshot_key(self.seq_id, self.version)


@dataclass(frozen=True, slots=True)
class Move:
    kind: MoveKind
    seq_id: str
    version: int
    size: int
    src: Tier
    dst: Tier | None
    """None for DROP and SUPERSEDE: delete from `src`."""

    @property
    def key(self) -> str:
        return snapshot_key(self.seq_id, self.version)


@dataclass(frozen=True, slots=True)
class Placement:
    """One decision. `entry` is what the ledger holds for the sequence afterwards (None: nothing)."""

    accepted: bool
    entry: Entry | None
    write: bool = False
    """The shell writes the sequence's blob to `entry.tier` (after `moves`, before `deletes`)."""
    moves: tuple[Move, ...] = ()
    deletes: tuple[Move, ...] = ()
    refusal: Refusal | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class TierStats:
    hits: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)
    entries: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)
    bytes_moved: int = 0
    """Bytes copied between tiers by demotions and promotions."""
    demotions: int = 0
    promotions: int = 0
    drops: int = 0
    superseded: int = 0
    refused_stale: int = 0
    refused_too_large: int = 0


class TierLedger:
    """Which (seq_id, version, size) lives in which tier, in LRU order; capacities in bytes per tier name."""

    def __init__(self, capacities: Mapping[str, int]) -> None:
        for name, cap in capacities.items():
            _tier_index(name)
            if int(cap) < 0:
                raise ValueError(f"capacity of {name} must be >= 0 bytes (0 turns the tier off), got {cap}")
        self._cap: dict[Tier, int] = {t: int(capacities.get(t, 0)) for t in TIERS}
        self._entries: dict[str, Entry] = {}
        self._used: dict[Tier, int] = dict.fromkeys(TIERS, 0)
        self._count: dict[Tier, int] = dict.fromkeys(TIERS, 0)
        # Per tier a min-heap of (last_used, seq_id) with lazy deletion: an item is live iff the entry of seq_id is
        # in that tier with that last_used (last_used values are unique, so a stale item never matches again).
        self._heap: dict[Tier, list[tuple[int, str]]] = {t: [] for t in TIERS}
        self._clock = 0
        self._hits: dict[str, int] = dict.fromkeys(TIERS, 0)
        self._misses: dict[str, int] = dict.fromkeys(TIERS, 0)
        self._bytes_moved = 0
        self._demotions = 0
        self._promotions = 0
        self._drops = 0
        self._superseded = 0
        self._refused_stale = 0
        self._refused_too_large = 0

    # ----------------------------------------------------------------------------------------- queries

    def capacity(self, tier: str) -> int:
        return self._cap[TIERS[_tier_index(tier)]]

    def used(self, tier: str) -> int:
        return self._used[TIERS[_tier_index(tier)]]

    def enabled(self, tier: str) -> bool:
        return self.capacity(tier) > 0

    def entry(self, seq_id: str) -> Entry | None:
        return self._entries.get(seq_id)

    def entries(self, tier: str | None = None) -> list[Entry]:
        """Held entries (of one tier, or all), least recently used first."""
        es = self._entries.values() if tier is None else (
            e for e in self._entries.values() if e.tier == TIERS[_tier_index(tier)])
        return sorted(es, key=lambda e: e.last_used)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._entries

    def stats(self) -> TierStats:
        return TierStats(
            hits=dict(self._hits), misses=dict(self._misses), entries={t: self._count[t] for t in TIERS},
            bytes={t: self._used[t] for t in TIERS}, capacity={t: self._cap[t] for t in TIERS},
            bytes_moved=self._bytes_moved, demotions=self._demotions,
            promotions=self._promotions, drops=self._drops, superseded=self._superseded,
            refused_stale=self._refused_stale, refused_too_large=self._refused_too_large,
        )

    # ----------------------------------------------------------------------------------------- decisions

    def place(self, seq_id: str, version: int, size: int, tier: str = "L1") -> Placement:
        """A new blob of (seq_id, version) is to be stored, in `tier` or the first deeper tier that can hold it."""
        if size < 0:
            raise ValueError(f"a snapshot's size must be >= 0 bytes, got {size}")
        start = _tier_index(tier)
        held = self._entries.get(seq_id)
        if held is not None and held.version > version:
            self._refused_stale += 1
            return Placement(False, held, refusal=Refusal.STALE,
                             detail=f"{seq_id}: version {version} < held version {held.version} in {held.tier}")
        ti = self._target(size, start)
        if ti is None:
            self._refused_too_large += 1
            caps = ", ".join(f"{t}={self._cap[t]}" for t in TIERS[start:])
            return Placement(False, held, refusal=Refusal.TOO_LARGE,
                             detail=f"{seq_id}: {size} bytes, capacities from {TIERS[start]}: {caps}")
        deletes: tuple[Move, ...] = ()
        if held is not None:
            self._take(seq_id)
            if (held.version, held.tier) != (version, TIERS[ti]):  # same key in the same tier: overwritten in place
                deletes = (Move(MoveKind.SUPERSEDE, seq_id, held.version, held.size, held.tier, None),)
                self._superseded += 1
        entry = Entry(seq_id, version, size, TIERS[ti], self._tick())
        self._insert(entry)
        return Placement(True, entry, write=True, moves=self._settle(ti, pinned=seq_id), deletes=deletes)

    def on_hit(self, seq_id: str, tier: str) -> Placement:
        """The shell read the held blob of `seq_id` from `tier`: count it, touch it, promote it if it is deeper
        than the shallowest tier that can hold it (the PROMOTE move comes last: the shell has the blob in hand)."""
        t = TIERS[_tier_index(tier)]
        held = self._entries.get(seq_id)
        if held is None or held.tier != t:
            where = "not held" if held is None else f"held in {held.tier}"
            raise KeyError(f"{seq_id} is {where}, not in {t}: reconcile before reporting a hit")
        self._hits[t] += 1
        touched = self._retime(held)
        target = self._target(held.size, 0)
        if target is None or target >= _tier_index(t):
            return Placement(True, touched)
        self._take(seq_id)
        promoted = replace(touched, tier=TIERS[target])
        self._insert(promoted)
        self._promotions += 1
        self._bytes_moved += held.size
        moves = (*self._settle(target, pinned=seq_id),
                 Move(MoveKind.PROMOTE, seq_id, held.version, held.size, t, TIERS[target]))
        return Placement(True, promoted, moves=moves)

    def on_miss(self, tier: str) -> None:
        self._misses[TIERS[_tier_index(tier)]] += 1

    def touch(self, seq_id: str) -> None:
        """Mark `seq_id` as just used (no hit counted); unknown ids are ignored."""
        held = self._entries.get(seq_id)
        if held is not None:
            self._retime(held)

    def remove(self, seq_id: str) -> Entry | None:
        """Forget `seq_id`; returns what was held so the shell can delete it."""
        if seq_id not in self._entries:
            return None
        return self._take(seq_id)

    def reconcile(self, seq_id: str, found: Mapping[str, Mapping[int, int]]) -> Placement:
        """Adopt what the stores hold for `seq_id`: `found[tier][version] = size`. The newest version wins (the
        shallowest copy of it, or the one already held); all other copies become deletes. Nothing found: the
        sequence is forgotten (it expired or another process deleted it)."""
        copies = [(v, size, TIERS[_tier_index(t)]) for t, vs in found.items() for v, size in vs.items()]
        held = self._entries.get(seq_id)
        if not copies:
            if held is not None:
                self._take(seq_id)
            return Placement(True, None)
        best = max(v for v, _, _ in copies)
        at = sorted((t for v, _, t in copies if v == best), key=TIERS.index)
        keep: Tier = held.tier if held is not None and held.version == best and held.tier in at else at[0]
        size = next(s for v, s, t in copies if (v, t) == (best, keep))
        copies.sort(key=lambda c: (TIERS.index(c[2]), c[0]))
        deletes = tuple(Move(MoveKind.SUPERSEDE, seq_id, v, s, t, None) for v, s, t in copies if (v, t) != (best, keep))
        self._superseded += len(deletes)
        if held is not None and (held.version, held.tier, held.size) == (best, keep, size):
            return Placement(True, held, deletes=deletes)
        if held is not None:
            self._take(seq_id)
        ti = self._target(size, _tier_index(keep))
        if ti is None:  # another process (other config) left a blob this ledger cannot hold
            self._drops += 1
            return Placement(True, None, deletes=(*deletes, Move(MoveKind.DROP, seq_id, best, size, keep, None)))
        entry = Entry(seq_id, best, size, TIERS[ti], self._tick())
        self._insert(entry)
        moves = self._settle(ti, pinned=seq_id)
        if TIERS[ti] != keep:
            self._demotions += 1
            self._bytes_moved += size
            moves = (*moves, Move(MoveKind.DEMOTE, seq_id, best, size, keep, TIERS[ti]))
        return Placement(True, entry, moves=moves, deletes=deletes)

    # ----------------------------------------------------------------------------------------- internals

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _target(self, size: int, start: int) -> int | None:
        """The first enabled tier from `start` on that can hold `size` bytes."""
        for i in range(start, len(TIERS)):
            cap = self._cap[TIERS[i]]
            if cap > 0 and size <= cap:
                return i
        return None

    def _insert(self, e: Entry) -> None:
        self._entries[e.seq_id] = e
        self._used[e.tier] += e.size
        self._count[e.tier] += 1
        heap = self._heap[e.tier]
        heapq.heappush(heap, (e.last_used, e.seq_id))
        if len(heap) > 2 * self._count[e.tier] + 64:  # drop dead items so touches cannot grow it without bound
            self._heap[e.tier] = [(x.last_used, x.seq_id) for x in self._entries.values() if x.tier == e.tier]
            heapq.heapify(self._heap[e.tier])

    def _take(self, seq_id: str) -> Entry:
        e = self._entries.pop(seq_id)
        self._used[e.tier] -= e.size
        self._count[e.tier] -= 1
        return e

    def _retime(self, e: Entry) -> Entry:
        self._take(e.seq_id)
        touched = replace(e, last_used=self._tick())
        self._insert(touched)
        return touched

    def _pop_lru(self, tier: Tier) -> Entry:
        heap = self._heap[tier]
        while heap:
            last_used, seq_id = heapq.heappop(heap)
            e = self._entries.get(seq_id)
            if e is not None and e.tier == tier and e.last_used == last_used:
                return e
        raise AssertionError(f"{tier} is over capacity with no entry to evict")  # accounting bug, ours

    def _settle(self, start: int, pinned: str) -> tuple[Move, ...]:
        """Bring every tier from `start` on back under capacity, oldest entries first; `pinned` (the entry that
        just arrived, the most recent) never leaves: it fits its tier alone, so something older is always there."""
        origin: dict[str, Entry] = {}
        final: dict[str, Tier | None] = {}
        for i in range(start, len(TIERS)):
            t = TIERS[i]
            while self._used[t] > self._cap[t]:
                victim = self._pop_lru(t)
                if victim.seq_id == pinned:
                    raise AssertionError(f"{pinned} would evict itself from {t}")  # _target guarantees it fits
                self._take(victim.seq_id)
                origin.setdefault(victim.seq_id, victim)
                nxt = self._target(victim.size, i + 1)
                if nxt is None:
                    final[victim.seq_id] = None
                else:
                    self._insert(replace(victim, tier=TIERS[nxt]))
                    final[victim.seq_id] = TIERS[nxt]
        drops: list[Move] = []
        demotes: list[Move] = []
        for seq_id, e in origin.items():
            dst = final[seq_id]
            if dst is None:
                drops.append(Move(MoveKind.DROP, seq_id, e.version, e.size, e.tier, None))
            else:
                demotes.append(Move(MoveKind.DEMOTE, seq_id, e.version, e.size, e.tier, dst))
        # Deeper sources first: an L2 -> L3 move makes the room an L1 -> L2 move needs.
        demotes.sort(key=lambda m: -TIERS.index(m.src))
        self._drops += len(drops)
        self._demotions += len(demotes)
        self._bytes_moved += sum(m.size for m in demotes)
        return (*drops, *demotes)
