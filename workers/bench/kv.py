"""`rackflow bench kv`: export (put) and import (get) of KV snapshots through `KvTierManager`.

Three shapes, their rounds interleaved in one process so all see the same machine state: `l1` (L1 alone: files in
a RAM-backed directory, /dev/shm when there is one), `l2` (L2 alone: Valkey) and `l1_with_l2` (both configured,
everything fits L1: what a node pays, the L2 version listing of every put/get included). Each round puts `n`
distinct snapshots, gets them back (decode included: the cost a worker pays to resume a sequence) and drops them.
Reported: medians over rounds of the throughput (snapshot MB/s) and of each round's p50/p99 latency of one op.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from pipeline.config import KvTierConfig
from pipeline.kv.snapshot import KvSnapshot
from pipeline.stats import percentile
from streams.runner import connect
from workers.kv.l1 import SharedMemoryStore
from workers.kv.l2 import ValkeyStore
from workers.kv.manager import KvTierManager

_SHM = Path("/dev/shm")


def _pct_ms(samples: list[float], q: float) -> float:
    return percentile(samples, q * 100) * 1e3


async def _round(m: KvTierManager, data: bytes, n: int) -> dict[str, float]:
    prefix = uuid.uuid4().hex[:12]
    snaps = [KvSnapshot(seq_id=f"bench-{prefix}-{i}", version=1, model="bench", engine="sim",
                        token_ids=tuple(range(64)), prompt_len=32, generated=tuple(range(32)), max_tokens=64,
                        data=data) for i in range(n)]
    put_s: list[float] = []
    get_s: list[float] = []
    t0 = time.perf_counter()
    for s in snaps:
        t = time.perf_counter()
        if not await m.put(s):
            raise RuntimeError(f"bench snapshot refused by {m.tiers}: capacity too small")
        put_s.append(time.perf_counter() - t)
    put_wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    for s in snaps:
        t = time.perf_counter()
        got = await m.get(s.seq_id)
        get_s.append(time.perf_counter() - t)
        if got is None or len(got.data) != len(data):
            raise RuntimeError(f"bench snapshot {s.seq_id} did not come back from {m.tiers}")
    get_wall = time.perf_counter() - t0
    for s in snaps:
        await m.drop(s.seq_id)
    mb = n * len(data) / 1e6
    return {
        "put_mb_s": mb / put_wall, "get_mb_s": mb / get_wall,
        "put_p50_ms": _pct_ms(put_s, 0.5), "put_p99_ms": _pct_ms(put_s, 0.99),
        "get_p50_ms": _pct_ms(get_s, 0.5), "get_p99_ms": _pct_ms(get_s, 0.99),
    }


def _median(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}


async def _bench(r: aioredis.Redis, root: Path, mb: float, n: int, repeats: int) -> dict[str, dict[str, float]]:
    data = random.Random(0).randbytes(int(mb * 1e6))
    room = 2 * n * mb + 16  # MB: never the bottleneck, nothing demoted or dropped
    l1 = KvTierManager(SharedMemoryStore(root, "bench"), None,
                       KvTierConfig(l1_capacity_mb=room, l1_dir=str(root), l2="none"))
    l2 = KvTierManager(None, ValkeyStore(r, 600), KvTierConfig(l1_capacity_mb=0, l2="valkey", l2_capacity_mb=room))
    # The production shape: both tiers, everything fits L1; each put/get also lists the sequence's versions in L2
    # (one HGETALL) so that another process's newer version is never missed.
    both = KvTierManager(SharedMemoryStore(root, "bench-both"), ValkeyStore(r, 600),
                         KvTierConfig(l1_capacity_mb=room, l1_dir=str(root), l2="valkey", l2_capacity_mb=room))
    tiers = {"l1": l1, "l2": l2, "l1_with_l2": both}
    for m in tiers.values():  # warm up: connections, page cache, allocator
        await _round(m, data, 2)
    rounds: dict[str, list[dict[str, float]]] = {k: [] for k in tiers}
    for _ in range(repeats):
        for k, m in tiers.items():
            rounds[k].append(await _round(m, data, n))
    return {k: _median(v) for k, v in rounds.items()}


def bench_kv(redis_url: str, sizes_mb: tuple[float, ...] = (1,), n: int = 50, repeats: int = 5) -> dict[str, Any]:
    """L1 and L2 put/get throughput and latency for snapshots of each size in `sizes_mb` (the first one is the
    headline; every size is under `by_size`)."""
    if not sizes_mb or n < 1 or repeats < 1:
        raise ValueError(f"need at least one size, n >= 1 and repeats >= 1 (got {sizes_mb}, {n}, {repeats})")

    async def main() -> dict[str, Any]:
        r = connect(redis_url)
        root = Path(tempfile.mkdtemp(prefix="rackflow-kv-bench-", dir=_SHM if _SHM.is_dir() else None))
        try:
            by_size = {mb: await _bench(r, root, mb, n, repeats) for mb in sizes_mb}
        finally:
            shutil.rmtree(root, ignore_errors=True)
            await r.aclose()
        head = by_size[sizes_mb[0]]
        return {"snapshot_mb": sizes_mb[0], "l1": head["l1"], "l2": head["l2"], "l1_with_l2": head["l1_with_l2"],
                "entries": n, "repeats": repeats,
                "l1_dir": str(root.parent), "by_size": {str(mb): v for mb, v in by_size.items()}}

    return asyncio.run(main())


def run(args_redis_url: str | None) -> dict[str, Any]:
    """`rackflow bench kv`: against `args_redis_url`, or embedded Valkey/etcd started in a temp dir and stopped."""
    if args_redis_url:
        return bench_kv(args_redis_url)
    from workers.local.services import EmbeddedServices

    with tempfile.TemporaryDirectory(prefix="rackflow-bench-") as tmp:
        services = EmbeddedServices(Path(tmp))
        ep = services.start()
        try:
            return bench_kv(ep.redis_url)
        finally:
            services.stop()
