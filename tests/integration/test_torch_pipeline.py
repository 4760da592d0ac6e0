"""The `torch` engine (a real Qwen2-architecture transformer on CPU) behind the whole pipeline: 50 requests produce
real text tokens, streamed and final; and `rackflow up --engine torch` serves a streaming completion over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pipeline.events import ResultEvent, TokenEvent
from pipeline.profiling import ProfileInput
from streams import codec, keys
from streams.runner import connect
from tests.integration import harness
from workers.local.launcher import ClusterProcesses, wait_cluster_ready
from workers.shell.runtime import WALL

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TORCH_CLUSTER = {
    "cluster": {"racks": [{"name": "r0", "node_count": 2,
                           "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}}]},
    "policies": {"worker": {"engine": "torch", "token_flush_ms": 20}, "streams": {"claim_idle_ms": 3000}},
}


async def _streamed(url: str, rid: str) -> tuple[list[TokenEvent], ResultEvent | None]:
    r = connect(url)
    try:
        entries = await r.xrange(keys.request_out(rid))
    finally:
        await r.aclose()
    toks: list[TokenEvent] = []
    final = None
    for _eid, f in entries:
        ev = codec.decode(f)
        if isinstance(ev, TokenEvent):
            toks.append(ev)
        elif isinstance(ev, ResultEvent) and final is None:
            final = ev
    return toks, final


def test_fifty_requests_produce_real_text(clean_services, config_file, tmp_path):  # type: ignore[no-untyped-def]
    override = json.loads(json.dumps(TORCH_CLUSTER))
    override["policies"]["kv"] = {"l1_dir": str(tmp_path / "l1")}
    path = config_file(override)
    config = harness.small_config(path)
    procs = ClusterProcesses(config, clean_services.redis_url, clean_services.etcd_url, tmp_path / "logs",
                             ["--config", str(path)], engine="torch", log_level="WARNING")
    procs.start()
    try:
        asyncio.run(wait_cluster_ready(config, clean_services.redis_url, clean_services.etcd_url, 120))
        items = [ProfileInput(str(uuid.uuid4()), "t1", f"user-{i % 9}", "qwen2-7b", WALL.now_ms(),
                              prompt=f"Request {i}: explain rack-affinity routing in one line.", max_tokens=24)
                 for i in range(50)]
        sent = asyncio.run(harness.submit(config, clean_services.redis_url, items))
        ids = {r.request_id for r in sent}
        got, counts = asyncio.run(harness.wait_results(clean_services.redis_url, ids, timeout_s=240))
        assert not procs.dead(), [p.log_path.read_text()[-1500:] for p in procs.dead()]
    finally:
        procs.stop()
    assert set(got) == ids and all(c == 1 for c in counts.values())
    assert all(e.status == "ok" for e in got.values()), [e.error for e in got.values() if e.status != "ok"][:2]
    for rid, res in got.items():
        assert 1 <= res.out_tokens <= 24
        assert res.text, "a real decoded text"
        toks, final = asyncio.run(_streamed(clean_services.redis_url, rid))
        assert final is not None and final.text == res.text
        assert "".join(t.text for t in toks) == res.text, "the streamed tokens are the result"
        assert [t.index for t in toks] == sorted(t.index for t in toks)
        assert sum(len(t.token_ids) for t in toks) == res.out_tokens
    # the model is real: its continuation depends on the prompt (a random-weight model repeats itself a lot, so
    # only a few distinct continuations are expected, but not one for all)
    assert len({e.text for e in got.values()}) > 1


def test_rackflow_up_with_torch_serves_a_streaming_completion(tmp_path: Path) -> None:
    import yaml

    from workers.local.supervise import free_port

    override = json.loads(json.dumps(TORCH_CLUSTER))
    override["policies"]["kv"] = {"l1_dir": str(tmp_path / "l1")}
    cfg = tmp_path / "torch.yaml"
    cfg.write_text(yaml.safe_dump(override))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RACKFLOW_")}
    proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "--config", str(cfg), "--log-level", "WARNING",
                             "up", "--engine", "torch", "--no-failover", "--gateway-port", str(port)],
                            cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert re.search(r"redis (\S+) etcd (\S+)", line), line
        proc.stdout.readline()
        body = json.dumps({"model": "qwen2-7b", "stream": True, "max_tokens": 16, "prompt": "Once upon a time"})
        curl = ["curl", "-sN", "--max-time", "120", "--retry", "30", "--retry-connrefused", "--retry-delay", "1",
                "-H", "Content-Type: application/json", "-d", body, f"http://127.0.0.1:{port}/v1/completions"]
        out = subprocess.run(curl, capture_output=True, text=True, timeout=180).stdout
        events = [ln[6:] for ln in out.splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", out[-800:]
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text and len(chunks) >= 2
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
