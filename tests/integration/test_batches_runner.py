"""The Batch API's runner (workers/control/batches.py) in process, on real Valkey, without a cluster: who may run a
batch (the lease and the `next` token: a second delivery of a message already handed on is stale, one racing a live
run waits), the input check that fails a batch naming its lines (what the gateway would refuse outright: n > 1,
logprobs, a prompt over the context), and a cancel that comes while the batch is validated (it ends `cancelled`
with nothing run and no file)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.batch_state import Batch
from pipeline.config import DEFAULT_CONFIG_DIR, RackflowConfig, load_config
from streams.runner import connect
from workers.control.batches import _slice
from workers.control.jobs import _TaskContext
from workers.local.services import ServiceEndpoints
from workers.stores.batches import BatchOwner, BatchStore, new_batch_id
from workers.stores.files import LocalFileStore
from workers.stores.ingress import Gateway

pytestmark = [pytest.mark.integration, pytest.mark.batch_api]


def _config(tmp_path: Path) -> RackflowConfig:
    p = tmp_path / "runner.yaml"
    p.write_text(yaml.safe_dump({
        "cluster": {"racks": [{"name": "r0", "node_count": 1,
                               "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}}]},
        "gateway": {"files_dir": str(tmp_path / "files")},
        "batches": {"slice_s": 2, "lease_s": 2, "poll_ms": 50},
    }))
    return load_config(DEFAULT_CONFIG_DIR, [p])


def _line(i: int, **body: Any) -> dict[str, Any]:
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "qwen2-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}}


async def _new_batch(config: RackflowConfig, store: BatchStore, rows: list[dict[str, Any]], token: str) -> Batch:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    f = LocalFileStore(Path(config.gateway.files_dir)).put("t1", "in.jsonl", "batch", data)
    b = Batch(new_batch_id(), "t1", "/v1/chat/completions", f.id, "24h", 1_900_000_000)
    await store.create(b, BatchOwner("t1", "u1"), token)
    return b


@pytest.mark.timeout(60)
def test_who_runs_a_batch(clean_services: ServiceEndpoints, tmp_path: Path) -> None:
    config = _config(tmp_path)

    async def run() -> None:
        r = connect(clean_services.redis_url)
        try:
            store = BatchStore(r, 3600)
            b = await _new_batch(config, store, [_line(0)], "t0")
            assert await store.claim(b.id, "t0", "h1", 5000) == "ok"
            assert await store.claim(b.id, "t0", "h2", 5000) == "busy"  # a second delivery while h1 works
            assert await store.renew(b.id, "h1", 5000) and not await store.renew(b.id, "h2", 5000)
            assert await store.hand_over(b.id, "h1", "t1")
            assert await store.claim(b.id, "t0", "h3", 5000) == "stale"  # handed on: the old message is a no-op
            assert await store.claim(b.id, "t1", "h3", 5000) == "ok"
            assert not await store.renew(b.id, "h1", 5000) and not await store.hand_over(b.id, "h1", "t9")
            assert await store.hand_over(b.id, "h3", "")  # dropped, `next` kept: a retry of t1 claims again
            assert await store.claim(b.id, "t1", "h4", 100) == "ok"
            await asyncio.sleep(0.3)  # h4 died: its lease runs out, the redelivered t1 resumes
            assert await store.claim(b.id, "t1", "h5", 5000) == "ok"
            assert await store.claim("batch_" + "f" * 32, "t1", "h5", 5000) == "gone"
        finally:
            await r.aclose()

    asyncio.run(run())


def _run_slice(config: RackflowConfig, redis_url: str, batch_id: str, token: str) -> tuple[str, str]:
    async def go() -> tuple[str, str]:
        r = connect(redis_url)
        try:
            ctx = _TaskContext(asyncio.get_running_loop(), config, r, Gateway(config, r))
            return await _slice(ctx, batch_id, token, "holder")
        finally:
            await r.aclose()

    return asyncio.run(go())


def _get(redis_url: str, batch_id: str) -> Batch:
    async def go() -> Batch:
        r = connect(redis_url)
        try:
            b = await BatchStore(r, 3600).get(batch_id)
            assert b is not None
            return b
        finally:
            await r.aclose()

    return asyncio.run(go())


@pytest.mark.timeout(60)
def test_lines_the_gateway_would_refuse_fail_the_batch_naming_them(clean_services: ServiceEndpoints,
                                                                    tmp_path: Path) -> None:
    config = _config(tmp_path)
    rows = [_line(0), _line(1, n=2), _line(2, logprobs=True), _line(3, max_tokens=10_000_000),
            _line(4, temperature=7), _line(5, model="no-such-model")]

    async def make() -> Batch:
        r = connect(clean_services.redis_url)
        try:
            return await _new_batch(config, BatchStore(r, 3600), rows, "t0")
        finally:
            await r.aclose()

    b = asyncio.run(make())
    assert _run_slice(config, clean_services.redis_url, b.id, "t0") == ("final", "failed")
    got = _get(clean_services.redis_url, b.id)
    assert got.status == "failed" and got.stamps.get("failed_at") and got.total == 0
    errors = {e["line"]: e for e in got.errors}
    assert set(errors) == {2, 3, 4, 5, 6}, errors
    assert (errors[2]["param"], errors[3]["param"]) == ("body.n", "body.logprobs")
    assert (errors[4]["code"], errors[4]["param"]) == ("context_length_exceeded", "body.max_tokens")
    assert "lower max_tokens" in errors[4]["message"]
    assert errors[5]["param"] == "body.temperature" and errors[6]["code"] == "model_not_found"
    # a second delivery of the same message: the batch is final, nothing is done
    assert _run_slice(config, clean_services.redis_url, b.id, "t0")[0] == "final"


@pytest.mark.timeout(60)
def test_a_cancel_during_validation_ends_cancelled_with_nothing_run(clean_services: ServiceEndpoints,
                                                                   tmp_path: Path) -> None:
    config = _config(tmp_path)

    async def make() -> Batch:
        r = connect(clean_services.redis_url)
        try:
            store = BatchStore(r, 3600)
            b = await _new_batch(config, store, [_line(i) for i in range(5)], "t0")
            await store.update(b.id, lambda x: x.cancel(x.created_at + 1))
            return b
        finally:
            await r.aclose()

    b = asyncio.run(make())
    assert _get(clean_services.redis_url, b.id).status == "cancelling"
    assert _run_slice(config, clean_services.redis_url, b.id, "t0") == ("final", "cancelled")
    got = _get(clean_services.redis_url, b.id)
    assert got.status == "cancelled" and got.output_file_id is None and got.error_file_id is None
    assert (got.completed, got.failed) == (0, 0)
