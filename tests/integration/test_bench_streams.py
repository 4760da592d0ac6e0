"""`rackflow bench streams-capacity` at a small scale: one gateway process holds every stream open on a few Valkey
connections (its reply stream), all of them open at once, and every stream completes in full."""

from __future__ import annotations

import pytest

from workers.bench.streams_capacity import bench_streams_capacity
from workers.local.services import ServiceEndpoints

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_one_gateway_holds_every_stream_on_a_few_connections(clean_services: ServiceEndpoints) -> None:
    res = bench_streams_capacity(clean_services.redis_url, clean_services.etcd_url, streams=600, max_tokens=16,
                                 ramp_s=1.0, progress=False)
    assert res["completed"] == 600 and res["errors"] == 0, res
    assert res["redis_connections_max"] <= 32, res
    # the router is paused until the last stream is admitted: every stream was open at once, whatever the speed
    assert res["held_max"] == 600, res
    assert res["open_max"] >= 1, res  # the gateway's own gauge, sampled every 250 ms
