"""The storage interface of one KV tier. Implementations: `SharedMemoryStore` (L1), `ValkeyStore` (L2); LMCache or
Mooncake Store adapters implement the same four calls."""

from __future__ import annotations

from typing import Protocol


class KvStore(Protocol):
    name: str
    """`L1`, `L2`, ..."""

    async def put(self, key: str, blob: bytes) -> None: ...

    async def get(self, key: str) -> bytes | None: ...

    async def delete(self, key: str) -> None: ...

    async def keys(self) -> list[str]: ...
