"""etcd store: the node registry (and, later, sequence ownership) behind our own interface.

Owns the translation of `aetcd` calls and errors into rackflow's: a node registers `/rackflow/nodes/{id}` under a
lease it keeps alive, so a worker killed with -9 disappears from the registry when its lease expires; readers list
the registered nodes with their state. Library errors become EtcdUnavailable (retryable) or EtcdStoreError.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import urlparse

import aetcd
import aetcd.exceptions as aex

from streams import keys
from streams.errors import RackflowError

log = logging.getLogger(__name__)


class EtcdStoreError(RackflowError):
    """An etcd operation was refused (bad argument, precondition, auth)."""


class EtcdUnavailable(EtcdStoreError):
    """etcd is unreachable or timed out (no quorum, server down): retry with backoff."""

    retryable = True


def _translate(e: Exception) -> EtcdStoreError:
    if isinstance(e, aex.ConnectionFailedError | aex.ConnectionTimeoutError | aex.InternalError):
        return EtcdUnavailable(f"etcd unavailable: {type(e).__name__}: {e}")
    return EtcdStoreError(f"etcd error: {type(e).__name__}: {e}")


def parse_etcd_url(url: str) -> tuple[str, int]:
    u = urlparse(url if "://" in url else f"http://{url}")
    if not u.hostname or not u.port:
        raise ValueError(f"etcd URL {url!r} must look like http://HOST:PORT")
    return u.hostname, u.port


class NodeRegistry:
    def __init__(self, url: str, ttl_s: int = 3) -> None:
        host, port = parse_etcd_url(url)
        self.client = aetcd.Client(host=host, port=port, timeout=5)
        self.ttl_s = ttl_s
        self._lease: Any = None
        self._keepalive: asyncio.Task[None] | None = None
        self._info: dict[str, Any] = {}
        self._node: str | None = None

    async def register(self, node: str, info: dict[str, Any]) -> None:
        """Put `/rackflow/nodes/{node}` = info (state `active`) under a lease kept alive until close()."""
        self._node = node
        self._info = {"state": "active", **info}
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


def etcd_client(url: str) -> aetcd.Client:
    host, port = parse_etcd_url(url)
    return aetcd.Client(host=host, port=port, timeout=5)
