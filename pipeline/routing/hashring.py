"""Consistent hash ring with virtual nodes, and bounded-load lookup.

Owns the map from a key (user_id) to a member (rack). Adding or removing one of n members moves only about 1/n of
the keys; `lookup` walks the ring past members the caller rejects (unhealthy, over the load bound).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Iterable


def stable_hash64(data: str) -> int:
    """64-bit hash that is the same in every process and Python version (unlike `hash()`)."""
    return int.from_bytes(hashlib.blake2b(data.encode("utf-8"), digest_size=8).digest(), "big")


WALK_CACHE = 50_000
"""Keys whose ring order a HashRing remembers (then it starts over): 50 k users x a tuple of the racks, about
65 MB at 160 racks."""
START_CACHE = 200_000
"""Keys whose start position a HashRing remembers (then it starts over): a user's requests hash their id once, not
each time (about 30 MB full)."""


class HashRing:
    def __init__(self, members: Iterable[str], virtual_nodes: int = 160) -> None:
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        self.members: tuple[str, ...] = tuple(sorted(set(members)))
        if not self.members:
            raise ValueError("a hash ring needs at least one member")
        points = sorted(
            (stable_hash64(f"{m}#{i}"), m) for m in self.members for i in range(virtual_nodes)
        )
        self._keys = [p for p, _ in points]
        self._owners = [m for _, m in points]
        self._walks: dict[str, tuple[str, ...]] = {}
        self._starts: dict[str, int] = {}
        self._points_of: dict[str, list[int]] = {m: [] for m in self.members}
        """Each member's ring positions (indexes into the sorted points), ascending."""
        for i, m in enumerate(self._owners):
            self._points_of[m].append(i)

    def start(self, key: str) -> int:
        """The ring position a key starts its walk at."""
        starts = self._starts
        pos = starts.get(key, -1)
        if pos < 0:
            if len(starts) >= START_CACHE:
                starts.clear()
            pos = starts[key] = bisect.bisect(self._keys, stable_hash64(key)) % len(self._keys)
        return pos

    def owner_at(self, position: int) -> str:
        return self._owners[position]

    def distance(self, position: int, member: str) -> int:
        """How many ring points a walk from `position` passes before it reaches `member` (its ring order: members
        sorted by distance are `walk`'s order). O(log virtual_nodes), no walk."""
        idx = self._points_of[member]
        j = bisect.bisect_left(idx, position)
        return idx[j] - position if j < len(idx) else idx[0] + len(self._owners) - position

    def first_from(self, position: int, accept: Callable[[str], bool]) -> str | None:
        """The first member from `position` on that `accept`s (the walk stops there: usually the first point)."""
        owners = self._owners
        n = len(owners)
        tried: set[str] = set()
        for i in range(position, position + n):
            m = owners[i - n] if i >= n else owners[i]
            if m in tried:
                continue
            if accept(m):
                return m
            tried.add(m)
            if len(tried) == len(self.members):
                break
        return None

    def order(self, key: str) -> tuple[str, ...]:
        """`walk` without the copy (the remembered tuple itself)."""
        cached = self._walks.get(key)
        if cached is None:
            cached = self._walk(key)
            if len(self._walks) >= WALK_CACHE:
                self._walks.clear()
            self._walks[key] = cached
        return cached

    def walk(self, key: str) -> list[str]:
        """Distinct members in ring order starting at the key's position (a fresh list; the order is remembered
        per key, up to WALK_CACHE keys: a ring never changes, and a cluster routes the same users again and
        again, so a 160-rack ring is walked once per user, not once per request)."""
        return list(self.order(key))

    def _walk(self, key: str) -> tuple[str, ...]:
        start = bisect.bisect(self._keys, stable_hash64(key)) % len(self._keys)
        owners = self._owners
        n = len(owners)
        want = len(self.members)
        seen: dict[str, None] = {}
        for i in range(start, start + n):
            m = owners[i % n] if i >= n else owners[i]
            if m not in seen:
                seen[m] = None
                if len(seen) == want:
                    break
        return tuple(seen)

    def primary(self, key: str) -> str:
        start = bisect.bisect(self._keys, stable_hash64(key)) % len(self._keys)
        return self._owners[start]

    def lookup(self, key: str, accept: Callable[[str], bool] = lambda _m: True) -> str | None:
        """First member on the ring from the key's position that `accept`s, or None if none does."""
        return self.first_from(self.start(key), accept)
