"""`rackflow bench engines`: the `torch` and `vllm` engines on the same checkpoint, side by side in one run, and
the latency the control plane adds in front of vLLM.

1. Decode throughput: tokens per second of each engine at batch 1 and batch 16 (greedy, every sequence to
   `--bench-tokens` tokens), the two engines alternated within each repeat; medians over the repeats.
2. Added TTFT: the time to the first token of a streamed completion through the HTTP gateway (gateway -> router ->
   batcher -> vLLM worker -> back), against the first token of the same prompt submitted to a vLLM engine in this
   process, measured in the same run, one request at a time; the difference of the medians is what rackflow adds.

Runs in an interpreter with vLLM (`.venv-vllm`); from the main environment it re-runs itself there.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from pipeline.events import RequestEvent
from pipeline.stats import percentile
from workers.local.launcher import config_overlay_file
from workers.shell.runtime import WALL


def _progress(msg: str) -> None:
    print(f"[bench engines] {msg}", file=sys.stderr, flush=True)


def _reqs(n: int, tokens: int, tag: str) -> list[RequestEvent]:
    return [RequestEvent(str(uuid.uuid4()), 1, "bench", f"u{i}", "m", 16, tokens, tokens, 1.0, WALL.now_ms(),
                         prompt=f"Benchmark {tag} sequence {i}: describe the rack's GPU nodes.")
            for i in range(n)]


async def _throughput(engine: Any, batch: int, tokens: int) -> float:
    reqs = _reqs(batch, tokens, engine.name)
    t0 = time.perf_counter()
    for r in reqs:
        engine.submit(r)
    n = 0
    while engine.has_work():
        n += len((await engine.step()).tokens)
    return n / (time.perf_counter() - t0)


async def _engine_ttft(engine: Any, prompt: str, max_tokens: int) -> float:
    r = RequestEvent(str(uuid.uuid4()), 1, "bench", "u", "m", 16, max_tokens, max_tokens, 1.0, WALL.now_ms(),
                     prompt=prompt)
    t0 = time.perf_counter()
    engine.submit(r)
    first = None
    while engine.has_work():
        out = await engine.step()
        if first is None and out.tokens:
            first = time.perf_counter() - t0
    return (first or 0.0) * 1000.0


def bench_engines(model_dir: Path, repeats: int = 3, tokens: int = 64, ttft_requests: int = 20,
                  progress: bool = True) -> dict[str, Any]:
    from pipeline.config import TorchEngineConfig, VllmEngineConfig
    from workers.engines.torch_engine import TorchEngine
    from workers.engines.vllm_engine import VllmEngine

    say = _progress if progress else (lambda _m: None)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch_eng = TorchEngine(TorchEngineConfig(checkpoint=str(model_dir), dtype="float32", max_batch=16,
                                              stop_at_eos=False, kv_capacity_mb=512), None, WALL.now_ms)
    vllm_eng = VllmEngine(VllmEngineConfig(model=str(model_dir), dtype="float32", ignore_eos=True, cpu_nice=0),
                          WALL.now_ms)  # normal priority: both engines run in this process, measured alike
    out: dict[str, Any] = {"model_dir": str(model_dir), "tokens_per_sequence": tokens, "repeats": repeats}

    async def engines() -> None:
        say("starting the vllm engine (loads in ~20-30 s on the CPU build)")
        t = time.perf_counter()
        await vllm_eng.start()
        out["vllm_start_s"] = round(time.perf_counter() - t, 1)
        await torch_eng.start()
        for eng in (torch_eng, vllm_eng):  # warm-up
            await _throughput(eng, 2, 8)
        runs: dict[str, list[float]] = {}
        for rep in range(repeats):
            for batch in (1, 16):
                for eng in (torch_eng, vllm_eng):
                    runs.setdefault(f"{eng.name}_b{batch}", []).append(await _throughput(eng, batch, tokens))
            say(f"throughput repeat {rep + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.0f} tok/s"
                                                                        for k, v in runs.items()))
        out["tokens_per_s"] = {k: round(statistics.median(v), 1) for k, v in runs.items()}
        tp = out["tokens_per_s"]
        out["vllm_over_torch"] = {f"b{b}": round(tp[f"vllm_b{b}"] / tp[f"torch_b{b}"], 2) for b in (1, 16)}
        await torch_eng.stop()
        for _ in range(3):
            await _engine_ttft(vllm_eng, TTFT_PROMPT, 8)
        for _ in range(ttft_requests):
            alone.append(await _engine_ttft(vllm_eng, TTFT_PROMPT, 8))
            await asyncio.sleep(0.2)
        say(f"ttft of vllm alone: p50 {statistics.median(alone):.1f} ms over {ttft_requests} requests")
        await vllm_eng.stop()

    import uvloop

    alone: list[float] = []
    loop = uvloop.new_event_loop()  # as the roles run theirs (workers.shell.runtime)
    try:
        loop.run_until_complete(engines())
        # then the same prompt through the whole control plane, with the in-process engine stopped: two vLLM
        # instances side by side on 2 cores slow each other down (their executors poll shared memory)
        via = _gateway_ttfts(model_dir, loop, ttft_requests, say)
    finally:
        loop.close()
    n = ttft_requests
    out["ttft"] = {"requests": n, "gateway_p50_ms": round(statistics.median(via), 1),
                   "gateway_p90_ms": round(percentile(via, 90), 1),
                   "vllm_alone_p50_ms": round(statistics.median(alone), 1),
                   "vllm_alone_p90_ms": round(percentile(alone, 90), 1),
                   "added_p50_ms": round(statistics.median(via) - statistics.median(alone), 1)}
    return out


TTFT_PROMPT = "Measure the first token of this prompt through the control plane."


def _gateway_ttfts(model_dir: Path, loop: asyncio.AbstractEventLoop, n: int, say: Any) -> list[float]:
    import httpx

    from workers.engines.checkpoint import served_name, vllm_overlay
    from workers.local.launcher import ClusterProcesses, gateway_url, wait_cluster_ready
    from workers.local.services import EmbeddedServices

    name = served_name(model_dir)
    tmp = Path(tempfile.mkdtemp(prefix="rackflow-bench-engines-"))
    over = vllm_overlay(model_dir, name, [{"name": "r0", "node_count": 1, "node": {"gpu": "h100-80gb", "tp": 1}}])
    over["policies"]["worker"]["vllm"]["dtype"] = "float32"  # type: ignore[index]
    over["policies"]["worker"]["token_flush_ms"] = 0  # type: ignore[index]
    path = tmp / "cluster.yaml"
    config = config_overlay_file(path, over)
    svc = EmbeddedServices(tmp / "svc")
    ep = svc.start()
    procs = ClusterProcesses(config, ep.redis_url, ep.etcd_url, tmp / "logs", ["--config", str(path)],
                             engine="vllm", log_level="WARNING", with_gateway=True, gateway_port=0,
                             gateway_no_auth=True)
    try:
        say("starting a 1-node vLLM cluster behind the gateway")
        procs.start()
        asyncio.run(wait_cluster_ready(config, ep.redis_url, ep.etcd_url, 300))
        url = gateway_url(procs)
        body = {"model": name, "prompt": TTFT_PROMPT, "max_tokens": 8, "stream": True, "temperature": 0}

        async def measure() -> list[float]:
            via: list[float] = []
            async with httpx.AsyncClient(timeout=60) as client:
                for _ in range(3):  # warm-up: connections, the engine's first steps
                    await _gateway_ttft(client, url, body)
                for i in range(n):
                    via.append(await _gateway_ttft(client, url, body))
                    await asyncio.sleep(0.2)
                    if (i + 1) % 5 == 0:
                        say(f"ttft via the gateway {i + 1}/{n}: p50 {statistics.median(via):.1f} ms")
            return via

        return loop.run_until_complete(measure())
    finally:
        procs.stop()
        svc.stop()


async def _gateway_ttft(client: Any, url: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"gateway answered {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                first = time.perf_counter() - t0
    return (first or 0.0) * 1000.0
