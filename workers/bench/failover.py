"""`rackflow bench failover`: kill one worker of 8 in the middle of a run, measure what the clients saw.

The default cluster (2 racks x 4 nodes, `sim` engines with real iteration times) runs with health agents, the
monitor and a Celery worker. The same slice of the Azure conversation trace is replayed twice: once undisturbed,
once with `kill -9` of one worker halfway through. Reported: lost, duplicate and error results, every client stream
checked token by token (through the gateway's reader), the migrations (count, and how long each move took from the
task's start to the ResumeEvent on the new owner), the detection delay (kill -> node marked dead), and the P95
shift between the two runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from pipeline.config import RackflowConfig
from pipeline.events import DecisionEvent, ResultEvent, TokenEvent
from pipeline.profiling import ProfileInput
from pipeline.sim.traces import assign_users, parse_azure
from pipeline.stats import percentile
from streams import codec, keys
from streams.runner import connect
from workers.local.launcher import ClusterProcesses, config_overlay_file, wait_cluster_ready
from workers.shell.runtime import WALL
from workers.stores.ingress import Gateway


async def _replay(config: RackflowConfig, redis_url: str, rows: list[Any], speedup: float,
                  on_half: Any = None) -> list[str]:
    r = connect(redis_url)
    gw = Gateway(config, r)
    ids: list[str] = []
    t0 = time.monotonic()
    fired = False
    try:
        for i, row in enumerate(rows):
            due = row.arrival_ms / speedup / 1000.0
            await asyncio.sleep(max(0.0, due - (time.monotonic() - t0)))
            if on_half is not None and not fired and i >= len(rows) // 2:
                fired = True
                on_half()
            req = await gw.submit(ProfileInput(str(uuid.uuid4()), "bench", row.user_id, "qwen2-7b", WALL.now_ms(),
                                               prompt_tokens=row.in_tokens, max_tokens=min(row.out_tokens, 400)))
            ids.append(req.request_id)
    finally:
        await r.aclose()
    return ids


async def _collect(config: RackflowConfig, redis_url: str, ids: list[str], timeout_s: float) -> dict[str, Any]:
    r = connect(redis_url)
    gw = Gateway(config, r)
    want = set(ids)
    results: dict[str, ResultEvent] = {}
    counts: dict[str, int] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            entries = await r.xrange(keys.RESULTS)
            results.clear()
            counts.clear()
            for _eid, fields in entries:
                ev = codec.decode(fields)
                if isinstance(ev, ResultEvent) and ev.request_id in want:
                    counts[ev.request_id] = counts.get(ev.request_id, 0) + 1
                    results.setdefault(ev.request_id, ev)
            if len(results) == len(want):
                break
            await asyncio.sleep(0.5)
        stream_errors = 0
        for rid, res in results.items():  # what an HTTP client streamed: every token once, in order, then the end
            got: list[int] = []
            text = []
            async for ev in gw.outputs(rid, timeout_s=5):
                if isinstance(ev, TokenEvent):
                    got += [ev.index + k for k in range(len(ev.token_ids))]
                    text.append(ev.text)
            if got != list(range(res.out_tokens)) or "".join(text) != res.text:
                stream_errors += 1
    finally:
        await r.aclose()
    return {"results": results, "counts": counts, "stream_errors": stream_errors}


async def _migrations(redis_url: str, since_ms: float) -> tuple[list[float], list[tuple[float, str]]]:
    r = connect(redis_url)
    try:
        entries = await r.xrange(keys.DECISIONS, min=f"{int(since_ms)}-0")
    finally:
        await r.aclose()
    moves: list[float] = []
    verdicts: list[tuple[float, str]] = []
    for _eid, fields in entries:
        ev = codec.decode(fields)
        if isinstance(ev, DecisionEvent) and ev.kind == "migration":
            moves.append(ev.scores.get("ms", 0.0))
        elif isinstance(ev, DecisionEvent) and ev.kind == "failover":
            verdicts.append((ev.ts_ms, ev.choice))
    return moves, verdicts


def bench_failover(redis_url: str, etcd_url: str, requests: int = 600, speedup: float = 8.0,
                   progress: bool = True) -> dict[str, Any]:
    trace = Path(__file__).resolve().parents[2] / "data" / "traces" / "azure-llm-2023" / \
        "AzureLLMInferenceTrace_conv.csv"
    with open(trace, newline="", encoding="utf-8") as fh:
        rows = assign_users(list(parse_azure(fh, requests)), 300, 1.1, random.Random(7))
    with tempfile.TemporaryDirectory(prefix="rackflow-bench-") as tmp:
        path = Path(tmp) / "failover.yaml"
        config = config_overlay_file(path, {"policies": {"kv": {"l1_dir": str(Path(tmp) / "l1")},
                                                         "worker": {"token_flush_ms": 20}}})
        procs = ClusterProcesses(config, redis_url, etcd_url, Path(tmp) / "logs", ["--config", str(path)],
                                 log_level="INFO", with_failover=True)
        procs.start()
        try:
            asyncio.run(wait_cluster_ready(config, redis_url, etcd_url, 120))
            base_ids = asyncio.run(_replay(config, redis_url, rows, speedup))
            base = asyncio.run(_collect(config, redis_url, base_ids, 300))
            victim = next(p for p in procs.procs if p.name == "worker-r0-n1")
            killed_at: list[float] = []

            def kill() -> None:
                killed_at.append(WALL.now_ms())
                os.kill(victim.proc.pid, signal.SIGKILL)

            run_ids = asyncio.run(_replay(config, redis_url, rows, speedup, on_half=kill))
            run = asyncio.run(_collect(config, redis_url, run_ids, 300))
            moves, verdicts = asyncio.run(_migrations(redis_url, killed_at[0] if killed_at else 0.0))
        finally:
            procs.stop()
    detect = [ts - killed_at[0] for ts, choice in verdicts if choice.startswith("r0-n1:") and killed_at]

    def p95(res: dict[str, ResultEvent]) -> float:
        return percentile([e.finish_ms - e.arrival_ms for e in res.values()], 95)

    rr: dict[str, ResultEvent] = run["results"]
    br: dict[str, ResultEvent] = base["results"]
    return {
        "requests": len(run_ids),
        "lost": len(run_ids) - len(rr),
        "duplicates": sum(c - 1 for c in run["counts"].values()),
        "client_errors": sum(1 for e in rr.values() if e.status != "ok"),
        "stream_errors": run["stream_errors"],
        "migrations": len(moves),
        "migration_p50_ms": round(percentile(moves, 50), 2),
        "migration_p99_ms": round(percentile(moves, 99), 2),
        "detection_ms": round(detect[0], 1) if detect else None,
        "p95_ms": round(p95(rr), 1),
        "p95_baseline_ms": round(p95(br), 1),
        "p95_shift_ms": round(p95(rr) - p95(br), 1),
        "baseline_lost": len(base_ids) - len(br),
        "speedup": speedup,
    }


def main_json(res: dict[str, Any]) -> str:
    return json.dumps(res, sort_keys=True)
