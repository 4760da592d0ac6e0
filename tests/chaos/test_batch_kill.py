"""Nothing lost: a batch of 10,000 lines (max_tokens small) through the whole cluster while each role is killed
with SIGKILL (its whole process group: `kill -9`) and started again, one after another, as a supervisor would: a GPU
worker, a batcher, the router, the gateway (the client's way in: it polls through the outage), and last the Celery
worker running the batch (its message comes back after the broker's visibility timeout and the new run resumes from
what Valkey recorded). Each kill waits for the batch to be further along, not for a time. At the end the batch is
`completed` and every custom_id has exactly one line in the output file or the error file.

`long` (`make test` leaves it out): about 100 s here, most of it the Celery worker's message coming back (the broker's
visibility timeout, 60 s)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.integration import harness
from workers.local.launcher import ClusterProcesses, RoleProcess, config_overlay_file, wait_cluster_ready
from workers.local.services import ServiceEndpoints
from workers.local.supervise import free_port
from workers.stores.batches import BatchStore

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.slow, pytest.mark.long,
              pytest.mark.batch_api]

LINES = 10_000
KILLS = [("worker", "worker-r0-n0", 0.03), ("batcher", "batcher-r1", 0.06), ("router", "router", 0.09),
         ("gateway", "gateway", 0.12), ("celery-jobs", "celery-jobs", 0.15)]
"""(role, process, share of the lines ended when it is killed), in order."""


def _kill(p: RoleProcess) -> None:
    try:
        os.killpg(p.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.proc.wait()


def _restart(procs: ClusterProcesses, victim: RoleProcess, gateway_port: int) -> None:
    """The killed role again, under the same name and arguments."""
    if victim.role == "worker":
        procs.start_worker(victim.name.removeprefix("worker-"))
    elif victim.role == "batcher":
        procs._spawn("batcher", victim.name, ["--rack", victim.name.removeprefix("batcher-")])
    elif victim.role == "router":
        procs._spawn("router", victim.name, [])
    elif victim.role == "gateway":
        procs.start_gateway(victim.name, gateway_port)
    elif victim.role == "celery-jobs":
        procs.start_jobs_worker(victim.name)
    else:  # pragma: no cover - KILLS is closed
        raise ValueError(victim.role)


def _progress(redis_url: str, batch_id: str) -> tuple[str, int]:
    """(status, lines ended) as Valkey has them (read there, not through the gateway: it is killed too)."""
    from streams.runner import connect

    async def read() -> tuple[str, int]:
        r = connect(redis_url)
        try:
            b = await BatchStore(r, 3600).get(batch_id)
        finally:
            await r.aclose()
        assert b is not None
        return b.status, b.completed + b.failed

    return asyncio.run(read())


def _http_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url.removesuffix("/v1") + "/healthz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the restarted gateway does not answer at {url}")


def _retrying(call: Any, timeout_s: float = 60.0) -> Any:
    """A client call that rides out the gateway's restart (connection refused while it is down)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except openai.APIConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.mark.timeout(900)
def test_a_10k_line_batch_survives_a_kill_of_every_role(clean_services: ServiceEndpoints, tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    config = config_overlay_file(path, {
        **harness.SMALL_CLUSTER,
        "gateway": {"files_dir": str(tmp_path / "files")},
        "batches": {"max_in_flight": 256, "slice_s": 15},
    })
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    procs = ClusterProcesses(config, clean_services.redis_url, clean_services.etcd_url, tmp_path / "logs",
                             ["--config", str(path)], log_level="INFO", gateway_port=port, gateway_no_auth=True,
                             with_gateway=True, with_failover=True, worker_grace_s=2.0)
    events: list[dict[str, Any]] = []
    try:
        procs.start()
        asyncio.run(wait_cluster_ready(config, clean_services.redis_url, clean_services.etcd_url, 90))
        _http_ready(url, 60)
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
        rows = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "qwen2-7b", "max_tokens": 2,
                          "messages": [{"role": "user", "content": f"line {i}: {'word ' * (i % 40)}"}]}}
                for i in range(LINES)]
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
        f = client.files.create(file=("10k.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        t0 = time.monotonic()

        for role, name, share in KILLS:
            while True:  # the batch further along, whatever time that takes
                status, ended = _progress(clean_services.redis_url, batch.id)
                if ended >= share * LINES or status not in ("validating", "in_progress"):
                    break
                time.sleep(0.1)
            victim = next(p for p in procs.procs if p.name == name and p.proc.poll() is None)
            _kill(victim)
            procs.procs.remove(victim)
            events.append({"role": role, "t_s": round(time.monotonic() - t0, 1), "status": status, "ended": ended})
            time.sleep(1.0)
            _restart(procs, victim, port)
            if role == "gateway":
                _http_ready(url, 60)
            else:  # the next kill finds the cluster whole again (every node registered, every group joined)
                asyncio.run(wait_cluster_ready(config, clean_services.redis_url, clean_services.etcd_url, 90))

        deadline = time.monotonic() + 600
        b = _retrying(lambda: client.batches.retrieve(batch.id))
        while b.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
            time.sleep(1.0)
            b = _retrying(lambda: client.batches.retrieve(batch.id))
        took = time.monotonic() - t0
        print(f"\nbatch of {LINES}: {b.status} in {took:.0f} s, counts {b.request_counts}, kills {events}")
        # every kill came while the batch ran: the test's precondition, by the batch's size
        assert all(e["status"] == "in_progress" for e in events), events
        assert b.status == "completed", b
        assert b.request_counts.total == LINES and b.request_counts.completed + b.request_counts.failed == LINES

        def lines(file_id: str | None) -> list[dict[str, Any]]:
            if file_id is None:
                return []
            raw = _retrying(lambda: client.files.content(file_id)).content
            return [json.loads(ln) for ln in raw.splitlines() if ln.strip()]

        out, err = lines(b.output_file_id), lines(b.error_file_id)
        ids = Counter(x["custom_id"] for x in out + err)
        assert set(ids) == {f"line-{i}" for i in range(LINES)}, f"{LINES - len(ids)} custom_ids missing"
        assert all(c == 1 for c in ids.values()), [k for k, c in ids.items() if c > 1][:10]
        assert len(out) == b.request_counts.completed and len(err) == b.request_counts.failed
        assert all(x["response"]["status_code"] == 200 and x["response"]["body"]["object"] == "chat.completion"
                   for x in out)
        codes = Counter(x["response"]["body"]["error"]["code"] if x["response"] else x["error"]["code"] for x in err)
        print(f"error-file lines by code: {dict(codes)}")
    finally:
        procs.stop()
