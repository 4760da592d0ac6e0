"""End to end through real processes on real Valkey + etcd: gateway function -> router -> batchers -> sim workers.

500 requests in -> exactly 500 final results out, none lost, none duplicated; a malformed entry in the middle of
the ingress stream lands in rf:dlq and the router keeps going; every batch respects its node's memory budget.
"""

from __future__ import annotations

import asyncio

import pytest

from streams import keys
from streams.runner import connect
from tests.integration import harness
from workers.local.launcher import ClusterProcesses

pytestmark = pytest.mark.integration


async def _xadd_raw(url: str, stream: str, fields: dict[bytes, bytes]) -> None:
    r = connect(url)
    await r.xadd(stream, fields)
    await r.aclose()


def test_500_requests_in_500_results_out(clean_services, config_file, tmp_path):  # type: ignore[no-untyped-def]
    path = config_file(harness.SMALL_CLUSTER)
    config = harness.small_config(path)
    procs = ClusterProcesses(config, clean_services.redis_url, clean_services.etcd_url, tmp_path / "logs",
                             ["--config", str(path)], log_level="WARNING")
    procs.start()
    try:
        items = harness.inputs(500)
        first = asyncio.run(harness.submit(config, clean_services.redis_url, items[:250]))
        asyncio.run(_xadd_raw(clean_services.redis_url, keys.INGRESS, {b"v": b"1", b"t": b"request", b"d": b"\xc1"}))
        second = asyncio.run(harness.submit(config, clean_services.redis_url, items[250:]))
        ids = {r.request_id for r in first + second}
        assert len(ids) == 500
        got, counts = asyncio.run(harness.wait_results(clean_services.redis_url, ids, timeout_s=180))
        assert not procs.dead(), [p.log_path.read_text()[-2000:] for p in procs.dead()]
    finally:
        procs.stop()
    missing = ids - set(got)
    assert not missing, f"{len(missing)} requests lost"
    assert set(got) == ids, "results for requests nobody sent"
    assert all(c == 1 for c in counts.values()), f"duplicates: {[k for k, c in counts.items() if c > 1][:5]}"
    assert all(e.status == "ok" for e in got.values()), [e.error for e in got.values() if e.status != "ok"][:3]
    by_id = {r.request_id: r for r in first + second}
    for rid, res in got.items():
        assert res.out_tokens == by_id[rid].max_tokens
        assert res.first_token_ms >= res.arrival_ms and res.finish_ms >= res.first_token_ms
    # the malformed entry went to the dead-letter stream with a reason
    dlq = asyncio.run(harness.read_stream(clean_services.redis_url, keys.DLQ))
    assert len(dlq) == 1 and dlq[0][1][b"stream"] == keys.INGRESS.encode()
    assert b"msgpack" in dlq[0][1][b"reason"]
    # every batch stayed within the budget it was packed for, and the budget within the node's cap
    for node in config.nodes():
        for _eid, b in asyncio.run(harness.batches(clean_services.redis_url, node.name)):
            assert b.mem_est_kb <= b.mem_budget_kb <= config.node_mem_budget_kb(node.name) + 1e-6
            assert sum(q.mem_est_kb for q in b.requests) == pytest.approx(b.mem_est_kb)
