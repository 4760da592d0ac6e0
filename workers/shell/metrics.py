"""Prometheus metrics of the role processes (router, batcher, worker, agent, monitor, Celery worker): one registry
per process, served on `--metrics-port` when given (the gateway serves its own on its HTTP port). Metrics are data
the roles already compute (stats dataclasses, events they handle); this module only exports them.

Names follow the Prometheus conventions: `rackflow_<what>_total` for counters, a unit suffix for the rest (the
request latencies in `_seconds` like the gateway's, the engine and window timings in `_ms` as they always were).
docs/GUIDE.md "Observability" lists them; `deploy/grafana/rackflow-dashboard.json` is built on them (a unit test checks
that every name it uses is defined here or in the gateway's registry).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pipeline.events import ResultEvent
from pipeline.sequences import NodeState
from streams.runner import DEAD_LETTER_OBSERVERS

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


# -- requests: counted where their final result is written (ResultWriter: workers, and the router/batcher errors) --
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
REQUESTS = Counter("rackflow_requests_total", "Final results written, by model and status (ok, error)",
                   ["model", "status"], registry=REGISTRY)
REQUEST_SECONDS = Histogram("rackflow_request_duration_seconds", "End-to-end latency: arrival at the gateway to the "
                            "final result (ok results)", ["model"], registry=REGISTRY, buckets=LATENCY_BUCKETS)
TTFT_SECONDS = Histogram("rackflow_time_to_first_token_seconds", "Arrival at the gateway to the first generated "
                         "token (ok results)", ["model"], registry=REGISTRY, buckets=LATENCY_BUCKETS)

# -- streams: XLEN and consumer-group state of the role's own streams, read on scrape (StreamStatsCollector) -------
DLQ_ENTRIES = Counter("rackflow_dlq_entries_total", "Entries this process sent to the dead-letter stream rf:dlq",
                      ["stream", "group"], registry=REGISTRY)

# -- node selection and health -------------------------------------------------------------------------------------
REPLY_COPY_ERRORS = Counter("rackflow_reply_copy_errors_total", "Gateway reply-stream copies that failed (the "
                            "request's own stream has the entry; the gateway catches up from it)", registry=REGISTRY)
NODE_WEIGHT = Gauge("rackflow_node_weight", "The weighted policy's live node weight W (batcher's view, own "
                    "reservations applied)", ["rack", "node"], registry=REGISTRY)
NODE_WEIGHT_SHARE = Gauge("rackflow_node_weight_share", "W of the node over the sum of W in its rack (the weighted "
                          "policy's dispatch probability)", ["rack", "node"], registry=REGISTRY)
NODE_ACTIVE = Gauge("rackflow_node_active", "1 when the node takes batches (registered, fresh status, no verdict)",
                    ["rack", "node"], registry=REGISTRY)
RACK_LOAD = Gauge("rackflow_rack_load", "Rack load the router balances on (running + waiting + batcher backlog)",
                  ["rack"], registry=REGISTRY)
RACK_HEALTHY = Gauge("rackflow_rack_healthy", "1 when the rack has an active node", ["rack"], registry=REGISTRY)
HEALTH_SCORE = Gauge("rackflow_node_health_score", "Health score of the node in [0, 1] (monitor's HealthScorer)",
                     ["node"], registry=REGISTRY)
NODE_STATE = Gauge("rackflow_node_state", "The monitor's verdict on the node: 1 for its current state",
                   ["node", "state"], registry=REGISTRY)
FAILOVER_ACTIONS = Counter("rackflow_failover_actions_total", "Nodes the monitor marked draining/dead or cleared",
                           ["state"], registry=REGISTRY)
MONITOR_LEADER = Gauge("rackflow_monitor_leader", "1 while this monitor is the leader", registry=REGISTRY)

# -- failover tasks (Celery worker) ----------------------------------------------------------------------------------
FAILOVER_MIGRATIONS = Counter("rackflow_failover_migrations_total", "migrate_sequence tasks by outcome",
                              ["outcome"], registry=REGISTRY)
FAILOVER_MIGRATION_MS = Histogram("rackflow_failover_migration_ms", "Time of a sequence move (ms)", registry=REGISTRY,
                                  buckets=(1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000))
FAILOVER_REQUEUES = Counter("rackflow_failover_requeues_total", "requeue_request tasks by outcome", ["outcome"],
                            registry=REGISTRY)
FAILOVER_DRAINS = Counter("rackflow_failover_drains_total", "drain_node tasks run", registry=REGISTRY)
MIGRATION_OUTCOMES = ("moved", "already", "conflict", "missing", "finished", "no-target")
REQUEUE_OUTCOMES = ("requeued", "already", "finished", "missing")

# -- KV tiers and engine memory --------------------------------------------------------------------------------------
KV_HITS = Counter("rackflow_kv_tier_hits_total", "KV snapshot reads served by the tier", ["node", "tier"],
                  registry=REGISTRY)
KV_MISSES = Counter("rackflow_kv_tier_misses_total", "KV snapshot reads the tier could not serve", ["node", "tier"],
                    registry=REGISTRY)
KV_CAPACITY_KB = Gauge("rackflow_engine_kv_capacity_kb", "KV memory the node's batches may use (KB, batcher units)",
                       ["node"], registry=REGISTRY)

# -- health agent ----------------------------------------------------------------------------------------------------
AGENT_SAMPLES = Counter("rackflow_agent_samples_total", "Health samples published", ["node"], registry=REGISTRY)
AGENT_FAILURES = Counter("rackflow_agent_publish_failures_total", "Health samples that could not be published",
                         ["node"], registry=REGISTRY)
GPU_TEMP = Gauge("rackflow_gpu_temperature_celsius", "Hottest GPU of the node", ["node"], registry=REGISTRY)
GPU_MEM_FREE_GB = Gauge("rackflow_gpu_mem_free_gb", "Free GPU memory of the node (GB)", ["node"], registry=REGISTRY)
GPU_XID = Gauge("rackflow_gpu_xid_errors", "Xid errors counted on the node's GPUs", ["node"], registry=REGISTRY)

ROLE_INFO = Gauge("rackflow_role_info", "The role this process runs (value 1)", ["role", "node", "rack"],
                  registry=REGISTRY)


# -- helpers the roles call ------------------------------------------------------------------------------------------
_request_children: dict[tuple[str, str], Any] = {}
_latency_children: dict[str, tuple[Any, Any]] = {}


def observe_results(results: Sequence[ResultEvent], written: Iterable[bool]) -> None:
    """Count the final results that were written (duplicates are not), and time the ok ones from the request's
    arrival: end to end, and to the first token. Label children are cached (labels() costs more than a count)."""
    for r, w in zip(results, written, strict=False):
        if not w:
            continue
        key = (r.model, r.status)
        c = _request_children.get(key)
        if c is None:
            c = _request_children[key] = REQUESTS.labels(r.model, r.status)
        c.inc()
        if r.status != "ok" or r.arrival_ms <= 0:
            continue
        h = _latency_children.get(r.model)
        if h is None:
            h = _latency_children[r.model] = (REQUEST_SECONDS.labels(r.model), TTFT_SECONDS.labels(r.model))
        h[0].observe(max(0.0, r.finish_ms - r.arrival_ms) / 1000.0)
        if r.first_token_ms > 0:
            h[1].observe(max(0.0, r.first_token_ms - r.arrival_ms) / 1000.0)


def count_dead_letter(stream: str, group: str) -> None:
    DLQ_ENTRIES.labels(stream, group).inc()


DEAD_LETTER_OBSERVERS.append(count_dead_letter)


def export_kv_counters(node: str, hits: dict[str, int], misses: dict[str, int],
                       seen: dict[tuple[str, str], int]) -> None:
    """The tier ledger keeps cumulative hit/miss counts; add what is new since the last call (`seen` keeps that)."""
    for kind, table, counter in (("hits", hits, KV_HITS), ("misses", misses, KV_MISSES)):
        for tier, value in table.items():
            last = seen.get((kind, tier), 0)
            if value > last:
                counter.labels(node, tier).inc(value - last)
            seen[(kind, tier)] = value


def set_node_state(node: str, state: str) -> None:
    for s in NodeState:
        NODE_STATE.labels(node, s).set(1.0 if s == state else 0.0)


class StreamStatsCollector(Collector):
    """Length and consumer-group state (pending, lag, consumers) of the role's own streams, read on each scrape in
    the metrics server's thread with its own synchronous client (the role's event loop never waits for it): one
    pipelined round trip of XLEN + XINFO GROUPS per stream. A failed read gives `rackflow_stream_stats_up 0`."""

    def __init__(self, redis_url: str, streams: Sequence[str], timeout_s: float = 1.0) -> None:
        import redis

        self.streams = list(streams)
        from streams.runner import is_cluster_url, plain_url

        self.client: Any
        if is_cluster_url(redis_url):
            from redis.cluster import RedisCluster

            self.client = RedisCluster.from_url(plain_url(redis_url), socket_timeout=timeout_s,
                                                socket_connect_timeout=timeout_s)
        else:
            self.client = redis.Redis.from_url(redis_url, socket_timeout=timeout_s,
                                               socket_connect_timeout=timeout_s)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily("rackflow_stream_length", "Entries in the stream (XLEN)", labels=["stream"]),
            GaugeMetricFamily("rackflow_stream_pending", "Entries delivered to the group and not acknowledged",
                              labels=["stream", "group"]),
            GaugeMetricFamily("rackflow_stream_lag", "Entries not yet delivered to the group",
                              labels=["stream", "group"]),
            GaugeMetricFamily("rackflow_stream_consumers", "Consumers in the group", labels=["stream", "group"]),
            GaugeMetricFamily("rackflow_stream_stats_up", "1 when the last read of the stream statistics worked"),
        )

    def collect(self) -> Iterator[GaugeMetricFamily]:
        length, pending, lag, consumers, up = self._families()
        try:
            pipe = self.client.pipeline(transaction=False)
            for s in self.streams:
                pipe.xlen(s)
                pipe.xinfo_groups(s)
            replies = pipe.execute(raise_on_error=False)
            for i, s in enumerate(self.streams):
                n, groups = replies[2 * i], replies[2 * i + 1]
                length.add_metric([s], float(n) if isinstance(n, int) else 0.0)
                for g in groups if isinstance(groups, list) else []:  # an error reply: no stream yet
                    name = g.get("name")
                    name = name.decode() if isinstance(name, bytes) else str(name)
                    pending.add_metric([s, name], float(g.get("pending") or 0))
                    lag.add_metric([s, name], float(g.get("lag") or 0))
                    consumers.add_metric([s, name], float(g.get("consumers") or 0))
            up.add_metric([], 1.0)
        except Exception as e:  # the server down or slow: the scrape still answers
            log.debug("stream statistics unavailable: %s", e)
            up.add_metric([], 0.0)
        yield from (length, pending, lag, consumers, up)


def watch_streams(redis_url: str, streams: Sequence[str]) -> StreamStatsCollector:
    collector = StreamStatsCollector(redis_url, streams)
    REGISTRY.register(collector)
    return collector


def serve(port: int | None) -> int | None:
    """Serve /metrics on `port` (0: any free port); returns the port, or None when metrics are off."""
    if port is None:
        return None
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=REGISTRY)
    bound = int(server.server_address[1])
    log.info("metrics on http://127.0.0.1:%d/metrics", bound)
    return bound


def serve_multiprocess(port: int, directory: str) -> int:
    """Serve /metrics of a process tree in prometheus_client's multiprocess mode (the Celery worker: tasks run in
    forked pool children). PROMETHEUS_MULTIPROC_DIR must have been set to `directory` before prometheus_client was
    imported anywhere in the process."""
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    bound = int(server.server_address[1])
    log.info("metrics (all pool processes) on http://127.0.0.1:%d/metrics", bound)
    return bound


def metric_names(registry: CollectorRegistry = REGISTRY) -> set[str]:
    """Every sample name `registry` can expose (a counter `x` as `x_total` and `x_created`, a histogram as
    `x_bucket`, `x_sum`, `x_count`, ...), whether or not it has samples yet; for REGISTRY also the stream statistics
    a role adds with watch_streams(). The dashboard test compares the dashboard's names with these."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",),
                "stateset": ("",), "gaugehistogram": ("_bucket", "_gsum", "_gcount"), "unknown": ("",)}
    families = list(registry.collect())
    if registry is REGISTRY:
        families += StreamStatsCollector._families()
    return {f.name + s for f in families for s in suffixes.get(f.type, ("",))}
