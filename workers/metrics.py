"""Prometheus metrics of the role processes (router, batcher, worker): one registry per process, served on
`--metrics-port` when given. Metrics are data the roles already compute (stats dataclasses); this module only
exports them."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()

BATCHES = Counter("rackflow_batches_total", "Batches dispatched", ["rack", "node", "policy"], registry=REGISTRY)
BATCH_REQUESTS = Histogram("rackflow_batch_requests", "Requests per batch", ["rack"], registry=REGISTRY,
                           buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
BATCH_MEM_UTIL = Histogram("rackflow_batch_mem_util", "Batch estimated memory / node budget", ["rack"],
                           registry=REGISTRY, buckets=(0.01, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0))
BATCH_WAIT_MS = Histogram("rackflow_batch_wait_ms", "Time a request waited in the window (ms)", ["rack"],
                          registry=REGISTRY, buckets=(1, 5, 10, 25, 50, 100, 200, 500, 1000, 5000))
REJECTED = Counter("rackflow_batcher_rejected_total", "Requests rejected by the batcher", ["rack"], registry=REGISTRY)
ROUTED = Counter("rackflow_routed_total", "Requests routed", ["rack", "affinity"], registry=REGISTRY)
ENGINE_STEPS = Counter("rackflow_engine_steps_total", "Engine iterations", ["node", "engine"], registry=REGISTRY)
ENGINE_TOKENS = Counter("rackflow_engine_tokens_total", "Tokens generated", ["node", "engine"], registry=REGISTRY)
ENGINE_STEP_MS = Histogram("rackflow_engine_step_ms", "Engine iteration time (ms)", ["node"], registry=REGISTRY,
                           buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000))
ENGINE_RUNNING = Gauge("rackflow_engine_running", "Running sequences", ["node"], registry=REGISTRY)
ENGINE_WAITING = Gauge("rackflow_engine_waiting", "Waiting sequences", ["node"], registry=REGISTRY)
KV_USED_KB = Gauge("rackflow_engine_kv_used_kb", "KV memory in use (KB, batcher accounting)", ["node"],
                   registry=REGISTRY)
RESULTS = Counter("rackflow_results_total", "Final results written", ["node", "status"], registry=REGISTRY)
MIGRATIONS = Counter("rackflow_migrations_total", "Sequence moves seen by a worker", ["node", "outcome"],
                     registry=REGISTRY)
KV_TIER = Gauge("rackflow_kv_tier", "KV tier statistics", ["node", "tier", "stat"], registry=REGISTRY)


def serve(port: int | None) -> int | None:
    """Serve /metrics on `port` (0: any free port); returns the port, or None when metrics are off."""
    if port is None:
        return None
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=REGISTRY)
    bound = int(server.server_address[1])
    log.info("metrics on http://127.0.0.1:%d/metrics", bound)
    return bound
