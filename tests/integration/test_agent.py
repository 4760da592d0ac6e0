"""The health agent on real Valkey + etcd: sim samples every 200 ms to rf:health and the node's GPU hash, the etcd
heartbeat (revoked on a clean stop, expiring after its TTL when the agent is killed -9), faults injected through the
CLI showing in the next samples, a `kill` fault SIGKILLing a real worker process, and `--source nvml` without NVML.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aetcd
import pynvml
import pytest

from pipeline.config import DEFAULT_CONFIG_DIR, RackflowConfig, load_config
from pipeline.events import HealthEvent
from streams import codec, keys
from streams.runner import connect
from workers.health import faults
from workers.local.launcher import ClusterProcesses
from workers.local.services import ServiceEndpoints
from workers.roles.agent import HealthAgent
from workers.shell.runtime import WALL
from workers.stores.etcd import parse_etcd_url

pytestmark = pytest.mark.integration

RF = [sys.executable, "-m", "workers.cli"]
TINY = {
    "cluster": {"racks": [{"name": "r0", "nodes": [
        {"name": "n0", "gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]},
        {"name": "n1", "gpu": "a100-80gb", "tp": 2, "models": ["qwen2-7b"]},
    ]}]},
}


@pytest.fixture
def tiny(config_file) -> tuple[Path, RackflowConfig]:  # type: ignore[no-untyped-def]
    path = config_file(TINY)
    return path, load_config(DEFAULT_CONFIG_DIR, [path])


def _cli_args(ep: ServiceEndpoints, path: Path) -> list[str]:
    return ["--config", str(path), "--redis-url", ep.redis_url, "--etcd-url", ep.etcd_url, "--log-level", "INFO"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RACKFLOW_")}


async def _cli(ep: ServiceEndpoints, path: Path, cwd: Path, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *RF, *_cli_args(ep, path), *args, cwd=cwd, env=_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def _health(r: Any, node: str, after_ms: float = 0.0) -> list[HealthEvent]:
    out = []
    for _id, fields in await r.xrange(keys.HEALTH):
        ev = codec.decode(fields)
        assert isinstance(ev, HealthEvent)
        if ev.node == node and ev.source == "sim" and ev.ts_ms > after_ms:
            out.append(ev)
    return out


async def _wait_samples(r: Any, node: str, after_ms: float, n: int, timeout_s: float = 5.0) -> list[HealthEvent]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = await _health(r, node, after_ms)
        if len(got) >= n:
            return got
        assert time.monotonic() < deadline, f"{len(got)}/{n} samples of {node} after {after_ms}"
        await asyncio.sleep(0.05)


def _etcd(ep: ServiceEndpoints) -> aetcd.Client:
    host, port = parse_etcd_url(ep.etcd_url)
    return aetcd.Client(host=host, port=port, timeout=5)


async def _etcd_json(client: aetcd.Client, key: str) -> dict[str, Any] | None:
    kv = await client.get(key.encode())
    return None if kv is None else json.loads(kv.value)


async def _wait_etcd(client: aetcd.Client, key: str, present: bool, timeout_s: float) -> float:
    """Seconds until `key` is (or is no longer) there."""
    t0 = time.monotonic()
    while (await client.get(key.encode()) is not None) != present:
        assert time.monotonic() - t0 < timeout_s, f"{key} still {'absent' if present else 'present'}"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


def _worker_status(node: str, rack: str, **kw: Any) -> dict[bytes, bytes]:
    return codec.encode(HealthEvent(node=node, rack=rack, ts_ms=WALL.now_ms(), source="worker", **kw))


async def _publish_worker_status(r: Any, node: str, rack: str, stop: asyncio.Event, **kw: Any) -> None:
    """What a live worker does to its status hash (fresh every 200 ms), without running one."""
    while not stop.is_set():
        await r.hset(keys.node_status(node), mapping=_worker_status(node, rack, **kw))
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except TimeoutError:
            pass


def test_sim_agent_publishes_every_interval_and_heartbeats(clean_services, tiny) -> None:  # type: ignore[no-untyped-def]
    _path, config = tiny
    weights_gb = config.models["qwen2-7b"].weight_bytes / 1e9

    async def main() -> None:
        r = connect(clean_services.redis_url)
        etcd = _etcd(clean_services)
        stop = asyncio.Event()
        await r.hset(keys.node_status("n1"), mapping=_worker_status("n1", "r0"))  # type: ignore[arg-type]
        worker = asyncio.create_task(_publish_worker_status(r, "n1", "r0", stop, running=8, kv_used_kb=4e6,
                                                            avg_latency_ms=25.0))
        agent = HealthAgent(config, "n1", "sim", clean_services.redis_url, clean_services.etcd_url)
        t0 = WALL.now_ms()
        task = asyncio.create_task(agent.run(stop))
        try:
            await _wait_etcd(etcd, keys.etcd_heartbeat("n1"), True, 3.0)
            hb = await _etcd_json(etcd, keys.etcd_heartbeat("n1"))
            assert hb is not None and hb["pid"] == os.getpid() and hb["source"] == "sim" and hb["rack"] == "r0"
            await asyncio.sleep(1.5)
        finally:
            stop.set()
            rc = await asyncio.wait_for(task, 5)
            await worker
        assert rc == 0
        # a clean stop revokes the lease: the heartbeat is gone at once, not after the TTL
        assert await etcd.get(keys.etcd_heartbeat("n1").encode()) is None
        evs = [e for e in await _health(r, "n1", t0) if e.avg_latency_ms]  # from the first fresh worker status on
        gaps = sorted(b.ts_ms - a.ts_ms for a, b in itertools.pairwise(evs))
        assert 6 <= len(evs) <= 11, len(evs)
        assert 170 <= gaps[len(gaps) // 2] <= 260, gaps
        # the GPU hash holds the last sample
        last = codec.decode(await r.hgetall(keys.node_gpu("n1")))
        assert last == evs[-1]
        ev = evs[-1]
        assert (ev.node, ev.rack, ev.source, ev.gpus) == ("n1", "r0", "sim", 2)
        assert ev.gpu_mem_total_gb == 160.0
        assert ev.gpu_mem_free_gb == pytest.approx(160.0 - weights_gb - 4.0)
        assert ev.avg_latency_ms == 25.0
        assert 80 < ev.gpu_util_pct < 95  # 8 running sequences
        assert 45 <= ev.temp_c <= 75 and 2 * 0.3 * 400 < ev.power_w <= 2 * 400
        assert ev.pcie_rx_mb_s > ev.pcie_tx_mb_s > 0 and 0 < ev.pcie_util_pct < 5
        assert (ev.xid_errors, ev.nvlink_crc_errors, ev.ecc_errors, ev.throttle_reasons) == (0, 0, 0, 0)
        assert agent.stats.samples == len(evs) and agent.stats.publish_failures == 0
        await etcd.close()
        await r.aclose()

    asyncio.run(main())


def test_faults_injected_through_the_cli_change_the_next_samples(clean_services, tiny, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path, config = tiny
    ep = clean_services

    async def main() -> None:
        r = connect(ep.redis_url)
        agent = HealthAgent(config, "n0", "sim", ep.redis_url, ep.etcd_url)
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        try:
            await _wait_samples(r, "n0", 0, 1)
            idle = (await _health(r, "n0"))[-1]
            assert idle.temp_c == 45.0 and idle.avg_latency_ms == 0.0 and idle.gpus == 1  # no worker: idle node

            # three CLI processes at once; long-lived faults, ended by `fault clear`: nothing here depends on how
            # fast a CLI process starts (this machine may be busy)
            results = await asyncio.gather(*(
                _cli(ep, path, tmp_path, "fault", "inject", "--node", "n0", "--json", "--kind", *extra)
                for extra in (["xid"], ["overheat"], ["nvlink-crc", "--factor", "2"])
            ))
            assert all(rc == 0 for rc, _, _ in results), [err for _, _, err in results]
            # a sample stamped after the CLI returned read the faults after they were written
            injected_ms = WALL.now_ms()
            injected = [(d["kind"], d["node"]) for d in (json.loads(out) for _, out, _ in results)]
            assert injected == [("xid", "n0"), ("overheat", "n0"), ("nvlink-crc", "n0")]
            rc, out, err = await _cli(ep, path, tmp_path, "fault", "list", "--node", "n0", "--json")
            assert rc == 0, err
            listed = {d["kind"]: d for d in map(json.loads, out.splitlines())}
            rc, table, err = await _cli(ep, path, tmp_path, "fault", "list", "--node", "n0")
            assert rc == 0 and table.count("active,") == 3 and "s left" in table, table + err
            assert set(listed) == {"xid", "overheat", "nvlink-crc"}
            assert all(d["state"] == "active" for d in listed.values())

            during = await _wait_samples(r, "n0", injected_ms, 3)
            assert all(e.xid_errors == 1 for e in during)  # once per injected fault, not per sample
            assert all(e.temp_c == 95.0 and e.throttle_reasons & 0x60 for e in during)
            crc = [e.nvlink_crc_errors for e in during]
            assert crc[0] >= 1000 and all(b - a == 1000 for a, b in itertools.pairwise(crc)), crc

            rc, out, err = await _cli(ep, path, tmp_path, "fault", "clear", "--node", "n0")
            assert rc == 0 and "cleared 3" in out, out + err
            assert await r.exists(keys.node_faults("n0")) == 0
            # faults gone: cooling down from 95 °C, no more CRC errors, the counters keep their totals
            after = (await _wait_samples(r, "n0", WALL.now_ms(), 4))[1:]
            assert all(e.xid_errors == 1 and e.throttle_reasons == 0 for e in after)
            temps = [e.temp_c for e in after]
            assert all(45 < t < 95 for t in temps) and temps == sorted(temps, reverse=True), temps
            assert len({e.nvlink_crc_errors for e in after}) == 1 and after[0].nvlink_crc_errors > crc[-1]

            # another xid fault: one more; and what the CLI refuses
            (rc, out, err), (rc1, _, err1), (rc2, _, err2) = await asyncio.gather(
                _cli(ep, path, tmp_path, "fault", "inject", "--node", "n0", "--kind", "xid"),
                _cli(ep, path, tmp_path, "fault", "inject", "--node", "nope", "--kind", "xid"),
                _cli(ep, path, tmp_path, "fault", "inject", "--node", "n0", "--kind", "slow", "--factor", "0.5"),
            )
            assert rc == 0, err
            again = await _wait_samples(r, "n0", WALL.now_ms(), 2)
            assert [e.xid_errors for e in again[-2:]] == [2, 2]
            assert rc1 == 2 and "unknown node 'nope'" in err1, err1
            assert rc2 == 2 and "must be >= 1" in err2, err2
        finally:
            stop.set()
            assert await asyncio.wait_for(task, 5) == 0
            await r.aclose()

    asyncio.run(main())


def test_slow_fault_is_not_counted_twice_and_expires(clean_services, tiny) -> None:  # type: ignore[no-untyped-def]
    _path, config = tiny

    async def main() -> None:
        r = connect(clean_services.redis_url)
        stop = asyncio.Event()
        await r.hset(keys.node_status("n0"), mapping=_worker_status("n0", "r0", running=2, avg_latency_ms=20.0))  # type: ignore[arg-type]
        worker = asyncio.create_task(_publish_worker_status(r, "n0", "r0", stop, running=2, avg_latency_ms=20.0))
        f = await faults.inject(r, "n0", "slow", 1.0, None, now_ms=WALL.now_ms())
        assert f.factor == 3.0
        agent = HealthAgent(config, "n0", "sim", clean_services.redis_url, clean_services.etcd_url)
        task = asyncio.create_task(agent.run(stop))
        try:
            evs = await _wait_samples(r, "n0", 0, 1)
            later = await _wait_samples(r, "n0", f.until_ms, 2)
        finally:
            stop.set()
            assert await asyncio.wait_for(task, 5) == 0
            await worker
        during = [e for e in evs if e.ts_ms < f.until_ms]
        # the worker applies `slow` to its engine; the agent reports the worker's measured latency, not x factor again
        assert during and all(e.avg_latency_ms == 20.0 for e in during)
        assert all(e.avg_latency_ms == 20.0 for e in later)  # the fault expired ...
        assert await r.exists(keys.node_faults("n0")) == 0  # ... and its reader removed it
        await r.aclose()

    asyncio.run(main())


def test_heartbeat_lease_lost_is_granted_again_and_etcd_outage_does_not_stop_sampling(clean_services, tiny) -> None:  # type: ignore[no-untyped-def]
    _path, config = tiny
    ep = clean_services

    async def main() -> None:
        r = connect(ep.redis_url)
        etcd = _etcd(ep)
        agent = HealthAgent(config, "n0", "sim", ep.redis_url, ep.etcd_url)
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        try:
            await _wait_etcd(etcd, keys.etcd_heartbeat("n0"), True, 3.0)
            kv = await etcd.get(keys.etcd_heartbeat("n0").encode())
            assert kv is not None and kv.lease
            await etcd.revoke_lease(kv.lease)  # as if etcd had been out longer than the TTL
            await _wait_etcd(etcd, keys.etcd_heartbeat("n0"), False, 1.0)
            await _wait_etcd(etcd, keys.etcd_heartbeat("n0"), True, 3.0)
            again = await etcd.get(keys.etcd_heartbeat("n0").encode())
            assert again is not None and again.lease != kv.lease
        finally:
            stop.set()
            assert await asyncio.wait_for(task, 5) == 0
        assert agent.heartbeat is not None and agent.heartbeat.stats.grants == 2

        # etcd unreachable from the start: samples keep coming, the heartbeat keeps trying, the stop is prompt
        dead = HealthAgent(config, "n1", "sim", ep.redis_url, "http://127.0.0.1:9")
        stop = asyncio.Event()
        t0 = WALL.now_ms()
        task = asyncio.create_task(dead.run(stop))
        try:
            await _wait_samples(r, "n1", t0, 4)
        finally:
            stop.set()
            t_stop = time.monotonic()
            assert await asyncio.wait_for(task, 5) == 0
        assert time.monotonic() - t_stop < 1.0
        assert dead.heartbeat is not None and dead.heartbeat.stats.failures >= 1 and dead.heartbeat.stats.beats == 0
        await etcd.close()
        await r.aclose()

    asyncio.run(main())


def _spawn_agent(ep: ServiceEndpoints, path: Path, cwd: Path, node: str) -> subprocess.Popen[bytes]:
    log = open(cwd / f"agent-{node}.log", "ab")  # noqa: SIM115 - the child owns it
    try:
        return subprocess.Popen([*RF, *_cli_args(ep, path), "agent", "--node", node, "--source", "sim"], cwd=cwd,
                                env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()


def _reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_kill_fault_sigkills_the_worker_and_a_killed_agent_expires(clean_services, tiny, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path, config = tiny
    ep = clean_services
    procs = ClusterProcesses(config, ep.redis_url, ep.etcd_url, tmp_path / "logs", ["--config", str(path)],
                             log_level="WARNING")
    worker = procs.start_worker("n0")
    agent = _spawn_agent(ep, path, tmp_path, "n0")

    async def main() -> None:
        etcd = _etcd(ep)
        try:
            await _wait_etcd(etcd, keys.etcd_node("n0"), True, 20.0)
            reg = await _etcd_json(etcd, keys.etcd_node("n0"))
            assert reg is not None and reg["pid"] == worker.proc.pid
            await _wait_etcd(etcd, keys.etcd_heartbeat("n0"), True, 10.0)
            hb = await _etcd_json(etcd, keys.etcd_heartbeat("n0"))
            assert hb is not None and hb["pid"] == agent.pid

            rc, _, err = await _cli(ep, path, tmp_path, "fault", "inject", "--node", "n0", "--kind", "kill")
            assert rc == 0, err
            deadline = time.monotonic() + 5
            while worker.proc.poll() is None:
                assert time.monotonic() < deadline, "the kill fault did not kill the worker"
                await asyncio.sleep(0.05)
            assert worker.proc.returncode == -signal.SIGKILL
            r = connect(ep.redis_url)
            assert await r.hexists(keys.node_faults("n0"), "kill") == 0  # one-shot: removed once acted on
            await r.aclose()
            assert agent.poll() is None, "the agent must survive the worker it killed"

            # kill -9 the agent: its heartbeat stays until the 2 s lease runs out, then goes
            agent.send_signal(signal.SIGKILL)
            agent.wait(timeout=5)
            assert await etcd.get(keys.etcd_heartbeat("n0").encode()) is not None
            gone_after = await _wait_etcd(etcd, keys.etcd_heartbeat("n0"), False, 5.0)
            assert 0.5 < gone_after < 4.0, gone_after
        finally:
            await etcd.close()

    try:
        asyncio.run(main())
    finally:
        _reap(agent)
        procs.stop()


def test_kill_fault_spares_a_process_that_is_not_the_worker(clean_services, tiny) -> None:  # type: ignore[no-untyped-def]
    _path, config = tiny
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)

    async def main() -> None:
        etcd = _etcd(clean_services)
        # a stale registration pointing at a pid that is not n0's worker
        await etcd.put(keys.etcd_node("n0").encode(), json.dumps({"pid": bystander.pid}).encode())
        r = connect(clean_services.redis_url)
        await faults.inject(r, "n0", "kill", 5.0, None, now_ms=WALL.now_ms())
        agent = HealthAgent(config, "n0", "sim", clean_services.redis_url, clean_services.etcd_url)
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        try:
            await _wait_samples(r, "n0", 0, 2)
        finally:
            stop.set()
            assert await asyncio.wait_for(task, 5) == 0
        assert bystander.poll() is None
        assert await r.hexists(keys.node_faults("n0"), "kill") == 0  # dropped, not retried forever
        await r.aclose()
        await etcd.close()

    try:
        asyncio.run(main())
    finally:
        _reap(bystander)


def test_agent_process_stops_cleanly_on_sigterm(clean_services, tiny, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path, _config = tiny
    agent = _spawn_agent(clean_services, path, tmp_path, "n1")

    async def main() -> None:
        etcd = _etcd(clean_services)
        try:
            await _wait_etcd(etcd, keys.etcd_heartbeat("n1"), True, 10.0)
            agent.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(agent.wait, 5) == 0
            assert await etcd.get(keys.etcd_heartbeat("n1").encode()) is None  # revoked, not left to expire
        finally:
            await etcd.close()

    try:
        asyncio.run(main())
    finally:
        _reap(agent)
    assert "stopped" in (tmp_path / "agent-n1.log").read_text()


def _nvml_library_absent() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return True
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return False


@pytest.mark.skipif(not _nvml_library_absent(), reason="the NVML library is present here")
def test_nvml_source_without_nvml_exits_2_with_the_reason(clean_services, tiny, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path, _config = tiny
    res = subprocess.run([*RF, *_cli_args(clean_services, path), "agent", "--node", "n0"], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2
    assert "NVML library not found (no NVIDIA driver): run with --source sim for a simulated node" in res.stderr
    assert res.stderr.count("NVML library not found") == 1 and "Traceback" not in res.stderr


def test_fault_schedule_loads_and_plays(clean_services, tmp_path) -> None:  # type: ignore[no-untyped-def]
    sched = tmp_path / "faults.yaml"
    sched.write_text("- {at_s: 0.3, node: n1, kind: slow, duration_s: 5, factor: 2}\n"
                     "- {at_s: 0, node: n0, kind: xid}\n")
    items = faults.load_schedule(sched)
    assert [(s.at_s, s.node, s.kind) for s in items] == [(0.0, "n0", "xid"), (0.3, "n1", "slow")]
    for bad, msg in [("- {at_s: 1, node: n0, kind: meltdown}", "unknown fault kind 'meltdown'"),
                     ("- {at_s: -1, node: n0, kind: xid}", "at_s: -1 must be >= 0"),
                     ("- {node: n0, kind: xid}", "missing at_s"),
                     ("{at_s: 1}", "expected a list")]:
        p = tmp_path / "bad.yaml"
        p.write_text(bad)
        with pytest.raises(faults.FaultError, match=msg):
            faults.load_schedule(p)

    async def main() -> None:
        r = connect(clean_services.redis_url)
        t0 = time.monotonic()
        assert await faults.play_schedule(r, items, asyncio.Event(), WALL.now_ms) == 2
        assert time.monotonic() - t0 >= 0.28
        got = await faults.active(r, "n1", WALL.now_ms())
        assert got["slow"].factor == 2.0 and set(await faults.listing(r, "n0")) == {"xid"}
        await r.aclose()

    asyncio.run(main())
