"""Observability without servers: JSON log lines and their context fields, the request metrics the result writer
feeds, KV tier hit/miss counters, and tracing (off by default, importable without OpenTelemetry, spans chained
through the traceparent each hop carries in the event)."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys

import pytest

from pipeline.events import RequestEvent, ResultEvent
from tests.conftest import REPO
from workers.shell import metrics, tracing
from workers.shell.runtime import LOG_FIELDS, ContextFilter, JsonFormatter, bind_log_context, log_context


def _logger(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.addFilter(ContextFilter())
    handler.setFormatter(formatter)
    lg = logging.getLogger(f"rackflow.test.{id(buf)}")
    lg.handlers[:] = [handler]
    lg.propagate = False
    lg.setLevel(logging.DEBUG)
    return lg, buf


def test_json_log_line_carries_context_fields_and_null_for_the_absent_ones() -> None:
    lg, buf = _logger(JsonFormatter("worker-r0-n0"))
    with log_context(node="r0-n0", rack="r0"):
        with log_context(request_id="req-1", batch_id="b-9"):
            lg.info("finished %s", "req-1")
        lg.warning("no request here")
    lg.error("outside any context")
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert len(lines) == 3
    first, second, third = lines
    for line in lines:
        assert {"ts", "level", "role", "logger", "message", *LOG_FIELDS} <= set(line)
        assert line["role"] == "worker-r0-n0" and line["ts"].endswith("Z")
    assert first["message"] == "finished req-1" and first["level"] == "INFO"
    assert (first["request_id"], first["batch_id"], first["node"], first["rack"]) == ("req-1", "b-9", "r0-n0", "r0")
    assert first["seq_id"] is None
    assert second["request_id"] is None and second["node"] == "r0-n0"
    assert third["node"] is None and third["rack"] is None


def test_json_log_line_has_the_traceback_and_extra_context_keys() -> None:
    lg, buf = _logger(JsonFormatter("celery"))
    with log_context(seq_id="s-1", node="r0-n1", dst="r0-n2"):
        try:
            raise ValueError("boom")
        except ValueError:
            lg.exception("migration failed")
    line = json.loads(buf.getvalue())
    assert line["seq_id"] == "s-1" and line["dst"] == "r0-n2"
    assert "ValueError: boom" in line["exc"]


def test_text_log_line_appends_the_context() -> None:
    lg, buf = _logger(logging.Formatter("%(levelname)s %(message)s%(rf_ctx)s"))
    lg.info("plain")
    with log_context(request_id="r-7", node=None, rack=""):
        lg.info("with context")
    assert buf.getvalue().splitlines() == ["INFO plain", "INFO with context [request_id=r-7]"]


def test_context_is_per_asyncio_task() -> None:
    import asyncio

    lg, buf = _logger(JsonFormatter("gateway"))

    async def request(rid: str) -> None:
        bind_log_context(request_id=rid)
        await asyncio.sleep(0)
        lg.info("answered")

    async def main() -> None:
        await asyncio.gather(request("a"), request("b"))
        lg.info("after")

    asyncio.run(main())
    ids = [json.loads(x)["request_id"] for x in buf.getvalue().splitlines()]
    assert sorted(ids[:2]) == ["a", "b"] and ids[2] is None


def _run_logging(env: dict[str, str], code: str) -> str:
    e = {k: v for k, v in os.environ.items() if not k.startswith("RACKFLOW_")}
    e.update(env)
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=e, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stderr


LOG_SCRIPT = """
import logging
from workers.shell.runtime import setup_logging, log_context
setup_logging("INFO", "worker-r0-n0", node="r0-n0", rack="r0")
with log_context(request_id="abc"):
    logging.getLogger("workers.roles.worker").info("done %d", 3)
"""


def test_setup_logging_writes_json_with_rackflow_log_json_and_text_otherwise() -> None:
    out = _run_logging({"RACKFLOW_LOG_JSON": "1"}, LOG_SCRIPT).strip().splitlines()
    assert len(out) == 1
    line = json.loads(out[0])
    assert line["message"] == "done 3" and line["logger"] == "workers.roles.worker" and line["role"] == "worker-r0-n0"
    assert (line["request_id"], line["node"], line["rack"], line["seq_id"]) == ("abc", "r0-n0", "r0", None)
    text = _run_logging({}, LOG_SCRIPT).strip()
    assert "INFO worker-r0-n0[" in text and text.endswith("done 3 [node=r0-n0 rack=r0 request_id=abc]")


def test_cli_log_json_flag_makes_role_logs_json() -> None:
    from workers.cli.main import build_parser

    args = build_parser().parse_args(["--log-json", "router"])
    assert args.log_json


# -- metrics -----------------------------------------------------------------------------------------------------------
def _result(model: str, status: str, rid: str = "r", arrival: float = 1000.0, first: float = 1250.0,
            finish: float = 3000.0) -> ResultEvent:
    return ResultEvent(request_id=rid, version=0, tenant="t", user_id="u", model=model, status=status, node="n",
                       rack="r", in_tokens=10, out_tokens=5, arrival_ms=arrival, finish_ms=finish,
                       first_token_ms=first)


def _value(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_written_results_are_counted_by_model_and_status_and_timed() -> None:
    model = "obs-test-model"
    before_ok = _value("rackflow_requests_total", model=model, status="ok")
    before_n = _value("rackflow_request_duration_seconds_count", model=model)
    metrics.observe_results(
        [_result(model, "ok"), _result(model, "ok"), _result(model, "error", first=0.0)], [True, False, True])
    assert _value("rackflow_requests_total", model=model, status="ok") == before_ok + 1  # the duplicate is not
    assert _value("rackflow_requests_total", model=model, status="error") >= 1
    assert _value("rackflow_request_duration_seconds_count", model=model) == before_n + 1
    assert _value("rackflow_request_duration_seconds_bucket", model=model, le="2.5") >= 1  # 2.0 s end to end
    assert _value("rackflow_time_to_first_token_seconds_bucket", model=model, le="0.25") >= 1  # 0.25 s TTFT


def test_kv_tier_counters_add_what_the_ledger_counted_since_the_last_export() -> None:
    seen: dict[tuple[str, str], int] = {}
    node = "obs-kv-node"
    metrics.export_kv_counters(node, {"L1": 3, "L2": 0}, {"L1": 1, "L2": 4}, seen)
    metrics.export_kv_counters(node, {"L1": 5, "L2": 2}, {"L1": 1, "L2": 4}, seen)
    assert _value("rackflow_kv_tier_hits_total", node=node, tier="L1") == 5
    assert _value("rackflow_kv_tier_hits_total", node=node, tier="L2") == 2
    assert _value("rackflow_kv_tier_misses_total", node=node, tier="L2") == 4


def test_dead_letters_are_counted_through_the_runner_hook() -> None:
    from streams.runner import DEAD_LETTER_OBSERVERS

    assert metrics.count_dead_letter in DEAD_LETTER_OBSERVERS
    before = _value("rackflow_dlq_entries_total", stream="rf:test", group="g")
    for observe in DEAD_LETTER_OBSERVERS:
        observe("rf:test", "g")
    assert _value("rackflow_dlq_entries_total", stream="rf:test", group="g") == before + 1


# -- tracing ---------------------------------------------------------------------------------------------------------
def _request(rid: str = "req-t") -> RequestEvent:
    return RequestEvent(request_id=rid, version=0, tenant="t", user_id="u", model="qwen2-7b", in_tokens=10,
                        out_tokens=5, max_tokens=5, mem_est_kb=100.0, arrival_ms=1000.0)


def test_tracing_is_off_by_default() -> None:
    from pipeline.config import TracingConfig

    assert TracingConfig().enabled is False
    old = os.environ.pop("RACKFLOW_TRACING", None)
    try:
        assert tracing.init_tracing(TracingConfig()) is False
        assert tracing.init_tracing(None) is False
    finally:
        if old is not None:
            os.environ["RACKFLOW_TRACING"] = old
    assert tracing.TRACER is None


def test_the_roles_import_and_run_without_opentelemetry_installed() -> None:
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import workers.shell.tracing as t, workers.stores.ingress, workers.roles.router, workers.roles.batcher
import workers.roles.worker, workers.cli.main
assert t.init_tracing(True) is False and t.TRACER is None
assert not [m for m in sys.modules if m.startswith("opentelemetry")]
print("ok")
"""
    e = {k: v for k, v in os.environ.items() if not k.startswith("RACKFLOW_")}
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=e, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
    assert "pip install 'rackflow[otel]'" in res.stderr


@pytest.fixture
def spans():  # type: ignore[no-untyped-def]
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    assert tracing.init_tracing(True, service="unit", exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown_tracing()


def test_each_hop_is_a_child_of_the_span_carried_in_the_event(spans) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    with tracing.root_span("gateway.admit") as root:
        req = tracing.stamp(root, _request())
    version, _trace_id, _span_id, flags = req.trace.split("-")
    assert version == "00" and int(flags, 16) & 1, req.trace  # W3C traceparent, sampled
    routed = dataclasses.replace(req, trace=tracing.hop("router.route", req, 1001.0, rack="r0"))
    (batched,) = tracing.dispatch([routed], [1002.0], 1010.0, rack="r0", node="r0-n0", batch_id="b1")
    span = tracing.start_span("worker.generate", batched.trace, {"request_id": req.request_id, "node": "r0-n0"},
                              1011.0)
    tracing.end_span(span, 1200.0, out_tokens=5)
    got = {s.name: s for s in spans.get_finished_spans()}
    assert set(got) == {"gateway.admit", "router.route", "batcher.dispatch", "worker.generate"}
    assert len({s.context.trace_id for s in got.values()}) == 1
    assert got["gateway.admit"].parent is None
    for child, parent in (("router.route", "gateway.admit"), ("batcher.dispatch", "router.route"),
                          ("worker.generate", "batcher.dispatch")):
        assert got[child].parent.span_id == got[parent].context.span_id, child
    assert got["batcher.dispatch"].attributes["batch_id"] == "b1"
    assert got["batcher.dispatch"].start_time == 1002 * 1_000_000 and got["worker.generate"].end_time == 1200 * 10**6


def test_an_untraced_request_makes_no_span(spans) -> None:  # type: ignore[no-untyped-def]
    req = _request()
    assert tracing.hop("router.route", req, 1.0) == ""
    assert tracing.dispatch([req], [1.0], 2.0, rack="r0", node="n", batch_id="b") == (req,)
    assert spans.get_finished_spans() == ()
