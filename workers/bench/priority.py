"""`rackflow bench priority` and `rackflow bench fairness`: priority classes and fair shares on a live cluster.

The cluster: real role processes (`rackflow up`'s launcher: a router, a batcher, two `sim` workers with real
iteration times, the H100 cost model of qwen2-7b) on services of its own. Each engine runs at most `max_running` (4)
sequences, so the engines, not this machine's two cores, bound the capacity. Requests enter through the gateway core
(`workers.stores.ingress.Gateway.admit`, what the HTTP gateway, the Batch API's runner and `rackflow jobs` call, with
its own route and admission), and every final result is read from `rf:results`: what a request's TTFT, tokens and
finish time are comes from the worker's record, not from this process's clock.

`bench priority` (issue: interactive traffic unharmed, idle capacity used). Per repeat:
1. `alone`: interactive requests (class `interactive`, Poisson at `load` x capacity, the same seeded schedule in both
   runs) for `phase_s`; their P99 TTFT (first token - arrival, as the worker recorded them);
0. `capacity`: the cluster saturated with requests of the bench's shape (`backlog` kept outstanding, interactive
   class: the engines' queues never empty); the generated tokens it completes in `capacity_s` after `ramp_s` are
   its token capacity (tokens/s; every request has the same shape, so generated tokens measure the work; a
   request's tokens count spread from its first token to its finish, the share inside the span);
2. `backlog`: a batch backlog (class `batch`, tenant `batch-job`) kept `backlog` requests deep (more than every slot
   of the cluster, so it saturates it alone) starts, `ramp_s` before
3. `mixed`: the same interactive schedule again, for `phase_s`, with the backlog still kept full.
   `interactive_p99_ttft_ms` is the interactive P99 TTFT of this phase, `interactive_alone_p99_ttft_ms` that of 1;
   `batch_idle_use` = batch tokens served in the phase / (token capacity x phase - interactive tokens served in
   it): the share of the capacity interactive work left idle that batch work used.
4. The backlog stops; every admitted request (of both classes) must end with exactly one final result (`lost`
   counts those without exactly one).
The capacity in requests/s that sets the interactive rate is measured once, before the first repeat, as in 0.
Figures are the medians over the repeats; `runs` has each repeat's.

`bench fairness` (issue: fair shares). Per repeat, two tenants send interactive requests of the same shape at 3:1
(`heavy` at 1.8x, `light` at 0.6x the capacity in requests/s: each above an equal share, half of it), for
`fair_s`. Service per tenant and minute: prompt + generated tokens of the requests that finished in that minute
(minutes counted from the start; the first `warmup_s`, while the queues form, are left out). `max_share_error` is
the largest |share - 1/2| / (1/2) of either tenant over the minutes (median over the repeats; `worst` the largest
of all).
With `--no-fair` the batchers' fair share is off (smallest memory first, whoever sent it): the baseline.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pipeline.config import RackflowConfig
from pipeline.events import ResultEvent
from pipeline.priority import BATCH, INTERACTIVE
from pipeline.profiling import ProfileInput
from pipeline.stats import percentile
from streams import codec, keys
from streams.runner import connect
from workers.bench.gateway import MODEL
from workers.local.launcher import ClusterProcesses, config_overlay_file, wait_cluster_ready
from workers.shell.runtime import WALL
from workers.stores.ingress import Gateway, RequestRejected

MAX_TOKENS = 48
PROMPT_WORDS = 120
"""Every request has the same shape (about 160 prompt tokens, 48 generated): tokens compare across classes."""

CLUSTER: dict[str, Any] = {
    "cluster": {"racks": [
        {"name": "r0", "node_count": 2, "node": {"gpu": "h100-80gb", "tp": 1, "models": [MODEL]}},
    ]},
    "policies": {"worker": {"max_running": 4, "token_flush_ms": 50}},
    # the fairness bench overloads the cluster on purpose: a short queue sheds the excess early (both tenants alike)
    "gateway": {"max_rack_queue": 200, "routing": "inline"},
}


@dataclass
class _Run:
    """What one measurement saw, by request id."""

    admitted: dict[str, tuple[int, str, float]] = field(default_factory=dict)
    """request id -> (class, tenant, monotonic admit time)."""
    results: dict[str, list[ResultEvent]] = field(default_factory=lambda: defaultdict(list))
    shed: Counter[str] = field(default_factory=Counter)
    """429s by tenant."""
    errors: Counter[str] = field(default_factory=Counter)


class _Follower:
    """Reads `rf:results` from the start of the bench (one XREAD loop) into `run.results`."""

    def __init__(self, r: Any, run: _Run, start_id: str) -> None:
        self.r = r
        self.run = run
        self.last = start_id
        self.stop = asyncio.Event()
        self.done = asyncio.Event()
        """Set at each batch of results (waiters re-check what they wait for)."""

    async def loop(self) -> None:
        while not self.stop.is_set():
            resp = await self.r.xread({keys.RESULTS: self.last}, count=1000, block=200)
            for _s, entries in resp or []:
                for eid, fields in entries:
                    self.last = eid.decode() if isinstance(eid, bytes) else eid
                    try:
                        ev = codec.decode(fields)
                    except Exception:
                        continue
                    if isinstance(ev, ResultEvent) and ev.request_id in self.run.admitted:
                        self.run.results[ev.request_id].append(ev)
                self.done.set()


def _prompt(i: int, tag: str) -> str:
    return f"{tag} {i}: " + " ".join(f"w{(i * 31 + k) % 997}" for k in range(PROMPT_WORDS))


class _Load:
    """Admits requests through the gateway core, as its front ends do."""

    def __init__(self, config: RackflowConfig, redis_url: str) -> None:
        self.config = config
        self.r = connect(redis_url)
        self.gw = Gateway(config, self.r)
        self.run = _Run()
        self.follower: _Follower | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.gw.start_routing()
        last = await self.r.xrevrange(keys.RESULTS, count=1)
        start = last[0][0].decode() if last else "0-0"
        self.follower = _Follower(self.r, self.run, start)
        self.tasks.add(asyncio.create_task(self.follower.loop()))

    async def close(self) -> None:
        if self.follower is not None:
            self.follower.stop.set()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.gw.stop_routing()
        await self.r.aclose()

    async def admit(self, cls: int, tenant: str, i: int, retry: bool = False) -> str | None:
        """One request; its id, or None when it was shed (429) and `retry` is off."""
        while True:
            rid = str(uuid.uuid4())
            inp = ProfileInput(request_id=rid, tenant=tenant, user_id=f"{tenant}-u{i % 16}", model=MODEL,
                               arrival_ms=WALL.now_ms(), prompt=_prompt(i, tenant), max_tokens=MAX_TOKENS,
                               priority=cls)
            self.run.admitted[rid] = (cls, tenant, time.monotonic())
            try:
                await self.gw.admit(inp)
                return rid
            except RequestRejected as e:
                del self.run.admitted[rid]
                if e.status != 429:
                    self.run.errors[f"{e.status} {e.code}"] += 1
                    return None
                self.run.shed[tenant] += 1
                if not retry:
                    return None
                await asyncio.sleep(min(1.0, float(e.retry_after_s or 1)) * random.uniform(0.2, 0.6))
            except Exception as e:
                del self.run.admitted[rid]
                self.run.errors[type(e).__name__] += 1
                return None

    def open_loop(self, cls: int, tenant: str, rate: float, duration_s: float, seed: int,
                  base: int = 0) -> asyncio.Task[None]:
        """Poisson arrivals at `rate`/s for `duration_s` (the schedule is the seed's), each admitted at its time."""
        async def go() -> None:
            rng = random.Random(seed)
            t0 = time.monotonic()
            t = 0.0
            i = 0
            while True:
                t += rng.expovariate(rate)
                if t >= duration_s:
                    return
                wait = t0 + t - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                task = asyncio.create_task(self._one(cls, tenant, base + i))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
                i += 1
        return asyncio.create_task(go())

    async def _one(self, cls: int, tenant: str, i: int) -> None:
        await self.admit(cls, tenant, i)

    def backlog(self, depth: int, stop: asyncio.Event, cls: int = BATCH,
                tenant: str = "batch-job") -> asyncio.Task[None]:
        """Keep `depth` requests (batch ones by default) admitted and unfinished until `stop` (a batch job's runner,
        as the Batch API runs one: shed requests wait their Retry-After and are offered again)."""
        async def go() -> None:
            outstanding: set[str] = set()
            i = 0
            assert self.follower is not None
            while not stop.is_set():
                outstanding = {rid for rid in outstanding if not self.run.results.get(rid)}
                want = depth - len(outstanding)
                if want > 0:
                    got = await asyncio.gather(*(self.admit(cls, tenant, i + k, retry=True)
                                                 for k in range(want)))
                    i += want
                    outstanding.update(r for r in got if r is not None)
                self.follower.done.clear()
                try:
                    await asyncio.wait_for(self.follower.done.wait(), timeout=0.2)
                except TimeoutError:
                    pass
        return asyncio.create_task(go())

    async def drain(self, timeout_s: float) -> None:
        """Until every admitted request has a final result (or `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self.run.results.get(rid) for rid in self.run.admitted):
                return
            await asyncio.sleep(0.5)


def _finished_in(run: _Run, cls: int | None, a_ms: float, b_ms: float, tenant: str | None = None) -> list[ResultEvent]:
    out = []
    for rid, evs in run.results.items():
        c, t, _ = run.admitted[rid]
        if (cls is None or c == cls) and (tenant is None or t == tenant):
            ev = evs[0]
            if ev.status == "ok" and a_ms <= ev.finish_ms < b_ms:
                out.append(ev)
    return out


def _tokens_in(run: _Run, cls: int, a_ms: float, b_ms: float, tenant: str | None = None) -> float:
    """Generated tokens of class `cls` served within [a_ms, b_ms): each finished request's tokens spread evenly
    from its first token to its finish (its first token at its first token's time), the share inside the span
    counted. Counting whole requests by finish time instead errs by the tokens in flight at both ends."""
    total = 0.0
    for rid, evs in run.results.items():
        c, t, _ = run.admitted[rid]
        if c != cls or (tenant is not None and t != tenant):
            continue
        ev = evs[0]
        if ev.status != "ok" or not ev.out_tokens:
            continue
        first = ev.first_token_ms or ev.finish_ms
        if a_ms <= first < b_ms:
            total += 1
        rest = ev.out_tokens - 1
        if rest > 0:
            span = ev.finish_ms - first
            if span <= 0:
                total += rest if a_ms <= ev.finish_ms < b_ms else 0
            else:
                total += rest * max(0.0, min(b_ms, ev.finish_ms) - max(a_ms, first)) / span
    return total


def _ttfts(run: _Run, ids: set[str]) -> list[float]:
    out = []
    for rid in ids:
        evs = run.results.get(rid)
        if evs and evs[0].status == "ok" and evs[0].first_token_ms:
            out.append(evs[0].first_token_ms - evs[0].arrival_ms)
    return out


def _hops(run: _Run, ids: set[str]) -> dict[str, float | None]:
    """Medians of where the TTFT went: arrival -> dispatched in a batch (routing and the window), then -> first
    token (the worker's queue, the engine's queue and the prefill)."""
    queue, start = [], []
    for rid in ids:
        evs = run.results.get(rid)
        if evs and evs[0].status == "ok" and evs[0].first_token_ms and evs[0].batched_ms:
            queue.append(evs[0].batched_ms - evs[0].arrival_ms)
            start.append(evs[0].first_token_ms - evs[0].batched_ms)
    return {"to_batch_p50_ms": round(percentile(queue, 50), 1) if queue else None,
            "to_batch_p99_ms": round(percentile(queue, 99), 1) if queue else None,
            "batch_to_first_token_p50_ms": round(percentile(start, 50), 1) if start else None,
            "batch_to_first_token_p99_ms": round(percentile(start, 99), 1) if start else None}


def _lost(run: _Run) -> int:
    return sum(1 for rid in run.admitted if len(run.results.get(rid, ())) != 1)


def _cluster(tmpd: Path, over: dict[str, Any], redis_url: str | None, etcd_url: str | None) -> tuple[
        RackflowConfig, ClusterProcesses, Any, Any, str, str]:
    from workers.local.etcd import EtcdProcess
    from workers.local.supervise import free_port
    from workers.local.valkey import ValkeyProcess

    valkey = etcd = None
    if redis_url is None:
        valkey = ValkeyProcess(tmpd / "valkey", port=free_port())
        valkey.start()
        redis_url = valkey.url
    if etcd_url is None:
        etcd = EtcdProcess(tmpd / "etcd")
        etcd.start()
        etcd_url = etcd.url
    raw = json.loads(json.dumps(over))
    raw.setdefault("policies", {})["kv"] = {"l1_dir": str(tmpd / "l1")}
    path = tmpd / "bench.yaml"
    config = config_overlay_file(path, raw)
    procs = ClusterProcesses(config, redis_url, etcd_url, tmpd / "logs", ["--config", str(path)], log_level="WARNING")
    procs.start()
    asyncio.run(wait_cluster_ready(config, redis_url, etcd_url, 180))
    return config, procs, valkey, etcd, redis_url, etcd_url


def _stop(procs: ClusterProcesses | None, valkey: Any, etcd: Any) -> None:
    if procs is not None:
        procs.stop()
    if etcd is not None:
        etcd.stop()
    if valkey is not None:
        valkey.stop()


def _overlay(batch_yield: str, fair: bool) -> dict[str, Any]:
    over = json.loads(json.dumps(CLUSTER))
    over["policies"]["batcher"] = {"batch_yield": batch_yield, "fair_share": fair}
    return over


def _on_cluster(prefix: str, over: dict[str, Any], redis_url: str | None, etcd_url: str | None,
                body: Callable[[_Load], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """Start the bench's cluster (`over` on CLUSTER), run `body` with its load generator, stop everything."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        procs = valkey = etcd = None
        try:
            config, procs, valkey, etcd, redis_url, etcd_url = _cluster(Path(tmp), over, redis_url, etcd_url)

            async def main() -> dict[str, Any]:
                load = _Load(config, redis_url)
                await load.start()
                try:
                    out = await body(load)
                    await load.drain(180)
                    return {**out, "lost": _lost(load.run), "admitted": len(load.run.admitted),
                            "shed": dict(load.run.shed), "errors": dict(load.run.errors)}
                finally:
                    await load.close()

            return asyncio.run(main())
        finally:
            _stop(procs, valkey, etcd)


async def _capacity(load: _Load, depth: int, ramp_s: float, capacity_s: float) -> tuple[float, float]:
    """The cluster saturated with interactive requests of the bench's shape, `depth` kept outstanding (the engines'
    queues never empty): (requests/s, generated tokens/s) completed in `capacity_s` after `ramp_s`."""
    stop = asyncio.Event()
    feeder = load.backlog(depth, stop, INTERACTIVE, "saturation")
    await asyncio.sleep(ramp_s)
    a = WALL.now_ms()
    await asyncio.sleep(capacity_s)
    b = WALL.now_ms()
    stop.set()
    await feeder
    await load.drain(120)
    done = _finished_in(load.run, INTERACTIVE, a, b, "saturation")
    span = (b - a) / 1000.0
    return len(done) / span, _tokens_in(load.run, INTERACTIVE, a, b, "saturation") / span


def bench_priority(redis_url: str | None = None, etcd_url: str | None = None, *, repeats: int = 3,
                   phase_s: float = 45.0, load_frac: float = 0.7, backlog: int = 48, ramp_s: float = 5.0,
                   capacity_s: float = 20.0, batch_yield: str = "preempt", progress: bool = True,
                   seed: int = 0) -> dict[str, Any]:
    """The priority bench described in this module's docstring; returns the report (JSON-ready)."""
    runs: list[dict[str, Any]] = []
    bar = tqdm(total=repeats * 3 + 1, desc="bench priority", unit="phase", disable=not progress, file=sys.stderr)

    async def body(load: _Load) -> dict[str, Any]:
        cap_rps, _ = await _capacity(load, backlog, ramp_s * 2, capacity_s)
        bar.update(1)
        rate = load_frac * cap_rps
        bar.set_postfix_str(f"capacity {cap_rps:.1f} req/s, interactive at {rate:.1f} req/s")
        for k in range(repeats):
            runs.append(await _one_repeat(load, rate, phase_s, backlog, ramp_s, capacity_s, seed + k, bar))
        return {"capacity_rps": round(cap_rps, 2), "interactive_rps": round(rate, 2)}

    try:
        totals = _on_cluster("rackflow-priority-", _overlay(batch_yield, True), redis_url, etcd_url, body)
    finally:
        bar.close()

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in runs), 3)

    return {
        "interactive_p99_ttft_ms": med("interactive_p99_ttft_ms"),
        "interactive_alone_p99_ttft_ms": med("interactive_alone_p99_ttft_ms"),
        "ttft_ratio": med("ttft_ratio"),
        "batch_idle_use": med("batch_idle_use"),
        "lost": totals["lost"],
        "admitted": totals["admitted"],
        "shed": totals["shed"],
        "errors": totals["errors"],
        "capacity_rps": totals["capacity_rps"],
        "interactive_rps": totals["interactive_rps"],
        "batch_yield": batch_yield,
        "repeats": repeats,
        "phase_s": phase_s,
        "runs": runs,
        "setup": "1 rack x 2 sim H100 nodes (qwen2-7b cost model, real iteration times, max_running 4); requests of "
                 f"one shape ({PROMPT_WORDS} words, {MAX_TOKENS} tokens) through the gateway core; interactive at "
                 f"{load_frac:g} x capacity (Poisson), batch backlog {backlog} deep; medians over the repeats",
    }


async def _one_repeat(load: _Load, rate: float, phase_s: float, backlog: int, ramp_s: float, capacity_s: float,
                      seed: int, bar: Any) -> dict[str, Any]:
    run = load.run
    # 0. the token capacity (saturated with requests of this shape)
    _, cap_tok = await _capacity(load, backlog, ramp_s, capacity_s)
    bar.update(1)
    # 1. interactive alone
    before = set(run.admitted)
    a0 = WALL.now_ms()
    await load.open_loop(INTERACTIVE, "chat", rate, phase_s, seed)
    await load.drain(60)
    alone_ids = {rid for rid in run.admitted if rid not in before}
    alone = _ttfts(run, alone_ids)
    a1 = WALL.now_ms()
    bar.update(1)
    # 2. the backlog fills the cluster, 3. the same interactive schedule with it
    stop = asyncio.Event()
    feeder = load.backlog(backlog, stop)
    await asyncio.sleep(ramp_s)
    before = set(run.admitted)
    m0 = WALL.now_ms()
    await load.open_loop(INTERACTIVE, "chat", rate, phase_s, seed)
    m1 = WALL.now_ms()
    mixed_ids = {rid for rid in run.admitted if rid not in before and run.admitted[rid][0] == INTERACTIVE}
    stop.set()
    await feeder
    await load.drain(120)
    bar.update(1)
    mixed = _ttfts(run, mixed_ids)
    inter_tok = _tokens_in(run, INTERACTIVE, m0, m1)
    batch_tok = _tokens_in(run, BATCH, m0, m1)
    idle = cap_tok * (m1 - m0) / 1000.0 - inter_tok
    p_alone = percentile(alone, 99) if alone else float("nan")
    p_mixed = percentile(mixed, 99) if mixed else float("nan")
    return {
        "interactive_alone_p99_ttft_ms": round(p_alone, 1),
        "interactive_p99_ttft_ms": round(p_mixed, 1),
        "interactive_alone_p50_ttft_ms": round(percentile(alone, 50), 1) if alone else None,
        "interactive_p50_ttft_ms": round(percentile(mixed, 50), 1) if mixed else None,
        "ttft_ratio": round(p_mixed / p_alone, 3) if alone and mixed else float("nan"),
        "alone_hops": _hops(run, alone_ids),
        "mixed_hops": _hops(run, mixed_ids),
        "interactive_requests": [len(alone), len(mixed)],
        "capacity_tokens_per_s": round(cap_tok, 1),
        "interactive_tokens": round(inter_tok),
        "batch_tokens": round(batch_tok),
        "batch_idle_use": round(batch_tok / idle, 3) if idle > 0 else float("nan"),
        "alone_s": round((a1 - a0) / 1000, 1),
    }


def bench_fairness(redis_url: str | None = None, etcd_url: str | None = None, *, repeats: int = 3,
                   fair_s: float = 130.0, warmup_s: float = 10.0, heavy: float = 1.8, light: float = 0.6,
                   fair: bool = True, progress: bool = True, seed: int = 0, backlog: int = 48, ramp_s: float = 5.0,
                   capacity_s: float = 15.0) -> dict[str, Any]:
    """The fairness bench described in this module's docstring; returns the report (JSON-ready)."""
    runs: list[dict[str, Any]] = []
    bar = tqdm(total=repeats + 1, desc="bench fairness", unit="run", disable=not progress, file=sys.stderr)

    async def body(load: _Load) -> dict[str, Any]:
        cap_rps, _ = await _capacity(load, backlog, ramp_s * 2, capacity_s)
        bar.update(1)
        bar.set_postfix_str(f"capacity {cap_rps:.1f} req/s")
        for k in range(repeats):
            t0 = WALL.now_ms()
            a = load.open_loop(INTERACTIVE, "heavy", heavy * cap_rps, fair_s, seed * 1000 + 2 * k)
            b = load.open_loop(INTERACTIVE, "light", light * cap_rps, fair_s, seed * 1000 + 2 * k + 1, base=10**6)
            await asyncio.gather(a, b)
            await load.drain(120)
            runs.append(_shares(load.run, t0 + warmup_s * 1000, t0 + fair_s * 1000))
            bar.update(1)
        return {"capacity_rps": round(cap_rps, 2)}

    try:
        totals = _on_cluster("rackflow-fairness-", _overlay("preempt", fair), redis_url, etcd_url, body)
    finally:
        bar.close()
    errs = [r["max_share_error"] for r in runs]
    return {
        "max_share_error": round(statistics.median(errs), 4),
        "max_share_error_worst": round(max(errs), 4),
        "fair_share": fair,
        "demand": {"heavy": heavy, "light": light, "unit": "x the capacity (requests/s)"},
        **totals,
        "repeats": repeats,
        "runs": runs,
        "setup": "1 rack x 2 sim H100 nodes (qwen2-7b cost model, real iteration times, max_running 4); two tenants "
                 f"at {heavy:g} and {light:g} x the capacity, interactive, requests of one shape; service = "
                 "prompt + generated tokens of the requests finished in each minute",
    }


def _shares(run: _Run, a_ms: float, b_ms: float) -> dict[str, Any]:
    minutes = []
    t = a_ms
    while t + 30_000 <= b_ms:  # whole minutes, and a last part of at least 30 s
        end = min(b_ms, t + 60_000)
        service = {ten: sum(ev.in_tokens + ev.out_tokens for ev in _finished_in(run, INTERACTIVE, t, end, ten))
                   for ten in ("heavy", "light")}
        total = sum(service.values())
        share = {ten: v / total for ten, v in service.items()} if total else {"heavy": 0.0, "light": 0.0}
        minutes.append({"from_s": round((t - a_ms) / 1000), "to_s": round((end - a_ms) / 1000),
                        "tokens": service, "share": {k: round(v, 4) for k, v in share.items()},
                        "error": round(max(abs(v - 0.5) / 0.5 for v in share.values()), 4)})
        t = end
    return {"minutes": minutes, "max_share_error": max((m["error"] for m in minutes), default=float("nan"))}
