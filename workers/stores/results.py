"""Final results, exactly once per request (ARCHITECTURE §6).

`ResultWriter.write` runs one Lua script that sets the marker `{rf:results}:done:<id>` with NX and, only if it was
not set, appends the ResultEvent to `rf:results`; both keys hash to one slot, so this also holds on Redis Cluster.
A duplicate delivery, a redelivered batch or a migrated sequence finishing twice can never add a second result.
The client's stream `rf:out:{id}` gets the result as its last entry (after its tokens) and expires after a TTL.

A request admitted by an HTTP gateway names that gateway's reply stream (`reply_to`, `rf:gw:{ID}:out`): every token
chunk and result written here is appended there too, in the same round trip, so that the gateway reads all its
open requests with one connection (workers/stores/replies.py). The per-request stream stays the durable copy. A
`reply_to` that is not a gateway reply stream is ignored (it comes from the stream, and a writer must not be made to
append anywhere else); a reply stream that has expired (its gateway stopped) is not re-created (NOMKSTREAM).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from pipeline.events import RequestEvent, ResultEvent, TokenEvent
from streams import codec, keys
from streams.runner import minid_for
from workers.shell import metrics
from workers.shell.runtime import WALL

log = logging.getLogger(__name__)


def _reply(pipe: object, ev: TokenEvent | ResultEvent, fields: dict[bytes, bytes], at: set[int], minid: str) -> None:
    """Queue the copy of `ev` for its gateway's reply stream on `pipe` (nothing without a valid `reply_to`), and
    note its position in `at`: a copy that fails must not fail the write (see `_execute`). The stream keeps
    `keys.GATEWAY_REPLIES_KEEP_MS` of entries (`minid`): its gateway reads them as they come, and one that falls
    further behind reads a quiet request from the request's own stream (its sweep)."""
    if ev.reply_to and keys.is_gateway_replies(ev.reply_to):
        at.add(len(pipe))  # type: ignore[arg-type]
        pipe.xadd(ev.reply_to, fields, minid=minid, approximate=True, nomkstream=True)  # type: ignore[attr-defined]


async def _execute(pipe: object, replies: set[int], scripts: dict[int, tuple[object, list[object]]] | None = None,
                   r: aioredis.Redis | None = None) -> list[object]:
    """Run `pipe`; an error at a reply copy's position is logged and counted, not raised: `reply_to` comes from the
    stream, and a key of that name holding another type (WRONGTYPE) must not stop a worker or a router. The
    per-request stream is the durable copy, and the gateway catches up from it. Any other error is raised.

    `scripts`: the positions of EVALSHA commands queued with `_evalsha`, with their script and arguments. A script
    that the server does not have (NOSCRIPT: a restarted Valkey, a SCRIPT FLUSH) did not run; it is loaded and run
    again alone, so each still runs exactly once. Without this, redis-py's pipeline asks SCRIPT EXISTS before every
    pipeline that carries a script: 1.4 extra commands per request under `rackflow bench gateway`."""
    if not replies and not scripts:
        return await pipe.execute()  # type: ignore[attr-defined,no-any-return]
    out: list[object] = await pipe.execute(raise_on_error=False)  # type: ignore[attr-defined]
    if scripts and r is not None:
        missing = [i for i in scripts if isinstance(out[i], NoScriptError)]
        if missing:
            again = r.pipeline(transaction=False)
            for i in missing:
                script, argv = scripts[i]
                again.execute_command("EVAL", script.script, *argv)  # type: ignore[attr-defined]
            for i, x in zip(missing, await again.execute(raise_on_error=False), strict=True):
                out[i] = x
            bodies = {script.script for script, _ in scripts.values()}  # type: ignore[attr-defined]
            for body in bodies:  # each once: the next pipeline's EVALSHA finds them
                await r.script_load(body)
    for i, x in enumerate(out):
        if isinstance(x, Exception):
            if i not in replies:
                raise x
            log.warning("a gateway reply copy failed (the request's own stream has it): %s", x)
            metrics.REPLY_COPY_ERRORS.inc()
            out[i] = None
    return out


def _evalsha(pipe: object, script: object, keys_: list[str], args: list[object],
             scripts: dict[int, tuple[object, list[object]]]) -> None:
    """Queue `script` on `pipe` as a plain EVALSHA (no SCRIPT EXISTS first), noting it for `_execute`'s NOSCRIPT
    retry."""
    argv: list[object] = [len(keys_), *keys_, *args]
    scripts[len(pipe)] = (script, argv)  # type: ignore[arg-type]
    pipe.execute_command("EVALSHA", script.sha, *argv)  # type: ignore[attr-defined]


_EWMA_LUA = """
local v = tonumber(ARGV[1])
local old = redis.call('GET', KEYS[1])
if old then v = tonumber(ARGV[2]) * v + (1 - tonumber(ARGV[2])) * tonumber(old) end
redis.call('SET', KEYS[1], tostring(v), 'EX', ARGV[3])
return tostring(v)
"""

# A client stream's first entry and its TTL in one command, and its copy on the gateway's reply stream (KEYS[2],
# when there is one: NOMKSTREAM, trimmed by MINID; a copy that fails, WRONGTYPE, is reported, never raised).
_FIRST_LUA = """
redis.call('XADD', KEYS[1], '*', 'v', ARGV[1], 't', ARGV[2], 'd', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
if KEYS[2] then
  local ok = redis.pcall('XADD', KEYS[2], 'NOMKSTREAM', 'MINID', '~', ARGV[5], '*', 'v', ARGV[1], 't', ARGV[2],
                         'd', ARGV[3])
  if type(ok) == 'table' and ok.err then return 2 end
end
return 1
"""

_FINAL_LUA = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
  redis.call('XADD', KEYS[2], 'MINID', '~', ARGV[3], '*', 'v', ARGV[4], 't', ARGV[5], 'd', ARGV[6])
  return 1
end
return 0
"""


# One round trip for a whole finish on a single server: the exactly-once result, the user's EWMA, the last token
# chunk and the end of the client stream, and their copies on the gateway's reply stream (KEYS[5], when there is
# one). Returns 1 when the result was written here (0: a duplicate), plus 2 when a reply copy failed. (On Redis
# Cluster these keys live in different slots: write_many then takes the two-phase path of slot-safe commands.)
_FINISH_LUA = """
local written = 0
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
  redis.call('XADD', KEYS[2], 'MINID', '~', ARGV[3], '*', 'v', ARGV[4], 't', ARGV[5], 'd', ARGV[6])
  written = 1
  if ARGV[10] == '1' then
    local v = tonumber(ARGV[11])
    local old = redis.call('GET', KEYS[4])
    if old then v = tonumber(ARGV[8]) * v + (1 - tonumber(ARGV[8])) * tonumber(old) end
    redis.call('SET', KEYS[4], tostring(v), 'EX', ARGV[9])
  end
end
if ARGV[12] ~= '' then redis.call('XADD', KEYS[3], '*', 'v', ARGV[12], 't', ARGV[13], 'd', ARGV[14]) end
redis.call('XADD', KEYS[3], '*', 'v', ARGV[4], 't', ARGV[5], 'd', ARGV[6])
redis.call('EXPIRE', KEYS[3], ARGV[7])
local failed = 0
if KEYS[5] then
  -- the gateway's copy: the last chunk, then the result
  if ARGV[12] ~= '' then
    local ok = redis.pcall('XADD', KEYS[5], 'NOMKSTREAM', 'MINID', '~', ARGV[15], '*', 'v', ARGV[12], 't', ARGV[13],
                           'd', ARGV[14])
    if type(ok) == 'table' and ok.err then failed = 2 end
  end
  local ok = redis.pcall('XADD', KEYS[5], 'NOMKSTREAM', 'MINID', '~', ARGV[15], '*', 'v', ARGV[4], 't', ARGV[5],
                         'd', ARGV[6])
  if type(ok) == 'table' and ok.err then failed = 2 end
end
return written + failed
"""


TTL_DUE_MAX = 100_000
"""`ResultWriter` remembers when to renew at most this many request streams' TTLs."""


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
        self._finish = r.register_script(_FINISH_LUA)
        self._first = r.register_script(_FIRST_LUA)
        from redis.asyncio.cluster import RedisCluster

        self.cluster = isinstance(r, RedisCluster)
        self.now_ms = now_ms
        self.retention_ms = retention_ms
        self.out_ttl_s = out_ttl_s
        self._script = r.register_script(_FINAL_LUA)
        self.marker_ttl_s = max(60, retention_ms // 1000)
        self._ttl_due: dict[str, float] = {}
        """Per request with chunks streamed by `stream_tokens`: when its stream's TTL is next renewed (wall ms)."""

    def _reply_minid(self) -> str:
        return minid_for(self.now_ms(), keys.GATEWAY_REPLIES_KEEP_MS)

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
        reply_minid = self._reply_minid()
        pipe = self.r.pipeline(transaction=False)
        rep: set[int] = set()
        pipe.xadd(out, f)  # type: ignore[arg-type]
        pipe.expire(out, self.out_ttl_s)
        _reply(pipe, result, f, rep, reply_minid)
        await _execute(pipe, rep)
        metrics.observe_results([result], [bool(written)])
        return bool(written)

    async def write_many(self, results: list[ResultEvent], tokens: list[TokenEvent]) -> list[bool]:
        """Token chunks, then final results, for many requests in two round trips (a worker's whole step):
        the tokens and the exactly-once result scripts first, then the EWMA updates of the results that were
        written and the end of each client stream."""
        if not results and not tokens:
            return []
        for r in results:
            self._ttl_due.pop(r.request_id, None)
        if not self.cluster:
            return await self._write_many_single(results, tokens)
        minid = minid_for(self.now_ms(), self.retention_ms)
        reply_minid = self._reply_minid()
        pipe = self.r.pipeline(transaction=False)
        rep: set[int] = set()
        expiring: set[str] = set()
        n_replies = 0
        for ev in tokens:
            out = keys.request_out(ev.request_id)
            tf = codec.encode(ev)
            pipe.xadd(out, tf)  # type: ignore[arg-type]
            if ev.index == 0:  # the stream is new: give it its TTL once (XADD keeps an existing TTL)
                pipe.expire(out, self.out_ttl_s)
                expiring.add(ev.request_id)
            if ev.reply_to and keys.is_gateway_replies(ev.reply_to):
                _reply(pipe, ev, tf, rep, reply_minid)
                n_replies += 1
        encoded = [codec.encode(r) for r in results]
        for r, f in zip(results, encoded, strict=True):
            # A cluster pipeline refuses EVALSHA (the script may not be loaded on every node): EVAL with the
            # body, routed by its keys' slot ({rf:results}).
            pipe.execute_command("EVAL", _FINAL_LUA, 2, keys.result_done(r.request_id), keys.RESULTS,
                                 r.version, self.marker_ttl_s, minid, f[b"v"], f[b"t"], f[b"d"])
        replies = await _execute(pipe, rep)
        written = [bool(x) for x in replies[len(tokens) + len(expiring) + n_replies:]]
        pipe = self.r.pipeline(transaction=False)
        rep = set()
        for r, f, w in zip(results, encoded, written, strict=True):
            if w and r.status == "ok":
                pipe.execute_command("EVAL", _EWMA_LUA, 1, keys.user_out_ewma(r.tenant, r.user_id),
                                     r.out_tokens, self.ewma_alpha, self.ewma_ttl_s)
            elif not w:
                log.info("request %s v%d: final result already written; duplicate dropped", r.request_id, r.version)
            out = keys.request_out(r.request_id)
            pipe.xadd(out, f)  # type: ignore[arg-type]
            pipe.expire(out, self.out_ttl_s)  # also covers a result whose stream had no token chunk
            _reply(pipe, r, f, rep, reply_minid)
        if results:
            await _execute(pipe, rep)
        metrics.observe_results(results, written)
        return written

    async def _write_many_single(self, results: list[ResultEvent], tokens: list[TokenEvent]) -> list[bool]:
        """One pipeline on a single server. A request's chunks and result are copied to its gateway's reply stream
        inside the scripts that write them (its first chunk, its finish): one command per request instead of one
        per copy. Per request, the reply stream gets every chunk before the result, as the request's own stream."""
        minid = minid_for(self.now_ms(), self.retention_ms)
        reply_minid = self._reply_minid()
        finishing = {r.request_id for r in results}
        last_chunk = {t.request_id: t for t in tokens if t.request_id in finishing}
        pipe = self.r.pipeline(transaction=False)
        rep: set[int] = set()
        scripts: dict[int, tuple[object, list[object]]] = {}
        copied: list[int] = []
        """Positions of scripts that also copy to a reply stream (their reply says whether the copy failed)."""
        for ev in tokens:
            if ev.request_id in finishing:
                continue  # goes out inside the finish script, right before the result
            f = codec.encode(ev)
            out = keys.request_out(ev.request_id)
            if ev.index == 0:
                reply = [ev.reply_to] if ev.reply_to and keys.is_gateway_replies(ev.reply_to) else []
                if reply:
                    copied.append(len(pipe))
                _evalsha(pipe, self._first, [out, *reply],
                         [f[b"v"], f[b"t"], f[b"d"], self.out_ttl_s, reply_minid], scripts)
            else:
                _reply(pipe, ev, f, rep, reply_minid)  # the gateway's copy first, as the finish script orders it
                pipe.xadd(out, f)  # type: ignore[arg-type]
        n_before = len(pipe.command_stack)
        for r in results:
            f = codec.encode(r)
            chunk = last_chunk.get(r.request_id)
            cf = codec.encode(chunk) if chunk is not None else {b"v": b"", b"t": b"", b"d": b""}
            reply = [r.reply_to] if r.reply_to and keys.is_gateway_replies(r.reply_to) else []
            if reply:
                copied.append(len(pipe))
            _evalsha(pipe, self._finish,
                     [keys.result_done(r.request_id), keys.RESULTS, keys.request_out(r.request_id),
                      keys.user_out_ewma(r.tenant, r.user_id), *reply],
                     [r.version, self.marker_ttl_s, minid, f[b"v"], f[b"t"], f[b"d"], self.out_ttl_s,
                      self.ewma_alpha, self.ewma_ttl_s, "1" if r.status == "ok" else "0", r.out_tokens,
                      cf[b"v"], cf[b"t"], cf[b"d"], reply_minid], scripts)
        replies = await _execute(pipe, rep, scripts, self.r)
        for i in copied:
            if isinstance(replies[i], int) and replies[i] >= 2:  # type: ignore[operator]
                log.warning("a gateway reply copy failed (the request's own stream has it)")
                metrics.REPLY_COPY_ERRORS.inc()
        written = [bool(int(x) & 1) for x in replies[n_before:n_before + len(results)]]  # type: ignore[call-overload]
        metrics.observe_results(results, written)
        for r, w in zip(results, written, strict=True):
            if not w:
                log.info("request %s v%d: final result already written; duplicate dropped", r.request_id, r.version)
        return written

    async def is_done(self, request_id: str) -> bool:
        return bool(await self.r.exists(keys.result_done(request_id)))

    async def done_among(self, request_ids: list[str]) -> set[str]:
        if not request_ids:
            return set()
        # every marker hashes to the {rf:results} slot: one MGET, also on Redis Cluster
        values = await self.r.mget([keys.result_done(rid) for rid in request_ids])
        return {rid for rid, v in zip(request_ids, values, strict=True) if v is not None}

    async def done_and_cancelled(self, request_ids: list[str]) -> tuple[set[str], set[str]]:
        """The requests that already have their final result, and those that were cancelled (their cancellation
        marker is set): both kinds of marker in one MGET (they share the {rf:results} slot)."""
        if not request_ids:
            return set(), set()
        n = len(request_ids)
        values = await self.r.mget([keys.result_done(rid) for rid in request_ids]
                                   + [keys.request_cancelled(rid) for rid in request_ids])
        done = {rid for rid, v in zip(request_ids, values[:n], strict=True) if v is not None}
        cancelled = {rid for rid, v in zip(request_ids, values[n:], strict=True) if v is not None}
        return done, cancelled

    async def stream_tokens(self, events: list[TokenEvent]) -> None:
        """Append token chunks to their clients' streams in one round trip."""
        if not events:
            return
        reply_minid = self._reply_minid()
        now = self.now_ms()
        if len(self._ttl_due) > TTL_DUE_MAX:  # requests that ended without a result here: forget, renew again
            self._ttl_due.clear()
        pipe = self.r.pipeline(transaction=False)
        rep: set[int] = set()
        for ev in events:
            out = keys.request_out(ev.request_id)
            f = codec.encode(ev)
            pipe.xadd(out, f)  # type: ignore[arg-type]
            # XADD keeps a stream's TTL: renewed at its first chunk and then every quarter of the TTL, not at every
            # chunk (the result renews it too)
            due = self._ttl_due.get(ev.request_id)
            if ev.index == 0 or due is None or now >= due:
                pipe.expire(out, self.out_ttl_s)
                self._ttl_due[ev.request_id] = now + self.out_ttl_s * 250.0
            _reply(pipe, ev, f, rep, reply_minid)
        await _execute(pipe, rep)


def error_result(req: RequestEvent, message: str, node: str = "", rack: str = "") -> ResultEvent:
    """The final `error` result of a request refused before any node ran it (no route, no rack serves its model):
    `rack` defaults to the one it was routed to."""
    return ResultEvent.of(req, "error", node, rack or (req.rack or ""), WALL.now_ms(), error=message, routed_ms=0.0)
