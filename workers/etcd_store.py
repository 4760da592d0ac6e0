"""etcd store: the node registry (and, later, sequence ownership) behind our own interface.

Owns the translation of `aetcd` calls and errors into rackflow's: a node registers `/rackflow/nodes/{id}` under a
lease it keeps alive, so a worker killed with -9 disappears from the registry when its lease expires; readers list
the registered nodes with their state. Library errors become EtcdUnavailable (retryable) or EtcdStoreError.
"""

from __future__ import annotations

import asyncio
import json
import logging
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
