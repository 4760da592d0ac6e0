"""Async jobs on Celery (queue `jobs`): completions that run through the same request path as HTTP traffic.

`generate` (task `rackflow.jobs.generate`) admits one request into `rf:ingress` through the gateway core
(`Gateway.admit`: profiling, the overload bound, then router, batcher and worker), under the task's own id as request
id, in the `batch` priority class (pipeline/priority.py): a job runs in the capacity interactive requests leave idle
and yields to them, as the Batch API's lines do (workers/control/batches.py, the full form of the same machinery).
It waits for the final result on `rf:out:{id}` and returns the completion: text, token counts and timings. A
redelivered task (`acks_late`, a worker killed mid-task) finds its request already admitted and only waits for its
result.

Clients (`rackflow jobs`, the gateway's `/v1/jobs`) submit one task or a Celery group, record the job in
`rf:job:{id}` (tenant, task ids: who may read or cancel it), read its state from the result backend, and cancel it:
the tasks are revoked (one that runs is terminated), every request gets its cancellation marker (a worker that
admits it later writes its `cancelled` result instead of running it), and the node that runs a live sequence (its
owner in the etcd sequence registry) gets a CancelEvent on its control stream: it aborts the sequence in its engine
and writes the final result with status `cancelled`, exactly once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis.asyncio as aioredis
from celery import group, states
from celery.exceptions import Ignore
from celery.result import AsyncResult
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.config import RackflowConfig
from pipeline.errors import RackflowError
from pipeline.events import CancelEvent, ResultEvent, TokenEvent
from pipeline.priority import BATCH
from pipeline.profiling import ProfileInput
from streams import keys
from streams.runner import StreamProducer, connect
from workers.control.app import _state as _app_state
from workers.control.app import app
from workers.shell.runtime import WALL
from workers.stores.etcd import EtcdStoreError, SequenceRegistry
from workers.stores.ingress import Gateway, RequestRejected, served_models

log = logging.getLogger(__name__)

TASK_NAME = "rackflow.jobs.generate"
DEFAULT_USER = "jobs"
MAX_JOB_REQUESTS = 10_000
"""Most requests in one job (one Celery group)."""
OVERLOAD_RETRIES = 600
"""How often a job's request is offered again while the cluster answers 429 (each after Retry-After + jitter)."""
SPEC_FIELDS = ("prompt", "model", "max_tokens", "user")


class JobFailed(RackflowError):
    """The job's request was refused, ended with an error, or got no result in time (the message says which)."""


class JobCancelled(RackflowError):
    """The job's request was cancelled (its final result has status `cancelled`)."""


# -- what a job asks for -------------------------------------------------------------------------------------------
class JobSpecError(RackflowError, ValueError):
    """A job request that cannot be submitted; the message starts with where it is (line, index), `field` names the
    offending field when there is one."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class JobSpec:
    prompt: str
    model: str | None = None
    max_tokens: int | None = None
    user: str | None = None


def parse_spec(obj: Any, where: str) -> JobSpec:
    """One job request from plain JSON data: `prompt` (required), optional `model`, `max_tokens`, `user`."""
    if not isinstance(obj, dict):
        raise JobSpecError(f"{where}: expected a JSON object with a `prompt`, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(SPEC_FIELDS))
    if unknown:
        raise JobSpecError(f"{where}: unknown field {unknown[0]!r}; allowed: {', '.join(SPEC_FIELDS)}", unknown[0])
    prompt = obj.get("prompt")
    if prompt is None:
        raise JobSpecError(f"{where}: `prompt` is required", "prompt")
    if not isinstance(prompt, str) or not prompt:
        raise JobSpecError(f"{where}: `prompt` must be a non-empty string", "prompt")
    model = obj.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise JobSpecError(f"{where}: `model` must be a non-empty string", "model")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise JobSpecError(f"{where}: `max_tokens` must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    user = obj.get("user")
    if user is not None and (not isinstance(user, str) or not user):
        raise JobSpecError(f"{where}: `user` must be a non-empty string", "user")
    return JobSpec(prompt, model, max_tokens, user)


def read_jsonl(path: Path) -> list[JobSpec]:
    """The job requests of a JSONL file, one JSON object a line (blank lines are skipped); JobSpecError naming the
    line of the first bad one."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise JobSpecError(f"{path}: cannot read it: {e}") from None
    specs: list[JobSpec] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise JobSpecError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        specs.append(parse_spec(obj, where))
    if not specs:
        raise JobSpecError(f"{path}: no requests in it (one JSON object a line, each with a `prompt`)")
    if len(specs) > MAX_JOB_REQUESTS:
        raise JobSpecError(f"{path}: {len(specs)} requests; at most {MAX_JOB_REQUESTS} in one job")
    return specs


def default_model(config: RackflowConfig) -> str | None:
    """The model a job without one runs on: the cluster's only served model, else none (the job must name one)."""
    served = served_models(config)
    return served[0] if len(served) == 1 else None


def _profile_input(config: RackflowConfig, request_id: str, spec: JobSpec, tenant: str) -> ProfileInput:
    model = spec.model or default_model(config)
    if model is None:
        raise RequestRejected(
            f"no model given and the cluster serves several ({', '.join(sorted(config.models))}): name one",
            400, "model", code="model_required",
        )
    return ProfileInput(request_id=request_id, tenant=tenant, user_id=spec.user or DEFAULT_USER, model=model,
                        arrival_ms=WALL.now_ms(), prompt=spec.prompt, max_tokens=spec.max_tokens, priority=BATCH)


def check_specs(config: RackflowConfig, specs: Sequence[JobSpec], tenant: str, where: Sequence[str]) -> list[JobSpec]:
    """Profile every request as the gateway will (model served, max_tokens, context length) before anything is
    submitted; returns the specs with their model filled in, or raises JobSpecError naming the first bad one."""
    profiler = Gateway(config, cast(aioredis.Redis, None))  # profiling does no I/O
    out = []
    for spec, w in zip(specs, where, strict=True):
        try:
            inp = _profile_input(config, "check", spec, tenant)
            profiler.profile(inp)
        except RequestRejected as e:
            raise JobSpecError(f"{w}: {e}") from None
        out.append(JobSpec(spec.prompt, inp.model, spec.max_tokens, spec.user))
    return out


# -- the task ------------------------------------------------------------------------------------------------------
@dataclass
class _TaskContext:
    loop: asyncio.AbstractEventLoop
    config: RackflowConfig
    r: aioredis.Redis
    gateway: Gateway


_local = threading.local()


def _context() -> _TaskContext:
    """This thread's event loop, Redis client and gateway core (kept across tasks; per thread, so a worker with the
    threads pool runs many jobs at once)."""
    ctx: _TaskContext | None = getattr(_local, "ctx", None)
    if ctx is None or ctx.loop.is_closed():
        if "config" not in _app_state:
            raise RuntimeError("celery app not configured: start workers with `rackflow celery-worker`")
        config: RackflowConfig = _app_state["config"]
        loop = asyncio.new_event_loop()
        r = connect(_app_state["redis_url"])
        ctx = _TaskContext(loop, config, r, Gateway(config, r))
        _local.ctx = ctx
    return ctx


@app.task(name=TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True,  # type: ignore[untyped-decorator]
          autoretry_for=(RedisConnectionError, RedisTimeoutError), retry_backoff=0.5, retry_backoff_max=10,
          retry_jitter=True, max_retries=12)
def generate(self: Any, prompt: str, model: str | None = None, user: str | None = None,
             max_tokens: int | None = None, tenant: str | None = None,
             timeout_s: float | None = None) -> dict[str, Any]:
    """One completion through the live pipeline; returns {id, status, model, text, tokens, usage, timings, node,
    rack}. The request id is this task's id. Raises JobFailed when the request is refused or fails; a cancelled
    request leaves the task REVOKED."""
    rid = str(self.request.id)
    ctx = _context()
    spec = JobSpec(prompt, model, max_tokens, user)
    try:
        return ctx.loop.run_until_complete(_generate(ctx, rid, spec, tenant, timeout_s))
    except RequestRejected as e:
        if e.status == 429:
            countdown = (e.retry_after_s or 1) * (1 + random.random())
            raise self.retry(countdown=countdown, max_retries=OVERLOAD_RETRIES,
                             exc=JobFailed(f"the cluster stayed overloaded: {e}")) from None
        raise JobFailed(f"request refused ({e.status} {e.code}): {e}") from None
    except JobCancelled as e:
        # revoked while it ran (a worker pool that cannot terminate a task, or a cancel that reached the sequence
        # first): the task ends as REVOKED, like one that was terminated
        log.info("job task %s cancelled: %s", rid, e)
        self.backend.mark_as_revoked(rid, str(e) or "cancelled", request=self.request)
        self.send_event("task-revoked", terminated=False, signum=None, expired=False)
        raise Ignore() from None


async def _generate(ctx: _TaskContext, rid: str, spec: JobSpec, tenant: str | None,
                    timeout_s: float | None) -> dict[str, Any]:
    r = ctx.r
    pipe = r.pipeline(transaction=False)
    pipe.exists(keys.request_cancelled(rid))
    pipe.exists(keys.job_admitted(rid))
    cancelled, admitted = await pipe.execute()
    if cancelled and not admitted:
        raise JobCancelled("cancelled before it started")
    if not admitted:
        inp = _profile_input(ctx.config, rid, spec, tenant or ctx.config.gateway.auth.default_tenant)
        await ctx.gateway.admit(inp)
        await r.set(keys.job_admitted(rid), b"1", ex=keys.JOB_TTL_S)
    timeout = timeout_s or ctx.config.gateway.request_timeout_s
    texts: list[str] = []
    first_ms = 0.0
    final: ResultEvent | None = None
    try:
        async with aclosing(ctx.gateway.outputs(rid, timeout_s=timeout)) as events:
            async for ev in events:
                if isinstance(ev, TokenEvent):
                    if not first_ms:
                        first_ms = ev.ts_ms
                    texts.append(ev.text)
                else:
                    final = ev
    except TimeoutError:
        raise JobFailed(f"no result for request {rid} within {timeout:g}s") from None
    assert final is not None  # outputs() ends with the result or raises
    if final.status == "cancelled":
        raise JobCancelled(final.error or "cancelled")
    if final.status != "ok":
        raise JobFailed(f"request {rid} failed: {final.error or final.status}")
    return completion(final, "".join(texts), first_ms)


def completion(res: ResultEvent, streamed: str = "", first_token_ms: float = 0.0) -> dict[str, Any]:
    """A job's result: the completion with its token counts and timings (milliseconds)."""
    first = res.first_token_ms or first_token_ms
    return {
        "id": res.request_id,
        "status": res.status,
        "model": res.model,
        "text": res.text or streamed,
        "tokens": res.out_tokens,
        "usage": {"prompt_tokens": res.in_tokens, "completion_tokens": res.out_tokens,
                  "total_tokens": res.in_tokens + res.out_tokens},
        "node": res.node,
        "rack": res.rack,
        "timings": {
            "arrival_ms": res.arrival_ms,
            "first_token_ms": first,
            "finish_ms": res.finish_ms,
            "queue_ms": round(max(0.0, res.batched_ms - res.arrival_ms), 3) if res.batched_ms else None,
            "ttft_ms": round(first - res.arrival_ms, 3) if first else None,
            "e2e_ms": round(res.finish_ms - res.arrival_ms, 3),
        },
    }


# -- clients: submit, record, state, cancel ------------------------------------------------------------------------
@dataclass
class Job:
    """A submitted job: one task, or a group of tasks (then `id` is the group's id)."""

    id: str
    kind: str
    """`task` or `group`."""
    task_ids: list[str]
    tenant: str = ""
    created_ms: float = 0.0
    cancelled_ms: float = 0.0
    extra: dict[str, str] = field(default_factory=dict)


def submit(specs: Sequence[JobSpec], tenant: str, as_group: bool = True, timeout_s: float | None = None) -> Job:
    """Enqueue the requests (blocking: Celery's client is synchronous): one task, or a group whose result is saved
    in the backend so `GroupResult.restore(id)` finds it. The app must be configured (`celery_app.configure`)."""
    if not specs:
        raise JobSpecError("a job needs at least one request")
    sigs = [generate.s(prompt=s.prompt, model=s.model, user=s.user, max_tokens=s.max_tokens, tenant=tenant,
                       timeout_s=timeout_s) for s in specs]
    now = WALL.now_ms()
    if len(sigs) == 1 and not as_group:
        res = sigs[0].apply_async()
        return Job(str(res.id), "task", [str(res.id)], tenant, now)
    gres = group(sigs).apply_async()
    gres.save()
    return Job(str(gres.id), "group", [str(t.id) for t in gres.results], tenant, now)


async def save_job(r: aioredis.Redis, job: Job) -> None:
    mapping = {"kind": job.kind, "tenant": job.tenant, "tasks": json.dumps(job.task_ids),
               "created_ms": str(job.created_ms), **job.extra}
    pipe = r.pipeline(transaction=True)
    pipe.hset(keys.job(job.id), mapping=mapping)  # type: ignore[arg-type]
    pipe.expire(keys.job(job.id), keys.JOB_TTL_S)
    await pipe.execute()


async def load_job(r: aioredis.Redis, job_id: str) -> Job | None:
    """The recorded job, or None (unknown or expired)."""
    h = await r.hgetall(keys.job(job_id))
    if not h:
        return None
    d = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in h.items()}
    try:
        tasks = [str(t) for t in json.loads(d.get("tasks", "[]"))]
    except ValueError:
        tasks = []
    extra = {k: v for k, v in d.items() if k not in ("kind", "tenant", "tasks", "created_ms", "cancelled_ms")}
    return Job(job_id, d.get("kind", "task"), tasks, d.get("tenant", ""), float(d.get("created_ms") or 0),
               float(d.get("cancelled_ms") or 0), extra)


def find_job(job_id: str) -> Job | None:
    """A job that has no record (submitted with `generate.delay` or by another client): a saved group, else a task
    the result backend knows. Blocking."""
    from celery.result import GroupResult

    gres = GroupResult.restore(job_id, app=app)
    if gres is not None:
        return Job(job_id, "group", [str(t.id) for t in gres.results])
    meta = _metas([job_id])[0]
    if meta.get("status", states.PENDING) != states.PENDING:
        return Job(job_id, "task", [job_id])
    return None


def _metas(task_ids: Sequence[str]) -> list[dict[str, Any]]:
    """The result-backend records of many tasks, a few round trips in all (a missing one is PENDING)."""
    backend = app.backend
    out: list[dict[str, Any]] = []
    if hasattr(backend, "mget") and hasattr(backend, "get_key_for_task"):
        for i in range(0, len(task_ids), 1000):
            chunk = task_ids[i : i + 1000]
            values = backend.mget([backend.get_key_for_task(t) for t in chunk])
            for v in values:
                out.append(backend.decode_result(v) if v else {"status": states.PENDING, "result": None})
        return out
    for t in task_ids:  # pragma: no cover - another backend
        ar = AsyncResult(t, app=app)
        out.append({"status": ar.state, "result": ar.result})
    return out


def job_state(job: Job, with_results: bool = True) -> dict[str, Any]:
    """State counts, progress and, per task, its result or error (blocking: reads the result backend)."""
    metas = _metas(job.task_ids)
    counts: Counter[str] = Counter()
    rows = []
    for tid, meta in zip(job.task_ids, metas, strict=True):
        st = str(meta.get("status", states.PENDING))
        counts[st] += 1
        row: dict[str, Any] = {"id": tid, "state": st}
        res = meta.get("result")
        if st == states.SUCCESS:
            row["result"] = res
        elif st in (states.FAILURE, states.REVOKED) or isinstance(res, BaseException):
            row["error"] = _error_text(res)
        rows.append(row)
    total = len(job.task_ids)
    done = sum(counts[s] for s in states.READY_STATES)
    if done < total and job.cancelled_ms:
        status = "cancelling"
    elif done < total:
        status = "queued" if counts[states.PENDING] == total else "running"
    elif counts[states.SUCCESS] == total:
        status = "succeeded"
    elif counts[states.REVOKED]:
        status = "cancelled"
    else:
        status = "failed"
    out: dict[str, Any] = {
        "id": job.id, "kind": job.kind, "status": status, "tasks": total,
        "progress": {"done": done, "total": total}, "counts": dict(sorted(counts.items())),
    }
    if job.created_ms:
        out["created_ms"] = job.created_ms
    if job.cancelled_ms:
        out["cancelled_ms"] = job.cancelled_ms
    if with_results:
        out["results"] = rows
    return out


def _error_text(res: Any) -> str:
    if isinstance(res, BaseException):
        return str(res) or type(res).__name__
    if isinstance(res, dict) and "exc_message" in res:  # an exception the client could not rebuild
        msg = res.get("exc_message")
        return " ".join(str(m) for m in msg) if isinstance(msg, list | tuple) else str(msg)
    return str(res) if res is not None else ""


def done_count(job: Job) -> int:
    return sum(1 for m in _metas(job.task_ids) if m.get("status") in states.READY_STATES)


def revoke(task_ids: Sequence[str], reason: str = "cancelled") -> None:
    """Revoke the tasks on every Celery worker (one that runs is terminated) and mark those not finished as
    REVOKED in the backend at once: a task still queued otherwise shows PENDING until a worker takes and drops
    it. Blocking."""
    if not task_ids:
        return
    app.control.revoke(list(task_ids), terminate=True, signal="SIGTERM")
    for tid, meta in zip(task_ids, _metas(task_ids), strict=True):
        if meta.get("status") not in states.READY_STATES:
            app.backend.mark_as_revoked(tid, reason)


async def abort_requests(r: aioredis.Redis, seqs: SequenceRegistry | None, request_ids: Sequence[str],
                         reason: str, retention_ms: int) -> dict[str, int]:
    """Cancel requests in the pipeline: each gets its cancellation marker (so it never starts, wherever it waits),
    and each live one's node (its owner in the etcd sequence registry) gets a CancelEvent on its control stream.
    A worker also aborts a live sequence whose marker it sees (its status loop), so a request that an owner has not
    recorded yet, or a cancel without etcd, still stops. Returns counts: requests, finished (already had a final
    result), signalled (CancelEvents sent)."""
    ids = list(dict.fromkeys(request_ids))
    if not ids:
        return {"requests": 0, "finished": 0, "signalled": 0}
    pipe = r.pipeline(transaction=False)
    for rid in ids:
        pipe.set(keys.request_cancelled(rid), reason.encode() or b"1", ex=keys.CANCEL_TTL_S)
    await pipe.execute()
    done_values = await r.mget([keys.result_done(rid) for rid in ids])
    live = [rid for rid, v in zip(ids, done_values, strict=True) if v is None]
    owners: dict[str, str] = {}
    if seqs is not None and live:
        try:
            owners = await _owners(seqs, live)
        except EtcdStoreError as e:
            log.warning("cancel: sequence owners not readable (%s); the workers find the markers", e)
    if owners:
        now = WALL.now_ms()
        producer = StreamProducer(r, WALL.now_ms, retention_ms)
        await producer.add_many((keys.node_control(node), CancelEvent(rid, now, reason)) for rid, node in
                                owners.items())
    return {"requests": len(ids), "finished": len(ids) - len(live), "signalled": len(owners)}


async def _owners(seqs: SequenceRegistry, ids: list[str]) -> dict[str, str]:
    if len(ids) <= 64:
        recs = await asyncio.gather(*(seqs.get(rid) for rid in ids))
        return {rec.seq_id: rec.owner for rec in recs if rec is not None}
    # many: one scan of the registry beats a round trip per request
    wanted = set(ids)
    resp = await seqs.client.get_prefix(keys.ETCD_SEQ.encode())
    out = {}
    for kv in resp:
        sid = kv.key.decode()[len(keys.ETCD_SEQ):]
        if sid in wanted:
            out[sid] = str(json.loads(kv.value).get("owner", ""))
    return {k: v for k, v in out.items() if v}


async def cancel(r: aioredis.Redis, seqs: SequenceRegistry | None, job: Job, retention_ms: int,
                 reason: str = "job cancelled") -> dict[str, Any]:
    """Abort the job's requests, then revoke its tasks; the record keeps when it was cancelled.

    The abort comes first: its markers and CancelEvents are what stop the tokens (a request not started yet never
    starts), and they cost a few Redis and etcd round trips. The revoke is a Celery broadcast plus a backend read in
    a thread, which took up to 24 s here while vLLM on CPU starved the host; done first, it let a sequence run to
    its end before its cancel was sent."""
    t0 = time.perf_counter()
    report = await abort_requests(r, seqs, job.task_ids, reason, retention_ms)
    t1 = time.perf_counter()
    await asyncio.to_thread(revoke, job.task_ids, reason)
    log.info("job %s: abort took %.0f ms, revoke %.0f ms", job.id, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3)
    now = WALL.now_ms()
    if await r.exists(keys.job(job.id)):
        await r.hset(keys.job(job.id), "cancelled_ms", str(now))
    job.cancelled_ms = now
    return {"id": job.id, "revoked": len(job.task_ids), **report}
