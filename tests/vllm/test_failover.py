"""Failover with vLLM workers: `kill -9` of a worker mid-stream, and an Xid fault that drains a node. Every stream
continues on the other node (re-prefilled there from prompt + the tokens already sent: vLLM's CPU build has no KV
connector), and its token ids equal one uninterrupted greedy run of the same request on vLLM alone: no gap, no
repeat, nothing lost, one final result each."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pipeline.events import RequestEvent, TokenEvent
from pipeline.profiling import ProfileInput
from streams import codec, keys
from streams.runner import connect
from tests.chaos.test_failover import Cluster, _check_all, _client_view, _inject, _migrations, _where
from tests.integration import harness
from tests.vllm.conftest import Reference, cluster_overlay
from workers.local.launcher import ClusterProcesses, wait_cluster_ready
from workers.shell.runtime import WALL
from workers.stores.ingress import Gateway

# two vLLM CPU workers decode on 2 cores while a third starts: the test's own waits (results within 400 s) must be
# reachable before the suite's 300 s default cuts it (a loaded CI machine took more than 300 s)
pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.chaos, pytest.mark.timeout(900)]

KILL_TOKENS = 1500
"""Long enough that a sequence is mid-stream for seconds on the CPU build (ignore_eos: every one runs to it)."""
XID_TOKENS = 16_000
"""An Xid drain reaches the worker after the agent's sample, the monitor's verdict, the Celery drain task and one
migrate task per sequence: measured 5-10 s on this 2-core machine while two vLLM workers decode, and, in runs of
2026-12-04, 12.7-14.8 s for the drain task and 21 s for a delegated migrate task while etcd missed its deadlines.
The sequences must still run then. Since the plugin stopped vLLM's shared-memory queue from losing its wake-ups a
step takes ~1.5 ms here, not 2.5-3.5: 8,000 tokens (~12 s) ended before the drain in most runs that day (the moves
reported `finished`); 16,000 passed one run of two. The race is not removed: the drain's own latency under CPU
contention is the weakness (issue notes)."""


@pytest.fixture
def cluster(clean_services, tmp_path: Path, tiny_ckpt: Path) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster_overlay(
        tiny_ckpt, 2, worker={"vllm": {"ignore_eos": True}}, kv={"l1_dir": str(tmp_path / "l1")},
        node_selection={"policy": "least_outstanding", "stale_ms": 2000})))
    config = harness.small_config(path)
    procs = ClusterProcesses(config, clean_services.redis_url, clean_services.etcd_url, tmp_path / "logs",
                             ["--config", str(path)], engine="vllm", log_level="INFO", with_failover=True)
    procs.start()
    try:
        asyncio.run(wait_cluster_ready(config, clean_services.redis_url, clean_services.etcd_url, 300))
        yield Cluster(config, procs, clean_services.redis_url, clean_services.etcd_url, path)
    finally:
        procs.stop()


def _items(model: str, n: int, max_tokens: int) -> list[ProfileInput]:
    return [ProfileInput(str(uuid.uuid4()), "t1", f"user-{i % 5}", model, WALL.now_ms(),
                         prompt=f"Node {i} of rack seven reports: temperature nominal, queue {i * 3}.",
                         max_tokens=max_tokens) for i in range(n)]


async def _submit_until_mid_stream(c: Cluster, items: list[ProfileInput]) -> tuple[list[RequestEvent], str]:
    """Submit, then wait until one node has at least two sequences mid-stream (tokens out, no result yet): that node
    is the victim (placement depends on which worker published its status first, so it is not fixed in advance)."""
    sent: list[RequestEvent] = []
    r = connect(c.redis_url)
    gw = Gateway(c.config, r)
    try:
        for it in items:
            sent.append(await gw.submit(it))
    finally:
        await r.aclose()
    r = connect(c.redis_url)
    try:
        for _ in range(600):
            on: dict[str, int] = {}
            for s in sent:  # the latest entry of each client stream only: these streams grow to thousands
                last = await r.xrevrange(keys.request_out(s.request_id), count=1)
                ev = codec.decode(last[0][1]) if last else None
                if isinstance(ev, TokenEvent):  # a finished one ends with its ResultEvent
                    on[ev.node] = on.get(ev.node, 0) + 1
            busy = [n for n, k in on.items() if k >= 2]
            if busy:
                return sent, busy[0]
            await asyncio.sleep(0.05)
    finally:
        await r.aclose()
    raise AssertionError(f"no node ever had two sequences mid-stream: {await _where(c, sent)}")


def _check_exact(c: Cluster, sent: list[RequestEvent], reference: Reference) -> None:
    got = _check_all(c, [s.request_id for s in sent], timeout_s=400)
    want = reference.run(sent, together=True)
    for s in sent:
        toks, _final = asyncio.run(_client_view(c, s.request_id))
        ids = [tid for t in toks for tid in t.token_ids]
        assert len(ids) == s.max_tokens == got[s.request_id].out_tokens
        first = next((i for i, (a, b) in enumerate(zip(ids, want[s.request_id], strict=True)) if a != b), None)
        assert first is None, f"{s.request_id}: streamed ids differ from the uninterrupted run at index {first}"


def test_sigkill_vllm_worker_mid_stream_streams_continue_exactly(cluster: Cluster, reference: Reference,
                                                                 model_name: str) -> None:
    sent, victim = asyncio.run(_submit_until_mid_stream(cluster, _items(model_name, 8, KILL_TOKENS)))
    # the whole node dies: the worker and vLLM's engine-core and executor processes (its process group). Killing the
    # worker alone leaves vLLM's executor orphaned, holding 1.5 GB and a core (measured: seven of them had piled up
    # on this machine from earlier runs, and starved the next tests out of memory)
    pid = cluster.proc(f"worker-{victim}").proc.pid
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    _check_exact(cluster, sent, reference)
    assert _migrations(cluster) > 0, "no sequence was moved off the killed vLLM worker"


def test_xid_fault_drains_a_vllm_node_and_its_sequences_move_exactly(cluster: Cluster, reference: Reference,
                                                                    model_name: str) -> None:
    sent, victim = asyncio.run(_submit_until_mid_stream(cluster, _items(model_name, 3, XID_TOKENS)))
    asyncio.run(_inject(cluster, victim, "xid"))
    _check_exact(cluster, sent, reference)
    assert _migrations(cluster) > 0, "no sequence was moved off the drained vLLM node"
    monitor = next(p for p in cluster.procs.procs if p.role == "monitor")
    assert f"node {victim} marked draining" in monitor.log_path.read_text()
