"""deploy/grafana/rackflow-dashboard.json is a real Grafana dashboard built on the names the code exports: every
metric a panel or variable query uses is defined in workers/shell/metrics.py or the gateway's registry, so the dashboard
cannot drift from the code."""

from __future__ import annotations

import json
import re
from typing import Any

from tests.conftest import REPO
from workers.gateway.http import GatewayMetrics
from workers.shell import metrics

DASHBOARD = REPO / "deploy" / "grafana" / "rackflow-dashboard.json"
NAME = re.compile(r"\b(rackflow_[A-Za-z0-9_]+)")


def _load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _panels(d: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out += p.get("panels", [])  # panels of a collapsed row
    return out


def _exprs(d: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _panels(d) for t in p.get("targets", [])]
    for v in d["templating"]["list"]:
        q = v.get("query")
        if isinstance(q, dict):
            exprs.append(q.get("query", ""))
        elif v.get("type") == "query" and isinstance(q, str):
            exprs.append(q)
    return exprs


def test_every_metric_the_dashboard_uses_is_defined_in_the_code() -> None:
    defined = metrics.metric_names() | metrics.metric_names(GatewayMetrics().registry)
    used = {m for e in _exprs(_load()) for m in NAME.findall(e)}
    assert used, "no metric names found in the dashboard"
    unknown = sorted(used - defined)
    assert not unknown, f"the dashboard uses metrics the code does not define: {unknown}"


def test_dashboard_is_a_grafana_dashboard_with_a_prometheus_datasource_variable() -> None:
    d = _load()
    assert d["schemaVersion"] >= 36 and d["uid"] and d["title"]
    ds = [v for v in d["templating"]["list"] if v["type"] == "datasource"]
    assert len(ds) == 1 and ds[0]["query"] == "prometheus"
    name = ds[0]["name"]
    ids = [p["id"] for p in _panels(d)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in _panels(d):
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == f"${{{name}}}", p["title"]
        assert p["targets"] and all(t["expr"].strip() and t["refId"] for t in p["targets"]), p["title"]
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]


def test_dashboard_covers_every_required_signal() -> None:
    d = _load()
    exprs = _exprs(d)
    joined = "\n".join(exprs)
    required = [
        "rackflow_requests_total",  # requests by status and model
        "rackflow_request_duration_seconds_bucket",  # end-to-end latency
        "rackflow_time_to_first_token_seconds_bucket",  # TTFT
        "rackflow_stream_length", "rackflow_stream_pending",
        "rackflow_batch_mem_util_bucket",
        "rackflow_node_weight",
        "rackflow_node_health_score",
        "rackflow_migrations_total", "rackflow_failover_migrations_total",
        "rackflow_dlq_entries_total",
        "rackflow_kv_tier_hits_total", "rackflow_kv_tier_misses_total",
    ]
    missing = [m for m in required if m not in NAME.findall(joined)]
    assert not missing, missing
    for m in ("rackflow_request_duration_seconds", "rackflow_time_to_first_token_seconds"):
        quantiles = {q for e in exprs if f"{m}_bucket" in e for q in re.findall(r"histogram_quantile\((0\.\d+)", e)}
        assert {"0.5", "0.95", "0.99"} <= quantiles, (m, quantiles)
