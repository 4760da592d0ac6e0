"""`rackflow bench streams-capacity`: how many concurrent streaming requests one gateway process holds, and on how
many Valkey connections.

A local cluster (1 rack x 2 nodes, `sim` engines with their real iteration times, router, batcher, one HTTP
gateway) takes `--streams` streaming completions, all open at once:
1. The router is paused (SIGSTOP: a real router process that routes nothing for a while), so that no stream can
   finish before the last one is open: every admitted request waits in `rf:ingress`, its SSE response open.
2. Clients open the streams as fast as the gateway admits them: at most `max_connecting` connections wait for their
   answer's status line at any time (a client that has it frees its slot), so the load generator never overflows
   the kernel's accept queue (its overflow resets connections: that measures the kernel, not the gateway).
3. Once every stream is admitted (or failed), the router resumes (SIGCONT), and every stream is read to `[DONE]`
   and checked: the token chunks count up to `max_tokens`, no SSE error event.
While it runs, every 250 ms: the gateway process's TCP connections to Valkey (its sockets in /proc, matched to the
established connections to Valkey's port: every connection, pooled or not), its open requests (its reply-stream
gauge) and its resident memory. `open_max` is the most streams the gateway held open at once by its own gauge,
`held_max` the most the clients held admitted and unfinished at once.

The admission bounds are lifted for the run (`max_rack_queue`, `max_queue_s`, `max_ingress_backlog`): the benchmark
measures holding streams, not shedding them (the overload tests measure shedding).

The clients are raw HTTP/1.1 over asyncio sockets (one connection per stream, `Connection: close`): a full HTTP
client per stream would cost more CPU than the gateway it measures, on the same 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from workers.bench.gateway import MODEL, wait_http_ready
from workers.local.launcher import ClusterProcesses, config_overlay_file, wait_cluster_ready
from workers.shell.runtime import run_async


def valkey_connections(pid: int, port: int) -> int:
    """Established TCP connections from process `pid` to 127.0.0.1:`port` (its socket inodes in /proc/PID/fd,
    matched against /proc/net/tcp)."""
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = fd.readlink().as_posix()
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return 0
    want = f"0100007F:{port:04X}"
    n = 0
    for row in rows:
        cols = row.split()
        # local, remote, state (01: established), ..., inode (column 9)
        if len(cols) > 9 and cols[2] == want and cols[3] == "01" and cols[9] in inodes:
            n += 1
    return n


@dataclass
class _Run:
    ok: int = 0
    errors: list[str] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    conns_max: int = 0
    open_max: int = 0
    rss_max_kb: int = 0
    rss_start_kb: int = 0
    samples: int = 0
    held: int = 0
    held_max: int = 0
    admitted: int = 0
    """Streams whose answer's status line came (200 or not)."""


async def _one(host: str, port: int, i: int, max_tokens: int, run: _Run, timeout_s: float,
               connecting: asyncio.Semaphore) -> None:
    body = json.dumps({"model": MODEL, "prompt": f"stream {i}", "max_tokens": max_tokens, "stream": True,
                       "user": f"u{i % 256}"}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    t0 = time.monotonic()
    slot = True
    await connecting.acquire()
    held = False
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(head + body)
                await writer.drain()
                status = await reader.readline()
                connecting.release()
                slot = False
                run.admitted += 1
                if b" 200 " in status:
                    held = True
                    run.held += 1
                    run.held_max = max(run.held_max, run.held)
                if b" 200 " not in status:
                    rest = await reader.read()
                    run.errors.append(f"HTTP {status.decode(errors='replace').strip()}: {rest[-200:]!r}")
                    return
                tokens = 0
                done = False
                while line := await reader.readline():
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        run.errors.append(f"SSE error event: {chunk['error'].get('code')}")
                        return
                    text = "".join(c.get("text") or "" for c in chunk.get("choices") or ())
                    if text and not tokens:
                        run.ttft_ms.append((time.monotonic() - t0) * 1000)
                    tokens += len(text.split())
            finally:
                writer.close()
    except (OSError, TimeoutError, ValueError) as e:
        run.errors.append(f"{type(e).__name__}: {e}")
        return
    finally:
        if slot:
            connecting.release()
            run.admitted += 1  # failed before its status line: it no longer waits to be admitted
        if held:
            run.held -= 1
    if not done:
        run.errors.append("stream ended without [DONE]")
    elif tokens != max_tokens:
        run.errors.append(f"{tokens} tokens, asked {max_tokens}")
    else:
        run.ok += 1


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


async def _sample(redis_url: str, gateway_pid: int, metrics_url: str, run: _Run, stop: asyncio.Event) -> None:
    from urllib.parse import urlsplit

    import httpx

    port = urlsplit(redis_url).port or 6379
    async with httpx.AsyncClient(timeout=5) as http:
        while not stop.is_set():
            run.conns_max = max(run.conns_max, valkey_connections(gateway_pid, port))
            run.rss_max_kb = max(run.rss_max_kb, _rss_kb(gateway_pid))
            try:
                text = (await http.get(metrics_url)).text
                for line in text.splitlines():
                    if line.startswith("rackflow_gateway_reply_open_requests "):
                        run.open_max = max(run.open_max, int(float(line.split()[1])))
            except httpx.HTTPError:
                pass
            run.samples += 1
            try:
                await asyncio.wait_for(stop.wait(), 0.25)
            except TimeoutError:
                pass


async def _drive(host: str, port: int, streams: int, max_tokens: int, ramp_s: float, redis_url: str,
                 gateway_pid: int, run: _Run, bar: tqdm[Any], timeout_s: float, max_connecting: int,
                 router_pid: int | None) -> tuple[float, float]:
    """Open every stream, resume the router (`router_pid`, paused by the caller) once all are admitted, and read
    them to the end; returns (wall seconds, seconds until the last was admitted)."""
    import os
    import signal

    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample(redis_url, gateway_pid, f"http://{host}:{port}/metrics", run, stop))
    connecting = asyncio.Semaphore(max_connecting)
    t0 = time.monotonic()
    tasks = []
    try:
        for i in range(streams):
            await asyncio.sleep(max(0.0, t0 + i * ramp_s / streams - time.monotonic()))
            task = asyncio.create_task(_one(host, port, i, max_tokens, run, timeout_s, connecting))
            task.add_done_callback(lambda _t: bar.update(1))
            tasks.append(task)
        while run.admitted < streams and not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        admitted_s = time.monotonic() - t0
    finally:
        if router_pid is not None:
            os.kill(router_pid, signal.SIGCONT)
    await asyncio.gather(*tasks)
    wall = time.monotonic() - t0
    stop.set()
    await sampler
    return wall, admitted_s


def bench_streams_capacity(redis_url: str, etcd_url: str, streams: int = 10_000, max_tokens: int = 32,
                           ramp_s: float = 0.0, progress: bool = True, max_connecting: int = 256,
                           hold: bool = True) -> dict[str, Any]:
    """`hold`: pause the router until every stream is admitted (all open at once); `ramp_s`: open the streams no
    faster than over this many seconds (0: as fast as the gateway admits them)."""
    import os
    import resource
    import signal

    from workers.local.supervise import free_port

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = streams + 1024
    if soft < need:
        if hard < need:
            raise RuntimeError(f"{streams} streams need {need} open files; this shell allows {hard} (ulimit -n)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))  # the gateway inherits it
    run = _Run()
    with tempfile.TemporaryDirectory(prefix="rackflow-bench-") as tmp:
        override = {
            "cluster": {"racks": [{"name": "r0", "node_count": 2,
                                   "node": {"gpu": "h100-80gb", "tp": 1, "models": [MODEL]}}]},
            # every stream is held open by pausing the router: the gateway queues them all on rf:ingress
            "gateway": {"max_rack_queue": 100_000_000, "max_queue_s": 0, "max_ingress_backlog": 100_000_000,
                        "routing": "router"},
        }
        path = Path(tmp) / "bench.yaml"
        config = config_overlay_file(path, override)
        port = free_port()
        procs = ClusterProcesses(config, redis_url, etcd_url, Path(tmp) / "logs", ["--config", str(path)],
                                 log_level="WARNING", with_gateway=True, gateway_no_auth=True, gateway_port=port)
        procs.start()
        try:
            asyncio.run(wait_cluster_ready(config, redis_url, etcd_url))
            asyncio.run(wait_http_ready(f"http://127.0.0.1:{port}"))
            gateway = next(p for p in procs.procs if p.role == "gateway")
            run.rss_start_kb = _rss_kb(gateway.proc.pid)
            bar = tqdm(total=streams, desc="bench streams-capacity", unit="stream", disable=not progress,
                       file=sys.stderr)
            router = next(p for p in procs.procs if p.role == "router")
            if hold:
                os.kill(router.proc.pid, signal.SIGSTOP)
            wall, admitted_s = run_async(_drive(
                "127.0.0.1", port, streams, max_tokens, ramp_s, redis_url, gateway.proc.pid, run, bar,
                timeout_s=config.gateway.request_timeout_s, max_connecting=max_connecting,
                router_pid=router.proc.pid if hold else None))
            bar.close()
            dead = [p.name for p in procs.dead()]
        finally:
            procs.stop()
    if dead:
        raise RuntimeError(f"role processes died during the benchmark: {', '.join(dead)}")
    from pipeline.stats import percentile

    errors: dict[str, int] = {}
    for e in run.errors:
        errors[e[:80]] = errors.get(e[:80], 0) + 1
    grown = max(0, run.rss_max_kb - run.rss_start_kb)
    return {
        "streams": streams,
        "completed": run.ok,
        "errors": len(run.errors),
        "error_kinds": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
        "open_max": run.open_max,
        "held_max": run.held_max,
        "admitted_per_s": round(streams / admitted_s, 1) if admitted_s > 0 else None,
        "admitted_s": round(admitted_s, 1),
        "hold": hold,
        "max_connecting": max_connecting,
        "redis_connections_max": run.conns_max,
        "gateway_rss_start_mb": round(run.rss_start_kb / 1024, 1),
        "gateway_rss_max_mb": round(run.rss_max_kb / 1024, 1),
        "gateway_kb_per_open_stream": round(grown / run.open_max, 1) if run.open_max else None,
        "ttft_p50_ms": round(percentile(run.ttft_ms, 50), 1) if run.ttft_ms else None,
        "ttft_p99_ms": round(percentile(run.ttft_ms, 99), 1) if run.ttft_ms else None,
        "wall_s": round(wall, 1),
        "max_tokens": max_tokens,
        "ramp_s": ramp_s,
        "samples": run.samples,
        "engine": "sim (real iteration times), 1 rack x 2 nodes",
    }
