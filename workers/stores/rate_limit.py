"""Per-tenant token rate limits (tokens per minute), shared by every gateway through Valkey.

A tenant's limit comes from its token's `tpm` claim, else from `gateway.tenants.{name}.tpm`; none: no limit. Each
interactive request is charged, at admission, its prompt tokens plus the output length the gateway expects (what
the batcher budgets for, pipeline/profiling.py), against the tenant's count for the current minute: a fixed window
per wall-clock minute (key `rf:tpm:{tenant}:{minute}`, kept two minutes). A request that would take the count over
the limit is refused with 429 and `Retry-After` the seconds left in the minute, and charges nothing; one that alone
is larger than the limit could never pass and is refused with 400, saying so. The check and the charge are one Lua
script (atomic across gateways). Batch-class requests are not charged: they run in the capacity interactive work
leaves idle, shared between tenants by the batchers' virtual token counters.
"""

from __future__ import annotations

import math

import redis.asyncio as aioredis

from streams import keys

_CHARGE = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local n = tonumber(ARGV[1])
if cur + n > tonumber(ARGV[2]) then return cur end
redis.call('INCRBY', KEYS[1], n)
redis.call('EXPIRE', KEYS[1], 120)
return -1
"""


class TokenRateLimiter:
    """`charge` a tenant's request against its tokens-per-minute limit."""

    def __init__(self, r: aioredis.Redis) -> None:
        self._script = r.register_script(_CHARGE)

    async def charge(self, tenant: str, tokens: int, limit: int, now_s: float) -> tuple[bool, int, int]:
        """(admitted, tokens already counted this minute, seconds until the minute ends)."""
        minute = int(now_s // 60)
        used = int(await self._script(keys=[keys.tenant_tpm(tenant, minute)], args=[max(0, tokens), limit]))
        left = max(1, math.ceil((minute + 1) * 60 - now_s))
        if used < 0:
            return True, 0, left
        return False, used, left
