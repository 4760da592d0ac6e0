"""Async jobs (Celery, queue `jobs`) against a live cluster: real router, batcher, sim workers, a Celery worker, Flower
and the HTTP gateway as processes on real Valkey + etcd.

A job's request runs through the same ingress stream as HTTP traffic; `.get()` returns the completion; a group
submitted with `rackflow jobs submit --wait --json` completes with every result; cancel revokes the task and aborts
the sequence on its engine (final result `cancelled`, exactly once, the engine no longer runs it); a request
cancelled before it starts never runs; `/v1/jobs` does the same over HTTP, per tenant.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
import redis
import yaml

from pipeline.config import RackflowConfig
from pipeline.events import HealthEvent, ResultEvent
from pipeline.profiling import ProfileInput
from streams import codec, keys
from tests.conftest import REPO, _clean
from tests.integration import harness
from workers.local.launcher import ClusterProcesses, wait_cluster_ready
from workers.local.services import ServiceEndpoints
from workers.local.supervise import free_port
from workers.shell.runtime import WALL

pytestmark = pytest.mark.integration

SECRET = "jobs-integration-secret-0123456789abcdef"
MODEL = "qwen2-7b"
LONG = 4000  # tokens: tens of seconds on a sim A100, so a cancel always finds it running
RF = [sys.executable, "-m", "workers.cli"]
CLUSTER = {
    "cluster": {"racks": [
        {"name": "r0", "node_count": 2, "node": {"gpu": "a100-80gb", "tp": 1, "models": [MODEL]}},
    ]},
    "policies": {"streams": {"claim_idle_ms": 1500}, "worker": {"token_flush_ms": 20}},
    "gateway": {"auth": {"mode": "hs256", "secret_env": "RACKFLOW_JWT_SECRET"}},
}


@dataclass
class JobCluster:
    config: RackflowConfig
    config_path: Path
    redis_url: str
    etcd_url: str
    gateway_url: str
    flower_url: str
    procs: ClusterProcesses

    def r(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RACKFLOW_")}
        cmd = [*RF, "--config", str(self.config_path), "--redis-url", self.redis_url, "--etcd-url", self.etcd_url,
               *args]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _start_gateway(config: Path, redis_url: str, etcd_url: str, log_path: Path) -> tuple[subprocess.Popen[str], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RACKFLOW_")} | {"RACKFLOW_JWT_SECRET": SECRET}
    cmd = [*RF, "--config", str(config), "--redis-url", redis_url, "--etcd-url", etcd_url, "--log-level", "WARNING",
           "gateway", "--port", "0"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                text=True, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline() if proc.stdout else ""), daemon=True).start()
    try:
        line = lines.get(timeout=60)
    except queue.Empty:
        line = ""
    if not line.startswith("gateway listening on "):
        _stop(proc)
        raise AssertionError(f"gateway did not start: {line!r}\n{log_path.read_text()[-3000:]}")
    return proc, line.removeprefix("gateway listening on ").strip()


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _until(what: str, fn: Callable[[], Any], timeout_s: float, every_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g}s: {what}")
        time.sleep(every_s)


def _flower(url: str, path: str) -> Any:
    try:
        resp = httpx.get(f"{url}{path}", timeout=10)
    except httpx.HTTPError:
        return None
    return resp.json() if resp.status_code == 200 else None


@pytest.fixture(scope="module")
def jc(services: ServiceEndpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobCluster]:
    asyncio.run(_clean(services))
    tmp = tmp_path_factory.mktemp("jobs")
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(CLUSTER))
    config = harness.small_config(path)
    procs = ClusterProcesses(config, services.redis_url, services.etcd_url, tmp / "logs", ["--config", str(path)],
                             log_level="INFO")
    gateway: subprocess.Popen[str] | None = None
    flower_port = free_port()
    try:
        procs.start()
        procs.start_flower(flower_port)
        procs.start_celery_worker()
        gateway, url = _start_gateway(path, services.redis_url, services.etcd_url, tmp / "gateway.log")
        asyncio.run(wait_cluster_ready(config, services.redis_url, services.etcd_url, 90))
        flower = f"http://127.0.0.1:{flower_port}"
        # Flower sees task events only once it is connected: wait until it lists the Celery worker
        _until("Flower lists the Celery worker", lambda: _flower(flower, "/api/workers?refresh=1"), 60, 0.5)
        from workers.control.app import configure

        configure(config, services.redis_url, services.etcd_url)
        yield JobCluster(config, path, services.redis_url, services.etcd_url, url, flower, procs)
        assert not procs.dead(), [p.log_path.read_text()[-2000:] for p in procs.dead()]
    finally:
        if gateway is not None:
            _stop(gateway)
        procs.stop()


def _final(jc: JobCluster, rid: str) -> ResultEvent | None:
    for _eid, fields in jc.r().xrevrange(keys.request_out(rid), count=8):
        ev = codec.decode(fields)
        if isinstance(ev, ResultEvent):
            return ev
    return None


def _results_of(jc: JobCluster, rid: str) -> list[ResultEvent]:
    out = []
    for _eid, fields in jc.r().xrange(keys.RESULTS):
        ev = codec.decode(fields)
        if isinstance(ev, ResultEvent) and ev.request_id == rid:
            out.append(ev)
    return out


def _running(jc: JobCluster, node: str) -> int:
    h = jc.r().hgetall(keys.node_status(node))
    ev = codec.decode(h)
    assert isinstance(ev, HealthEvent)
    return ev.running


def _token(tenant: str, sub: str = "alice") -> dict[str, str]:
    now = int(time.time())
    tok = jwt.encode({"sub": sub, "tenant": tenant, "iat": now, "exp": now + 600}, SECRET, algorithm="HS256")
    return {"Authorization": f"Bearer {tok}"}


# -- the task ----------------------------------------------------------------------------------------------------------
def test_generate_returns_the_completion_through_the_pipeline(jc: JobCluster) -> None:
    from workers.control.jobs import generate

    res = generate.delay(prompt="write a haiku about racks", model=MODEL, user="u-7", max_tokens=16)
    out = res.get(timeout=60)
    assert out["id"] == res.id and out["status"] == "ok" and out["model"] == MODEL
    assert out["tokens"] == 16 and len(out["text"].split()) == 16, out
    assert out["usage"]["completion_tokens"] == 16 and out["usage"]["prompt_tokens"] > 0
    t = out["timings"]
    assert 0 < t["ttft_ms"] <= t["e2e_ms"] and t["queue_ms"] is not None, t
    assert out["node"] in {n.name for n in jc.config.nodes()} and out["rack"] == "r0"
    # the same path as HTTP traffic: admitted to rf:ingress, routed and dispatched, one final result
    results = _results_of(jc, res.id)
    assert len(results) == 1 and results[0].status == "ok" and results[0].user_id == "u-7"
    decisions = [f for _e, f in jc.r().xrange(keys.DECISIONS) if res.id.encode() in f[b"d"]]
    assert len(decisions) >= 2, "route and dispatch decisions of the job's request"
    # Flower shows the job with its state and runtime
    task = _until("Flower has the task as succeeded", lambda: (
        (t := (_flower(jc.flower_url, "/api/tasks") or {}).get(res.id)) and t.get("state") == "SUCCESS" and t), 20)
    assert task["name"] == "rackflow.jobs.generate" and task["runtime"] > 0, task


def test_cli_submits_a_group_and_waits_for_every_result(jc: JobCluster, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join([
        json.dumps({"prompt": "first"}),
        json.dumps({"prompt": "second", "max_tokens": 5, "user": "bob"}),
        "",
        json.dumps({"prompt": "third", "model": MODEL}),
    ]) + "\n")
    res = jc.cli("jobs", "submit", "--file", str(prompts), "--max-tokens", "7", "--wait", "--json", "--no-progress",
                 timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    state = json.loads(res.stdout)
    assert state["kind"] == "group" and state["status"] == "succeeded" and state["tasks"] == 3
    assert state["progress"] == {"done": 3, "total": 3} and state["counts"] == {"SUCCESS": 3}
    assert [r["result"]["tokens"] for r in state["results"]] == [7, 5, 7]
    assert all(r["result"]["text"] for r in state["results"])
    human = jc.cli("jobs", "status", state["id"])
    assert human.returncode == 0 and "succeeded" in human.stdout and "3/3 done" in human.stdout, human.stdout
    # a bad line: a clear error naming it, and nothing submitted
    jobs_before = len(jc.r().keys("rf:job:*"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": "ok", "model": "gpt-nope"}) + "\n")
    res = jc.cli("jobs", "submit", "--file", str(bad))
    assert res.returncode == 2 and f"{bad}:2: model 'gpt-nope' does not exist" in res.stderr and \
        "nothing was submitted" in res.stderr, res.stderr
    assert len(jc.r().keys("rf:job:*")) == jobs_before


def test_job_file_errors_name_the_line(tmp_path: Path) -> None:
    from workers.control import jobs

    config = harness.small_config(_write(tmp_path / "c.yaml", CLUSTER))
    bad = tmp_path / "bad.jsonl"
    for text, message in (
        (json.dumps({"prompt": "ok"}) + "\n\n" + json.dumps({"max_tokens": 3}) + "\n", ":3: `prompt` is required"),
        ('{"prompt": "ok"\n', ":1: not valid JSON"),
        (json.dumps({"prompt": "ok", "max_tokens": "9"}) + "\n", ":1: `max_tokens` must be an integer >= 1"),
        (json.dumps({"prompt": "ok", "temperature": 1}) + "\n", ":1: unknown field 'temperature'"),
        ("\n", "no requests in it"),
    ):
        bad.write_text(text)
        with pytest.raises(jobs.JobSpecError) as e:
            jobs.read_jsonl(bad)
        assert message in str(e.value), (text, str(e.value))
    with pytest.raises(jobs.JobSpecError, match=r"line 2: prompt \(\d+ tokens\) \+ max_tokens \(40000\) exceeds"):
        jobs.check_specs(config, [jobs.JobSpec("ok"), jobs.JobSpec("ok", max_tokens=40_000)], "t", ["line 1", "line 2"])
    assert jobs.check_specs(config, [jobs.JobSpec("ok")], "t", ["line 1"])[0].model == MODEL  # the only one served


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_cancel_revokes_the_task_and_aborts_the_sequence(jc: JobCluster) -> None:
    from celery.result import AsyncResult

    from workers.control.jobs import generate

    res = generate.delay(prompt="a very long story", model=MODEL, max_tokens=LONG)
    rid = res.id
    _until("the job's request streams tokens", lambda: jc.r().xlen(keys.request_out(rid)) > 2, 30, 0.1)
    assert AsyncResult(rid).state == "STARTED"
    out = jc.cli("jobs", "cancel", rid, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["revoked"] == 1 and report["signalled"] == 1 and report["finished"] == 0, report
    final = _until("the cancelled final result", lambda: _final(jc, rid), 10)
    assert final.status == "cancelled" and 0 < final.out_tokens < LONG and "cancelled" in final.error, final
    _until("the task is REVOKED", lambda: AsyncResult(rid).state == "REVOKED", 15)
    # the engine no longer runs it: the node reports nothing running, its stream stops, its etcd record is gone
    _until(f"{final.node} runs nothing", lambda: _running(jc, final.node) == 0, 5)
    n = jc.r().xlen(keys.request_out(rid))
    time.sleep(0.6)
    assert jc.r().xlen(keys.request_out(rid)) == n
    assert len(_results_of(jc, rid)) == 1

    async def record() -> Any:
        from workers.stores.etcd import NodeRegistry, SequenceRegistry

        reg = NodeRegistry(jc.etcd_url)
        try:
            return await SequenceRegistry(reg.client).get(rid)
        finally:
            await reg.close(revoke=False)

    assert _until("the sequence record is released", lambda: asyncio.run(record()) is None, 5)
    status = jc.cli("jobs", "status", rid, "--json")
    assert json.loads(status.stdout)["status"] == "cancelled", status.stdout
    flower = _until("Flower has the task as revoked", lambda: (
        (t := (_flower(jc.flower_url, "/api/tasks") or {}).get(rid)) and t.get("state") == "REVOKED" and t), 20)
    assert flower["name"] == "rackflow.jobs.generate"


def test_request_cancelled_before_it_starts_never_runs(jc: JobCluster) -> None:
    from workers.control import jobs

    rid = str(uuid.uuid4())

    async def cancel_first() -> dict[str, int]:
        from streams.runner import connect

        r = connect(jc.redis_url)
        try:
            return await jobs.abort_requests(r, None, [rid], "cancelled by test", 60_000)
        finally:
            await r.aclose()

    assert asyncio.run(cancel_first()) == {"requests": 1, "finished": 0, "signalled": 0}
    item = ProfileInput(rid, "t1", "u1", MODEL, WALL.now_ms(), prompt_tokens=100, max_tokens=LONG)
    asyncio.run(harness.submit(jc.config, jc.redis_url, [item]))
    got, counts = asyncio.run(harness.wait_results(jc.redis_url, {rid}, timeout_s=20))
    assert counts[rid] == 1
    assert got[rid].status == "cancelled" and got[rid].out_tokens == 0 and "before it started" in got[rid].error
    assert jc.r().xlen(keys.request_out(rid)) == 1  # the result alone: not a single token


def test_task_whose_request_was_cancelled_ends_revoked(jc: JobCluster) -> None:
    """The task's own check (a worker pool that cannot terminate, or a revoke that never reached the worker): a task
    that starts after its request was cancelled admits nothing and ends REVOKED."""
    from celery.exceptions import TaskRevokedError

    from workers.control import jobs

    rid = str(uuid.uuid4())

    async def cancel_first() -> None:
        from streams.runner import connect

        r = connect(jc.redis_url)
        try:
            await jobs.abort_requests(r, None, [rid], "cancelled by test", 60_000)
        finally:
            await r.aclose()

    asyncio.run(cancel_first())
    res = jobs.generate.apply_async(kwargs={"prompt": "never", "model": MODEL, "max_tokens": 5}, task_id=rid)
    with pytest.raises(TaskRevokedError, match="cancelled before it started"):
        res.get(timeout=30)
    assert res.state == "REVOKED"
    assert jc.r().xlen(keys.request_out(rid)) == 0 and not jc.r().exists(keys.job_admitted(rid))


# -- HTTP ------------------------------------------------------------------------------------------------------------
def test_http_jobs_per_tenant(jc: JobCluster) -> None:
    url = f"{jc.gateway_url}/v1/jobs"
    acme, other = _token("acme"), _token("globex")

    def state(job_id: str, headers: dict[str, str] = acme) -> httpx.Response:
        return httpx.get(f"{url}/{job_id}", headers=headers, timeout=10)

    def until_status(job_id: str, want: str, timeout_s: float) -> dict[str, Any]:
        return _until(f"job {job_id} {want}", lambda: (s := state(job_id).json()).get("status") == want and s,
                      timeout_s, 0.3)

    one = httpx.post(url, headers=acme, json={"prompt": "hello", "model": MODEL, "max_tokens": 6}, timeout=30)
    assert one.status_code == 202, one.text
    body = one.json()
    assert body["status"] == "queued" and body["tasks"] == 1 and body["object"] == "rackflow.job"
    batch = httpx.post(url, headers=acme, timeout=30,
                       json={"requests": [{"prompt": "a", "max_tokens": 4}, {"prompt": "b", "max_tokens": 5}]})
    assert batch.status_code == 202 and batch.json()["tasks"] == 2, batch.text
    done = until_status(body["id"], "succeeded", 30)
    assert done["progress"] == {"done": 1, "total": 1}
    result = done["results"][0]["result"]
    assert result["tokens"] == 6 and len(result["text"].split()) == 6 and result["timings"]["e2e_ms"] > 0
    done = until_status(batch.json()["id"], "succeeded", 30)
    assert sorted(r["result"]["tokens"] for r in done["results"]) == [4, 5]
    # the request ran under the caller's tenant and user: its result is readable at /v1/results by that tenant
    rid = result["id"]
    assert httpx.get(f"{jc.gateway_url}/v1/results/{rid}", headers=acme, timeout=10).status_code == 200
    # another tenant: the same 404 as an unknown job, for reading and for cancelling
    for resp in (state(body["id"], other), httpx.delete(f"{url}/{body['id']}", headers=other, timeout=10),
                 state(str(uuid.uuid4())), state("not-a-job")):
        assert resp.status_code == 404, resp.text
        assert resp.json()["error"]["code"] == "job_not_found"
    assert httpx.get(f"{url}/{body['id']}", timeout=10).status_code == 401
    # malformed bodies: 400 with a message naming what is wrong
    for payload, words, param in (
        (b"{not json", "not valid JSON", None),
        (json.dumps({"requests": [{"prompt": "ok"}, {"max_tokens": 3}]}).encode(), "requests[1]",
         "requests[1].prompt"),
        (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), "max_tokens", "max_tokens"),
        (json.dumps({"requests": []}).encode(), "non-empty list", "requests"),
        (json.dumps([1, 2]).encode(), "expected a JSON object", None),
    ):
        resp = httpx.post(url, headers=acme | {"Content-Type": "application/json"}, content=payload, timeout=10)
        assert resp.status_code == 400, (payload, resp.text)
        err = resp.json()["error"]
        assert words in err["message"] and err["param"] == param, err
    resp = httpx.post(url, headers=acme, json={"prompt": "x", "model": "gpt-nope"}, timeout=10)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found", resp.text
    # cancel over HTTP: a long job, running, is revoked and its sequence aborted
    long = httpx.post(url, headers=acme, json={"prompt": "long", "model": MODEL, "max_tokens": LONG}, timeout=30)
    job_id = long.json()["id"]
    _until("the long job runs", lambda: jc.r().xlen(keys.request_out(job_id)) > 2, 30, 0.1)
    cancel = httpx.delete(f"{url}/{job_id}", headers=acme, timeout=30)
    assert cancel.status_code == 200, cancel.text
    assert cancel.json()["cancel"]["signalled"] == 1
    done = until_status(job_id, "cancelled", 15)
    assert done["results"][0]["state"] == "REVOKED"
    final = _final(jc, job_id)
    assert final is not None and final.status == "cancelled" and final.out_tokens < LONG
