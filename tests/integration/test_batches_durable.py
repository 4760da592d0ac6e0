"""A batch's state survives a crash of Valkey with persistence on (the durable profile: the append-only file,
fsynced per write): its record, its status, its request counts and every recorded line are there when Valkey comes
back on the same data dir after a kill -9, and the runner's next write goes on from them. Its files live in the file
store, on disk (tests/unit/test_file_store.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from pipeline.batch_state import Batch
from streams.runner import connect
from workers.local.supervise import free_port
from workers.local.valkey import ValkeyProcess, valkey_durable_args
from workers.stores.batches import BatchOwner, BatchStore, new_batch_id

pytestmark = [pytest.mark.integration, pytest.mark.batch_api, pytest.mark.timeout(120)]


def _kill9(valkey: ValkeyProcess) -> None:
    pid = valkey.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"valkey {pid} did not die")


def test_a_batchs_record_status_counts_and_lines_survive_a_kill_9_of_valkey(tmp_path: Path) -> None:
    data, port = tmp_path / "valkey", free_port()
    bid = new_batch_id()
    batch = Batch(bid, "acme", "/v1/chat/completions", "file-" + "0" * 24, "24h", int(time.time()), total=3)

    async def before(url: str) -> None:
        r = connect(url)
        store = BatchStore(r, 3600)
        await store.create(batch, BatchOwner("acme", "u1"), "token-1")
        await store.update(bid, lambda b: b.moved("in_progress", int(time.time())))
        assert await store.record_lines(batch, [(0, True, {"custom_id": "a"}), (1, False, {"custom_id": "b"})]) == 2
        await r.aclose()

    async def after(url: str) -> None:
        r = connect(url)
        store = BatchStore(r, 3600)
        got = await store.get(bid)
        assert got is not None and got.status == "in_progress"
        assert (got.total, got.completed, got.failed) == (3, 1, 1)
        lines = await store.lines(bid)
        assert sorted(lines) == [0, 1] and lines[0][0] and not lines[1][0]
        # the runner goes on: a line already recorded is not recorded twice, the last one is
        assert await store.record_lines(got, [(1, True, {"custom_id": "b"}), (2, True, {"custom_id": "c"})]) == 1
        done = await store.update(bid, lambda b: b.moved("finalizing", int(time.time())))
        assert (done.status, done.completed, done.failed) == ("finalizing", 2, 1)
        assert (await store.owner(bid)).tenant == "acme"
        await r.aclose()

    valkey = ValkeyProcess(data, port=port, extra_args=valkey_durable_args("always"))
    valkey.start()
    try:
        asyncio.run(before(valkey.url))
        _kill9(valkey)
    finally:
        valkey.stop()
    with ValkeyProcess(data, port=port, extra_args=valkey_durable_args("always")) as again:
        asyncio.run(after(again.url))
