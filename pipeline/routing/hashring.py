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
        for m in self.walk(key):
            if accept(m):
                return m
        return None
