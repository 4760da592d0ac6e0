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

    async def _keep_alive(self) -> None:
        interval = max(0.2, self.ttl_s / 3)
        while True:
            await asyncio.sleep(interval)
            try:
                await self._lease.refresh()
                # Re-put under our lease: another process of the same node (hot swap) may have taken the key
                # with its own lease, and when that one dies the key must not vanish while we are alive.
                await self.client.put(
                    keys.etcd_node(self._node or "").encode(), json.dumps(self._info).encode(), lease=self._lease
                )
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


class MoveOutcome(StrEnum):
    MOVED = "moved"
    """Ownership changed from (src, version) to (dst, version + 1)."""
    ALREADY = "already"
    """The record already carries a higher version: a duplicate of a migration that happened."""
    CONFLICT = "conflict"
    """The record is at the expected version but owned by another node than `src`."""
    MISSING = "missing"
    """No record: the sequence finished (or its owner never recorded it)."""


def _seq_value(owner: str, version: int, rack: str, ts: float, entry: str) -> bytes:
    return json.dumps({"owner": owner, "version": version, "rack": rack, "last_update_ts": ts,
                       "entry": entry}).encode()


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
                         float(d.get("last_update_ts", 0.0)), str(d.get("entry", "")), mod_revision)

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

    async def owned_by(self, node: str) -> list[SeqRecord]:
        try:
            resp = await self.client.get_prefix(keys.ETCD_SEQ.encode())
        except aex.ClientError as e:
            raise _translate(e) from None
        out = []
        for kv in resp:
            rec = self._parse(kv.key.decode()[len(keys.ETCD_SEQ):], kv.value, kv.mod_revision)
            if rec.owner == node:
                out.append(rec)
        return out

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
                        success=[t.put(key, _seq_value(dst, version + 1, "", now_ms, entry))],
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
                    success=[t.put(key, _seq_value(dst, version + 1, rec.rack, now_ms, entry))],
                    failure=[],
                )
                if ok:
                    return MoveOutcome.MOVED, SeqRecord(seq_id, dst, version + 1, rec.rack, now_ms, entry)
            raise EtcdUnavailable(f"sequence {seq_id}: ownership kept changing under the compare-and-swap")
        except aex.ClientError as e:
            raise _translate(e) from None


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

