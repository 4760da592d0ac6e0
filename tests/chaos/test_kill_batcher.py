"""Two batchers share each rack's consumer group; kill -9 one while requests wait in its window: the other claims
its pending entries and every request still gets exactly one final result."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from streams.runner import connect
from tests.integration import harness
from workers.local.launcher import ClusterProcesses, wait_cluster_ready

pytestmark = pytest.mark.integration


async def _pending_by_pid(url: str, racks: tuple[str, ...]) -> dict[int, int]:
    """Pending (delivered, unacknowledged) rack-stream entries per batcher process id."""
    from streams import keys

    r = connect(url)
    out: dict[int, int] = {}
    try:
        for rack in racks:
            for c in await r.xinfo_consumers(keys.rack_requests(rack), keys.GROUP_BATCHER):
                pid = int(c["name"].decode().rsplit(":", 1)[1])
                out[pid] = out.get(pid, 0) + int(c["pending"])
    finally:
        await r.aclose()
    return out


def test_sigkill_one_of_two_batchers_loses_nothing(clean_services, config_file, tmp_path):  # type: ignore[no-untyped-def]
    override = json.loads(json.dumps(harness.SMALL_CLUSTER))
    # long windows so requests sit in the victim's window when it dies; two batchers per rack
    override["policies"]["batcher"] = {"consumers_per_rack": 2, "window_ms": 3000, "close_when_node_idle": False,
                                      "close_when_room": False}
    path = config_file(override)
    config = harness.small_config(path)
    url = clean_services.redis_url
    procs = ClusterProcesses(config, url, clean_services.etcd_url, tmp_path / "logs", ["--config", str(path)],
                             log_level="INFO")
    procs.start()
    try:
        asyncio.run(wait_cluster_ready(config, url, clean_services.etcd_url, 90))
        batchers = [p for p in procs.procs if p.role == "batcher"]
        assert len(batchers) == 4
        sent = asyncio.run(harness.submit(config, url, harness.inputs(120, seed=3)))
        time.sleep(0.8)  # inside the 3 s window: the requests are held, unacknowledged, by the batchers
        holding = asyncio.run(_pending_by_pid(url, config.rack_names()))
        victim = next(p for p in batchers if holding.get(p.proc.pid, 0) > 0)
        held = holding[victim.proc.pid]
        victim.proc.kill()
        victim.proc.wait()
        got, counts = asyncio.run(harness.wait_results(url, {r.request_id for r in sent}, timeout_s=90))
        survivors = [p for p in batchers if p is not victim]
        assert all(p.proc.poll() is None for p in survivors)
        claimed = any("claimed" in p.log_path.read_text() for p in survivors)
    finally:
        procs.stop()
    assert len(got) == 120, f"{120 - len(got)} requests lost"
    assert all(c == 1 for c in counts.values())
    assert all(e.status == "ok" for e in got.values())
    assert held > 0
    assert claimed, "the surviving batcher of the rack never claimed the dead one's entries"
