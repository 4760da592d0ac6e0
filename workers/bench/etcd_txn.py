"""etcd ownership-transaction latency under contention: `clients` concurrent clients, each moving its own
sequence records by the live compare-and-swap (`SequenceRegistry.move`: a read, then a transaction on the
record's mod revision, what a migration pays), against a real etcd (in calibration: a 3-member cluster on
loopback, every write a Raft round through a quorum and an fsync)."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from typing import Any

from pipeline.stats import percentile
from workers.stores.etcd import SeqRecord, SequenceRegistry, etcd_client


async def _level(url: str, clients: int, duration_s: float) -> dict[str, Any]:
    conns = [etcd_client(url) for _ in range(clients)]
    lat: list[float] = []
    try:
        regs = [SequenceRegistry(c) for c in conns]
        seqs = [f"bench-{uuid.uuid4().hex}" for _ in range(clients)]
        await regs[0].apply([SeqRecord(s, "n0", 1, "r0", 0.0) for s in seqs], [])
        stop_at = time.perf_counter() + duration_s

        async def mover(k: int) -> None:
            version, owner = 1, "n0"
            while time.perf_counter() < stop_at:
                dst = "n1" if owner == "n0" else "n0"
                t = time.perf_counter()
                await regs[k].move(seqs[k], version, owner, dst, time.time() * 1000.0)
                lat.append((time.perf_counter() - t) * 1000.0)
                version, owner = version + 1, dst

        t0 = time.perf_counter()
        await asyncio.gather(*(mover(k) for k in range(clients)))
        wall = time.perf_counter() - t0
        await regs[0].apply([], seqs)
    finally:
        for c in conns:
            await c.close()
    return {"clients": clients, "moves": len(lat), "p50_ms": round(percentile(lat, 50), 3),
            "p99_ms": round(percentile(lat, 99), 3), "moves_per_s": round(len(lat) / wall, 1)}


async def bench_etcd_txn(url: str, levels: tuple[int, ...] = (1, 8, 32), duration_s: float = 4.0,
                         repeats: int = 3) -> dict[str, Any]:
    """Per concurrency level, the medians over `repeats` runs of `duration_s` each."""
    out: dict[str, Any] = {"url_members": len(url.split(",")), "duration_s": duration_s, "repeats": repeats,
                           "levels": {}}
    for c in levels:
        runs = [await _level(url, c, duration_s) for _ in range(repeats)]
        out["levels"][str(c)] = {
            "clients": c,
            "p50_ms": round(statistics.median(r["p50_ms"] for r in runs), 3),
            "p99_ms": round(statistics.median(r["p99_ms"] for r in runs), 3),
            "moves_per_s": round(statistics.median(r["moves_per_s"] for r in runs), 1),
            "runs": runs,
        }
    return out
