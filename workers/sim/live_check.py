"""The simulator against a real engine (issue 17): the same small trace through the live pipeline with vLLM's CPU
engine and through `rackflow sim`, whose cost model is fitted to that engine's measured step times.

What `live_vs_sim` does, in order (every step real; nothing is read from an earlier run):
1. starts embedded Valkey and etcd and one rack of `nodes` `vllm` workers serving the tiny random-weight Qwen2
   (`.venv-vllm`, `.cache/tiny-qwen2-vllm`: `make .venv-vllm` builds both), with the gateway, router, batcher and
   monitor roles, exactly as `rackflow up --engine vllm`;
2. profiles the engine (`workers.engines.vllm_profile`, in vLLM's interpreter) while that cluster idles, so the
   measured iterations see the same machine the live run sees, and fits the linear step cost to them;
3. measures the pipeline's fixed latency: `PROBES` one-token requests, one at a time, through the idle cluster; the
   median of their live TTFT less the simulator's TTFT of the same request is the hop latency the simulator adds
   per dispatch (`SimParams.dispatch_latency_ms`). This and the fit are the simulator's only inputs from the engine;
4. replays the trace slice in real time through the live cluster (`DemoRun`: the gateway's own submit path);
5. simulates the same requests at the same arrival times on the same config with the fitted cost, vLLM's own
   scheduler limits (max_num_seqs, max_num_batched_tokens) and the measured hop latency. The profile is taken beside
   an idle cluster; under the run's load the same engine steps slower (2 cores shared with its own frontend, the
   worker and the pipeline roles). The engine measures its own iterations during the run (the workers' status on
   the health stream: mean step ms over 10 s); their median over the profile's prediction at the run's mean batch
   is one factor that scales the whole fitted cost (`in_run_steps`). The simulation with the profile alone is
   reported beside it (`sim_profile_only_ms`);
6. reports TTFT and end-to-end P50/P99 of both and their relative errors; `live_p99_error` is the larger of the
   TTFT and end-to-end P99 errors.

The trace: the first `requests` Azure 2023 conversation requests, prompts cut to `MAX_IN` tokens and outputs to
`MAX_OUT` (every output runs to its length: `ignore_eos`, so the live lengths are the trace's), arrivals scaled so
the simulator puts the node at `load` of its capacity (queueing matters, nothing is shed)."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from pipeline.sim.simulator import SimParams, Simulator
from pipeline.sim.traces import TraceRequest, parse_azure, scale_rate
from pipeline.stats import percentile
from workers.engines.vllm_profile import LinearStepCost
from workers.sim.harness import AZURE_CONV, REPO

TINY = REPO / ".cache" / "tiny-qwen2-vllm"
MAX_IN = 1024
MAX_OUT = 96
PROBES = 8
MAX_SEQS = 4
"""vLLM's max_num_seqs in the live run: few slots, so requests queue for them (the engine, not the 2-core
machine's pipeline processes, is the bottleneck of the run; the tiny model decodes 32 sequences in 3 ms)."""


def _log(msg: str, progress: bool) -> None:
    if progress:
        print(f"sim validate (live): {msg}", file=sys.stderr, flush=True)


def overlay(ckpt: Path, nodes: int) -> dict[str, Any]:
    from workers.engines.checkpoint import served_name, vllm_overlay

    over = vllm_overlay(ckpt, served_name(ckpt), [{"name": "r0", "node_count": nodes,
                                                   "node": {"gpu": "h100-80gb", "tp": 1}}])
    pol = over["policies"]
    assert isinstance(pol, dict)
    pol["worker"]["vllm"]["max_num_seqs"] = MAX_SEQS
    pol["worker"]["vllm"]["ignore_eos"] = True
    pol["worker"]["lease_ttl_s"] = 15  # vLLM on 2 cores starves the lease refresh for seconds (tests/vllm)
    pol["health"] = {"agent_heartbeat_ttl_s": 15}
    return json.loads(json.dumps(over))


def trace_slice(requests: int) -> list[TraceRequest]:
    with open(AZURE_CONV, newline="", encoding="utf-8") as fh:
        rows = list(parse_azure(fh, requests))
    return [replace(r, in_tokens=max(1, min(r.in_tokens, MAX_IN)), out_tokens=max(1, min(r.out_tokens, MAX_OUT)))
            for r in rows]


def simulate(config: Any, reqs: list[TraceRequest], cost: LinearStepCost, engine: dict[str, Any],
             dispatch_ms: float) -> tuple[list[float], list[float], Any]:
    params = SimParams(max_num_seqs=engine["max_num_seqs"], max_batched_tokens=engine["max_num_batched_tokens"],
                       dispatch_latency_ms=dispatch_ms, prefix_cache=False, host_prefix_cache=False,
                       admission=False)  # DemoRun submits past the gateway's HTTP admission: nothing is shed live
    res = Simulator(config, reqs, lambda _spec: cost, params=params).run()
    done = [i for i in range(len(reqs)) if res.finish[i] >= 0 and not res.dropped[i]]
    ttft = [res.first_token[i] - res.arrival[i] for i in done]
    e2e = [res.finish[i] - res.arrival[i] for i in done]
    return ttft, e2e, res


def at_load(config: Any, reqs: list[TraceRequest], cost: LinearStepCost, engine: dict[str, Any],
            load: float) -> list[TraceRequest]:
    """The requests with arrivals scaled so that the node is busy `load` of the time in the simulator."""
    span = max(1.0, max(r.arrival_ms for r in reqs))
    flood = list(scale_rate(reqs, span / 1.0))  # all within 1 ms: the time to serve them all is the capacity
    _t, _e, res = simulate(config, flood, cost, engine, 0.0)
    serve_ms = max(res.finish) - min(res.arrival)
    factor = span / max(1.0, serve_ms / load)
    return list(scale_rate(reqs, factor))


async def _engine_steps(redis_url: str, since_ms: float) -> list[tuple[int, float]]:
    """(running sequences, mean step ms) of every worker status on the health stream since `since_ms` while it ran
    sequences: the step times the engine measured itself during the run (VllmEngine.stats, avg_step_ms)."""
    import redis.asyncio as aioredis

    from pipeline.events import HealthEvent
    from streams import codec, keys

    r = aioredis.Redis.from_url(redis_url)
    out: list[tuple[int, float]] = []
    try:
        for _id, fields in await r.xrange(keys.HEALTH, min=f"{int(since_ms)}-0", max="+"):
            try:
                ev = codec.decode(fields)
            except Exception:
                continue
            if isinstance(ev, HealthEvent) and ev.source == "worker" and ev.running > 0 and ev.avg_latency_ms > 0:
                out.append((ev.running, ev.avg_latency_ms))
    finally:
        await r.aclose()
    return out


def _rel(sim: float, live: float) -> float:
    return abs(sim - live) / max(1e-9, live)


def live_vs_sim(requests: int = 120, load: float = 0.35, nodes: int = 1, progress: bool = True,
                keep_dir: Path | None = None) -> dict[str, Any]:
    from pipeline.config import parse_config, raw_config
    from workers.local.demo import DemoRun
    from workers.local.launcher import ClusterProcesses, vllm_python, wait_cluster_ready
    from workers.local.services import EmbeddedServices

    t_all = time.perf_counter()
    vpy = vllm_python()
    work = Path(keep_dir) if keep_dir else Path(tempfile.mkdtemp(prefix="rackflow-live-check-"))
    work.mkdir(parents=True, exist_ok=True)
    if not (TINY / "config.json").exists():
        _log(f"writing the tiny checkpoint to {TINY}", progress)
        subprocess.run([vpy, "-m", "workers.engines.checkpoint", str(TINY)], check=True, cwd=REPO,
                       stdout=subprocess.DEVNULL)
    cfg_path = work / "cluster.yaml"
    cfg_path.write_text(yaml.safe_dump(overlay(TINY, nodes)))
    config = parse_config(raw_config(REPO / "configs", [cfg_path]), source=str(cfg_path))
    model = config.nodes()[0].models[0]
    svc = EmbeddedServices(work / "services", etcd_args=["--unsafe-no-fsync"])  # a throwaway store: no stalls
    ep = svc.start()
    procs = ClusterProcesses(config, ep.redis_url, ep.etcd_url, work / "logs", ["--config", str(cfg_path)],
                             engine="vllm", log_level="WARNING")
    try:
        _log(f"starting {nodes} vLLM worker(s) and the pipeline roles (logs: {work / 'logs'})", progress)
        procs.start()
        asyncio.run(wait_cluster_ready(config, ep.redis_url, ep.etcd_url, 600))
        _log("profiling the engine's step times (vLLM's interpreter, beside the idle cluster)", progress)
        env = dict(os.environ, PYTHONPATH=str(REPO))
        prof = subprocess.run([vpy, "-m", "workers.engines.vllm_profile", "--config-dir", str(REPO / "configs"),
                               "--config", str(cfg_path), "-o", str(work / "profile.json"),
                               *([] if progress else ["--no-progress"])],
                              cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=None if progress else
                              subprocess.DEVNULL, timeout=900)
        if prof.returncode != 0:
            raise RuntimeError(f"the vLLM step profile failed (exit {prof.returncode})")
        profile = json.loads((work / "profile.json").read_text())
        cost = LinearStepCost(**profile["fit"])
        engine = profile["engine"]
        # the pipeline's own latency: one-token requests one at a time, live and simulated
        probe = [TraceRequest(0.0, 64, 1)]
        _log(f"{PROBES} probes for the pipeline's fixed latency", progress)
        live_probe = []
        for _ in range(PROBES):
            rep = asyncio.run(DemoRun(config, ep.redis_url, ep.etcd_url, AZURE_CONV, 1, 1.0, model, 0,
                                      progress=False, rows=probe).run())
            live_probe += rep["_ttft"]
            time.sleep(0.2)
        sim_probe, _e, _r = simulate(config, probe, cost, engine, 0.0)
        dispatch_ms = max(0.0, percentile(live_probe, 50) - sim_probe[0])
        reqs = at_load(config, trace_slice(requests), cost, engine, load)
        span_s = max(r.arrival_ms for r in reqs) / 1000.0
        _log(f"replaying {len(reqs)} requests over {span_s:.1f} s through the live pipeline", progress)
        t_run = time.time() * 1000.0
        report = asyncio.run(DemoRun(config, ep.redis_url, ep.etcd_url, AZURE_CONV, len(reqs), 1.0, model, 0,
                                     progress=progress, rows=reqs, idle_timeout_s=300.0).run())
        in_run = asyncio.run(_engine_steps(ep.redis_url, t_run))
    finally:
        procs.stop()
        svc.stop()
    # the engine's own step times in the run (its workers' status: mean iteration ms over the last 10 s, while
    # running): the level of the profile's shape under the run's CPU contention
    if in_run:
        running = statistics.fmean(n for n, _ms in in_run)
        live_step = statistics.median(ms for _n, ms in in_run)
        prof_step = cost.step_ms([], round(running), round(running) * (MAX_IN // 2))
        factor = live_step / prof_step if prof_step > 0 else 1.0
    else:
        running, live_step, factor = 0.0, 0.0, 1.0
    run_cost = LinearStepCost(*(factor * c for c in (cost.base_ms, cost.per_prefill_token_ms, cost.per_decode_seq_ms,
                                                     cost.per_kv_token_ms)))
    iso_ttft, iso_e2e, _ = simulate(config, reqs, cost, engine, dispatch_ms)
    sim_ttft, sim_e2e, res = simulate(config, reqs, run_cost, engine, dispatch_ms)
    live_ttft, live_e2e = report["_ttft"], report["_e2e"]
    fig = {}
    for name, s, iso, v in (("ttft", sim_ttft, iso_ttft, live_ttft), ("e2e", sim_e2e, iso_e2e, live_e2e)):
        for q in (50, 99):
            a, b, c = percentile(s, q), percentile(v, q), percentile(iso, q)
            fig[f"{name}_p{q}"] = {"live_ms": round(b, 1), "sim_ms": round(a, 1), "error": round(_rel(a, b), 4),
                                   "sim_profile_only_ms": round(c, 1), "profile_only_error": round(_rel(c, b), 4)}
    out = {
        "requests": len(reqs), "load": load, "nodes": nodes, "span_s": round(span_s, 1),
        "live": {k: report[k] for k in ("completed", "errors", "lost", "duplicates", "wall_s")},
        "sim": {"completed": len(sim_e2e), "dropped": sum(res.dropped), "preemptions": res.preemptions},
        "figures": fig,
        "live_p50_error": max(fig["ttft_p50"]["error"], fig["e2e_p50"]["error"]),
        "live_p99_error": max(fig["ttft_p99"]["error"], fig["e2e_p99"]["error"]),
        "step_cost": profile["fit"], "step_fit": profile["fit_quality"], "engine": engine,
        "in_run_steps": {"samples": len(in_run), "median_step_ms": round(live_step, 3),
                         "mean_running": round(running, 2), "factor_over_profile": round(factor, 3)},
        "dispatch_latency_ms": round(dispatch_ms, 2), "probe_ttft_live_p50_ms": round(percentile(live_probe, 50), 2),
        "probe_ttft_sim_ms": round(sim_probe[0], 2), "wall_s": round(time.perf_counter() - t_all, 1),
        "work_dir": str(work),
    }
    (work / "live-vs-sim.json").write_text(json.dumps(out, indent=2))
    return out
