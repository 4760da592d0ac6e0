"""`rackflow bench gateway`: the HTTP gateway under load, end to end through the live pipeline.

A local cluster (1 rack x 2 nodes, `sim` engines in zero-time mode, router, batcher) runs as real processes with a
real HTTP gateway (`rackflow gateway --no-auth`, uvicorn) in front. An async load generator in this process
(httpx.AsyncClient with a connection pool) runs N concurrent clients in a closed loop for a fixed duration:
non-streaming completions with small `max_tokens`, and every k-th request streamed (SSE, read to `[DONE]`).

Reported, as medians over repeats:
- `rps`: completed (2xx, full answer) requests per second, sustained over the measured window;
- `p50_ms` / `p99_ms`: the control plane's added latency. The engine takes no time (zero-time `sim`), so the
  end-to-end HTTP latency a client sees (request sent -> full answer, or -> `[DONE]` for a stream) is all control
  plane: HTTP + gateway admission + router + batcher window + worker loop + result/token streams back;
- `errors`: non-2xx answers other than 429, transport errors, wrong answers and SSE error events (must be 0);
- `shed`: 429 answers (load shed, reported apart from errors);
- `cpu_us_per_request`: CPU time (user + system) each role process spent per completed request over the measured
  runs, from /proc/<pid>/stat (gateway, router, batcher, workers) and Valkey's own `INFO cpu`; the load generator
  is apart. A profile of one role names its hot functions: `py-spy record -p <pid>` (docs/GUIDE.md, Benchmarks).
`--http-parser h11|httptools` picks uvicorn's parser for the gateway (default: the config's, httptools).
`--window-hold` runs the batcher with `close_when_room` off (the window holds a request a node could start now until
it closes on its budget or its `window_ms`), to measure what closing on room buys.
The load generator shares the 2 cores with the 5 processes it measures, so the figures are a floor for the
control plane, not its ceiling.

The load-generator functions (`closed_loop`, `open_loop`) are also what the overload test drives the gateway with.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from pipeline.stats import percentile
from workers.local.launcher import ClusterProcesses, config_overlay_file, wait_cluster_ready
from workers.shell.runtime import run_async

MODEL = "qwen2-7b"


@dataclass
class Outcome:
    """One HTTP request as the client saw it."""

    start: float
    """time.monotonic() when it was sent."""
    latency_s: float
    status: int
    """HTTP status; 0 for a transport error."""
    stream: bool
    request_id: str | None = None
    retry_after: str | None = None
    error: str | None = None
    """Why an answer counts as an error (transport error, SSE error event, wrong token count)."""
    ttft_s: float | None = None
    """Streamed answers: seconds from sending to the first SSE chunk that carries text (None if none came)."""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and self.error is None

    @property
    def shed(self) -> bool:
        return self.status == 429


async def one_request(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, stream: bool,
                      headers: dict[str, str] | None = None) -> Outcome:
    body = {"model": MODEL, "prompt": f"load test request {i}", "max_tokens": max_tokens, "user": f"u{i % 64}"}
    t0 = time.monotonic()
    try:
        if not stream:
            resp = await client.post(f"{url}/v1/completions", json=body, headers=headers)
            out = Outcome(t0, time.monotonic() - t0, resp.status_code, False,
                          retry_after=resp.headers.get("retry-after"))
            if resp.status_code == 200:
                data = resp.json()
                out.request_id = str(data["id"]).removeprefix("cmpl-")
                if data["usage"]["completion_tokens"] != max_tokens:
                    out.error = f"{data['usage']['completion_tokens']} tokens, asked {max_tokens}"
            return out
        async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                                 headers=headers) as resp:
            out = Outcome(t0, 0.0, resp.status_code, True, retry_after=resp.headers.get("retry-after"))
            if resp.status_code != 200:
                await resp.aread()
                out.latency_s = time.monotonic() - t0
                return out
            last = ""
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                last = line.removeprefix("data: ")
                if last == "[DONE]":
                    break
                chunk = json.loads(last)
                if "error" in chunk:
                    out.error = f"SSE error event: {chunk['error'].get('code')}"
                elif out.request_id is None:
                    out.request_id = str(chunk["id"]).removeprefix("cmpl-")
                if out.ttft_s is None and any(c.get("text") for c in chunk.get("choices") or ()):
                    out.ttft_s = time.monotonic() - t0
            if last != "[DONE]" and out.error is None:
                out.error = "stream ended without [DONE]"
            out.latency_s = time.monotonic() - t0
            return out
    except (httpx.HTTPError, OSError, ValueError, KeyError) as e:
        return Outcome(t0, time.monotonic() - t0, 0, stream, error=f"{type(e).__name__}: {e}")


def _client(max_connections: int, timeout_s: float) -> httpx.AsyncClient:
    # idle connections are dropped after 2 s, before uvicorn's keep-alive timeout (5 s) closes them from its side: a
    # request sent on a connection the server is closing would fail with a read error that is the client's doing
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                          keepalive_expiry=2.0)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s))


async def closed_loop(url: str, clients: int, duration_s: float, max_tokens: int = 8, stream_every: int = 5,
                      on_done: Callable[[Outcome], None] | None = None, timeout_s: float = 60.0) -> list[Outcome]:
    """`clients` concurrent clients, each sending its next request when the last one ended, for `duration_s`;
    every `stream_every`-th request is streamed (0: none)."""
    outcomes: list[Outcome] = []
    counter = [0]
    end = time.monotonic() + duration_s
    async with _client(clients, timeout_s) as client:

        async def run_client() -> None:
            while time.monotonic() < end:
                i = counter[0]
                counter[0] += 1
                o = await one_request(client, url, i, max_tokens, bool(stream_every) and i % stream_every == 0)
                outcomes.append(o)
                if on_done is not None:
                    on_done(o)

        await asyncio.gather(*(run_client() for _ in range(clients)))
    return outcomes


async def open_loop(url: str, rate: float, duration_s: float, max_tokens: int = 8, stream_every: int = 5,
                    max_in_flight: int = 4000, on_done: Callable[[Outcome], None] | None = None,
                    timeout_s: float = 120.0) -> list[Outcome]:
    """Requests sent at a fixed `rate` per second for `duration_s`, whatever the answers (offered load does not
    slow down when the service does). Raises RuntimeError if more than `max_in_flight` wait at once."""
    outcomes: list[Outcome] = []
    tasks: set[asyncio.Task[None]] = set()
    async with _client(max_in_flight, timeout_s) as client:

        async def send(i: int) -> None:
            o = await one_request(client, url, i, max_tokens, bool(stream_every) and i % stream_every == 0)
            outcomes.append(o)
            if on_done is not None:
                on_done(o)

        t0 = time.monotonic()
        n = int(rate * duration_s)
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            if len(tasks) >= max_in_flight:
                raise RuntimeError(f"more than {max_in_flight} requests in flight: the service stopped answering")
            task = asyncio.create_task(send(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
    return outcomes


async def shown_closed_loop(url: str, clients: int, duration_s: float, max_tokens: int, stream_every: int,
                            bar: tqdm[Any], label: str) -> list[Outcome]:
    """`closed_loop`, advancing `bar` by one per second of the run with the req/s so far (the bench's progress)."""
    done = [0]

    def tick(_o: Outcome) -> None:
        done[0] += 1

    task = asyncio.create_task(closed_loop(url, clients, duration_s, max_tokens, stream_every, tick))
    shown = 0
    while not task.done():
        await asyncio.sleep(1.0)
        if shown < duration_s:
            bar.update(1)
            shown += 1
            bar.set_postfix_str(f"{label} {done[0] / shown:.0f} req/s")
    bar.update(max(0, round(duration_s) - shown))
    return await task


def summarize(outcomes: list[Outcome], window_s: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    lat = [o.latency_s * 1000 for o in ok]
    return {
        "requests": len(outcomes),
        "completed": len(ok),
        "streamed": sum(1 for o in ok if o.stream),
        "rps": round(len(ok) / window_s, 1) if window_s > 0 else 0.0,
        "p50_ms": round(percentile(lat, 50), 2) if lat else None,
        "p99_ms": round(percentile(lat, 99), 2) if lat else None,
        "errors": sum(1 for o in outcomes if not o.ok and not o.shed),
        "shed": sum(1 for o in outcomes if o.shed),
    }


HOPS = (
    ("http_in", "client sends -> gateway admits (HTTP, auth, profile)"),
    ("ingress_to_router", "admitted -> routed to a rack (rf:ingress and the router; inline: the gateway itself)"),
    ("window", "rack stream -> batcher placed it in a batch (the window)"),
    ("batch_to_start", "node stream -> the worker's engine started it"),
    ("engine_first_token", "engine start -> first token (zero-time engine: ~0)"),
    ("engine_rest", "first token -> last token (zero-time engine: ~0)"),
    ("reply", "result written -> client has the whole answer (reply stream, gateway, HTTP)"),
)
"""The hops of the live path, in order, each from the timestamps the events carry (wall-clock ms, one machine)."""


async def hop_times(redis_url: str, outcomes: list[Outcome], wall_offset_s: float) -> dict[str, list[float]]:
    """Per hop (HOPS), the milliseconds each completed request spent in it: the final results' timestamps
    (arrival, routed, batched, start, first token, finish) from `rf:results`, and the client's send and end
    (`wall_offset_s`: time.time() - time.monotonic() of this process)."""
    from pipeline.events import ResultEvent
    from streams import codec, keys
    from streams.runner import connect

    sent = {o.request_id: o for o in outcomes if o.ok and o.request_id}
    if not sent:
        return {h: [] for h, _ in HOPS}
    since_ms = int((min(o.start for o in sent.values()) + wall_offset_s) * 1000) - 1000
    r = connect(redis_url)
    found: dict[str, ResultEvent] = {}
    try:
        start = f"{since_ms}-0"
        while True:
            entries = await r.xrange(keys.RESULTS, min=start, count=5000)
            for _eid, fields in entries:
                ev = codec.decode(fields)
                if isinstance(ev, ResultEvent) and ev.request_id in sent:
                    found[ev.request_id] = ev
            if len(entries) < 5000:
                break
            last = entries[-1][0]
            start = "(" + (last.decode() if isinstance(last, bytes) else last)
    finally:
        await r.aclose()
    hops: dict[str, list[float]] = {h: [] for h, _ in HOPS}
    for rid, ev in found.items():
        o = sent[rid]
        send_ms = (o.start + wall_offset_s) * 1000
        end_ms = (o.start + o.latency_s + wall_offset_s) * 1000
        marks = (send_ms, ev.arrival_ms, ev.routed_ms, ev.batched_ms, ev.start_ms, ev.first_token_ms, ev.finish_ms,
                 end_ms)
        if any(m <= 0 for m in marks):
            continue
        for (name, _), a, b in zip(HOPS, marks, marks[1:], strict=False):
            hops[name].append(b - a)
    return hops


def hop_summary(hops: dict[str, list[float]]) -> dict[str, dict[str, float | None]]:
    return {h: {"p50_ms": round(percentile(v, 50), 2) if v else None,
                "p99_ms": round(percentile(v, 99), 2) if v else None} for h, v in hops.items()}


async def wait_http_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5) as c:
        while True:
            try:
                if (await c.get(f"{url}/healthz")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway at {url} not healthy after {timeout_s:.0f}s")
            await asyncio.sleep(0.2)


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (Linux /proc; None where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime (fields 14 and 15 of stat)


async def valkey_cpu_s(redis_url: str) -> float | None:
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(redis_url)
    try:
        info = await r.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    except Exception:  # a server that does not say: no figure
        return None
    finally:
        await r.aclose()


def cpu_snapshot(procs: ClusterProcesses, redis_url: str) -> dict[str, float]:
    """CPU seconds so far per role (processes of one role summed: both workers are `worker`), and Valkey's."""
    out: dict[str, float] = {}
    for p in procs.procs:
        cpu = process_cpu_s(p.proc.pid)
        if cpu is not None:
            out[p.role] = out.get(p.role, 0.0) + cpu
    v = run_async(valkey_cpu_s(redis_url))
    if v is not None:
        out["valkey"] = v
    return out


def bench_gateway(redis_url: str, etcd_url: str, clients: int = 32, duration_s: float = 12.0, repeats: int = 3,
                  max_tokens: int = 8, stream_every: int = 5, progress: bool = True,
                  window_hold: bool = False, http_parser: str | None = None,
                  routing: str | None = None) -> dict[str, Any]:
    from workers.local.supervise import free_port

    runs: list[dict[str, Any]] = []
    hop_ms: dict[str, list[float]] = {h: [] for h, _ in HOPS}
    ttft_ms: list[float] = []
    cpu_s: dict[str, float] = {}
    wall_offset = time.time() - time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rackflow-bench-") as tmp:
        override = {
            "cluster": {"racks": [{"name": "r0", "node_count": 2,
                                   "node": {"gpu": "h100-80gb", "tp": 1, "models": [MODEL]}}]},
            "policies": {"worker": {"zero_time": True, "token_flush_ms": 50},
                         "batcher": {"close_when_room": not window_hold}},
        }
        gw: dict[str, Any] = {}
        if http_parser is not None:
            gw["http_parser"] = http_parser
        if routing is not None:
            gw["routing"] = routing
        if gw:
            override["gateway"] = gw
        path = Path(tmp) / "bench.yaml"
        config = config_overlay_file(path, override)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        procs = ClusterProcesses(config, redis_url, etcd_url, Path(tmp) / "logs", ["--config", str(path)],
                                 log_level="WARNING", with_gateway=True, gateway_no_auth=True, gateway_port=port)
        procs.start()
        try:
            asyncio.run(wait_cluster_ready(config, redis_url, etcd_url))
            asyncio.run(wait_http_ready(url))
            total = (repeats + 1) * duration_s
            bar = tqdm(total=round(total), desc="bench gateway", unit="s", disable=not progress, file=sys.stderr)
            for k in range(repeats + 1):  # run 0 warms up (connections, caches), not counted
                t0 = time.monotonic()
                cpu0 = cpu_snapshot(procs, redis_url)
                outcomes = run_async(shown_closed_loop(url, clients, duration_s, max_tokens, stream_every, bar,
                                                       f"run {k}/{repeats}"))
                cpu1 = cpu_snapshot(procs, redis_url)
                window = max(duration_s, max((o.start + o.latency_s for o in outcomes), default=t0) - t0)
                if k > 0:
                    runs.append(summarize(outcomes, window))
                    for role, v in cpu1.items():
                        cpu_s[role] = cpu_s.get(role, 0.0) + v - cpu0.get(role, v)
                    for name, v in run_async(hop_times(redis_url, outcomes, wall_offset)).items():
                        hop_ms[name] += v
                    ttft_ms += [o.ttft_s * 1000 for o in outcomes if o.ok and o.stream and o.ttft_s is not None]
            bar.close()
            dead = [p.name for p in procs.dead()]
        finally:
            procs.stop()
    if dead:
        raise RuntimeError(f"role processes died during the benchmark: {', '.join(dead)}")

    def med(key: str) -> float | None:
        vals = [r[key] for r in runs if r[key] is not None]
        return round(statistics.median(vals), 2) if vals else None

    completed = sum(r["requests"] - r["errors"] - r["shed"] for r in runs)
    cpu_us = {role: round(v / completed * 1e6, 1) for role, v in sorted(cpu_s.items())} if completed else {}
    if cpu_us:
        cpu_us["control_plane"] = round(sum(v for k, v in cpu_us.items()), 1)
    return {
        "rps": med("rps"),
        "p50_ms": med("p50_ms"),
        "p99_ms": med("p99_ms"),
        # the engine takes no time: a streamed request's time to its first token is all control plane
        "added_ttft_p50_ms": round(percentile(ttft_ms, 50), 2) if ttft_ms else None,
        "added_ttft_p99_ms": round(percentile(ttft_ms, 99), 2) if ttft_ms else None,
        "hops": hop_summary(hop_ms),
        "cpu_us_per_request": cpu_us,
        "window": {"close_when_room": not window_hold},
        "http_parser": config.gateway.http_parser,
        "routing": config.gateway.routing,
        "errors": sum(r["errors"] for r in runs),
        "shed": sum(r["shed"] for r in runs),
        "requests": sum(r["requests"] for r in runs),
        "streamed": sum(r["streamed"] for r in runs),
        "rps_runs": [r["rps"] for r in runs],
        "p99_runs_ms": [r["p99_ms"] for r in runs],
        "clients": clients,
        "duration_s": duration_s,
        "repeats": repeats,
        "max_tokens": max_tokens,
        "stream_share": round(1 / stream_every, 3) if stream_every else 0.0,
        "engine": "sim, zero-time (latency = control plane + HTTP)",
        "cluster": "1 rack x 2 nodes; router, batcher, 2 workers, 1 gateway",
    }
