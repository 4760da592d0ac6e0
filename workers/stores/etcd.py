"""etcd store: the node registry and sequence ownership behind our own interface.

One concern in one file (over 500 lines on purpose): every etcd call rackflow makes, with its failover over the
members and its error translation; nothing else is here.

Owns the translation of `aetcd` calls and errors into rackflow's: a node registers `/rackflow/nodes/{id}` under a
lease it keeps alive, so a worker killed with -9 disappears from the registry when its lease expires; readers list
the registered nodes with their state. Library errors become EtcdUnavailable (retryable) or EtcdStoreError.

An etcd URL names one endpoint (`http://HOST:PORT`) or several members of one cluster, comma-separated
(`http://h1:p1,http://h2:p2,http://h3:p3`). With several, `etcd_client` returns a `FailoverClient`: it talks to one
member at a time and, when that member is unreachable, times out or has no leader, moves on to the next and retries
the call (bounded); leases are cluster-wide, so a lease's keep-alive simply continues on the next member. When no
member answers (quorum lost: a majority is down), a call fails within about `retry_s` + `timeout` seconds with
EtcdUnavailable naming the endpoints it tried. Reads are linearizable, so they fail without a quorum too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import urlparse

import aetcd
import aetcd.exceptions as aex
import aetcd.leases
import aetcd.rpc
import aetcd.transactions

from pipeline.backoff import ExponentialBackoff, Retrying
from pipeline.errors import RackflowError
from pipeline.sequences import NodeState
from streams import keys

log = logging.getLogger(__name__)


class EtcdStoreError(RackflowError):
    """An etcd operation was refused (bad argument, precondition, auth)."""


class EtcdUnavailable(EtcdStoreError):
    """etcd is unreachable or timed out (no quorum, server down): retry with backoff."""

    retryable = True


def _translate(e: Exception) -> EtcdStoreError:
    if isinstance(e, EndpointsExhausted):
        return EtcdUnavailable(str(e))
    if isinstance(e, aex.ConnectionFailedError | aex.ConnectionTimeoutError | aex.InternalError):
        return EtcdUnavailable(f"etcd unavailable: {type(e).__name__}: {e}")
    return EtcdStoreError(f"etcd error: {type(e).__name__}: {e}")


def parse_etcd_url(url: str) -> tuple[str, int]:
    """The one endpoint of `url` (`http://HOST:PORT`); a list of several is refused (see parse_etcd_urls)."""
    if "," in url:
        raise ValueError(f"etcd URL {url!r} names several endpoints; use parse_etcd_urls / etcd_client for it")
    u = urlparse(url if "://" in url else f"http://{url}")
    if not u.hostname or not u.port:
        raise ValueError(f"etcd URL {url!r} must look like http://HOST:PORT")
    return u.hostname, u.port


def parse_etcd_urls(url: str) -> list[tuple[str, int]]:
    """The endpoints of `url`: one `http://HOST:PORT`, or several comma-separated (`http://h1:p1,http://h2:p2`,
    the scheme optional on each), in order and without repeats."""
    out: list[tuple[str, int]] = []
    for part in url.split(","):
        part = part.strip()
        if not part:
            continue
        ep = parse_etcd_url(part)
        if ep not in out:
            out.append(ep)
    if not out:
        raise ValueError(f"etcd URL {url!r} names no endpoint; expected http://HOST:PORT[,http://HOST:PORT...]")
    return out


class EndpointsExhausted(aex.ConnectionFailedError, RackflowError):
    """No endpoint of a multi-endpoint etcd URL answered a call: the cluster has lost its quorum, or every listed
    member is unreachable. An aetcd ConnectionFailedError, so every `except aex.ClientError` translates it."""

    retryable = True


class _LeaderRequiredClient(aetcd.Client):
    """An aetcd.Client whose calls carry `hasleader: true` (etcd's WithRequireLeader): a member that has no leader
    (no quorum, or an election in progress) refuses at once with `etcdserver: no leader` instead of holding the
    call until its deadline, so the failover client moves on to another member, or gives up, quickly."""

    async def connect(self) -> None:
        await super().connect()
        if self.metadata is None:  # set by connect() only with username/password auth
            self.metadata = (("hasleader", "true"),)


# Reconnect to a restarted member within about a second (gRPC's default backoff grows to 2 minutes).
_GRPC_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
}


_RETRY_INTERNAL = frozenset({
    "get", "get_prefix", "get_range", "get_all", "put", "delete", "delete_prefix", "delete_range", "lease",
    "refresh_lease", "revoke_lease", "get_lease_info", "status",
})
"""Calls retried on the next member after an INTERNAL status too: gRPC core reports a stream or connection that
breaks mid-call (a member killed or restarting, the lease keep-alive stream above all) as INTERNAL ("Internal error
from Core"), not UNAVAILABLE. These calls are idempotent; a compare-and-swap transaction is not retried on it."""


ROUND_BACKOFF = ExponentialBackoff(base=0.1, cap=1.0)
"""Between two rounds over every member that none answered: 0.1 s doubling to 1 s (an election takes 1-2 s)."""


class FailoverClient:
    """The calls of aetcd.Client that rackflow uses, over several members of one etcd cluster.

    Calls go to the current member. One that fails with ConnectionFailedError (refused, `no leader`),
    ConnectionTimeoutError or (idempotent calls only, see _RETRY_INTERNAL) InternalError makes the next member
    current and is retried there (each retry waits at most
    `failover_timeout_s` for its answer); after a round over every member without an answer it waits (0.1 s,
    doubling to 1 s) and starts another round, until `retry_s` has passed since the call began: then it raises
    EndpointsExhausted listing each endpoint's last error. Any other error (bad
    argument, precondition) is raised at once. A retried write may have been applied by the member that timed out:
    puts and deletes are idempotent, compare-and-swap transactions then fail their compare, and a lease granted
    twice leaves one unused lease that expires by itself.

    `lease()` returns leases bound to this client, so `Lease.refresh()` / `revoke()` fail over as well: lease ids
    are cluster-wide, and a keep-alive continues on whichever member is current. Attributes not wrapped here (watch,
    lock, ...) are those of the current member's client, without failover.
    """

    def __init__(self, endpoints: list[tuple[str, int]], timeout: int = 5, retry_s: float = 4.0,
                 failover_timeout_s: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("FailoverClient needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.retry_s = retry_s
        self.failover_timeout_s = min(float(timeout), failover_timeout_s)
        """Deadline of the attempts after a call's first failure (the first has `timeout`): a follower that still
        believes in a dead leader holds a write until its deadline, and the election that ends this takes ~1-2 s."""
        self._clients = [_LeaderRequiredClient(host=h, port=p, timeout=timeout, options=dict(_GRPC_OPTIONS))
                         for h, p in self.endpoints]
        self._current = 0
        self.transactions = self._clients[0].transactions
        self.switches = 0
        """How many times the current endpoint changed (tests and logs)."""
        self._answering = True

    @property
    def endpoint(self) -> str:
        """URL of the member calls go to now."""
        return self._url(self._current)

    def _url(self, i: int) -> str:
        h, p = self.endpoints[i]
        return f"http://{h}:{p}"

    async def _call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        n = len(self._clients)
        start = time.monotonic()
        deadline = start + self.retry_s
        tried: dict[str, str] = {}
        attempts = 0
        rounds = Retrying(ROUND_BACKOFF)
        while True:
            first = self._current
            for k in range(n):
                i = (first + k) % n
                # the cluster is in trouble (this call or the last one failed somewhere): do not wait the full
                # timeout on each member
                limit = self.failover_timeout_s if attempts or not self._answering else None
                try:
                    result = await asyncio.wait_for(getattr(self._clients[i], op)(*args, **kwargs), limit)
                except TimeoutError:
                    e = aex.ConnectionTimeoutError(f"no answer within {limit or self.timeout:g}s")
                    attempts += 1
                    tried[self._url(i)] = f"{type(e).__name__}: {e}"
                    self._moved_off(i, e)
                    continue
                except (aex.ConnectionFailedError, aex.ConnectionTimeoutError, aex.InternalError) as e:
                    if isinstance(e, aex.InternalError) and op not in _RETRY_INTERNAL:
                        raise
                    attempts += 1
                    tried[self._url(i)] = f"{type(e).__name__}: {str(e)[:160]}"
                    self._moved_off(i, e)
                    continue
                if not self._answering:
                    self._answering = True
                    log.info("etcd endpoint %s answers (after %d failed attempts of this call)", self._url(i),
                             attempts)
                return result
            left = deadline - time.monotonic()
            if left <= 0:
                raise EndpointsExhausted(
                    f"etcd unavailable: no endpoint answered {op} in {time.monotonic() - start:.1f}s "
                    f"({attempts} attempts): quorum lost (a majority of the members down or cut off) or every "
                    "endpoint unreachable; tried " + "; ".join(f"{u} ({why})" for u, why in tried.items())
                )
            await asyncio.sleep(min(rounds.next_delay(), left))

    def _moved_off(self, i: int, e: Exception) -> None:
        if self._current != i:  # another call has moved on already
            return
        self._current = (i + 1) % len(self._clients)
        self.switches += 1
        # one warning per outage, not one per member and retry round
        log.log(logging.WARNING if self._answering else logging.DEBUG,
                "etcd endpoint %s failed (%s: %s); now using %s", self._url(i), type(e).__name__, str(e)[:160],
                self._url(self._current))
        self._answering = False

    # -- the wrapped calls --------------------------------------------------------------------------------------
    async def get(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("get", *args, **kwargs)

    async def get_prefix(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("get_prefix", *args, **kwargs)

    async def get_range(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("get_range", *args, **kwargs)

    async def get_all(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("get_all", *args, **kwargs)

    async def put(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("put", *args, **kwargs)

    async def delete(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("delete", *args, **kwargs)

    async def delete_prefix(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("delete_prefix", *args, **kwargs)

    async def delete_range(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("delete_range", *args, **kwargs)

    async def replace(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("replace", *args, **kwargs)

    async def transaction(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("transaction", *args, **kwargs)

    async def lease(self, ttl: int, lease_id: int | None = None) -> aetcd.leases.Lease:
        got = await self._call("lease", ttl, lease_id)
        return aetcd.leases.Lease(lease_id=got.id, ttl=got.ttl, etcd_client=self)

    async def revoke_lease(self, lease_id: int) -> Any:
        return await self._call("revoke_lease", lease_id)

    async def refresh_lease(self, lease_id: int) -> Any:
        return await self._call("refresh_lease", lease_id)

    async def get_lease_info(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("get_lease_info", *args, **kwargs)

    async def status(self) -> Any:
        return await self._call("status")

    def __getattr__(self, name: str) -> Any:  # only for what is not wrapped above
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._clients[self._current], name)

    async def close(self) -> None:
        for c in self._clients:
            try:
                await c.close()
            except Exception as e:
                log.debug("etcd close %s: %s", c, e)

    async def __aenter__(self) -> FailoverClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def etcd_client(url: str, timeout: int = 5) -> Any:
    """A client for `url`: an aetcd.Client for one endpoint (unchanged single-server behaviour), a FailoverClient
    for a comma-separated list of several members of one cluster."""
    endpoints = parse_etcd_urls(url)
    if len(endpoints) == 1:
        host, port = endpoints[0]
        return aetcd.Client(host=host, port=port, timeout=timeout)
    return FailoverClient(endpoints, timeout=timeout)


class NodeRegistry:
    def __init__(self, url: str, ttl_s: int = 3) -> None:
        self.client = etcd_client(url)
        self.ttl_s = ttl_s
        self._lease: Any = None
        self._keepalive: asyncio.Task[None] | None = None
        self._info: dict[str, Any] = {}
        self._node: str | None = None
        self.lease_losses = 0
        """How many times the registration lease was found gone (expired or revoked) and replaced."""

    async def register(self, node: str, info: dict[str, Any]) -> None:
        """Put `/rackflow/nodes/{node}` = info (state `active`) under a lease kept alive until close()."""
        self._node = node
        self._info = {"state": NodeState.ACTIVE.value, **info}
        try:
            self._lease = await self.client.lease(self.ttl_s)
            await self.client.put(keys.etcd_node(node).encode(), json.dumps(self._info).encode(), lease=self._lease)
        except aex.ClientError as e:
            raise _translate(e) from None
        self._keepalive = asyncio.create_task(self._keep_alive())

    async def set_state(self, state: str) -> None:
        if self._node is None:
            raise EtcdStoreError("set_state before register")
        self._info["state"] = state
        try:
            await self.client.put(
                keys.etcd_node(self._node).encode(), json.dumps(self._info).encode(), lease=self._lease
            )
        except aex.ClientError as e:
            raise _translate(e) from None

    async def _put_unless_ours(self) -> None:
        key = keys.etcd_node(self._node or "").encode()
        value = json.dumps(self._info).encode()
        t = self.client.transactions
        await self.client.transaction(
            compare=[_LeaseIs(key) == self._lease.id, t.value(key) == value],
            success=[], failure=[t.put(key, value, lease=self._lease)],
        )

    async def _keep_alive(self) -> None:
        interval = max(0.2, self.ttl_s / 3)
        while True:
            await asyncio.sleep(interval)
            try:
                reply = await self._lease.refresh()
                if reply is not None and getattr(reply, "TTL", 1) <= 0:
                    # gone: expired while this process could not refresh it, or revoked by the monitor because
                    # this worker's heartbeats stopped (it was taken for dead and its sequences moved; the movers'
                    # release messages stop what it still runs). Register again as a fresh incarnation.
                    self.lease_losses += 1
                    log.warning("node %s: registration lease %x is gone (expired, or revoked by the monitor after "
                                "missed heartbeats); registering again", self._node, self._lease.id)
                    self._lease = await self.client.lease(self.ttl_s)
                # Re-put under our lease when the key is not ours as we wrote it: another process of the same node
                # (hot swap) may have taken it with its own lease, and when that one dies the key must not vanish
                # while we are alive; a `set_state` whose put failed is written here. One read-only transaction
                # when nothing changed: an unconditional put every second was a Raft write (and a WAL fsync) per
                # worker per second, most of an idle cluster's etcd CPU.
                await self._put_unless_ours()
            except Exception as e:  # keep trying: a transient etcd outage must not kill the worker
                log.warning("node %s: lease refresh failed: %s", self._node, e)
                try:  # the lease may have expired meanwhile: register again with a fresh one
                    self._lease = await self.client.lease(self.ttl_s)
                    await self.client.put(
                        keys.etcd_node(self._node or "").encode(), json.dumps(self._info).encode(), lease=self._lease
                    )
                except Exception as e2:
                    log.warning("node %s: re-register failed: %s", self._node, e2)

    async def nodes(self) -> dict[str, dict[str, Any]]:
        """Registered nodes (only those whose lease is alive) -> their info."""
        try:
            resp = await self.client.get_prefix(keys.ETCD_NODES.encode())
        except aex.ClientError as e:
            raise _translate(e) from None
        out: dict[str, dict[str, Any]] = {}
        for kv in resp:
            name = kv.key.decode()[len(keys.ETCD_NODES):]
            try:
                out[name] = json.loads(kv.value)
            except ValueError:
                out[name] = {"state": "unknown"}
        return out

    async def admin(self) -> dict[str, dict[str, Any]]:
        """The monitor's verdicts (draining/dead) by node."""
        try:
            resp = await self.client.get_prefix(keys.ETCD_ADMIN.encode())
        except aex.ClientError as e:
            raise _translate(e) from None
        out: dict[str, dict[str, Any]] = {}
        for kv in resp:
            try:
                out[kv.key.decode()[len(keys.ETCD_ADMIN):]] = json.loads(kv.value)
            except ValueError:
                continue
        return out

    async def close(self, revoke: bool = True) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            await asyncio.gather(self._keepalive, return_exceptions=True)
        if revoke and self._lease is not None:
            try:
                await self._lease.revoke()
            except Exception as e:
                log.warning("node %s: lease revoke failed: %s", self._node, e)
        try:
            await self.client.close()
        except Exception as e:
            log.debug("etcd close: %s", e)


# -- sequence ownership ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SeqRecord:
    seq_id: str
    owner: str
    version: int
    rack: str
    last_update_ts: float
    entry: str = ""
    """Stream id of the entry that carries the request in the owner's `rf:node:{owner}:batch` stream."""
    mod_revision: int = 0
    moved_from: str = ""
    """Set by a move, until the new owner claims the record (its claim writes the record again without it): the
    node it was moved from ..."""
    from_entry: str = ""
    """... and the entry that carried its request there. A drain of that node finds a move whose target was never
    told (the mover died in between) by these, and tells the target again."""


class MoveOutcome(StrEnum):
    MOVED = "moved"
    """Ownership changed from (src, version) to (dst, version + 1)."""
    ALREADY = "already"
    """The record already carries a higher version: a duplicate of a migration that happened."""
    CONFLICT = "conflict"
    """The record is at the expected version but owned by another node than `src`."""
    MISSING = "missing"
    """No record: the sequence finished (or its owner never recorded it)."""


@dataclass(frozen=True, slots=True)
class PlannedMove:
    """One sequence to move (src, version) -> (dst, version + 1), with what the planner read of its record."""

    seq_id: str
    version: int
    src: str
    dst: str
    mod_revision: int = 0
    """The record's mod revision as read (0: not read: the move reads it first, one more round trip)."""
    rack: str = ""
    entry: str = ""
    """The entry that carried the request to `src` (kept in the moved record until the target claims it)."""


@dataclass(frozen=True, slots=True)
class MoveResult:
    move: PlannedMove
    outcome: MoveOutcome
    record: SeqRecord | None
    """MOVED: the record as written; otherwise the record as found (None: none)."""

    @property
    def unclaimed_ours(self) -> bool:
        """ALREADY, but the record is exactly what this move writes and the target has not claimed it yet (a claim
        re-puts it with the target's entry): an earlier attempt of this move changed the owner and may have died
        before it told the target. Telling the target again is safe (a duplicate resume is refused there)."""
        r = self.record
        return (self.outcome is MoveOutcome.ALREADY and r is not None and r.owner == self.move.dst
                and r.version == self.move.version + 1 and not r.entry and r.moved_from in ("", self.move.src))


def _seq_value(owner: str, version: int, rack: str, ts: float, entry: str, moved_from: str = "",
               from_entry: str = "") -> bytes:
    d: dict[str, Any] = {"owner": owner, "version": version, "rack": rack, "last_update_ts": ts, "entry": entry}
    if moved_from:
        d["from"] = moved_from
        d["from_entry"] = from_entry
    return json.dumps(d).encode()


class SequenceRegistry:
    """`/rackflow/seq/{uuid}` -> {owner, version, rack, last_update_ts, entry}. Records carry no lease: they must
    outlive a node that dies, so the monitor can find its sequences. A worker records the sequences it runs and
    deletes them when they finish, in batched transactions written in order (`SeqRecorder`); ownership then changes
    only by a compare-and-swap on the record's mod revision, so two racing migrations cannot both win."""

    def __init__(self, client: aetcd.Client) -> None:
        self.client = client

    @staticmethod
    def _parse(seq_id: str, raw: bytes, mod_revision: int) -> SeqRecord:
        d = json.loads(raw)
        return SeqRecord(seq_id, str(d["owner"]), int(d["version"]), str(d.get("rack", "")),
                         float(d.get("last_update_ts", 0.0)), str(d.get("entry", "")), mod_revision,
                         str(d.get("from", "")), str(d.get("from_entry", "")))

    async def apply(self, puts: list[SeqRecord], deletes: list[str]) -> None:
        """Write and delete records in as few transactions as etcd allows (128 operations each)."""
        t = self.client.transactions
        ops = [t.put(keys.etcd_seq(r.seq_id).encode(),
                     _seq_value(r.owner, r.version, r.rack, r.last_update_ts, r.entry)) for r in puts]
        ops += [t.delete(keys.etcd_seq(sid).encode()) for sid in deletes]
        try:
            for i in range(0, len(ops), 120):
                await self.client.transaction(compare=[], success=ops[i : i + 120], failure=[])
        except aex.ClientError as e:
            raise _translate(e) from None

    async def get(self, seq_id: str) -> SeqRecord | None:
        try:
            got = await self.client.get(keys.etcd_seq(seq_id).encode())
        except aex.ClientError as e:
            raise _translate(e) from None
        return None if got is None else self._parse(seq_id, got.value, got.mod_revision)

    async def records(self) -> dict[str, SeqRecord]:
        """Every sequence record (one range read), by sequence id."""
        try:
            resp = await self.client.get_prefix(keys.ETCD_SEQ.encode())
        except aex.ClientError as e:
            raise _translate(e) from None
        out = {}
        for kv in resp:
            rec = self._parse(kv.key.decode()[len(keys.ETCD_SEQ):], kv.value, kv.mod_revision)
            out[rec.seq_id] = rec
        return out

    async def snapshot(self) -> tuple[dict[str, SeqRecord], dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """Every sequence record, every registered node (its info) and every monitor verdict, read in ONE
        transaction (one revision: a consistent picture of who owns what and who is alive), as a drain plans."""
        from aetcd.utils import prefix_range_end

        t = self.client.transactions
        prefixes = [keys.ETCD_SEQ, keys.ETCD_NODES, keys.ETCD_ADMIN]
        try:
            _ok, resp = await self.client.transaction(compare=[], success=[
                t.get(p.encode(), prefix_range_end(p.encode())) for p in prefixes], failure=[])
        except aex.ClientError as e:
            raise _translate(e) from None
        records = {}
        for value, meta in resp[0]:
            rec = self._parse(meta.key.decode()[len(keys.ETCD_SEQ):], value, meta.mod_revision)
            records[rec.seq_id] = rec
        tables: list[dict[str, dict[str, Any]]] = []
        for prefix, rows in zip(prefixes[1:], resp[1:], strict=True):
            table: dict[str, dict[str, Any]] = {}
            for value, meta in rows:
                try:
                    table[meta.key.decode()[len(prefix):]] = json.loads(value)
                except ValueError:
                    table[meta.key.decode()[len(prefix):]] = {"state": "unknown"}
            tables.append(table)
        return records, tables[0], tables[1]

    async def owned_by(self, node: str) -> list[SeqRecord]:
        return [r for r in (await self.records()).values() if r.owner == node]

    async def move(
        self, seq_id: str, version: int, src: str, dst: str, now_ms: float, entry: str = ""
    ) -> tuple[MoveOutcome, SeqRecord | None]:
        """(src, version) -> (dst, version + 1) by compare-and-swap; the outcome says what happened. A sequence its
        dead owner never got to record is created at the new version (create-if-absent)."""
        t = self.client.transactions
        key = keys.etcd_seq(seq_id).encode()
        try:
            for _ in range(5):
                got = await self.client.get(key)
                if got is None:
                    ok, _ = await self.client.transaction(
                        compare=[t.version(key) == 0],
                        success=[t.put(key, _seq_value(dst, version + 1, "", now_ms, entry, src))],
                        failure=[],
                    )
                    if ok:
                        return MoveOutcome.MOVED, SeqRecord(seq_id, dst, version + 1, "", now_ms, entry)
                    continue
                rec = self._parse(seq_id, got.value, got.mod_revision)
                if rec.version > version:
                    return MoveOutcome.ALREADY, rec
                if rec.owner != src:
                    return MoveOutcome.CONFLICT, rec
                ok, _ = await self.client.transaction(
                    compare=[t.mod(key) == got.mod_revision],
                    success=[t.put(key, _seq_value(dst, version + 1, rec.rack, now_ms, entry, src, rec.entry))],
                    failure=[],
                )
                if ok:
                    return MoveOutcome.MOVED, SeqRecord(seq_id, dst, version + 1, rec.rack, now_ms, entry)
            raise EtcdUnavailable(f"sequence {seq_id}: ownership kept changing under the compare-and-swap")
        except aex.ClientError as e:
            raise _translate(e) from None

    async def move_many(self, moves: list[PlannedMove], now_ms: float,
                        probe: str | None = None) -> tuple[list[MoveResult], bool | None]:
        """Every move in ONE round trip (per 100 moves): a transaction of one nested compare-and-swap per sequence
        on the mod revision its planner read, each decided on its own (one sequence that changed meanwhile does
        not fail the others), each answering with the record as it is when its compare fails. `probe`: a node
        whose registration is read in the same transaction (is its worker's lease alive?). A move planned without
        a mod revision, or whose record was only re-written by its owner meanwhile (same owner and version),
        reads the record and tries again (at most 5 rounds).

        Returns the result of each move, in order, and whether `probe` is registered (None without a probe)."""
        t = self.client.transactions
        results: dict[int, MoveResult] = {}
        todo = list(enumerate(moves))
        alive: bool | None = None
        try:
            for _round in range(5):
                if not todo:
                    break
                unknown = [(i, m) for i, m in todo if m.mod_revision <= 0]
                if unknown:  # no revision planned: read these records first (one range read each, one txn)
                    _ok, resp = await self.client.transaction(
                        compare=[], success=[t.get(keys.etcd_seq(m.seq_id).encode()) for _i, m in unknown],
                        failure=[])
                    known = {}
                    for (i, m), rows in zip(unknown, resp, strict=True):
                        if not rows:
                            known[i] = m  # absent: created at the new version if still absent (version == 0)
                            continue
                        rec = self._parse(m.seq_id, rows[0][0], rows[0][1].mod_revision)
                        verdict = self._verdict(m, rec)
                        if verdict is not None:
                            results[i] = verdict
                        else:
                            known[i] = PlannedMove(m.seq_id, m.version, m.src, m.dst, rec.mod_revision, rec.rack,
                                                   rec.entry)
                    todo = [(i, known[i]) if i in known else (i, m) for i, m in todo if i not in results]
                retry: list[tuple[int, PlannedMove]] = []
                for start in range(0, len(todo), 100):
                    chunk = todo[start:start + 100]
                    ops = []
                    for _i, m in chunk:
                        key = keys.etcd_seq(m.seq_id).encode()
                        cmp = t.mod(key) == m.mod_revision if m.mod_revision > 0 else t.version(key) == 0
                        ops.append(t.txn(compare=[cmp],
                                         success=[t.put(key, _seq_value(m.dst, m.version + 1, m.rack, now_ms, "",
                                                                        m.src, m.entry))],
                                         failure=[t.get(key)]))
                    if probe is not None and start == 0:
                        ops.append(t.get(keys.etcd_node(probe).encode()))
                    _ok, resp = await self.client.transaction(compare=[], success=ops, failure=[])
                    if probe is not None and start == 0:
                        alive = bool(resp[-1])
                        resp = resp[:-1]
                    for (i, m), r in zip(chunk, resp, strict=True):
                        inner = r.response_txn
                        if inner.succeeded:
                            results[i] = MoveResult(m, MoveOutcome.MOVED, SeqRecord(
                                m.seq_id, m.dst, m.version + 1, m.rack, now_ms, "",
                                inner.responses[0].response_put.header.revision, m.src, m.entry))
                            continue
                        kvs = inner.responses[0].response_range.kvs
                        if not kvs:  # gone meanwhile: it finished (its owner deleted the record)
                            results[i] = MoveResult(m, MoveOutcome.MISSING, None)
                            continue
                        rec = self._parse(m.seq_id, kvs[0].value, kvs[0].mod_revision)
                        verdict = self._verdict(m, rec)
                        if verdict is not None:
                            results[i] = verdict
                        else:  # re-written by its owner (same owner, same version): try again on the new revision
                            retry.append((i, PlannedMove(m.seq_id, m.version, m.src, m.dst, rec.mod_revision,
                                                         rec.rack, rec.entry)))
                todo = retry
                probe = None
            if todo:
                raise EtcdUnavailable(f"{len(todo)} sequences: ownership kept changing under the compare-and-swap")
        except aex.ClientError as e:
            raise _translate(e) from None
        return [results[i] for i in range(len(moves))], alive

    @staticmethod
    def _verdict(m: PlannedMove, rec: SeqRecord) -> MoveResult | None:
        """What a record found in place of the planned one means (None: it is still (src, version): move it)."""
        if rec.version > m.version:
            return MoveResult(m, MoveOutcome.ALREADY, rec)
        if rec.owner != m.src:
            return MoveResult(m, MoveOutcome.CONFLICT, rec)
        return None

    async def delete_if_unchanged(self, records: list[SeqRecord]) -> None:
        """Delete each record only if it is still the one given (its mod revision): the cleanup of records a move
        wrote for sequences that turned out to have finished."""
        t = self.client.transactions
        ops = [t.txn(compare=[t.mod(keys.etcd_seq(r.seq_id).encode()) == r.mod_revision],
                     success=[t.delete(keys.etcd_seq(r.seq_id).encode())], failure=[]) for r in records
               if r.mod_revision > 0]
        try:
            for i in range(0, len(ops), 100):
                await self.client.transaction(compare=[], success=ops[i:i + 100], failure=[])
        except aex.ClientError as e:
            raise _translate(e) from None


class _LeaseIs(aetcd.transactions.BaseCompare):
    """Compare a key's lease (etcd's Compare target LEASE, which aetcd does not wrap): `_LeaseIs(key) == lease_id`.
    A missing key has lease 0."""

    def build_compare(self, compare: Any) -> None:
        compare.target = aetcd.rpc.Compare.LEASE
        compare.lease = int(self.value)  # type: ignore[arg-type]


class SeqRecorder:
    """A worker's writer of its sequence records: claims and releases are queued and written IN ORDER by one task,
    coalesced into batched transactions, so recording never blocks the engine and a release can never overtake
    the claim it undoes."""

    def __init__(self, registry: SequenceRegistry, flush_ms: float = 20.0) -> None:
        self.registry = registry
        self.flush_ms = flush_ms
        self._ops: list[tuple[str, Any]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.errors = 0

    def claim(self, records: list[SeqRecord]) -> None:
        if records:
            self._ops.append(("put", records))
            self._wake.set()

    def release(self, seq_ids: list[str]) -> None:
        if seq_ids:
            self._ops.append(("delete", seq_ids))
            self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.flush_ms / 1000.0)  # coalesce what arrives meanwhile
            await self.flush()

    async def flush(self) -> None:
        while self._ops:
            ops, self._ops = self._ops, []
            puts: dict[str, SeqRecord] = {}
            deletes: dict[str, None] = {}
            for kind, payload in ops:  # in order: a later delete cancels an earlier put, and the other way round
                if kind == "put":
                    for r in payload:
                        deletes.pop(r.seq_id, None)
                        puts[r.seq_id] = r
                else:
                    for sid in payload:
                        if sid in puts:
                            del puts[sid]  # claimed and finished within one flush: nothing to write at all
                        else:
                            deletes[sid] = None
            try:
                await self.registry.apply(list(puts.values()), list(deletes))
            except EtcdStoreError as e:
                self.errors += 1
                log.warning("sequence records not written (%s); failover falls back to the batch streams", e)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.flush()


# -- node verdicts and monitor election ----------------------------------------------------------------------------
class NodeAdmin:
    """The monitor's verdict on nodes: `/rackflow/admin/{node}` = {"state": draining|dead, "reason", "ts"}."""

    def __init__(self, client: aetcd.Client) -> None:
        self.client = client

    async def set(self, node: str, state: str, reason: str, now_ms: float) -> None:
        try:
            await self.client.put(keys.etcd_admin(node).encode(),
                                  json.dumps({"state": state, "reason": reason, "ts": now_ms}).encode())
        except aex.ClientError as e:
            raise _translate(e) from None

    async def clear(self, node: str) -> None:
        try:
            await self.client.delete(keys.etcd_admin(node).encode())
        except aex.ClientError as e:
            raise _translate(e) from None

    async def all(self) -> dict[str, dict[str, Any]]:
        try:
            resp = await self.client.get_prefix(keys.ETCD_ADMIN.encode())
        except aex.ClientError as e:
            raise _translate(e) from None
        return {kv.key.decode()[len(keys.ETCD_ADMIN):]: json.loads(kv.value) for kv in resp}

    async def set_and_fence(self, node: str, state: str, reason: str, now_ms: float) -> int | None:
        """`set`, then end the registration of `node`'s worker now: revoke the lease its `/rackflow/nodes/{node}`
        key is under, which deletes the key (and anything else under that lease) exactly as the lease's expiry
        would, only without waiting for the TTL. The monitor does this to a worker whose heartbeats stopped: from
        then on etcd says the node is gone, so every mover treats it as dead, and a worker that was merely stalled
        finds its lease gone when it wakes up and registers again as a fresh incarnation. Two round trips: the
        verdict is written and the registration read in one transaction, then the lease is revoked. Returns the
        revoked lease id (None: no registration, or one without a lease)."""
        t = self.client.transactions
        try:
            _ok, resp = await self.client.transaction(compare=[], success=[
                t.put(keys.etcd_admin(node).encode(),
                      json.dumps({"state": state, "reason": reason, "ts": now_ms}).encode()),
                t.get(keys.etcd_node(node).encode()),
            ], failure=[])
            rows = resp[1]
            lease = int(rows[0][1].lease) if rows else 0
            if not lease:
                return None
            try:
                await self.client.revoke_lease(lease)
            except aex.ClientError as e:
                if "not found" not in str(e):  # expired meanwhile: nothing left to revoke
                    raise
            return lease
        except aex.ClientError as e:
            raise _translate(e) from None

    async def heartbeats(self) -> set[str]:
        try:
            resp = await self.client.get_prefix(keys.ETCD_HEARTBEAT.encode(), keys_only=True)
        except aex.ClientError as e:
            raise _translate(e) from None
        return {kv.key.decode()[len(keys.ETCD_HEARTBEAT):] for kv in resp}


class LeaderElection:
    """One leader among monitors: the leader holds `/rackflow/monitor/leader` under its lease (created only if the
    key does not exist); when it dies the lease expires within `ttl_s` and another candidate takes the key."""

    def __init__(self, client: aetcd.Client, identity: str, ttl_s: int = 3) -> None:
        self.client = client
        self.identity = identity
        self.ttl_s = ttl_s
        self._lease: Any = None

    async def try_acquire(self) -> bool:
        """Take the leadership if nobody holds it. A candidate holds no lease while it waits (a lease granted and
        then left unrefreshed would have expired by the time the leader dies): a fresh lease is granted only when
        the key is absent, and revoked again when another candidate won the race."""
        t = self.client.transactions
        key = keys.ETCD_MONITOR_LEADER.encode()
        try:
            got = await self.client.get(key)
            if got is not None:
                mine = got.value.decode() == self.identity and self._lease is not None
                return mine
            lease = await self.client.lease(self.ttl_s)
            ok, _ = await self.client.transaction(
                compare=[t.version(key) == 0],
                success=[t.put(key, self.identity.encode(), lease=lease)],
                failure=[],
            )
            if ok:
                self._lease = lease
            else:
                await lease.revoke()
            return bool(ok)
        except aex.ClientError as e:
            raise _translate(e) from None

    async def keep(self) -> bool:
        """Refresh the lease; False when leadership was lost (the lease expired meanwhile)."""
        try:
            if self._lease is None:
                return False
            await self._lease.refresh()
            got = await self.client.get(keys.ETCD_MONITOR_LEADER.encode())
            if got is None or got.value.decode() != self.identity:
                self._lease = None
                return False
            return True
        except aex.ClientError as e:
            self._lease = None
            raise _translate(e) from None

    async def leader(self) -> str | None:
        got = await self.client.get(keys.ETCD_MONITOR_LEADER.encode())
        return None if got is None else got.value.decode()

    async def resign(self) -> None:
        if self._lease is not None:
            try:
                await self._lease.revoke()
            except Exception as e:
                log.warning("monitor %s: resign failed: %s", self.identity, e)
            self._lease = None

