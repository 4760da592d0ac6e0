"""`rackflow bench pipeline` and `rackflow bench batching`: the live control plane measured end to end.

pipeline: gateway function -> router -> batcher -> worker (`sim` engine in zero-time mode) -> final result, all
as real processes on a real Valkey, flooded with requests; measured side by side in the same run with two
references on the same server:
- the raw pipelined XADD rate (the physical limit of one stream hop),
- a plain Celery task per request with the same trivial work (what a user would build instead).
Then the latency at half the sustained rate (the batching window's wait excluded).

batching: the Azure conversation trace through the live pipeline with `sim` engines (real iteration times), once
with fixed batches of 32 and once with the memory-budget window; batch memory utilisation and the P95 latency of
small requests (<= 100 output tokens).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
from tqdm import tqdm

from pipeline.config import RackflowConfig
from pipeline.events import RequestEvent, ResultEvent
from pipeline.profiling import ProfileInput
from pipeline.stats import percentile
from streams import keys
from streams.runner import StreamProducer, connect
from workers.local.launcher import ClusterProcesses, config_overlay_file, wait_cluster_ready
from workers.shell.runtime import WALL, run_async
from workers.stores.ingress import Gateway


async def xadd_limit(redis_url: str, n: int = 20_000, repeats: int = 3) -> float:
    """Entries per second one client appends with pipelined XADD (500 per round trip), median of repeats."""
    r = connect(redis_url)
    req = RequestEvent("x" * 36, 1, "bench", "u", "qwen2-7b", 1000, 4, 4, 500_000.0, WALL.now_ms(), rack="r0")
    rates = []
    try:
        for _ in range(repeats):
            stream = f"rf:bench:{uuid.uuid4().hex}"
            producer = StreamProducer(r, WALL.now_ms, 3_600_000)
            t = time.perf_counter()
            for i in range(0, n, 500):
                await producer.add_many((stream, req) for _ in range(min(500, n - i)))
            rates.append(n / (time.perf_counter() - t))
            await r.delete(stream)
    finally:
        await r.aclose()
    return statistics.median(rates)


def celery_baseline(redis_url: str, n: int = 2000, progress: bool = True) -> float:
    """Requests per second through one Celery task per request (real `celery worker`, 2 processes)."""
    base = redis_url.rsplit("/", 1)[0] if redis_url.count("/") >= 3 else redis_url
    url = f"{base}/1"  # a separate database: the baseline's queues never mix with the pipeline's streams
    env = {**os.environ, "RACKFLOW_REDIS_URL": url}
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers.bench.celery_baseline", "worker", "--concurrency", "2",
         "--pool", "prefork", "--loglevel", "WARNING", "--without-gossip", "--without-mingle", "--without-heartbeat"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        os.environ["RACKFLOW_REDIS_URL"] = url
        import importlib

        import workers.bench.celery_baseline as bc

        bc = importlib.reload(bc)  # bind the app to this URL
        ping_deadline = time.monotonic() + 60
        while not bc.app.control.ping(timeout=0.5):
            if time.monotonic() > ping_deadline or worker.poll() is not None:
                err = worker.stderr.read().decode()[-800:] if worker.stderr and worker.poll() is not None else ""
                raise RuntimeError(f"celery worker did not start: {err}")
        warm = [bc.generate.delay(f"warm-{i}", 1000, 4) for i in range(50)]
        for a in warm:
            a.get(timeout=60)
        bar = tqdm(total=n, desc="celery baseline", unit="req", disable=not progress, file=sys.stderr)
        t = time.perf_counter()
        handles = [bc.generate.delay(str(uuid.uuid4()), 1000, 4) for _ in range(n)]
        for a in handles:
            a.get(timeout=300)
            bar.update(1)
        rate = n / (time.perf_counter() - t)
        bar.close()
        return rate
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, 9)
            worker.wait()


def _bench_config(tmp: Path, **policies: Any) -> tuple[RackflowConfig, Path]:
    override = {
        "cluster": {"racks": [{"name": "r0", "node_count": 2,
                               "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}}]},
        "policies": policies,
    }
    path = tmp / "bench.yaml"
    return config_overlay_file(path, override), path


async def _flood(config: RackflowConfig, redis_url: str, items: list[ProfileInput], rate: float | None,
                 progress: bool, label: str) -> tuple[dict[str, dict[str, Any]], Counter[str], list[float], float]:
    """Submit (as fast as possible, or at `rate` per second) and collect every final result."""
    r = connect(redis_url)
    gw = Gateway(config, r)
    try:
        info = await r.xinfo_stream(keys.RESULTS)
        start_id = info["last-generated-id"]
        start_id = start_id.decode() if isinstance(start_id, bytes) else start_id
    except Exception:
        start_id = "0-0"
    want = {i.request_id for i in items}
    results: dict[str, dict[str, Any]] = {}
    counts: Counter[str] = Counter()
    finish_wall: list[float] = []
    bar = tqdm(total=len(items), desc=label, unit="req", disable=not progress, file=sys.stderr)
    done = asyncio.Event()

    async def collect() -> None:
        reader = connect(redis_url)
        last = start_id
        idle_since = time.monotonic()
        try:
            while len(results) < len(want):
                resp = await reader.xread({keys.RESULTS: last}, count=2000, block=500)
                got = 0
                for _s, entries in resp or []:
                    for eid, fields in entries:
                        last = eid.decode() if isinstance(eid, bytes) else eid
                        # the measuring client reads the few fields it needs from the raw entry instead of
                        # validating whole events: the measurement takes as little CPU as it can from the system
                        # under test (the pipeline's own consumers validate everything)
                        if fields.get(b"t") != ResultEvent.TYPE.encode():
                            continue
                        data = msgpack.unpackb(fields[b"d"], raw=False)
                        rid = data.get("request_id")
                        if rid not in want:
                            continue
                        counts[rid] += 1
                        if rid not in results:
                            results[rid] = data
                            finish_wall.append(time.perf_counter())
                            got += 1
                bar.update(got)
                if got:
                    idle_since = time.monotonic()
                elif done.is_set() and time.monotonic() - idle_since > 60:
                    return
        finally:
            await reader.aclose()

    task = asyncio.create_task(collect())
    t0 = time.perf_counter()
    chunk = 200
    for i in range(0, len(items), chunk):
        now = WALL.now_ms()
        batch = items[i : i + chunk]
        for x in batch:
            object.__setattr__(x, "arrival_ms", now)  # stamped when submitted, not when the list was built
        await gw.submit_many(batch)
        if rate:
            due = t0 + (i + chunk) / rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
        else:
            await asyncio.sleep(0)
    done.set()
    await task
    bar.close()
    await r.aclose()
    return results, counts, finish_wall, t0


def _items(n: int, max_tokens: int) -> list[ProfileInput]:
    return [ProfileInput(str(uuid.uuid4()), "bench", f"user-{i % 500}", "qwen2-7b", WALL.now_ms(),
                         prompt_tokens=256, max_tokens=max_tokens) for i in range(n)]


def bench_pipeline(redis_url: str, etcd_url: str, requests: int = 20_000, progress: bool = True,
                   repeats: int = 3) -> dict[str, Any]:
    """Medians of `repeats` measurements of each: the XADD limit, the Celery baseline, the pipeline flood."""
    limit = asyncio.run(xadd_limit(redis_url))
    celery = [celery_baseline(redis_url, n=1500, progress=progress) for _ in range(repeats)]
    celery_rps = statistics.median(celery)
    floods: list[float] = []
    cpu_ms: dict[str, list[float]] = {}
    lost = dups = errors = 0
    n_total = 0
    with tempfile.TemporaryDirectory(prefix="rackflow-bench-") as tmp:
        config, path = _bench_config(Path(tmp), worker={"zero_time": True, "token_flush_ms": 50})
        procs = ClusterProcesses(config, redis_url, etcd_url, Path(tmp) / "logs", ["--config", str(path)],
                                 log_level="WARNING")
        procs.start()
        try:
            asyncio.run(wait_cluster_ready(config, redis_url, etcd_url))
            from workers.bench.gateway import cpu_snapshot

            per = max(1000, requests // repeats)
            for k in range(repeats):
                items = _items(per, 4)
                cpu0 = cpu_snapshot(procs, redis_url)
                results, counts, finish, _t0 = run_async(
                    _flood(config, redis_url, items, None, progress, f"pipeline {k + 1}/{repeats}"))
                cpu1 = cpu_snapshot(procs, redis_url)
                for role in cpu1:  # CPU per request of each role's process(es): its service time
                    if role in cpu0 and results:
                        cpu_ms.setdefault(role, []).append((cpu1[role] - cpu0[role]) * 1000.0 / len(results))
                n = len(finish)
                if n >= 8:
                    a, b = finish[n // 4], finish[3 * n // 4]
                    floods.append((3 * n // 4 - n // 4) / max(1e-9, b - a))
                n_total += len(items)
                lost += len(items) - len(results)
                dups += sum(c - 1 for c in counts.values() if c > 1)
                errors += sum(1 for e in results.values() if e.get("status") != "ok")
            steady = statistics.median(floods) if floods else 0.0
            lat_items = _items(max(500, int(steady * 8)), 4)
            lat_res, lat_counts, _f, _t = run_async(
                _flood(config, redis_url, lat_items, max(1.0, steady / 2), progress, "latency at half rate"))
        finally:
            procs.stop()
    # the window's wait (routed -> batched) excluded: the control plane's own cost
    e2e = [(e["finish_ms"] - e["arrival_ms"]) - max(0.0, e["batched_ms"] - e["routed_ms"]) for e in lat_res.values()]
    raw = [e["finish_ms"] - e["arrival_ms"] for e in lat_res.values()]
    lost += len(lat_items) - len(lat_res)
    dups += sum(c - 1 for c in lat_counts.values() if c > 1)
    errors += sum(1 for e in lat_res.values() if e.get("status") != "ok")
    return {
        "requests": n_total,
        "throughput_rps": round(steady, 1),
        "throughput_runs_rps": [round(x, 1) for x in floods],
        "xadd_limit_rps": round(limit, 1),
        "celery_baseline_rps": round(celery_rps, 1),
        "celery_runs_rps": [round(x, 1) for x in celery],
        "vs_celery": round(steady / celery_rps, 1) if celery_rps else None,
        "of_xadd_limit": round(steady / limit, 3) if limit else None,
        "latency_rate_rps": round(max(1.0, steady / 2), 1),
        "p50_ms": round(percentile(e2e, 50), 2),
        "p99_ms": round(percentile(e2e, 99), 2),
        "p50_with_window_ms": round(percentile(raw, 50), 2),
        "p99_with_window_ms": round(percentile(raw, 99), 2),
        "lost": lost,
        "duplicates": dups,
        "errors": errors,
        # CPU ms per request of each role during the floods (medians): the router's and the batcher's per-request
        # service time (both workers summed under `worker`; `valkey` from its INFO cpu)
        "cpu_ms_per_request": {k: round(statistics.median(v), 4) for k, v in sorted(cpu_ms.items())},
        "cpu_ms_per_request_runs": {k: [round(x, 4) for x in v] for k, v in sorted(cpu_ms.items())},
        # the same in µs, with the control plane's total (every role plus Valkey), as `bench gateway` gives it: the
        # total is the median over the runs of each run's sum, not the sum of the roles' medians
        "cpu_us_per_request": cpu_us_per_request(cpu_ms),
    }


def cpu_us_per_request(cpu_ms: dict[str, list[float]]) -> dict[str, float]:
    """Each role's median CPU µs per request over the runs, and `control_plane`: the median of the runs' totals."""
    if not cpu_ms:
        return {}
    out = {k: round(statistics.median(v) * 1000.0, 1) for k, v in sorted(cpu_ms.items())}
    runs = min(len(v) for v in cpu_ms.values())
    out["control_plane"] = round(statistics.median(sum(v[i] for v in cpu_ms.values()) for i in range(runs)) * 1000.0,
                                 1)
    return out


def bench_batching(redis_url: str, etcd_url: str, requests: int = 1500, speedup: float = 10.0,
                   progress: bool = True) -> dict[str, Any]:
    """Fixed batches of 32 vs the memory-budget window on the Azure conv trace, live, `sim` engines."""
    from workers.local.demo import DEFAULT_TRACE, DemoRun

    out: dict[str, Any] = {"requests": requests, "speedup": speedup}
    for name, batcher in (("fixed32", {"mode": "fixed", "fixed_batch": 32}), ("window", {"mode": "window"})):
        with tempfile.TemporaryDirectory(prefix="rackflow-bench-") as tmp:
            override = {"policies": {"batcher": batcher, "worker": {"max_running": 32 if name == "fixed32" else 256}}}
            path = Path(tmp) / "b.yaml"
            config = config_overlay_file(path, override)
            procs = ClusterProcesses(config, redis_url, etcd_url, Path(tmp) / "logs", ["--config", str(path)],
                                     log_level="WARNING")
            procs.start()
            try:
                run = DemoRun(config, redis_url, etcd_url, DEFAULT_TRACE, requests, speedup, "qwen2-7b",
                              config.policies.seed, progress=progress)
                asyncio.run(run.wait_ready())
                report = asyncio.run(run.run())
            finally:
                procs.stop()
        ok = [e for e in run.results.values() if e.request_id in run.submitted and e.status == "ok"]
        small = [e.finish_ms - e.arrival_ms for e in ok if e.out_tokens <= 100]
        out[name] = {
            "mean_batch_mem_util": report["mean_batch_mem_util"],
            "mean_batch_size": report["mean_batch_size"],
            "batches": report["batches"],
            "small_p95_ms": round(percentile(small, 95), 1),
            "small_requests": len(small),
            "p95_ms": report["p95_ms"],
            "ttft_p95_ms": report["ttft_p95_ms"],
            "completed": report["completed"],
            "lost": report["lost"],
            "duplicates": report["duplicates"],
        }
    return out

