"""Durable Valkey (append-only file, `appendfsync always`) killed with SIGKILL under a steady load and started again
on the same port and data dir: every request whose XADD to rf:ingress was acknowledged ends with exactly one final
result, every role process survives (its clients reconnect with backoff), and the recovery time is measured.

Run alone with the figures printed:
    .venv/bin/python -m pytest -q -s tests/hardening/test_durable_restart.py
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pipeline.config import RackflowConfig
from streams import keys
from tests.integration import harness
from workers.local.launcher import ClusterProcesses, wait_cluster_ready
from workers.local.services import ServiceEndpoints
from workers.local.supervise import free_port
from workers.local.valkey import ValkeyProcess, valkey_durable_args
from workers.stores.ingress import Gateway

pytestmark = [pytest.mark.integration, pytest.mark.hardening, pytest.mark.timeout(180)]

TICK_S = 0.1
PER_TICK = 2
BEFORE_KILL_S = 4.0
DOWN_S = float(os.environ.get("RACKFLOW_TEST_VALKEY_DOWN_S", "2.0"))  # how long Valkey stays dead
LONG_DOWN_S = 10.0  # longer than every role's first reconnect attempts and the health staleness windows
AFTER_RESTART_S = 5.0


async def _xlen(url: str, stream: str) -> int:
    """XLEN with one attempt and short timeouts (a probe; the server may be down)."""
    r = aioredis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    try:
        return int(await r.xlen(stream))
    finally:
        await r.aclose()


async def _scenario(config: RackflowConfig, valkey: ValkeyProcess, down_s: float) -> dict[str, object]:
    from streams.runner import connect

    url = valkey.url
    accepted: list[str] = []  # XADD acknowledged
    failed: list[str] = []  # submit raised: maybe written, maybe not
    submit_errors: list[str] = []
    marks: dict[str, float] = {}
    stop = asyncio.Event()

    async def submitter() -> None:
        r = connect(url)  # the gateway's client: retries with jittered exponential backoff
        gw = Gateway(config, r)
        seed = 0
        try:
            while not stop.is_set():
                seed += 1
                items = harness.inputs(PER_TICK, seed=seed)
                try:
                    await gw.submit_many(items)
                except Exception as e:
                    failed.extend(i.request_id for i in items)
                    submit_errors.append(type(e).__name__)
                else:
                    accepted.extend(i.request_id for i in items)
                    if "restarted" in marks and "first_accept_after_restart" not in marks:
                        marks["first_accept_after_restart"] = time.monotonic()
                await asyncio.sleep(TICK_S)
        finally:
            await r.aclose()

    task = asyncio.create_task(submitter())
    await asyncio.sleep(BEFORE_KILL_S)
    before_kill = len(accepted)
    marks["killed"] = time.monotonic()
    await asyncio.to_thread(valkey.kill)  # SIGKILL: no shutdown, no final fsync
    await asyncio.sleep(down_s)
    await asyncio.to_thread(valkey.start)  # same port, same data dir: reloads the AOF
    marks["restarted"] = time.monotonic()
    marks["restarted_wall_ms"] = time.time() * 1000.0
    results_at_restart = await _xlen(url, keys.RESULTS)
    # the first final result written after the restart
    while time.monotonic() - marks["restarted"] < 60:
        if await _xlen(url, keys.RESULTS) > results_at_restart:
            marks["first_result_after_restart"] = time.monotonic()
            break
        await asyncio.sleep(0.05)
    remaining = AFTER_RESTART_S - (time.monotonic() - marks["restarted"])
    if remaining > 0:
        await asyncio.sleep(remaining)
    stop.set()
    await task
    # the health agents write again and the monitor reads again: the failover group has consumed entries written
    # after the restart (stream ids are wall-clock ms)
    probe = connect(url)
    try:
        group = next(g for g in await probe.xinfo_groups(keys.HEALTH) if g["name"] in (b"failover", "failover"))
        last = group["last-delivered-id"]
        last = last.decode() if isinstance(last, bytes) else str(last)
        health_read_after_restart = int(last.split("-")[0]) > marks["restarted_wall_ms"]
    finally:
        await probe.aclose()

    ids = set(accepted)
    got, counts = await harness.wait_results(url, ids, timeout_s=90)
    t0 = marks["restarted"]
    return {
        "accepted": len(accepted),
        "accepted_before_kill": before_kill,
        "submit_failed": len(failed),
        "submit_errors": sorted(set(submit_errors)),
        "results": len(got),
        "results_at_restart": results_at_restart,
        "lost": len(ids - set(got)),
        "duplicates": sum(1 for c in counts.values() if c > 1),
        "unexpected": len(set(got) - ids - set(failed)),
        "failed_but_answered": len(set(failed) & set(got)),
        "errors": sum(1 for e in got.values() if e.status != "ok"),
        "health_read_after_restart": health_read_after_restart,
        "valkey_down_s": round(t0 - marks["killed"], 2),
        "recovery_first_result_s": round(marks["first_result_after_restart"] - t0, 2)
        if "first_result_after_restart" in marks else None,
        "recovery_first_accept_s": round(marks["first_accept_after_restart"] - t0, 2)
        if "first_accept_after_restart" in marks else None,
        "_missing": sorted(ids - set(got))[:5],
        "_dups": [k for k, c in counts.items() if c > 1][:5],
    }


@pytest.mark.parametrize("down_s", [
    pytest.param(DOWN_S, id="short-outage"),
    pytest.param(LONG_DOWN_S, id="long-outage", marks=[pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(240)]),
])
def test_sigkill_durable_valkey_under_load_loses_nothing(
    clean_services: ServiceEndpoints, config_file, tmp_path: Path, down_s: float  # type: ignore[no-untyped-def]
) -> None:
    """Every role runs: router, batchers, workers, and the failover set (a health agent per node, the monitor, a
    Celery worker). Valkey's outage is not a node failure: no node may be drained for it."""
    path = config_file(harness.SMALL_CLUSTER)
    config = harness.small_config(path)
    valkey = ValkeyProcess(tmp_path / "valkey", port=free_port(), extra_args=valkey_durable_args("always"))
    valkey.start()
    procs = ClusterProcesses(config, valkey.url, clean_services.etcd_url, tmp_path / "logs",
                             ["--config", str(path)], log_level="INFO", with_failover=True)
    try:
        procs.start()
        asyncio.run(wait_cluster_ready(config, valkey.url, clean_services.etcd_url, timeout_s=60))
        figures = asyncio.run(_scenario(config, valkey, down_s))
        dead = procs.dead()
        assert not dead, {p.name: p.log_path.read_text()[-2000:] for p in dead}
        roles = {p.role for p in procs.procs}
        assert roles >= {"router", "batcher", "worker", "agent", "monitor", "celery"}, roles
        monitor_log = "".join(p.log_path.read_text() for p in procs.procs if p.role == "monitor")
        figures["drained_nodes"] = monitor_log.count("marked draining") + monitor_log.count("marked dead")
    finally:
        procs.stop()
        valkey.stop()
    print("\ndurable-restart " + json.dumps(figures, sort_keys=True))
    assert figures["drained_nodes"] == 0, f"the monitor drained a node for Valkey's outage: {figures}"
    assert figures["health_read_after_restart"], f"agents or monitor did not resume after the restart: {figures}"
    assert list((tmp_path / "valkey").glob("appendonlydir/*.aof")), "no append-only file written"
    assert figures["accepted_before_kill"], figures
    assert figures["results_at_restart"], f"the restarted Valkey did not reload the results from its AOF: {figures}"
    assert figures["recovery_first_result_s"] is not None, f"no result after the restart: {figures}"
    assert figures["lost"] == 0, f"accepted requests without a final result: {figures}"
    assert figures["duplicates"] == 0, f"requests with more than one final result: {figures}"
    assert figures["unexpected"] == 0, figures
    assert figures["errors"] == 0, figures
