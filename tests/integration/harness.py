"""Helpers for integration tests: submit requests through the gateway function, read final results back."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from pipeline.config import DEFAULT_CONFIG_DIR, RackflowConfig, load_config
from pipeline.events import BatchEvent, RequestEvent, ResultEvent
from pipeline.profiling import ProfileInput
from streams import codec, keys
from streams.runner import connect
from workers.shell.runtime import WALL
from workers.stores.ingress import Gateway

SMALL_CLUSTER = {
    "cluster": {
        "racks": [
            {"name": "r0", "node_count": 2, "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}},
            {"name": "r1", "node_count": 2, "node": {"gpu": "a100-80gb", "tp": 1, "models": ["qwen2-7b"]}},
        ]
    },
    "policies": {"streams": {"claim_idle_ms": 1500}},
}


def small_config(path: Path) -> RackflowConfig:
    return load_config(DEFAULT_CONFIG_DIR, [path])


def inputs(n: int, seed: int = 1, max_out: int = 24) -> list[ProfileInput]:
    rng = random.Random(seed)
    return [
        ProfileInput(
            request_id=str(uuid.uuid4()), tenant="t1", user_id=f"user-{rng.randrange(50)}", model="qwen2-7b",
            arrival_ms=WALL.now_ms(), prompt_tokens=rng.randint(16, 2000), max_tokens=rng.randint(1, max_out),
        )
        for _ in range(n)
    ]


async def submit(config: RackflowConfig, redis_url: str, items: list[ProfileInput]) -> list[RequestEvent]:
    r = connect(redis_url)
    try:
        gw = Gateway(config, r)
        out: list[RequestEvent] = []
        for i in range(0, len(items), 100):
            out += await gw.submit_many(items[i : i + 100])
        return out
    finally:
        await r.aclose()


async def results(redis_url: str) -> tuple[dict[str, ResultEvent], Counter[str]]:
    r = connect(redis_url)
    try:
        entries = await r.xrange(keys.RESULTS)
    finally:
        await r.aclose()
    first: dict[str, ResultEvent] = {}
    counts: Counter[str] = Counter()
    for _eid, fields in entries:
        ev = codec.decode(fields)
        assert isinstance(ev, ResultEvent)
        counts[ev.request_id] += 1
        first.setdefault(ev.request_id, ev)
    return first, counts


async def wait_results(redis_url: str, ids: set[str], timeout_s: float) -> tuple[dict[str, ResultEvent], Counter[str]]:
    deadline = time.monotonic() + timeout_s
    while True:
        got, counts = await results(redis_url)
        if ids <= set(got) or time.monotonic() > deadline:
            return got, counts
        await asyncio.sleep(0.3)


async def batches(redis_url: str, node: str) -> list[tuple[str, BatchEvent]]:
    r = connect(redis_url)
    try:
        entries = await r.xrange(keys.node_batches(node))
    finally:
        await r.aclose()
    out = []
    for eid, fields in entries:
        ev = codec.decode(fields)
        assert isinstance(ev, BatchEvent)
        out.append((eid.decode(), ev))
    return out


async def read_stream(redis_url: str, stream: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    r = connect(redis_url)
    try:
        return await r.xrange(stream)
    finally:
        await r.aclose()


def ok_result(req: RequestEvent) -> ResultEvent:
    """A one-token `ok` final result of `req`, as node r0-n0 would write it."""
    now = WALL.now_ms()
    return ResultEvent.of(req, "ok", "r0-n0", "r0", now, out_tokens=1, text="ok", first_token_ms=now)


class Responder:
    """Stands in for the pipeline: answers every request admitted to rf:ingress with the final result that
    `answer(request)` gives (None: leave it unanswered; default: an `ok` result of one token). `answered` counts
    the results written."""

    def __init__(self, redis_url: str, answer: Callable[[RequestEvent], ResultEvent | None] | None = None) -> None:
        self.redis_url = redis_url
        self.answer = answer or ok_result
        self.answered = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True, name="responder")

    async def _main(self) -> None:
        from streams.runner import connect
        from workers.stores.results import ResultWriter

        r = connect(self.redis_url)
        writer = ResultWriter(r, WALL.now_ms, 3_600_000)
        last = "0-0"
        try:
            while not self._stop.is_set():
                for _stream, entries in await r.xread({keys.INGRESS: last}, count=64, block=100) or []:
                    for eid, fields in entries:
                        last = eid.decode()
                        req = codec.decode(fields)
                        assert isinstance(req, RequestEvent)
                        try:
                            res = self.answer(req)
                        except Exception as e:  # fail the request at once, not after the gateway's timeout
                            res = ResultEvent.of(req, "error", "r0-n0", "r0", WALL.now_ms(),
                                                 error=f"the test's responder failed: {type(e).__name__}: {e}")
                        if res is not None and await writer.write(res):
                            self.answered += 1
        finally:
            await r.aclose()

    def __enter__(self) -> Responder:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.thread.join(10)
