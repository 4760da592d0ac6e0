"""`rackflow bench failover`: kill one worker of 8 in the middle of a run, measure what the clients saw.

The default cluster (2 racks x 4 nodes, `sim` engines with real iteration times) runs with health agents, the
monitor and a Celery worker. The same slice of the Azure conversation trace is replayed twice: once undisturbed,
once with `kill -9` of one worker halfway through. Reported: lost, duplicate and error results, every client stream
checked token by token (through the gateway's reader), the migrations (count, and how long each move took from its
start, in the drain task or a migrate task of its own, to the ResumeEvent in the new owner's stream; with the
part spent reading and changing the owner, and how many moved together), the detection delay (kill -> node marked
dead: the monitor's verdict), how long the whole failover took (kill -> the last sequence handed to its new
owner; `handover_ms`: from the verdict), the verdicts on nodes that were not killed (a live node taken for dead),
and the P95 shift between the two runs. `detection_p50_ms` is the median over the run's kills (one).
RACKFLOW_BENCH_KEEP_LOGS=DIR keeps the processes' logs and the failover's timeline (timeline.json) there.
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


async def _migrations(redis_url: str, since_ms: float) -> tuple[list[DecisionEvent], list[tuple[float, str]]]:
    r = connect(redis_url)
    try:
        entries = await r.xrange(keys.DECISIONS, min=f"{int(since_ms)}-0")
    finally:
        await r.aclose()
    moves: list[DecisionEvent] = []
    verdicts: list[tuple[float, str]] = []
    for _eid, fields in entries:
        ev = codec.decode(fields)
        if isinstance(ev, DecisionEvent) and ev.kind == "migration":
            moves.append(ev)
        elif isinstance(ev, DecisionEvent) and ev.kind == "failover":
            verdicts.append((ev.ts_ms, ev.choice))
    return moves, verdicts


def bench_failover(redis_url: str, etcd_url: str, requests: int = 600, speedup: float = 8.0,
                   progress: bool = True) -> dict[str, Any]:
    trace = Path(__file__).resolve().parents[2] / "data" / "traces" / "azure-llm-2023" / \
        "AzureLLMInferenceTrace_conv.csv"
    with open(trace, newline="", encoding="utf-8") as fh:
        rows = assign_users(list(parse_azure(fh, requests)), 300, 1.1, random.Random(7))
    keep = os.environ.get("RACKFLOW_BENCH_KEEP_LOGS")
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
            moved, verdicts = asyncio.run(_migrations(redis_url, killed_at[0] if killed_at else 0.0))
        finally:
            procs.stop()
            if keep:
                import shutil

                shutil.copytree(Path(tmp) / "logs", keep, dirs_exist_ok=True)
    victim_name = "r0-n1"
    if keep:  # the raw timeline next to the logs
        Path(keep, "timeline.json").write_text(json.dumps({
            "killed_at": killed_at, "verdicts": verdicts,
            "moves": [{"ts": m.ts_ms, "seq": m.request_ids[0], "src": m.batch_id, "dst": m.choice, **m.scores}
                      for m in moved]}, indent=1))
    detect = [ts - killed_at[0] for ts, choice in verdicts if choice.startswith(f"{victim_name}:") and killed_at]
    # verdicts on the nodes that were not killed: a live node taken for dead or drained (a false positive)
    others = sorted({choice for _ts, choice in verdicts if not choice.startswith(f"{victim_name}:")
                     and not choice.endswith(":active")})
    moves = [m.scores.get("ms", 0.0) for m in moved]
    off_victim = [m for m in moved if m.batch_id == victim_name]
    failover_ms = (max(m.ts_ms for m in off_victim) - killed_at[0]) if off_victim and killed_at else None
    dead_ts = [ts for ts, choice in verdicts if choice == f"{victim_name}:dead"]
    # the monitor's verdict -> the last sequence handed over: the Celery hop, the drain's plan and the moves
    handover_ms = (max(m.ts_ms for m in off_victim) - dead_ts[0]) if off_victim and dead_ts else None

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
        "migration_prepare_p50_ms": round(percentile([m.scores.get("prepare_ms", 0.0) for m in moved], 50), 2),
        "migration_release_p50_ms": round(percentile([m.scores.get("release_ms", 0.0) for m in moved], 50), 2),
        "migration_read_p50_ms": round(percentile([m.scores.get("read_ms", 0.0) for m in moved], 50), 2),
        "migration_cas_p50_ms": round(percentile([m.scores.get("cas_ms", 0.0) for m in moved], 50), 2),
        "migration_batch_max": int(max((m.scores.get("batch", 1.0) for m in moved), default=0)),
        "heartbeat_timeout_ms": config.policies.worker_heartbeat_timeout_ms(),
        "handover_ms": round(handover_ms, 1) if handover_ms is not None else None,
        "detection_ms": round(detect[0], 1) if detect else None,
        "detection_p50_ms": round(percentile(detect[:1], 50), 1) if detect else None,
        "failover_ms": round(failover_ms, 1) if failover_ms is not None else None,
        "other_verdicts": others,
        "p95_ms": round(p95(rr), 1),
        "p95_baseline_ms": round(p95(br), 1),
        "p95_shift_ms": round(p95(rr) - p95(br), 1),
        "baseline_lost": len(base_ids) - len(br),
        "speedup": speedup,
    }


def main_json(res: dict[str, Any]) -> str:
    return json.dumps(res, sort_keys=True)
