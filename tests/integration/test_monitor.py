"""The monitor's reconcile step: a node marked dead or draining that still holds work after its drain task gets
the task again (a drain lost with a killed Celery worker is re-driven), and one with nothing left does not."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from pipeline.events import HealthEvent
from pipeline.sequences import NodeState
from streams import keys
from streams.runner import Delivery
from tests.integration import harness
from workers.local.etcd import EtcdProcess
from workers.roles.monitor import Monitor
from workers.shell.runtime import WALL
from workers.stores.etcd import SeqRecord

pytestmark = pytest.mark.integration


async def _drains(r) -> list[list[str]]:  # type: ignore[no-untyped-def]
    """Drain tasks waiting in Celery's `control` queue (kombu keeps each message as JSON in a Redis list)."""
    out = []
    for raw in await r.lrange("control", 0, -1):
        msg = json.loads(raw)
        if msg["headers"]["task"] == "rackflow.drain_node":
            out.append(msg["headers"]["argsrepr"])
    return out


def test_redrive_resends_a_drain_only_while_the_node_holds_work(clean_services, config_file) -> None:  # type: ignore[no-untyped-def]
    config = harness.small_config(config_file({}))
    node = config.nodes()[0].name

    async def main() -> None:
        m = Monitor(config, clean_services.redis_url, clean_services.etcd_url, redrive_ms=60_000)
        try:
            await m.seqs.apply([SeqRecord("seq-1", node, 1, config.rack_of(node), WALL.now_ms())], [])
            m.verdicts[node] = "dead"
            await m.redrive()
            assert await _drains(m.r) == [f"('{node}',)"]
            await m.redrive()  # within redrive_ms of the last one: nothing new
            assert len(await _drains(m.r)) == 1
            m.redrive_ms = 0
            await m.redrive()  # still owns seq-1: sent again
            assert len(await _drains(m.r)) == 2
            await m.seqs.apply([], ["seq-1"])
            await m.redrive()  # nothing left: no more drains
            assert len(await _drains(m.r)) == 2
            # an entry in the node's batch stream nobody read counts as work too
            await m.r.xgroup_create(keys.node_batches(node), keys.GROUP_WORKER, id="0", mkstream=True)
            await m.r.xadd(keys.node_batches(node), {"x": "1"})
            await m.redrive()
            assert len(await _drains(m.r)) == 3
            del m.verdicts[node]  # back in service: never re-driven
            await m.redrive()
            assert len(await _drains(m.r)) == 3
        finally:
            await m.registry.close(revoke=False)
            await m.r.aclose()

    asyncio.run(main())


def test_a_health_verdict_made_while_etcd_stalls_is_applied_once_etcd_answers(
        clean_services, config_file, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The scorer reports a change of verdict once. A drain decided while etcd does not answer (here: its process
    stopped, as a store stalled by the disk) must not be lost: it is applied at the node's next sample. Before the fix
    the write's error went up to the consumer, the entry was redelivered, and the scorer, already draining, reported
    no change again: the node was never marked draining (CI, tests/vllm/test_failover.py)."""
    config = harness.small_config(config_file({}))
    node = config.nodes()[0].name
    etcd = EtcdProcess(tmp_path / "etcd")
    etcd.start()

    def sample(xid: int) -> list[Delivery]:
        ev = HealthEvent(node, config.rack_of(node), WALL.now_ms(), "sim", xid_errors=xid)
        return [Delivery(keys.HEALTH, f"{int(WALL.now_ms())}-0", ev, {})]

    async def main() -> None:
        m = Monitor(config, clean_services.redis_url, etcd.url)
        try:
            await m._on_health(sample(0))
            assert m.verdicts == {}
            assert etcd.pid is not None
            os.kill(etcd.pid, signal.SIGSTOP)
            try:
                await m._on_health(sample(1))  # an Xid: draining, but nothing can be written now
            finally:
                os.kill(etcd.pid, signal.SIGCONT)
            assert m.verdicts == {} and await _drains(m.r) == []
            await m._on_health(sample(1))  # the next sample (no new Xid: the verdict does not change again)
            assert m.verdicts == {node: NodeState.DRAINING}
            assert (await m.admin.all())[node]["state"] == NodeState.DRAINING
            assert await _drains(m.r) == [f"('{node}',)"]
            await m._on_health(sample(1))  # applied once: no second drain
            assert len(await _drains(m.r)) == 1
        finally:
            await m.registry.close(revoke=False)
            await m.r.aclose()

    try:
        asyncio.run(main())
    finally:
        etcd.stop()
