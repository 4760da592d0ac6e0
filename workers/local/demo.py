"""`rackflow demo`: a whole local cluster on a real trace, end to end, and its report.

Starts Valkey and etcd (unless URLs point at existing servers), one router, a batcher per rack and a `sim` worker
per node as separate processes; replays the first N requests of the Azure LLM inference trace (conversation, Nov
2023) time-compressed; waits for every final result; prints the report (and writes a PNG); stops all it started.
The trace has no user ids: users are drawn from a seeded Zipf distribution so rack affinity has something to do.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import statistics
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pipeline.config import RackflowConfig
from pipeline.events import BatchEvent, ResultEvent
from pipeline.profiling import ProfileInput
from pipeline.sim.traces import TraceRequest, parse_azure
from pipeline.sim.world import ClientModel
from pipeline.stats import percentile
from streams import codec, keys
from streams.errors import DecodeError
from streams.runner import connect
from workers.local.launcher import wait_cluster_ready
from workers.shell.runtime import WALL
from workers.stores.ingress import Gateway

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO_ROOT / "data" / "traces" / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"


def read_azure_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The Azure trace's first `limit` requests (arrival offsets from the first one)."""
    with open(path, newline="", encoding="utf-8") as fh:
        return list(parse_azure(fh, limit))


def zipf_users(n_users: int, s: float, rng: random.Random, count: int) -> list[str]:
    weights = [1.0 / (k**s) for k in range(1, n_users + 1)]
    return [f"user-{k:04d}" for k in rng.choices(range(n_users), weights=weights, k=count)]


@dataclass
class DemoRun:
    config: RackflowConfig
    redis_url: str
    etcd_url: str
    trace: Path
    requests: int
    speedup: float
    model: str
    seed: int
    progress: bool = True
    idle_timeout_s: float = 120.0
    rows: list[TraceRequest] | None = None
    """Requests to replay instead of the first `requests` of the Azure trace at `trace` (their users and prefix
    blocks are kept; a request without a user gets a Zipf-drawn one)."""
    client: ClientModel | None = None
    """What the clients send as max_tokens (`pipeline.sim.world.ClientModel`): each request then carries its true
    length only in `sim_out_tokens`, for the sim engine alone, and the control plane sees the drawn cap (or none).
    None: max_tokens is the trace's true length (an engine that runs to max_tokens, vLLM with ignore_eos)."""
    caps: list[int | None] | None = None
    """Per row, the max_tokens its client sends (None: unset), drawn once outside so that several runs (and the
    simulator) send the same; with it, every request carries its true length in `sim_out_tokens`. Wins over
    `client`."""
    route_policy: str = ""
    """The node-selection policy every request of the run asks for (ProfileInput.route_policy); empty: the
    config's."""
    submitted: dict[str, float] = field(default_factory=dict)
    results: dict[str, ResultEvent] = field(default_factory=dict)
    result_counts: Counter[str] = field(default_factory=Counter)

    async def wait_ready(self, timeout_s: float = 90.0) -> None:
        await wait_cluster_ready(self.config, self.redis_url, self.etcd_url, timeout_s)

    async def run(self) -> dict[str, Any]:
        rows = self.rows if self.rows is not None else read_azure_trace(self.trace, self.requests)
        rng = random.Random(self.seed)
        users = [row.user_id or u for row, u in zip(rows, zipf_users(500, 1.1, rng, len(rows)), strict=True)]
        crng = random.Random(self.seed + 7)
        hidden = self.client is not None or self.caps is not None
        caps = (list(self.caps) if self.caps is not None else
                [self.client.draw(row.out_tokens, crng) if self.client is not None else row.out_tokens for row in rows])
        r = connect(self.redis_url)
        gateway = Gateway(self.config, r)
        try:
            info = await r.xinfo_stream(keys.RESULTS)
            start_id = info["last-generated-id"]
            start_id = start_id.decode() if isinstance(start_id, bytes) else start_id
        except Exception:
            start_id = "0-0"
        t_start = WALL.now_ms()
        bar = tqdm(total=len(rows), desc="requests", unit="req", disable=not self.progress, file=sys.stderr,
                   dynamic_ncols=True)
        done_submitting = asyncio.Event()
        collector = asyncio.create_task(self._collect(start_id, bar, done_submitting))
        t0 = time.monotonic()
        i = 0
        while i < len(rows):
            now = (time.monotonic() - t0) * 1000.0
            due = []
            while i < len(rows) and rows[i].arrival_ms / self.speedup <= now:
                row = rows[i]
                due.append(ProfileInput(
                    request_id=str(uuid.uuid4()), tenant="demo", user_id=users[i], model=self.model,
                    arrival_ms=WALL.now_ms(), prompt_tokens=row.in_tokens, max_tokens=caps[i],
                    prefix_hashes=row.prefix_hashes or None, route_policy=self.route_policy,
                    sim_out_tokens=row.out_tokens if hidden else 0,
                ))
                i += 1
            if due:
                reqs = await gateway.submit_many(due)
                for q in reqs:
                    self.submitted[q.request_id] = q.arrival_ms
                bar.set_postfix(submitted=len(self.submitted), refresh=False)
            if i < len(rows):
                await asyncio.sleep(max(0.0, min(0.05, rows[i].arrival_ms / self.speedup / 1000.0 - (
                    time.monotonic() - t0))))
        submit_s = time.monotonic() - t0
        done_submitting.set()
        await collector
        bar.close()
        wall_s = time.monotonic() - t0
        report = await self._report(r, t_start, submit_s, wall_s)
        await r.aclose()
        return report

    async def _collect(self, start_id: str, bar: Any, done_submitting: asyncio.Event) -> None:
        r = connect(self.redis_url)
        last = start_id
        last_progress = time.monotonic()
        try:
            while True:
                resp = await r.xread({keys.RESULTS: last}, count=1000, block=200)
                for _stream, entries in resp or []:
                    for eid, fields in entries:
                        last = eid.decode() if isinstance(eid, bytes) else eid
                        try:
                            ev = codec.decode(fields)
                        except DecodeError:
                            continue
                        if not isinstance(ev, ResultEvent):
                            continue
                        self.result_counts[ev.request_id] += 1
                        if ev.request_id not in self.results:
                            self.results[ev.request_id] = ev
                            if ev.request_id in self.submitted or not done_submitting.is_set():
                                bar.update(1)
                        last_progress = time.monotonic()
                mine = sum(1 for rid in self.submitted if rid in self.results)
                if done_submitting.is_set() and mine >= len(self.submitted):
                    return
                if done_submitting.is_set() and time.monotonic() - last_progress > self.idle_timeout_s:
                    log.error("no result for %.0fs; %d of %d requests have none", self.idle_timeout_s,
                              len(self.submitted) - mine, len(self.submitted))
                    return
        finally:
            await r.aclose()

    async def _report(self, r: Any, t_start: float, submit_s: float, wall_s: float) -> dict[str, Any]:
        mine = {rid: self.results[rid] for rid in self.submitted if rid in self.results}
        ok = [e for e in mine.values() if e.status == "ok"]
        errors = [e for e in mine.values() if e.status != "ok"]
        e2e = [e.finish_ms - e.arrival_ms for e in ok]
        ttft = [e.first_token_ms - e.arrival_ms for e in ok if e.first_token_ms > 0]
        per_node = Counter(e.node for e in ok)
        batches_per_node: Counter[str] = Counter()
        utils: list[float] = []
        batch_sizes: list[int] = []
        for node in self.config.nodes():
            entries = await r.xrange(keys.node_batches(node.name), min=f"{int(t_start)}-0", max="+")
            for _eid, fields in entries:
                try:
                    ev = codec.decode(fields)
                except DecodeError:
                    continue
                if isinstance(ev, BatchEvent) and any(q.request_id in self.submitted for q in ev.requests):
                    batches_per_node[node.name] += 1
                    utils.append(ev.mem_est_kb / ev.mem_budget_kb if ev.mem_budget_kb else 0.0)
                    batch_sizes.append(len(ev.requests))
        dup = sum(c - 1 for rid, c in self.result_counts.items() if rid in self.submitted and c > 1)
        out_tokens = sum(e.out_tokens for e in ok)
        return {
            "trace": self.trace.name,
            "speedup": self.speedup,
            "submitted": len(self.submitted),
            "completed": len(ok),
            "errors": len(errors),
            "lost": len(self.submitted) - len(mine),
            "duplicates": dup,
            "p50_ms": round(percentile(e2e, 50), 1),
            "p95_ms": round(percentile(e2e, 95), 1),
            "p99_ms": round(percentile(e2e, 99), 1),
            "ttft_p50_ms": round(percentile(ttft, 50), 1),
            "ttft_p95_ms": round(percentile(ttft, 95), 1),
            "ttft_p99_ms": round(percentile(ttft, 99), 1),
            "requests_per_node": dict(sorted(per_node.items())),
            "batches_per_node": dict(sorted(batches_per_node.items())),
            "batches": sum(batches_per_node.values()),
            "mean_batch_size": round(statistics.fmean(batch_sizes), 2) if batch_sizes else 0.0,
            "mean_batch_mem_util": round(statistics.fmean(utils), 4) if utils else 0.0,
            "output_tokens": out_tokens,
            "submit_s": round(submit_s, 1),
            "wall_s": round(wall_s, 1),
            "error_samples": [e.error for e in errors[:3]],
            "_e2e": e2e,
            "_ttft": ttft,
        }


def write_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label in (("_e2e", "end-to-end"), ("_ttft", "time to first token")):
        vals = sorted(report[key])
        if vals:
            ys = [(i + 1) / len(vals) for i in range(len(vals))]
            ax1.plot(vals, ys, label=f"{label} (p95 {percentile(vals, 95):.0f} ms)")
    ax1.set_xscale("log")
    ax1.set_xlabel("latency (ms)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title(f"Latency CDF, {report['completed']} requests")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(loc="lower right")
    nodes = sorted(set(report["requests_per_node"]) | set(report["batches_per_node"]))
    xs = range(len(nodes))
    ax2.bar([x - 0.2 for x in xs], [report["requests_per_node"].get(n, 0) for n in nodes], width=0.4,
            label="requests")
    ax2.bar([x + 0.2 for x in xs], [report["batches_per_node"].get(n, 0) for n in nodes], width=0.4,
            label="batches")
    ax2.set_xticks(list(xs), nodes, rotation=30, ha="right")
    ax2.set_title(f"Load per node (mean batch memory use {100 * report['mean_batch_mem_util']:.1f}% of budget)")
    ax2.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def public(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if not k.startswith("_")}


def format_report(report: dict[str, Any]) -> str:
    p = public(report)
    lines = [
        "rackflow demo report",
        f"  trace              {p['trace']} (first {p['submitted']} requests, {p['speedup']:g}x time compression)",
        f"  submitted          {p['submitted']}",
        f"  completed          {p['completed']}",
        f"  errors             {p['errors']}",
        f"  lost               {p['lost']}",
        f"  duplicates         {p['duplicates']}",
        f"  end-to-end latency p50 {p['p50_ms']} ms   p95 {p['p95_ms']} ms   p99 {p['p99_ms']} ms",
        f"  time to 1st token  p50 {p['ttft_p50_ms']} ms   p95 {p['ttft_p95_ms']} ms   p99 {p['ttft_p99_ms']} ms",
        f"  batches            {p['batches']} (mean {p['mean_batch_size']} requests, "
        f"mean memory use {100 * p['mean_batch_mem_util']:.2f}% of the node budget)",
        "  per node           requests / batches",
    ]
    for n in sorted(set(p["requests_per_node"]) | set(p["batches_per_node"])):
        lines.append(f"    {n:<16} {p['requests_per_node'].get(n, 0):>6} / {p['batches_per_node'].get(n, 0)}")
    lines.append(f"  wall time          {p['wall_s']} s (submission {p['submit_s']} s)")
    if p.get("plot"):
        lines.append(f"  plot               {p['plot']}")
    return "\n".join(lines)


def dump_json(report: dict[str, Any]) -> str:
    return json.dumps(public(report), sort_keys=True)
