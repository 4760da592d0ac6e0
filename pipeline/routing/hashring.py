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

    def walk(self, key: str) -> list[str]:
        """Distinct members in ring order starting at the key's position."""
        start = bisect.bisect(self._keys, stable_hash64(key)) % len(self._keys)
        seen: list[str] = []
        n = len(self._keys)
        for i in range(n):
            m = self._owners[(start + i) % n]
            if m not in seen:
                seen.append(m)
                if len(seen) == len(self.members):
                    break
        return seen

    def primary(self, key: str) -> str:
        start = bisect.bisect(self._keys, stable_hash64(key)) % len(self._keys)
        return self._owners[start]

    def lookup(self, key: str, accept: Callable[[str], bool] = lambda _m: True) -> str | None:
        """First member on the ring from the key's position that `accept`s, or None if none does."""
        for m in self.walk(key):
            if accept(m):
                return m
        return None
