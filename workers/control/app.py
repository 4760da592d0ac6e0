"""Celery: the control plane's tasks (queue `control`) and async jobs (queue `jobs`), on the Redis/Valkey broker.

Tasks are thin and idempotent (Celery's own advice, and the seed's UUID + version rule): they take ids, re-read the
state they act on, run with `acks_late` + `reject_on_worker_lost` (a worker killed mid-task gets the task
redelivered), and retry with exponential backoff and jitter on transient errors only (etcd or Redis unreachable).
The work itself is in `workers.control.failover`.

`rackflow celery-worker` configures the app from the same config and URLs as every role and starts a worker;
`configure()` does the same for clients (the monitor) that only send tasks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from celery import Celery
from celery.signals import worker_process_init
from kombu import Queue
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.config import RackflowConfig
from streams.errors import TransientStreamError
from workers.stores.etcd import EtcdUnavailable

log = logging.getLogger(__name__)

# the worker imports the job tasks (`workers.control.jobs`) and the Batch API's runner (`workers.control.batches`),
# both on queue `jobs`, at start; they import this module for `app`
app = Celery("rackflow", include=["workers.control.jobs", "workers.control.batches"])
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_default_queue="control",
    task_queues=(Queue("control"), Queue("jobs")),
    task_routes={"rackflow.jobs.*": {"queue": "jobs"}, "rackflow.batches.*": {"queue": "jobs"},
                 "rackflow.*": {"queue": "control"}},
    result_expires=24 * 3600,
    task_track_started=True,
    worker_send_task_events=True,
    task_send_sent_event=True,
    broker_connection_retry_on_startup=True,
    # a task taken by a worker that was killed outright (not just a pool child) comes back after this long; the
    # monitor re-sends a drain that left work behind sooner (`Monitor.redrive`), so this is only the backstop. A task
    # held longer than this is delivered again while it runs: a batch's run works in slices well under it
    # (`batches.slice_s`). Every worker looks for such messages every 10 s (kombu's default sweep is every tenth
    # 10 s tick: a killed batch run would wait up to 160 s to resume, not 70)
    broker_transport_options={"visibility_timeout": 60, "unacked_restore_interval": 10,
                              "unacked_restore_throttle": 1},
)

TRANSIENT = (EtcdUnavailable, TransientStreamError, RedisConnectionError, RedisTimeoutError, ConnectionError,
             TimeoutError)
RETRY = {"autoretry_for": TRANSIENT, "retry_backoff": 0.2, "retry_backoff_max": 10, "retry_jitter": True,
         "max_retries": 12, "acks_late": True, "reject_on_worker_lost": True}

_state: dict[str, Any] = {}
T = TypeVar("T")


BROKER_ENV = "RACKFLOW_CELERY_BROKER_URL"


def broker_url(redis_url: str) -> str:
    """Celery's broker and result backend: env RACKFLOW_CELERY_BROKER_URL, else the streams' Redis. Celery's Redis
    transport (kombu) cannot use Redis Cluster, so with a `redis+cluster://` streams URL a separate single
    Valkey/Redis (or Sentinel) URL must be given; say so instead of failing later inside kombu."""
    import os

    from streams.runner import is_cluster_url

    url = os.environ.get(BROKER_ENV) or redis_url
    if is_cluster_url(url):
        raise ValueError(
            f"Celery (kombu) cannot use a Redis Cluster as its broker ({url.split('@')[-1]}); set {BROKER_ENV} to a "
            "single Valkey/Redis, e.g. redis://broker-host:6379/0 (the streams stay on the cluster)"
        )
    return url


def configure(config: RackflowConfig, redis_url: str, etcd_url: str) -> Celery:
    app.conf.broker_url = broker_url(redis_url)
    app.conf.result_backend = app.conf.broker_url
    _state.update(config=config, redis_url=redis_url, etcd_url=etcd_url)
    return app


def _run(coro_fn: Any, *args: Any) -> Any:
    """Run a failover coroutine on this worker process's own event loop (kept across tasks, with its connections)."""
    from workers.control.failover import FailoverContext

    loop: asyncio.AbstractEventLoop | None = _state.get("loop")
    if loop is None or loop.is_closed():
        loop = asyncio.new_event_loop()
        _state["loop"] = loop
    ctx = _state.get("ctx")
    if ctx is None:
        if "config" not in _state:
            raise RuntimeError("celery app not configured: start workers with `rackflow celery-worker`")
        ctx = loop.run_until_complete(_open(FailoverContext))
        _state["ctx"] = ctx
    coro: Coroutine[Any, Any, Any] = coro_fn(ctx, *args)
    return loop.run_until_complete(coro)


async def _open(cls: Any) -> Any:
    return cls.open(_state["config"], _state["redis_url"], _state["etcd_url"])


async def _warm(ctx: Any) -> None:
    """One call on each store, so that the first failover of this process does not also open its connections (the
    etcd channel and a Valkey connection, tens of milliseconds on a loaded host, in front of the first drain)."""
    await asyncio.gather(ctx.r.ping(), ctx.seqs.client.get(b"/rackflow/monitor/leader"))


@worker_process_init.connect  # type: ignore[untyped-decorator]
def _warm_pool_process(**_: Any) -> None:
    """A pool process opens its failover context when it starts, not in its first task (a failover's). Bounded to a
    second: the pool waits for its processes to come up (and kills one that takes 4 s), so on a host too loaded to
    connect that fast the first task connects instead, as before."""
    if "config" not in _state or _state.get("pool") == "threads":
        return

    async def bounded(ctx: Any) -> None:
        await asyncio.wait_for(_warm(ctx), 1.0)

    try:
        _run(bounded)
    except Exception as e:  # a store not up yet, or too slow: the first task connects
        log.warning("celery pool process: stores not reached at start (%r); connecting on the first task", e)


def _account(report: Any) -> None:
    """Metrics of one move, and the requeue of a sequence no move can place."""
    from workers.shell import metrics

    metrics.FAILOVER_MIGRATIONS.labels(report.outcome).inc()
    if report.outcome == "moved":
        metrics.FAILOVER_MIGRATION_MS.observe(report.ms)
    if report.outcome in ("missing", "no-target"):
        requeue_request.apply_async((report.seq_id, report.version, report.src), queue="control")


@app.task(name="rackflow.drain_node", bind=True, **RETRY)  # type: ignore[untyped-decorator]
def drain_node(self: Any, node: str) -> dict[str, Any]:
    """Move every live sequence off `node` (in this task, one lean move after another: an etcd transaction
    overlapped with a Valkey read, then a Valkey write) and requeue what it never started (here, before its stream
    entries are acknowledged); a sequence the drain cannot settle itself gets a `migrate_sequence` task of its own.
    Safe to run again: moved sequences and finished requests are skipped; a redelivered drain (its worker killed
    mid-move) tells the targets its predecessor did not."""
    from workers.control.failover import drain
    from workers.shell import metrics
    from workers.shell.runtime import log_context

    with log_context(node=node):
        hop = _hop_ms(self.request)
        if hop is not None:
            log.info("drain %s: started %.0f ms after it was sent", node, hop)
        report = _run(drain, node)
        for m in report.moves:
            _account(m)
        for it in report.delegated:
            migrate_sequence.apply_async((it.seq_id, it.version, node, it.dst, it.mod_revision, it.entry, it.rack),
                                         queue="control")
        moved = sum(1 for m in report.moves if m.outcome == "moved")
        log.info("drain %s: %d sequences moved, %d other outcomes, %d left to their own task, %d requeues "
                 "(plan %.1f ms, moves %.1f ms, requeues %.1f ms)", node, moved, len(report.moves) - moved,
                 len(report.delegated), report.requeued, report.plan_ms, report.move_ms, report.requeue_ms)
    metrics.FAILOVER_DRAINS.inc()
    return {"node": node, "migrations": moved, "delegated": len(report.delegated), "requeues": report.requeued}


@app.task(name="rackflow.migrate_sequence", bind=True, **RETRY)  # type: ignore[untyped-decorator]
def migrate_sequence(self: Any, seq_id: str, version: int, src: str, dst: str | None, mod_revision: int = 0,
                     entry: str = "", rack: str = "") -> dict[str, Any]:
    """(src, version) -> (dst, version + 1); idempotent: a repeat finds the record moved and does nothing (or, if
    the earlier attempt died before telling the target, tells it). `mod_revision`, `entry`, `rack`: what the
    planner read of the record (the move then takes one etcd transaction)."""
    from workers.control.failover import migrate_sequence as move
    from workers.shell.runtime import log_context

    with log_context(request_id=seq_id, seq_id=seq_id, node=src, dst=dst or ""):
        report = _run(move, seq_id, version, src, dst, mod_revision, entry, rack)
    _account(report)
    return dict(report.as_dict())


@app.task(name="rackflow.requeue_request", bind=True, **RETRY)  # type: ignore[untyped-decorator]
def requeue_request(self: Any, seq_id: str, version: int, src: str) -> str:
    """Back to the rack's batcher at version + 1; idempotent (a finished or already moved request is left)."""
    from workers.control.failover import requeue_request as requeue
    from workers.shell import metrics
    from workers.shell.runtime import log_context

    with log_context(request_id=seq_id, seq_id=seq_id, node=src):
        outcome = str(_run(requeue, seq_id, version, src))
    metrics.FAILOVER_REQUEUES.labels(outcome).inc()
    return outcome


def warm_sender() -> None:
    """Everything a first `send` would set up, done now: the result backend, the broker connection, the `control`
    queue's declaration. Measured: the first send took 60 ms (680 ms on a loaded host) against 1-2 ms for the next
    ones; after this, 8 ms. The monitor calls it when it becomes the leader, so its first drain (sent at a node's
    death) is not the one that pays."""
    _ = app.backend
    with app.producer_or_acquire() as producer:
        producer.connection.ensure_connection(max_retries=3)
        producer.maybe_declare(app.amqp.queues["control"])


SENT_HEADER = "rf_sent_ms"
"""Message header: when the task was sent (wall ms), so that its worker can say how long the hop took."""


def send(name: str, *args: Any) -> Any:
    """Enqueue a control task by name (from a process that only sends: the monitor)."""
    import time

    return app.send_task(f"rackflow.{name}", args=args, queue="control", headers={SENT_HEADER: time.time() * 1000})


def _hop_ms(request: Any) -> float | None:
    """How long ago the task was sent (None: its sender did not say)."""
    import time

    sent = getattr(request, SENT_HEADER, None) or (getattr(request, "headers", None) or {}).get(SENT_HEADER)
    try:
        return time.time() * 1000 - float(sent) if sent else None
    except (TypeError, ValueError):
        return None


def worker_main(config: RackflowConfig, redis_url: str, etcd_url: str, concurrency: int, queues: str,
                loglevel: str, pool: str = "prefork") -> int:
    """`pool`: prefork (default; a revoked job's task is terminated at once) or threads (for a worker of the `jobs`
    queue only: a job task mostly waits for its result, so one process can wait for many; a revoked job then ends
    when its aborted request's result arrives)."""
    configure(config, redis_url, etcd_url)
    _state["pool"] = pool
    # imported here, before the pool forks, so that no pool process imports it in its first failover (~0.3 s)
    import workers.control.failover  # noqa: F401

    argv = ["worker", f"--concurrency={concurrency}", f"--queues={queues}", f"--loglevel={loglevel}",
            f"--pool={pool}", "--without-gossip", "--without-mingle", "-E"]
    app.worker_main(argv)
    return 0
