"""Optional OpenTelemetry tracing of a request across gateway -> router -> batcher -> worker (off by default).

One trace per request: the gateway starts the root span `gateway.admit` and writes its W3C `traceparent` into the
request's `trace` field; each later hop starts its span as a child of the context carried in the event and, when it
forwards the request, carries its own span's context on (the router in its overlay, the batcher in the batch's
copy of the request), so the spans form the chain

    gateway.admit -> router.route -> batcher.dispatch -> worker.generate

with attributes request_id, model, rack, node (and batch_id where there is one). Only requests whose `trace` is set
are traced: the gateway's sampling decides once, and a request admitted while tracing was off stays untraced.

Off (the default): `TRACER` is None and every hop's only cost is that check; this module imports no OpenTelemetry
package then, and the project imports and runs without them. On: `policies.observability.tracing.enabled: true` or
RACKFLOW_TRACING=1, with `opentelemetry-sdk` installed (`pip install 'rackflow[otel]'`). The provider is this
module's own (the global one is left alone), so tests can install an in-memory exporter.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pipeline.config import TracingConfig
from pipeline.events import RequestEvent

log = logging.getLogger(__name__)

TRACER: Any = None
"""The opentelemetry Tracer while tracing is on; None: tracing is off and every helper below is a no-op."""
_PROVIDER: Any = None
_PROPAGATOR: Any = None


def env_enabled() -> bool:
    return os.environ.get("RACKFLOW_TRACING", "").strip().lower() in ("1", "true", "yes", "on")


def init_tracing(config: TracingConfig | bool | None = None, service: str = "rackflow", exporter: Any = None) -> bool:
    """Turn tracing on when `config` says so (a TracingConfig with enabled, or True), RACKFLOW_TRACING=1 is set, or
    an `exporter` (a SpanExporter, e.g. the SDK's InMemorySpanExporter in tests) is given. Returns whether tracing
    is on; without the OpenTelemetry SDK it logs why and stays off (the role runs as it would without tracing)."""
    global TRACER, _PROVIDER, _PROPAGATOR
    cfg = config if isinstance(config, TracingConfig) else TracingConfig(enabled=bool(config))
    if not (cfg.enabled or env_enabled() or exporter is not None):
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError as e:
        log.error("tracing is on but the OpenTelemetry SDK is not installed (%s): pip install 'rackflow[otel]'; "
                  "running without tracing", e)
        return False
    shutdown_tracing()
    provider = TracerProvider(
        resource=Resource.create({"service.name": f"rackflow-{service}"}),
        sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
    )
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif cfg.exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif cfg.exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            log.error("tracing exporter otlp needs opentelemetry-exporter-otlp-proto-http (%s): pip install "
                      "'rackflow[otel]'; running without tracing", e)
            return False
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.otlp_endpoint)))
    _PROVIDER = provider
    _PROPAGATOR = TraceContextTextMapPropagator()
    TRACER = provider.get_tracer("rackflow")
    log.info("tracing on: service rackflow-%s, exporter %s, sample ratio %g", service,
             type(exporter).__name__ if exporter is not None else cfg.exporter, cfg.sample_ratio)
    return True


def shutdown_tracing() -> None:
    """Flush and stop the exporter; tracing is off afterwards."""
    global TRACER, _PROVIDER
    provider, _PROVIDER, TRACER = _PROVIDER, None, None
    if provider is not None:
        provider.shutdown()


def _ns(ms: float | None) -> int | None:
    return None if ms is None else int(ms * 1_000_000)


def _attrs(req: RequestEvent, **more: object) -> dict[str, Any]:
    out: dict[str, Any] = {"request_id": req.request_id, "model": req.model, "tenant": req.tenant,
                           "version": req.version}
    out.update({k: v for k, v in more.items() if v is not None and v != ""})
    return out


def traceparent(span: Any) -> str:
    """The W3C traceparent of `span` (to carry in an event)."""
    from opentelemetry import trace

    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def start_span(name: str, parent: str, attributes: dict[str, Any], start_ms: float | None = None) -> Any:
    """A span, child of the context in the traceparent `parent` (a root span when `parent` is empty). Call only
    while TRACER is not None."""
    ctx = _PROPAGATOR.extract({"traceparent": parent}) if parent else None
    return TRACER.start_span(name, context=ctx, attributes=attributes, start_time=_ns(start_ms))


def end_span(span: Any, end_ms: float | None = None, error: str = "", **attributes: object) -> None:
    if span is None:
        return
    if attributes:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
    if error:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error[:200]))
    span.end(end_time=_ns(end_ms))


@contextmanager
def root_span(name: str) -> Iterator[Any]:
    """The gateway's admission span (a root): ended when the block ends, marked as an error if it raises."""
    span = start_span(name, "", {})
    try:
        yield span
    except BaseException as e:
        end_span(span, error=f"{type(e).__name__}: {e}")
        raise
    end_span(span)


def stamp(span: Any, req: RequestEvent) -> RequestEvent:
    """`req` carrying the context of the gateway's span (the root of its trace), with the span's attributes set."""
    span.set_attributes(_attrs(req, in_tokens=req.in_tokens, max_tokens=req.max_tokens))
    return dataclasses.replace(req, trace=traceparent(span))


def hop(name: str, req: RequestEvent, start_ms: float, error: str = "", **attributes: object) -> str:
    """A span of one hop that has finished (the router's decision): from `start_ms` to now, child of the request's
    context; returns the span's traceparent for the next hop (the request's own when it is not traced)."""
    if not req.trace:
        return ""
    span = start_span(name, req.trace, _attrs(req, **attributes), start_ms)
    end_span(span, error=error)
    return traceparent(span)


def dispatch(requests: Sequence[RequestEvent], enqueued_ms: Sequence[float], now_ms: float, *, rack: str, node: str,
             batch_id: str) -> tuple[RequestEvent, ...]:
    """The batcher's spans: one `batcher.dispatch` per traced request of a batch, from the moment it entered the
    window to the dispatch; returns the requests carrying their span's context (untraced ones unchanged)."""
    out = []
    for req, t0 in zip(requests, enqueued_ms, strict=True):
        if not req.trace:
            out.append(req)
            continue
        span = start_span("batcher.dispatch", req.trace,
                          _attrs(req, rack=rack, node=node, batch_id=batch_id, window_ms=max(0.0, now_ms - t0)), t0)
        end_span(span, now_ms)
        out.append(dataclasses.replace(req, trace=traceparent(span)))
    return tuple(out)
