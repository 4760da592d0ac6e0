"""`rackflow bench gateway` at a small scale: its figures come from what it ran (requests completed, hops from the
results' timestamps, CPU time per role process from /proc and Valkey's INFO), and its switches reach the roles."""

from __future__ import annotations

import os

import pytest

from workers.bench.gateway import bench_gateway, process_cpu_s
from workers.local.services import ServiceEndpoints

pytestmark = pytest.mark.integration


def test_process_cpu_time_grows_with_work() -> None:
    before = process_cpu_s(os.getpid())
    assert before is not None and before > 0
    x = 0
    for i in range(3_000_000):
        x += i * i
    after = process_cpu_s(os.getpid())
    assert after is not None and after > before, (before, after)
    assert process_cpu_s(2**22 + 12345) is None  # no such process: no figure


@pytest.mark.timeout(300)
def test_bench_gateway_reports_cpu_per_role_and_its_settings(clean_services: ServiceEndpoints) -> None:
    """Both switches off their defaults in one run (the default path runs in every other gateway test)."""
    res = bench_gateway(clean_services.redis_url, clean_services.etcd_url, clients=2, duration_s=2.0, repeats=1,
                        progress=False, window_hold=True, http_parser="h11")
    assert res["errors"] == 0 and res["requests"] > 0, res
    assert res["window"] == {"close_when_room": False}
    assert res["http_parser"] == "h11"
    cpu = res["cpu_us_per_request"]
    assert res["routing"] == "inline"  # the gateway routes: the router role serves no request, so no role check on it
    assert "router" in cpu, cpu  # it is still measured (its idle cost is part of the control plane's)
    for role in ("gateway", "batcher", "worker", "valkey"):
        assert cpu.get(role, 0) > 0, cpu  # every role on the path did work for the requests it served
    assert cpu["control_plane"] == pytest.approx(sum(v for k, v in cpu.items() if k != "control_plane"), abs=1)
    assert res["hops"]["window"]["p50_ms"] is not None
