"""`rackflow sim experiment vidur`: Microsoft's Vidur simulator (vidur==0.0.26, MIT) and `rackflow sim` side by side
on the same model, GPU, trace slice and scheduler settings (issue 17).

Vidur lives in its own environment (`make .venv-vidur`; `RACKFLOW_VIDUR_PYTHON` overrides it) and runs as a
subprocess; it is no rackflow dependency. Vidur 0.0.26 downloads its operator profiles from Hugging Face datasets;
here it runs offline on the profiles rackflow ships (`data/profiles/vidur/`), laid out as a local Hugging Face
cache in the run's directory (`data/` is never written). Those profiles hold no `attention.csv` (rackflow's cost
model has its own attention terms), so the attention table Vidur needs is written from rackflow's calibrated
attention model: the two simulators share the attention costs and differ in the scheduler, the KV accounting and
the fit of the linear/element-wise operators (random forests on the profile against rackflow's per-operator fit).
"""

from __future__ import annotations

import csv
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.config import RackflowConfig
from pipeline.sim.report import latencies, summarize
from pipeline.sim.simulator import SimParams, SimResult, Simulator
from pipeline.sim.traces import TraceRequest, parse_azure
from pipeline.stats import percentile
from workers.sim.harness import AZURE_CONV, REPO, run_once, sim_config

VIDUR_VERSION = "0.0.26"
PROFILES = REPO / "data" / "profiles" / "vidur"
SNAPSHOT = "0" * 40
"""The commit name of the local Hugging Face snapshots (any 40 hex digits: nothing is fetched)."""
TRACE_DATE = "2023-11-16"
"""Vidur's trace replay keeps the rows of one `Date`; ours all carry this one."""


@dataclass(frozen=True)
class PeerSetup:
    """The settings both simulators run with; `vidur_args` and `rackflow_params` map them to each side."""

    rackflow_model: str = "llama-2-7b"
    vidur_model: str = "meta-llama/Llama-2-7b-hf"
    rackflow_gpu: str = "h100-80gb"
    vidur_device: str = "h100"
    vidur_network: str = "h100_pairwise_nvlink"
    tp: int = 1
    batch_cap: int = 128
    chunk_tokens: int = 4096
    block_size: int = 16
    num_blocks: int = 6976
    max_tokens: int = 4096
    """Prompt + output cap (Llama-2's context); longer requests lose prompt tokens on both sides, as Vidur does."""
    seed: int = 20231116
    rf_estimators: int = 100
    rf_max_depth: int = 16
    """Vidur's random-forest fit (its defaults search 250-750 trees x depth 8-32 with 10-fold CV)."""


def vidur_python() -> Path:
    env = os.environ.get("RACKFLOW_VIDUR_PYTHON")
    if env:
        p = Path(env)
        if not p.exists():
            raise SystemExit(f"rackflow sim experiment vidur: RACKFLOW_VIDUR_PYTHON={env} does not exist")
        return p
    p = REPO / ".venv-vidur" / "bin" / "python"
    if not p.exists():
        raise SystemExit("rackflow sim experiment vidur: no Vidur environment; build it with `make .venv-vidur` "
                         f"(vidur=={VIDUR_VERSION} in .venv-vidur/) or set RACKFLOW_VIDUR_PYTHON")
    return p


def clip_requests(reqs: Iterable[TraceRequest], max_tokens: int) -> list[TraceRequest]:
    """Vidur's trace replay rule, applied to both sides: prompt + output <= max_tokens, the prompt gives way."""
    out = []
    for r in reqs:
        tout = min(r.out_tokens, max_tokens - 1)
        tin = max(1, min(r.in_tokens, max_tokens - tout))
        out.append(TraceRequest(r.arrival_ms, tin, tout, r.user_id, (), r.model))
    return out


def vidur_trace_csv(reqs: Sequence[TraceRequest]) -> str:
    """Vidur's trace replay CSV (`vidur/request_generator/trace_replay_request_generator.py`): Date, Time in
    seconds, PromptTokenCount, CompletionTokenCount."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["Date", "Time", "PromptTokenCount", "CompletionTokenCount"])
    for r in reqs:
        w.writerow([TRACE_DATE, f"{r.arrival_ms / 1000.0:.6f}", r.in_tokens, r.out_tokens])
    return buf.getvalue()


def vidur_args(setup: PeerSetup, trace: Path, cache: Path, out: Path) -> list[str]:
    """`python -m vidur.main` flags for `setup`: sarathi (chunked prefill) with the batch cap and chunk, the KV blocks
    fixed, the trace replayed unscaled, the random-forest predictor on the local profile datasets."""
    rf = "random_forrest_execution_time_predictor_config"
    return [
        "--seed", str(setup.seed),
        "--replica_config_model_name", setup.vidur_model,
        "--replica_config_device", setup.vidur_device,
        "--replica_config_network_device", setup.vidur_network,
        "--replica_config_tensor_parallel_size", str(setup.tp),
        "--replica_config_num_pipeline_stages", "1",
        "--cluster_config_num_replicas", "1",
        "--replica_scheduler_config_type", "sarathi",
        "--sarathi_scheduler_config_batch_size_cap", str(setup.batch_cap),
        "--sarathi_scheduler_config_chunk_size", str(setup.chunk_tokens),
        "--cache_config_block_size", str(setup.block_size),
        "--cache_config_num_blocks", str(setup.num_blocks),
        "--request_generator_config_type", "trace_replay",
        "--trace_request_generator_config_trace_file", str(trace),
        "--trace_request_generator_config_date", TRACE_DATE,
        "--trace_request_generator_config_prefill_scale_factor", "1",
        "--trace_request_generator_config_decode_scale_factor", "1",
        "--trace_request_generator_config_time_scale_factor", "1",
        "--trace_request_generator_config_max_tokens", str(setup.max_tokens),
        "--execution_time_predictor_config_type", "random_forrest",
        f"--{rf}_cache_dir", str(cache),
        f"--{rf}_model_profiling_dataset", _compute_repo(setup),
        f"--{rf}_network_profiling_dataset", _network_repo(setup),
        # the fit made affordable on a small machine: one forest shape instead of Vidur's 27-point grid x 10-fold
        # CV (hours on 2 cores), and predictions tabulated up to the trace's token cap instead of 2 M tokens
        f"--{rf}_num_estimators", str(setup.rf_estimators),
        f"--{rf}_max_depth", str(setup.rf_max_depth),
        f"--{rf}_min_samples_split", "2",
        f"--{rf}_k_fold_cv_splits", "2",
        f"--{rf}_prediction_max_tokens_per_request", str(setup.max_tokens),
        f"--{rf}_prediction_max_prefill_chunk_size", str(setup.chunk_tokens),
        f"--{rf}_prediction_max_batch_size", str(setup.batch_cap),
        "--metrics_config_output_dir", str(out),
        "--no-metrics_config_enable_chrome_trace",
        "--no-metrics_config_store_plots",
    ]


def rackflow_params(setup: PeerSetup) -> SimParams:
    """The node settings that match Vidur's: no prefix cache (GPU or host), no admission shedding, the same caps."""
    return SimParams(block_size=setup.block_size, max_num_seqs=setup.batch_cap, max_batched_tokens=setup.chunk_tokens,
                     prefix_cache=False, host_prefix_cache=False, admission=False)


def rackflow_config(setup: PeerSetup, config_dir: Path = REPO / "configs") -> RackflowConfig:
    cluster = {"racks": [{"name": "r0", "node_count": 1,
                          "node": {"gpu": setup.rackflow_gpu, "tp": setup.tp, "models": [setup.rackflow_model]}}]}
    return sim_config(config_dir, [], None, None, over={"cluster": cluster, "policies": {"seed": setup.seed}})


def rackflow_blocks(config: RackflowConfig, setup: PeerSetup) -> int:
    """KV blocks rackflow's node gets for `setup` (what Vidur is given as `num_blocks`)."""
    kv_kb = config.node_kv_capacity_kb("r0-n0")
    return int(kv_kb * 1000 // config.models[setup.rackflow_model].kv_bytes_per_token) // setup.block_size


def _compute_repo(setup: PeerSetup) -> str:
    return f"rackflow-local/{setup.vidur_device}-{setup.vidur_model.split('/')[-1].lower()}"


def _network_repo(setup: PeerSetup) -> str:
    return f"rackflow-local/{setup.vidur_network.replace('_', '-')}"


def _snapshot(cache: Path, kind: str, repo: str) -> Path:
    """A Hugging Face hub cache entry (`datasets--ORG--NAME/refs/main` + `snapshots/COMMIT/`) that
    `snapshot_download(repo, repo_type="dataset", cache_dir=cache/profiling_data/KIND)` resolves offline."""
    base = cache / "profiling_data" / kind / ("datasets--" + repo.replace("/", "--"))
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "refs" / "main").write_text(SNAPSHOT)
    snap = base / "snapshots" / SNAPSHOT
    snap.mkdir(parents=True, exist_ok=True)
    return snap


def _xz(src: Path, dst: Path) -> None:
    with open(src, "rb") as fi, lzma.open(dst, "wb") as fo:
        shutil.copyfileobj(fi, fo)


def attention_rows(config: RackflowConfig, setup: PeerSetup) -> list[dict[str, Any]]:
    """Vidur's attention profile table (per layer, ms) from rackflow's calibrated attention model: prefill rows
    (one sequence, `prefill_chunk_size` new tokens after `kv_cache_size` cached ones) and decode rows
    (`batch_size` sequences of `kv_cache_size` KV tokens each)."""
    from pipeline.costmodel import CalibratedCostModel

    cm = CalibratedCostModel.for_node(config, (setup.rackflow_gpu, setup.rackflow_model, setup.tp))
    model = config.models[setup.rackflow_model]
    layers = model.layers
    common = {"n_embd": model.hidden, "n_q_head": model.heads, "n_kv_head": model.kv_heads,
              "block_size": setup.block_size, "num_tensor_parallel_workers": setup.tp,
              "time_stats.attn_kv_cache_save.median": 0.0}
    rows: list[dict[str, Any]] = []
    kvs = [0, 16, 64, 128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072, 3584, 4096]
    for chunk in (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096):
        for kv in kvs:
            parts = cm._parts([chunk], 0, 0, [kv])
            assert parts is not None
            rows.append({**common, "batch_size": 1, "prefill_chunk_size": chunk, "kv_cache_size": kv,
                         "time_stats.attn_prefill.median": parts[1] / layers,
                         "time_stats.attn_decode.median": float("nan")})
    for batch in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128):
        for kv in kvs[1:]:
            parts = cm._parts([], batch, batch * kv, None)
            assert parts is not None
            rows.append({**common, "batch_size": batch, "prefill_chunk_size": 0, "kv_cache_size": kv,
                         "time_stats.attn_prefill.median": float("nan"),
                         "time_stats.attn_decode.median": parts[1] / layers})
    return rows


def write_profile_cache(cache: Path, config: RackflowConfig, setup: PeerSetup) -> None:
    """The compute and network datasets Vidur asks the hub for, from `data/profiles/vidur/` (copied, xz'd)."""
    mlp = PROFILES / "compute" / setup.vidur_device / setup.vidur_model / "mlp.csv"
    net = PROFILES / "network" / setup.vidur_network
    for p in (mlp, net / "all_reduce.csv", net / "send_recv.csv"):
        if not p.exists():
            raise SystemExit(f"rackflow sim experiment vidur: profile {p} not shipped")
    snap = _snapshot(cache, "compute", _compute_repo(setup))
    (snap / "config.json").write_text(json.dumps({"model": setup.vidur_model, "device_sku": setup.vidur_device}))
    _xz(mlp, snap / "mlp.csv.xz")
    rows = attention_rows(config, setup)
    with lzma.open(snap / "attention.csv.xz", "wt", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    nsnap = _snapshot(cache, "network", _network_repo(setup))
    (nsnap / "config.json").write_text(json.dumps({"sku": setup.vidur_network}))
    _xz(net / "all_reduce.csv", nsnap / "all_reduce.csv.xz")
    _xz(net / "send_recv.csv", nsnap / "send_recv.csv.xz")


def find_request_metrics(out: Path) -> Path:
    """Vidur writes `<output_dir>/<timestamp>/request_metrics.csv`; the newest one under `out`."""
    found = sorted(out.rglob("request_metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise RuntimeError(f"Vidur wrote no request_metrics.csv under {out}")
    return found[-1]


def parse_request_metrics(path: Path, arrivals_s: Sequence[float] | None = None) -> dict[str, Any]:
    """TTFT and end-to-end latency (Vidur writes seconds: `prefill_e2e_time`, `request_e2e_time`) per request, and
    the throughput: completed requests over first arrival to last completion (the arrivals of the trace, by
    request id, since the CSV carries none)."""
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    if not rows:
        raise RuntimeError(f"{path}: no requests")
    need = {"Request Id", "request_e2e_time", "prefill_e2e_time"}
    if not need <= set(rows[0]):
        raise RuntimeError(f"{path}: expected columns {sorted(need)}, got {sorted(rows[0])}")
    e2e_ms, ttft_ms, last_ms = [], [], 0.0
    for r in rows:
        e = float(r["request_e2e_time"]) * 1000.0
        e2e_ms.append(e)
        ttft_ms.append(float(r["prefill_e2e_time"]) * 1000.0)
        if arrivals_s is not None:
            last_ms = max(last_ms, arrivals_s[int(float(r["Request Id"]))] * 1000.0 + e)
    span_s = (last_ms - min(arrivals_s) * 1000.0) / 1000.0 if arrivals_s is not None else 0.0
    return {"e2e_ms": e2e_ms, "ttft_ms": ttft_ms, "completed": len(rows),
            "throughput_rps": round(len(rows) / span_s, 3) if span_s > 0 else None}


def summary(e2e_ms: Sequence[float], ttft_ms: Sequence[float]) -> dict[str, float]:
    return {"ttft_p50_s": round(percentile(list(ttft_ms), 50) / 1000, 3),
            "ttft_p99_s": round(percentile(list(ttft_ms), 99) / 1000, 3),
            "e2e_p50_s": round(percentile(list(e2e_ms), 50) / 1000, 3),
            "e2e_p99_s": round(percentile(list(e2e_ms), 99) / 1000, 3)}


def run_vidur(python: Path, setup: PeerSetup, reqs: Sequence[TraceRequest], config: RackflowConfig, work: Path,
              progress: bool = True, timeout_s: float = 1800.0) -> dict[str, Any]:
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    trace = work / "trace.csv"
    trace.write_text(vidur_trace_csv(reqs))
    cache = work / "cache"
    write_profile_cache(cache, config, setup)
    out = work / "output"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    args = [str(python), "-m", "vidur.main", *vidur_args(setup, trace, cache, out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "WANDB_MODE": "disabled"}
    if progress:
        print(f"vidur: {len(reqs)} requests; {' '.join(args[:3])} ... (log: {work / 'vidur.log'})", file=sys.stderr)
    t = time.perf_counter()
    with open(work / "vidur.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(args, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if progress:
                sys.stderr.write("vidur| " + line)
        rc = proc.wait(timeout=timeout_s)
    wall = time.perf_counter() - t
    if rc != 0:
        raise RuntimeError(f"vidur exited {rc}; see {work / 'vidur.log'}")
    m = parse_request_metrics(find_request_metrics(out), [r.arrival_ms / 1000.0 for r in reqs])
    return {**m, "wall_s": round(wall, 1), "args": args[1:]}


def load_requests(n: int) -> list[TraceRequest]:
    with open(AZURE_CONV, newline="", encoding="utf-8") as fh:
        return list(parse_azure(fh, n))


def compare(n: int, out: Path, progress: bool = True, setup: PeerSetup | None = None) -> dict[str, Any]:
    setup = setup or PeerSetup()
    config = rackflow_config(setup)
    blocks = rackflow_blocks(config, setup)
    if blocks != setup.num_blocks:
        setup = PeerSetup(**{**asdict(setup), "num_blocks": blocks})
    reqs = clip_requests(load_requests(n), setup.max_tokens)
    vid = run_vidur(vidur_python(), setup, reqs, config, out / "vidur-run", progress)
    params = rackflow_params(setup)
    t = time.perf_counter()
    row, res = run_once(config, reqs, params, [], setup.rackflow_model, progress, label="rackflow sim")
    rf_wall = time.perf_counter() - t
    e2e, ttft = latencies(res)
    table = {
        "rackflow": {**summary(e2e, ttft), "throughput_rps": round(row["throughput_rps"], 3),
                     "completed": row["completed"], "wall_s": round(rf_wall, 2)},
        "vidur": {**summary(vid["e2e_ms"], vid["ttft_ms"]), "throughput_rps": vid["throughput_rps"],
                  "completed": vid["completed"], "wall_s": vid["wall_s"]},
        "rackflow-0cpu": no_cpu_overhead(config, reqs, setup, params),
    }
    plot = out / "vidur-vs-rackflow.png"
    plot_cdfs(res, vid, plot)
    return {
        "requests": len(reqs),
        "table": table,
        "settings": {"setup": asdict(setup), "rackflow_params": {k: v for k, v in asdict(params).items()
                                                                 if k != "control_plane"},
                     "rackflow_cluster": "1 rack x 1 node", "vidur_args": vid["args"],
                     "trace": str(AZURE_CONV.relative_to(REPO)), "vidur_version": VIDUR_VERSION},
        "plot": str(plot),
        "text": format_peer_table(table, len(reqs)),
    }


def no_cpu_overhead(config: RackflowConfig, reqs: Sequence[TraceRequest], setup: PeerSetup, params: SimParams
                    ) -> dict[str, Any]:
    """rackflow's simulator without its fixed CPU time per iteration (`overhead_ms=0`; Vidur models none)."""
    from pipeline.costmodel import CalibratedCostModel

    cost = CalibratedCostModel.for_node(config, (setup.rackflow_gpu, setup.rackflow_model, setup.tp), overhead_ms=0.0)
    t = time.perf_counter()
    res = Simulator(config, list(reqs), lambda _spec: cost, params=params, faults=[],
                    default_model=setup.rackflow_model).run()
    wall = time.perf_counter() - t
    row = summarize(res)
    e2e, ttft = latencies(res)
    return {**summary(e2e, ttft), "throughput_rps": round(row["throughput_rps"], 3), "completed": row["completed"],
            "wall_s": round(wall, 2)}


def format_peer_table(table: dict[str, dict[str, Any]], n: int) -> str:
    keys = ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s", "throughput_rps", "completed", "wall_s")
    lines = [f"{n} Azure conv requests, Llama-2-7B, 1x H100, TP1 (rackflow-0cpu: rackflow without its 2 ms of CPU "
             "time per iteration)", "metric".ljust(16) + "".join(k.rjust(15) for k in table)]
    for k in keys:
        lines.append(k.ljust(16) + "".join(str(table[s].get(k)).rjust(15) for s in table))
    return "\n".join(lines)


def plot_cdfs(res: SimResult, vid: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e2e, ttft = latencies(res)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, name, ours, theirs in ((axes[0], "TTFT", ttft, vid["ttft_ms"]), (axes[1], "end-to-end", e2e,
                                                                              vid["e2e_ms"])):
        for label, xs in (("rackflow sim", ours), (f"vidur {VIDUR_VERSION}", theirs)):
            s = sorted(x / 1000 for x in xs)
            ax.plot(s, [(i + 1) / len(s) for i in range(len(s))], label=label)
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} latency (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle("Llama-2-7B, 1x H100, Azure conv: rackflow sim vs Vidur")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
