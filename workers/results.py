"""Final results, exactly once per request (ARCHITECTURE §6).

`ResultWriter.write` runs one Lua script that sets the marker `{rf:results}:done:<id>` with NX and, only if it was
not set, appends the ResultEvent to `rf:results`; both keys hash to one slot, so this also holds on Redis Cluster.
A duplicate delivery, a redelivered batch or a migrated sequence finishing twice can never add a second result.
The client's stream `rf:out:{id}` gets the result as its last entry (after its tokens) and expires after a TTL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis.asyncio as aioredis

from pipeline.events import ResultEvent, TokenEvent
from streams import codec, keys
from streams.runner import minid_for

log = logging.getLogger(__name__)

_EWMA_LUA = """
local v = tonumber(ARGV[1])
local old = redis.call('GET', KEYS[1])
if old then v = tonumber(ARGV[2]) * v + (1 - tonumber(ARGV[2])) * tonumber(old) end
redis.call('SET', KEYS[1], tostring(v), 'EX', ARGV[3])
return tostring(v)
"""

_FINAL_LUA = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
  redis.call('XADD', KEYS[2], 'MINID', '~', ARGV[3], '*', 'v', ARGV[4], 't', ARGV[5], 'd', ARGV[6])
  return 1
end
return 0
"""


class ResultWriter:
    def __init__(
        self,
        r: aioredis.Redis,
        now_ms: Callable[[], float],
        retention_ms: int,
        out_ttl_s: int = 3600,
        ewma_alpha: float = 0.2,
        ewma_ttl_s: int = 30 * 86_400,
    ) -> None:
        self.r = r
        self.ewma_alpha = ewma_alpha
        self.ewma_ttl_s = ewma_ttl_s
        self._ewma = r.register_script(_EWMA_LUA)
        self.now_ms = now_ms
        self.retention_ms = retention_ms
        self.out_ttl_s = out_ttl_s
        self._script = r.register_script(_FINAL_LUA)
        self.marker_ttl_s = max(60, retention_ms // 1000)

    async def write(self, result: ResultEvent) -> bool:
        """Write the final result; False when one was already written for this request (nothing is added)."""
        f = codec.encode(result)
        written = await self._script(
            keys=[keys.result_done(result.request_id), keys.RESULTS],
            args=[
                result.version,
                self.marker_ttl_s,
                minid_for(self.now_ms(), self.retention_ms),
                f[b"v"],
                f[b"t"],
                f[b"d"],
            ],
        )
        if written and result.status == "ok":
            # the user's output-length history feeds the next output estimate (ARCHITECTURE §2)
            await self._ewma(
                keys=[keys.user_out_ewma(result.tenant, result.user_id)],
                args=[result.out_tokens, self.ewma_alpha, self.ewma_ttl_s],
            )
        if not written:
            log.info("request %s v%d: final result already written; duplicate dropped", result.request_id,
                     result.version)
        # Always end the client stream: if an earlier attempt wrote the result but died before this point, the
        # client would otherwise wait forever. A client stops at the first result entry, so a repeat is harmless.
        out = keys.request_out(result.request_id)
        pipe = self.r.pipeline(transaction=False)
        pipe.xadd(out, f)  # type: ignore[arg-type]
        pipe.expire(out, self.out_ttl_s)
        await pipe.execute()
        return bool(written)

    async def is_done(self, request_id: str) -> bool:
        return bool(await self.r.exists(keys.result_done(request_id)))

    async def done_among(self, request_ids: list[str]) -> set[str]:
        if not request_ids:
            return set()
        pipe = self.r.pipeline(transaction=False)
        for rid in request_ids:
            pipe.exists(keys.result_done(rid))
        flags = await pipe.execute()
        return {rid for rid, f in zip(request_ids, flags, strict=True) if f}

    async def stream_tokens(self, events: list[TokenEvent]) -> None:
        """Append token chunks to their clients' streams in one round trip."""
        if not events:
            return
        pipe = self.r.pipeline(transaction=False)
        for ev in events:
            out = keys.request_out(ev.request_id)
            pipe.xadd(out, codec.encode(ev))  # type: ignore[arg-type]
            pipe.expire(out, self.out_ttl_s)
        await pipe.execute()
