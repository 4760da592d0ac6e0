"""A worker's registration keep-alive on a real etcd: it refreshes its lease and writes its key only when the key is
not its own as it wrote it (another process of the node took it, or a state change was not written). Before, it
re-put the key every refresh: a Raft write (and a WAL fsync) per worker per second on an idle cluster."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import pytest

from streams import keys
from workers.local.services import ServiceEndpoints
from workers.stores.etcd import NodeRegistry

pytestmark = pytest.mark.integration


async def _until(cond: Callable[[], Awaitable[bool]], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await cond():
        assert time.monotonic() < deadline, "not reached in time"
        await asyncio.sleep(0.05)


def test_keepalive_writes_only_when_the_key_is_not_ours(clean_services: ServiceEndpoints) -> None:
    async def run() -> None:
        reg = NodeRegistry(clean_services.etcd_url, ttl_s=3)  # a refresh every second
        other = NodeRegistry(clean_services.etcd_url, ttl_s=3)
        key = keys.etcd_node("r0-n0").encode()
        try:
            await reg.register("r0-n0", {"pid": 1})
            first = (await reg.client.get(key)).mod_revision
            await asyncio.sleep(3.5)  # about three refreshes (fewer on a slow machine: never more writes)
            got = await reg.client.get(key)
            assert got.value is not None and json.loads(got.value)["pid"] == 1
            # rewritten only if a stall let the lease expire (a new lease: a real change of owner)
            assert got.mod_revision == first or reg.lease_losses > 0, "the key was rewritten though it was ours"
            assert got.lease == reg._lease.id

            # another process of the node takes the key with its own lease (a hot swap), then dies
            other_lease = await other.client.lease(3)
            await other.client.put(key, json.dumps({"pid": 2}).encode(), lease=other_lease)

            async def ours_again() -> bool:  # a later refresh sees a key that is not ours: written back under ours
                got = await reg.client.get(key)
                return got.value is not None and json.loads(got.value)["pid"] == 1 and got.lease == reg._lease.id

            await _until(ours_again)
            await other_lease.revoke()  # that lease's end no longer takes our key with it
            assert (await reg.client.get(key)).value is not None

            # a state the process holds but whose put was lost is written at the next refresh
            reg._info["state"] = "draining"

            async def drained() -> bool:
                got = await reg.client.get(key)
                return got.value is not None and json.loads(got.value).get("state") == "draining"

            await _until(drained)
        finally:
            await other.close(revoke=True)
            await reg.close(revoke=True)

    asyncio.run(run())
