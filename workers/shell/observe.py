"""What every role process sets up first: logging (text or JSON, its node and rack on every line), tracing when
configured, and Prometheus /metrics (its own streams' lengths and consumer groups; for a Celery worker, the
multiprocess registry its pool's forked children write to)."""

from __future__ import annotations

import argparse
import logging
import sys

from pipeline.config import RackflowConfig
from workers.shell.runtime import setup_logging


# -- roles ---------------------------------------------------------------------------------------------------------
def observe(args: argparse.Namespace, config: RackflowConfig, role: str, redis_url: str,
             streams: list[str] | None = None, node: str | None = None, rack: str | None = None,
             serve_metrics: bool = True) -> None:
    """What every role process sets up first: logging (text or JSON, with its node/rack on every line), tracing
    (when configured) and, with --metrics-port, Prometheus /metrics including its own streams' lengths and
    consumer-group state."""
    obs = config.policies.observability
    setup_logging(args.log_level, role, json_logs=args.log_json or obs.log_json, node=node, rack=rack)
    kind = role.split("-", 1)[0]
    from workers.shell import tracing

    tracing.init_tracing(obs.tracing, service=kind)
    if serve_metrics and getattr(args, "metrics_port", None) is not None:
        from workers.shell import metrics

        if streams:
            metrics.watch_streams(redis_url, streams)
        metrics.ROLE_INFO.labels(kind, node or "", rack or "").set(1)
        metrics.serve(args.metrics_port)

log = logging.getLogger(__name__)


def celery_metrics(port: int) -> None:
    """/metrics of a Celery worker and its pool processes (tasks run in forked children): prometheus_client's
    multiprocess mode, in a directory of this run (removed at exit)."""
    import atexit
    import os
    import shutil
    import tempfile

    if "prometheus_client" in sys.modules:
        log.warning("celery worker: prometheus_client imported before its multiprocess directory was set; "
                    "the pool's task metrics may be missing")
    directory = tempfile.mkdtemp(prefix="rackflow-celery-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    atexit.register(shutil.rmtree, directory, True)
    from workers.shell import metrics

    for outcome in metrics.MIGRATION_OUTCOMES:  # the series exist before the first task (multiprocess mode
        metrics.FAILOVER_MIGRATIONS.labels(outcome)  # exports only values some process has created)
    for outcome in metrics.REQUEUE_OUTCOMES:
        metrics.FAILOVER_REQUEUES.labels(outcome)
    metrics.ROLE_INFO.labels("celery", "", "").set(1)
    metrics.serve_multiprocess(port, directory)
