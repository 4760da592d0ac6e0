"""KV tiers against a real Valkey (clean_services) and real files: the stores' round trips, the manager's LRU
demotion/promotion/drops, version fencing within one process and across processes, and ledger rebuild.
L1 lives under pytest's tmp_path (not /dev/shm), so nothing is left behind."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from pipeline.config import KvTierConfig
from pipeline.kv.snapshot import KvSnapshot, encode
from pipeline.kv.tiers import snapshot_key
from streams.errors import StreamError, TransientStreamError
from workers.kv.l1 import SharedMemoryStore
from workers.kv.l2 import ValkeyStore, blob_key, versions_key
from workers.kv.manager import KvTierManager
from workers.local.services import ServiceEndpoints
from workers.local.supervise import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

REPO = Path(__file__).resolve().parents[2]
DATA = 3_000
T = TypeVar("T")


def snap(seq_id: str, version: int = 1, fill: int = 0, size: int = DATA) -> KvSnapshot:
    return KvSnapshot(seq_id=seq_id, version=version, model="tiny", engine="sim", token_ids=(1, 2, 3, 4),
                      prompt_len=2, generated=(3, 4), max_tokens=8, data=bytes([fill % 256]) * size,
                      meta={"layers": 2})


BLOB = len(encode(snap("s-0000")))  # every test snapshot id has 6 characters: one blob size


def kv_config(tmp_path: Path, l1_blobs: float, l2_blobs: float) -> KvTierConfig:
    """Capacities in whole test blobs (0 turns a tier off)."""
    return KvTierConfig(l1_capacity_mb=l1_blobs * BLOB / 1e6, l1_dir=str(tmp_path / "shm"),
                        l2="valkey", l2_capacity_mb=l2_blobs * BLOB / 1e6, l2_ttl_s=600)


def with_redis(url: str, fn: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
    async def main() -> T:
        r = aioredis.Redis.from_url(url)
        try:
            return await fn(r)
        finally:
            await r.aclose()

    return asyncio.run(main())


def left_in_tmp(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "shm").rglob("*") if p.name.startswith("."))


# --------------------------------------------------------------------------------------------- stores


def test_l1_round_trip_with_unsafe_ids(tmp_path: Path) -> None:
    async def main() -> None:
        store = SharedMemoryStore(tmp_path / "shm", "node/0")
        odd = "../ü x:y."
        await store.put(snapshot_key(odd, 3), b"three")
        await store.put(snapshot_key(odd, 4), b"four!")
        await store.put(snapshot_key("plain", 1), b"x" * 5_000_000)  # above the inline size: via a thread
        assert await store.get(snapshot_key(odd, 3)) == b"three"
        assert await store.get(snapshot_key(odd, 9)) is None
        assert sorted(await store.keys()) == sorted([f"{odd}:3", f"{odd}:4", "plain:1"])
        assert await store.versions(odd) == {3: 5, 4: 5}
        assert await store.sizes([f"{odd}:4", "plain:1", "nope:1"]) == {f"{odd}:4": 5, "plain:1": 5_000_000}
        await store.put(snapshot_key(odd, 3), b"THREE")  # replace
        assert await store.get(snapshot_key(odd, 3)) == b"THREE"
        for k in await store.keys():
            await store.delete(k)
        await store.delete(snapshot_key(odd, 3))  # idempotent
        assert await store.keys() == []
        assert list(store.dir.iterdir()) == []  # no empty sequence directories, no temp files
        assert all(p.is_relative_to(tmp_path / "shm") for p in (tmp_path / "shm").rglob("*"))
        with pytest.raises(ValueError, match="not a KV snapshot key"):
            await store.put("no-version", b"")

    asyncio.run(main())


def test_l2_round_trip_ttl_and_keys(clean_services: ServiceEndpoints) -> None:
    async def main(r: aioredis.Redis) -> None:
        store = ValkeyStore(r, ttl_s=600)
        await store.put("seq-a:1", b"\x00\xffbinary")
        await store.put("seq-a:2", b"two")
        await store.put("b:7", b"bee")
        assert await store.get("seq-a:1") == b"\x00\xffbinary"
        assert await r.exists("rf:kv:{seq-a}:1", "rf:kv:{seq-a}:versions") == 2
        assert sorted(await store.keys()) == ["b:7", "seq-a:1", "seq-a:2"]
        assert await store.versions("seq-a") == {1: 8, 2: 3}
        assert await store.sizes(["seq-a:1", "b:7", "b:8"]) == {"seq-a:1": 8, "b:7": 3}
        await r.expire(blob_key("seq-a", 2), 5)
        assert await r.ttl(blob_key("seq-a", 2)) <= 5
        assert await store.get("seq-a:2") == b"two"
        assert await r.ttl(blob_key("seq-a", 2)) > 500  # refreshed on get
        await r.delete(blob_key("b", 7))  # as if it expired: the versions hash heals on the next get
        assert await store.get("b:7") is None and await store.versions("b") == {}
        await store.delete("seq-a:1")
        assert await store.versions("seq-a") == {2: 3} and await store.get("seq-a:1") is None
        assert await store.keys() == ["seq-a:2"]

    with_redis(clean_services.redis_url, main)


def test_l2_errors_are_translated(clean_services: ServiceEndpoints) -> None:
    async def main(r: aioredis.Redis) -> None:
        await r.set(versions_key("x"), "not a hash")
        with pytest.raises(StreamError, match="put x:1") as err:
            await ValkeyStore(r, 600).put("x:1", b"blob")
        assert not err.value.retryable
        down = aioredis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5,
                              retry=Retry(NoBackoff(), 0))  # fail at once instead of redis-py's default retries
        try:
            with pytest.raises(TransientStreamError) as terr:
                await ValkeyStore(down, 600).get("x:1")
            assert terr.value.retryable
        finally:
            await down.aclose()

    with_redis(clean_services.redis_url, main)


# --------------------------------------------------------------------------------------------- manager


def test_lru_demotion_to_l2_and_promotion_on_reuse(clean_services: ServiceEndpoints, tmp_path: Path) -> None:
    async def main(r: aioredis.Redis) -> None:
        m = KvTierManager.for_node(kv_config(tmp_path, l1_blobs=2, l2_blobs=10), "n0", r)
        assert await m.put(snap("s-aaaa", fill=1)) and await m.put(snap("s-bbbb", fill=2))
        assert (await m.get("s-aaaa")).data[0] == 1  # type: ignore[union-attr]  # a is now more recent than b
        assert await m.put(snap("s-cccc", fill=3))  # L1 full: b, the least recently used, goes to L2
        assert await m.get_from("L1", "s-bbbb") is None
        assert (await m.get_from("L2", "s-bbbb")).data[0] == 2  # type: ignore[union-attr]
        s = m.stats()
        assert (s.entries, s.demotions, s.bytes_moved) == ({"L1": 2, "L2": 1}, 1, BLOB)
        assert s.bytes == {"L1": 2 * BLOB, "L2": BLOB}
        got = await m.get("s-bbbb")  # an L2 hit: promoted, and a (older than c) goes down
        assert got is not None and got.data == bytes([2]) * DATA
        assert await m.get_from("L1", "s-bbbb") is not None and await m.get_from("L2", "s-bbbb") is None
        assert await m.get_from("L2", "s-aaaa") is not None and await m.get_from("L1", "s-aaaa") is None
        assert sorted(await r.keys("rf:kv:{*}:1")) == [b"rf:kv:{s-aaaa}:1"]
        s = m.stats()
        assert (s.hits, s.misses) == ({"L1": 1, "L2": 1}, {"L1": 1, "L2": 0})
        assert (s.promotions, s.demotions, s.bytes_moved) == (1, 2, 3 * BLOB)
        assert await m.get("nope-0") is None
        assert m.stats().misses == {"L1": 2, "L2": 1}
        await m.drop("s-aaaa")
        assert await m.get_from("L2", "s-aaaa") is None and "s-aaaa" not in m.ledger
        assert left_in_tmp(tmp_path) == []

    with_redis(clean_services.redis_url, main)


def test_l2_drops_beyond_capacity_and_too_large_is_refused(clean_services: ServiceEndpoints, tmp_path: Path) -> None:
    async def main(r: aioredis.Redis) -> None:
        m = KvTierManager.for_node(kv_config(tmp_path, l1_blobs=1, l2_blobs=2), "n0", r)
        for i in range(4):  # 1 in L1, 2 in L2: the oldest is dropped
            assert await m.put(snap(f"s-{i:04d}", fill=i))
        assert await m.get_from("L1", "s-0000") is None and await m.get_from("L2", "s-0000") is None
        assert await r.exists(blob_key("s-0000", 1)) == 0
        assert [await m.get_from("L2", f"s-{i:04d}") is not None for i in (1, 2)] == [True, True]
        s = m.stats()
        assert (s.drops, s.demotions, s.entries) == (1, 3, {"L1": 1, "L2": 2})
        assert await m.get("s-0000") is None
        assert not await m.put(snap("s-huge", size=10 * DATA))
        assert m.stats().refused_too_large == 1 and await m.get_from("L2", "s-huge") is None
        only_l2 = KvTierManager.for_node(kv_config(tmp_path, l1_blobs=0, l2_blobs=2), "n1", r)
        assert only_l2.tiers == ("L2",)
        assert await only_l2.put(snap("s-l2ly")) and await only_l2.get_from("L2", "s-l2ly") is not None

    with_redis(clean_services.redis_url, main)


def test_a_stale_version_never_overwrites_a_newer_one(clean_services: ServiceEndpoints, tmp_path: Path) -> None:
    async def main(r: aioredis.Redis) -> None:
        m = KvTierManager.for_node(kv_config(tmp_path, l1_blobs=4, l2_blobs=4), "n0", r)
        assert await m.put(snap("s-vvvv", version=2, fill=2))
        assert not await m.put(snap("s-vvvv", version=1, fill=1))
        assert not await m.put(snap("s-vvvv", version=1, fill=1), tier="L2")
        assert m.stats().refused_stale == 2 and await m.get_from("L2", "s-vvvv") is None
        assert await m.put(snap("s-vvvv", version=2, fill=22))  # an equal version replaces
        assert (await m.get("s-vvvv")).data[0] == 22  # type: ignore[union-attr]
        assert await m.put(snap("s-vvvv", version=3, fill=3), tier="L2")  # newer: the L1 copy of v2 goes
        assert await m.get_from("L1", "s-vvvv") is None
        got = await m.get("s-vvvv")
        assert got is not None and (got.version, got.data[0]) == (3, 3)
        assert m.stats().superseded == 1
        assert sorted(await m._stores["L1"].keys()) == ["s-vvvv:3"]  # promoted; no older copy anywhere
        assert await m._stores["L2"].keys() == []

    with_redis(clean_services.redis_url, main)


_OTHER_PROCESS = """
import asyncio, json, sys
import redis.asyncio as aioredis
from pipeline.config import KvTierConfig
from pipeline.kv.snapshot import KvSnapshot
from workers.kv.manager import KvTierManager

args = json.loads(sys.argv[1])

async def main():
    r = aioredis.Redis.from_url(args["redis_url"])
    m = KvTierManager.for_node(KvTierConfig(**args["config"]), "n0", r)
    out = {"rebuilt": await m.rebuild()}
    seen = await m.get_from("L1", "s-xxxx")
    out["read_l1"] = None if seen is None else [seen.version, seen.data[0]]
    def snap(v):
        return KvSnapshot("s-xxxx", v, "tiny", "sim", (1, 2, 3, 4), 2, (3, 4), 8, bytes([v]) * args["size"])
    out["put_stale"] = await m.put(snap(1))
    out["put_newer"] = await m.put(snap(5))
    await r.aclose()
    print(json.dumps(out))

asyncio.run(main())
"""


def test_processes_share_l1_and_fence_stale_versions(clean_services: ServiceEndpoints, tmp_path: Path) -> None:
    config = kv_config(tmp_path, l1_blobs=4, l2_blobs=4)

    async def before(r: aioredis.Redis) -> KvTierManager:
        m = KvTierManager.for_node(config, "n0", r)
        assert await m.put(snap("s-xxxx", version=2, fill=2))
        return m

    m = with_redis(clean_services.redis_url, before)
    args = {"redis_url": clean_services.redis_url, "config": config.model_dump(), "size": DATA}
    proc = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, json.dumps(args)], cwd=REPO, capture_output=True,
                          text=True, timeout=30, env=dict(os.environ, PYTHONPATH=str(REPO)), check=False)
    assert proc.returncode == 0, proc.stderr
    other = json.loads(proc.stdout.strip().splitlines()[-1])
    # The other process saw this one's L1 blob, refused to go back to version 1, and wrote version 5.
    assert other == {"rebuilt": 1, "read_l1": [2, 2], "put_stale": False, "put_newer": True}

    async def after(r: aioredis.Redis) -> None:
        m2 = KvTierManager(m._stores["L1"], ValkeyStore(r, 600), config)  # this process's stores, its old ledger
        m2.ledger = m.ledger
        assert m2.ledger.entry("s-xxxx").version == 2  # type: ignore[union-attr]  # stale view ...
        assert not await m2.put(snap("s-xxxx", version=3, fill=3))  # ... but the stores fence it
        got = await m2.get("s-xxxx")
        assert got is not None and (got.version, got.data[0]) == (5, 5)
        assert sorted(await m2._stores["L1"].keys()) == ["s-xxxx:5"]

    with_redis(clean_services.redis_url, after)


def test_rebuild_recovers_the_ledger(clean_services: ServiceEndpoints, tmp_path: Path) -> None:
    config = kv_config(tmp_path, l1_blobs=2, l2_blobs=3)

    async def main(r: aioredis.Redis) -> None:
        a = KvTierManager.for_node(config, "n0", r)
        for i in range(4):
            assert await a.put(snap(f"s-{i:04d}"))
        l1 = SharedMemoryStore(Path(config.l1_dir), "n0")
        await l1.put(snapshot_key("s-0003", 0), encode(snap("s-0003", version=0)))  # a stale leftover
        b = KvTierManager.for_node(config, "n0", r)
        assert await b.rebuild() == 4
        sa, sb = a.stats(), b.stats()
        assert (sb.entries, sb.bytes) == (sa.entries, sa.bytes)
        assert sb.entries == {"L1": 2, "L2": 2} and sb.bytes == {"L1": 2 * BLOB, "L2": 2 * BLOB}
        assert {(e.seq_id, e.version, e.tier) for e in b.ledger.entries()} == {
            (e.seq_id, e.version, e.tier) for e in a.ledger.entries()}
        assert sb.superseded == 1 and await l1.versions("s-0003") == {1: BLOB}
        assert (await b.get("s-0000")) is not None and b.stats().hits["L2"] == 1
        await l1.delete(snapshot_key("s-0003", 1))  # gone behind b's back: a rebuild forgets it
        assert await b.rebuild() == 3

    with_redis(clean_services.redis_url, main)


def test_bench_kv_reports_both_tiers(clean_services: ServiceEndpoints) -> None:
    from workers.bench.kv import bench_kv

    res: dict[str, Any] = bench_kv(clean_services.redis_url, sizes_mb=(0.25,), n=8, repeats=1)
    assert res["snapshot_mb"] == 0.25
    for tier in ("l1", "l2", "l1_with_l2"):
        assert set(res[tier]) >= {"put_mb_s", "get_mb_s", "put_p99_ms", "get_p99_ms"}
        assert all(v > 0 for v in res[tier].values())
