"""`rackflow bench ...`: benchmarks that report medians of repeated runs, measured side by side in one process.

`streams`: the cost of the stream layer itself on this machine — msgpack codec encode/decode of a RequestEvent,
pipelined XADD, and the consumer-group runner (XREADGROUP + decode + XACK) end to end, against a real Valkey
(embedded, unless URLs are given).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from pipeline.events import RequestEvent
from streams import codec
from streams.runner import Delivery, StreamConsumer, StreamProducer, connect
from workers.runtime import WALL


def _req(i: int) -> RequestEvent:
    return RequestEvent(
        request_id=str(uuid.uuid4()), version=1, tenant="bench", user_id=f"u{i % 100}", model="qwen2-7b",
        in_tokens=1000, out_tokens=200, max_tokens=200, mem_est_kb=500_000.0, arrival_ms=WALL.now_ms(),
        rack="r0",
    )


async def _bench_streams(redis_url: str, n: int, repeats: int = 3) -> dict[str, Any]:
    events = [_req(i) for i in range(n)]
    enc, dec, xadd, consume = [], [], [], []
    r = connect(redis_url)
    try:
        for rep in range(repeats):
            t = time.perf_counter()
            encoded = [codec.encode(e) for e in events]
            enc.append(n / (time.perf_counter() - t))
            t = time.perf_counter()
            for f in encoded:
                codec.decode(f)
            dec.append(n / (time.perf_counter() - t))
            stream = f"rf:bench:{uuid.uuid4().hex}"
            producer = StreamProducer(r, WALL.now_ms, 3_600_000)
            t = time.perf_counter()
            for i in range(0, n, 500):
                await producer.add_many((stream, e) for e in events[i : i + 500])
            xadd.append(n / (time.perf_counter() - t))
            seen = [0]
            finished = asyncio.Event()

            async def handle(ds: list[Delivery], seen: list[int] = seen, finished: asyncio.Event = finished) -> None:
                seen[0] += len(ds)
                if seen[0] >= n:
                    finished.set()

            consumer = StreamConsumer(r, stream, "bench", f"c{rep}", handle, now_ms=WALL.now_ms, count=500,
                                      block_ms=50)
            t = time.perf_counter()
            task = asyncio.create_task(consumer.run())
            await asyncio.wait_for(finished.wait(), timeout=120)
            consume.append(n / (time.perf_counter() - t))
            consumer.stop()
            await task
            await consumer.close()
            await r.delete(stream)
    finally:
        await r.aclose()
    return {
        "entries": n,
        "repeats": repeats,
        "codec_encode_per_s": round(statistics.median(enc)),
        "codec_decode_per_s": round(statistics.median(dec)),
        "xadd_pipelined_per_s": round(statistics.median(xadd)),
        "consume_ack_per_s": round(statistics.median(consume)),
    }


def run_bench(args: argparse.Namespace, endpoints: tuple[str, str] | None) -> int:
    from workers.services import EmbeddedServices

    services = None
    tmp = None
    if endpoints is None:
        tmp = tempfile.TemporaryDirectory(prefix="rackflow-bench-")
        services = EmbeddedServices(Path(tmp.name))
        ep = services.start()
        endpoints = (ep.redis_url, ep.etcd_url)
    try:
        if args.what == "streams":
            res = asyncio.run(_bench_streams(endpoints[0], args.entries))
        else:  # argparse restricts the choices
            raise ValueError(args.what)
    finally:
        if services is not None:
            services.stop()
        if tmp is not None:
            tmp.cleanup()
    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        for k, v in res.items():
            print(f"{k:<24} {v}")
    return 0
