"""Where the Batch API keeps its batches: records, line results and the runner's lease, in Valkey.

A batch is a hash `rf:batch:{id}` (streams/keys.py): its OpenAI record (`record`, pipeline/batch_state.py's `Batch`
as JSON), its line counts (`completed`, `failed`: incremented by the script that records a line, so `GET` shows
progress without rewriting the record), who created it (`tenant`, `user`, `models`, `trust_user`) and the token of
the task run expected next (`next`). Beside it, under the same hash tag: the ended lines (`:lines`, line index ->
its output- or error-file line, written once: HSETNX), the admitted ones (`:admitted`) and the runner's lease
(`:lease`). A tenant's batches are listed from a sorted set by creation time (`rf:batches:{sha256(tenant)}`). Every
key lives `completion window + batches.retention_s`.

Two writers move a batch's status: the API (a cancel) and its runner. Each move reads the record, applies
`Batch.moved` / `Batch.cancel` (the one transition table) and writes it back only if the record is still the one it
read (a compare-and-set script), else reads again: no race moves a batch backwards or out of a final status.

Who runs a batch (workers/control/batches.py) is decided here too: a task run may work on a batch only while it
holds the lease, and only if it carries the token the batch expects next (`claim`); a run hands the batch to the
next one by setting `next` and dropping the lease in one script (`hand_over`). A second delivery of a message that
was already handed on finds its token stale; one whose run died finds the token still current and resumes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis

from pipeline.batch_state import WINDOW_S, Batch
from pipeline.errors import RackflowError
from streams import keys

BATCH_ID = re.compile(r"^batch_[0-9a-f]{32}$")
"""Our batch ids (OpenAI's shape: `batch_` and an opaque suffix); anything else is unknown."""
LINE_NAMESPACE = uuid.UUID("5d0c64f2-6f57-4d38-9a55-0b7f1c2b8a31")
"""The uuid5 namespace of the lines' request ids: line i of batch B is always request uuid5(NS, "B/i")."""


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def line_request_id(batch_id: str, index: int) -> str:
    """The request id of a batch's line (0-based among its requests): the same in every run of its task, so a
    resumed run finds what an earlier one admitted."""
    return str(uuid.uuid5(LINE_NAMESPACE, f"{batch_id}/{index}"))


def tenant_hash(tenant: str) -> str:
    return hashlib.sha256(tenant.encode()).hexdigest()[:32]


class BatchNotFound(RackflowError, KeyError):
    """No such batch (never created, or its record expired)."""


@dataclass(frozen=True, slots=True)
class BatchOwner:
    """Who created a batch, as its lines are admitted: the tenant, the user they run as (a line's own `user` only
    where `trust_user`: the gateway runs without auth), and the models the creator's token allows (None: any)."""

    tenant: str
    user: str
    models: tuple[str, ...] | None = None
    trust_user: bool = False

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


@dataclass(frozen=True, slots=True)
class Admitted:
    """A line in the cluster: when it was admitted (wall ms) and its profiled max_tokens (its finish_reason)."""

    at_ms: float
    max_tokens: int


# -- scripts -------------------------------------------------------------------------------------------------------
_CAS = """
local cur = redis.call('HGET', KEYS[1], 'record')
if not cur then return -1 end
if cur ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'record', ARGV[2])
return 1
"""
"""Write the record (ARGV[2]) only if it is still the one read (ARGV[1]): 1 written, 0 changed meanwhile, -1 gone."""

_LINE = """
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""
"""Record a line once (KEYS[1] lines hash, KEYS[2] the batch) and count it (ARGV[3]: `completed` or `failed`)."""

_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 'gone' end
local held = redis.call('GET', KEYS[2])
if held and held ~= ARGV[2] then return 'busy' end
if redis.call('HGET', KEYS[1], 'next') ~= ARGV[1] then return 'stale' end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return 'ok'
"""

_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

_HAND_OVER = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'next', ARGV[2]) end
redis.call('DEL', KEYS[2])
return 1
"""
"""Set the token of the next run (ARGV[2]; empty: none) and drop the lease, if the caller (ARGV[1]) holds it."""


def _decode(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class BatchStore:
    """The batches of one cluster, on its Valkey (module docstring). `retention_s`: how long a batch's keys outlive
    its completion window."""

    def __init__(self, r: aioredis.Redis, retention_s: int) -> None:
        self.r = r
        self.retention_s = retention_s
        self._cas = r.register_script(_CAS)
        self._line = r.register_script(_LINE)
        self._claim = r.register_script(_CLAIM)
        self._renew = r.register_script(_RENEW)
        self._hand_over = r.register_script(_HAND_OVER)

    def ttl_s(self, batch: Batch) -> int:
        return WINDOW_S[batch.completion_window] + self.retention_s

    # -- records ---------------------------------------------------------------------------------------------------
    async def create(self, batch: Batch, owner: BatchOwner, token: str, created_ms: float | None = None) -> None:
        """Record a new batch (status `validating`), expecting its first run to carry `token`. `created_ms`: its
        creation to the millisecond, which orders the tenant's list (`created_at` is in seconds)."""
        key, ttl = keys.batch(batch.id), self.ttl_s(batch)
        index = keys.tenant_batches(tenant_hash(batch.tenant))
        # not one transaction: the record and the tenant's index hash to different slots on Redis Cluster (a record
        # whose index entry was not written is only missing from the list)
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(key, mapping={
            "record": json.dumps(batch.to_record()), "completed": 0, "failed": 0, "tenant": owner.tenant,
            "user": owner.user, "models": json.dumps(list(owner.models) if owner.models is not None else None),
            "trust_user": "1" if owner.trust_user else "0", "next": token,
        })
        pipe.expire(key, ttl)
        pipe.zadd(index, {batch.id: created_ms if created_ms is not None else batch.created_at * 1000.0})
        pipe.expire(index, ttl)
        await pipe.execute()

    async def remove(self, batch: Batch) -> None:
        """Forget a batch whose run could not be queued (its creation is answered with an error)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(keys.batch(batch.id))
        pipe.zrem(keys.tenant_batches(tenant_hash(batch.tenant)), batch.id)
        await pipe.execute()

    @staticmethod
    def _merged(raw: Any, completed: Any, failed: Any) -> Batch:
        b = Batch.from_record(json.loads(raw))
        return dataclasses.replace(b, completed=int(completed or 0), failed=int(failed or 0))

    async def get(self, batch_id: str) -> Batch | None:
        """The batch with its current line counts, or None."""
        raw, completed, failed = await self.r.hmget(keys.batch(batch_id), ["record", "completed", "failed"])
        return None if raw is None else self._merged(raw, completed, failed)

    async def owner(self, batch_id: str) -> BatchOwner:
        tenant, user, models, trust = await self.r.hmget(keys.batch(batch_id), ["tenant", "user", "models",
                                                                                "trust_user"])
        if tenant is None:
            raise BatchNotFound(batch_id)
        allowed = json.loads(models) if models is not None else None
        return BatchOwner(_decode(tenant), _decode(user or b""), tuple(allowed) if allowed is not None else None,
                          trust == b"1")

    async def list(self, tenant: str, limit: int, after: str | None = None) -> tuple[list[Batch], bool] | None:
        """The tenant's batches, newest first: at most `limit` after the batch `after` (None: from the newest), and
        whether more follow. None when `after` is not one of the tenant's batches."""
        index = keys.tenant_batches(tenant_hash(tenant))
        start = 0
        if after is not None:
            rank = await self.r.zrevrank(index, after)
            if rank is None:
                return None
            start = int(cast(int, rank)) + 1
        ids = [_decode(x) for x in await self.r.zrevrange(index, start, start + limit)]
        pipe = self.r.pipeline(transaction=False)
        for bid in ids:
            pipe.hmget(keys.batch(bid), ["record", "completed", "failed"])
        out: list[Batch] = []
        gone: list[str] = []
        for bid, (raw, completed, failed) in zip(ids, await pipe.execute(), strict=True):
            if raw is None:
                gone.append(bid)  # its record expired: drop it from the index too
            else:
                out.append(self._merged(raw, completed, failed))
        if gone:
            await self.r.zrem(index, *gone)
        return out[:limit], len(out) > limit

    async def update(self, batch_id: str, change: Callable[[Batch], Batch]) -> Batch:
        """Apply `change` to the batch as it is now and write the result, atomically (compare-and-set, again on a
        concurrent write). `change` raises (BatchTransitionError) to refuse, or returns its argument to write
        nothing. BatchNotFound when the batch is gone."""
        key = keys.batch(batch_id)
        while True:
            raw, completed, failed = await self.r.hmget(key, ["record", "completed", "failed"])
            if raw is None:
                raise BatchNotFound(batch_id)
            cur = self._merged(raw, completed, failed)
            new = change(cur)
            if new is cur:
                return cur
            written = int(await self._cas(keys=[key], args=[raw, json.dumps(new.to_record())]))
            if written == 1:
                return new
            if written < 0:
                raise BatchNotFound(batch_id)

    # -- lines -----------------------------------------------------------------------------------------------------
    async def record_lines(self, batch: Batch, lines: Iterable[tuple[int, bool, dict[str, Any]]]) -> int:
        """Record ended lines (index, ok, its output- or error-file line), each only if it has none yet; returns how
        many were new. A line's count (`completed` or `failed`) moves with it, in the same script."""
        items = list(lines)
        if not items:
            return 0
        ttl = self.ttl_s(batch)
        pipe = self.r.pipeline(transaction=False)
        for index, ok, line in items:
            await self._line(keys=[keys.batch_lines(batch.id), keys.batch(batch.id)],
                             args=[index, ("o" if ok else "e") + json.dumps(line), "completed" if ok else "failed",
                                   ttl], client=pipe)
        return sum(1 for x in await pipe.execute() if int(x) == 1)

    async def ended(self, batch_id: str) -> set[int]:
        return {int(k) for k in await self.r.hkeys(keys.batch_lines(batch_id))}

    async def lines(self, batch_id: str) -> dict[int, tuple[bool, bytes]]:
        """Every ended line: index -> (ok, its file line as JSON bytes)."""
        raw = await self.r.hgetall(keys.batch_lines(batch_id))
        out: dict[int, tuple[bool, bytes]] = {}
        for k, v in raw.items():
            b = v if isinstance(v, bytes) else str(v).encode()
            out[int(k)] = (b[:1] == b"o", b[1:])
        return out

    async def admitted(self, batch_id: str) -> dict[int, Admitted]:
        out = {}
        for k, v in (await self.r.hgetall(keys.batch_admitted(batch_id))).items():
            at, max_tokens = _decode(v).split(",")
            out[int(k)] = Admitted(float(at), int(max_tokens))
        return out

    async def mark_admitted(self, batch: Batch, entries: dict[int, Admitted]) -> None:
        if not entries:
            return
        key = keys.batch_admitted(batch.id)
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(key, mapping={i: f"{a.at_ms:.0f},{a.max_tokens}" for i, a in entries.items()})
        pipe.expire(key, self.ttl_s(batch))
        await pipe.execute()

    # -- who runs it -----------------------------------------------------------------------------------------------
    async def claim(self, batch_id: str, token: str, holder: str, lease_ms: int) -> str:
        """`ok` (the caller holds the lease now), `busy` (another run holds it: wait for it), `stale` (a later run
        was handed the batch: this message is a second delivery) or `gone` (no such batch)."""
        return _decode(await self._claim(keys=[keys.batch(batch_id), keys.batch_lease(batch_id)],
                                         args=[token, holder, lease_ms]))

    async def renew(self, batch_id: str, holder: str, lease_ms: int) -> bool:
        """Extend the caller's lease; False when it lost it (it ran out while the caller stalled)."""
        return int(await self._renew(keys=[keys.batch_lease(batch_id)], args=[holder, lease_ms])) == 1

    async def hand_over(self, batch_id: str, holder: str, next_token: str = "") -> bool:
        """Name the run that comes next (`next_token`; empty: none) and drop the lease, if the caller holds it."""
        return int(await self._hand_over(keys=[keys.batch(batch_id), keys.batch_lease(batch_id)],
                                         args=[holder, next_token])) == 1
