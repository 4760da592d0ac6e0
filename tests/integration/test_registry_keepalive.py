"""A worker's registration keep-alive on a real etcd: it refreshes its lease and writes its key only when the key is
not its own as it wrote it (another process of the node took it, or a state change was not written). Before, it
re-put the key every refresh: a Raft write (and a WAL fsync) per worker per second on an idle cluster."""

from __future__ import annotations

import asyncio
import json

import pytest

from streams import keys
from workers.local.services import ServiceEndpoints
from workers.stores.etcd import NodeRegistry

pytestmark = pytest.mark.integration


def test_keepalive_writes_only_when_the_key_is_not_ours(clean_services: ServiceEndpoints) -> None:
    async def run() -> None:
        reg = NodeRegistry(clean_services.etcd_url, ttl_s=1)  # a refresh every 0.33 s
        other = NodeRegistry(clean_services.etcd_url, ttl_s=1)
        key = keys.etcd_node("r0-n0").encode()
        try:
            await reg.register("r0-n0", {"pid": 1})
            first = (await reg.client.get(key)).mod_revision
            await asyncio.sleep(1.5)  # four refreshes or so: the lease lives, and the key was not written again
            got = await reg.client.get(key)
            assert got.value is not None and json.loads(got.value)["pid"] == 1
            assert got.mod_revision == first, "the key was rewritten though it was ours"
            assert got.lease == reg._lease.id

            # another process of the node takes the key with its own lease (a hot swap), then dies
            other_lease = await other.client.lease(1)
            await other.client.put(key, json.dumps({"pid": 2}).encode(), lease=other_lease)
            await asyncio.sleep(1.0)  # the next refresh sees a key that is not ours: written back under our lease
            got = await reg.client.get(key)
            assert json.loads(got.value)["pid"] == 1 and got.lease == reg._lease.id
            await other_lease.revoke()  # that lease's end no longer takes our key with it
            await asyncio.sleep(0.5)
            assert (await reg.client.get(key)).value is not None

            # a state the process holds but whose put was lost is written at the next refresh
            reg._info["state"] = "draining"
            await asyncio.sleep(1.0)
            assert json.loads((await reg.client.get(key)).value)["state"] == "draining"
        finally:
            await other.close(revoke=True)
            await reg.close(revoke=True)

    asyncio.run(run())
