"""`rackflow bench fuzz` at a small scale (the full run, 10,000 requests, is the acceptance check `fuzz-e2e`): the
real cluster as `rackflow up` starts it, valid and hostile requests, some streams dropped by the client mid-way;
no answer of 500 or more, no transport error, no crashed role, and no key a finished request left without expiry."""

from __future__ import annotations

import pytest

from workers.bench.fuzz import bench_fuzz

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_small_fuzz_of_the_real_cluster_finds_no_5xx_crash_or_leak() -> None:
    res = bench_fuzz(requests=400, streamed=60, concurrency=16, seed=7, progress=False)
    assert res["target"] == "rackflow up" and res["requests"] == 400 and res["streamed"] >= 60
    assert res["status_5xx"] == 0, res["statuses"]
    assert res["transport_errors"] == 0, res["transport_error_samples"]
    assert res["roles_crashed"] == 0, res["crashed"]
    assert res["leaked_keys"] == 0, (res["keys_without_ttl"], res["etcd_sequences_left"])
    # it did reach the pipeline: valid requests answered, hostile ones refused with 4xx
    assert res["statuses"].get("200", 0) >= 50 and sum(v for k, v in res["statuses"].items() if k.startswith("4")) > 100
