"""Performance-model shell: reads the shipped Vidur profiles, fits the cost model, writes and reads its calibration.

Owns the I/O around `pipeline.costmodel`: parsing `data/profiles/vidur/**.csv` into profile rows, the calibration
file `configs/calibration.json` (generated, deterministic, committed; its header names every source file and its
sha256), the calibration error tables, and the numbers `rackflow perf` prints. Loading a cost model reads the
committed file (pipeline/costmodel/committed.py) and never re-fits (that takes seconds; `rackflow perf calibrate`
does it on purpose).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import workers
from pipeline.config import GpuSpec, ModelSpec, NodeSpec, RackflowConfig
from pipeline.costmodel import CALIBRATION_FILE as CALIBRATION_FILE  # re-exported: the shell's file
from pipeline.costmodel import (
    AllReduceRow,
    CalibratedCostModel,
    Calibration,
    IterationError,
    LayerShape,
    OperatorError,
    ProfileRow,
    fit,
    iteration_errors,
    operator_errors,
)
from pipeline.costmodel import CalibrationError as CalibrationError
from pipeline.costmodel import load_calibration as load_calibration
from pipeline.costmodel import read_calibration_document as read_calibration_document
from pipeline.costmodel.operators import PROFILED_OPS
from pipeline.errors import RackflowError

REPO = Path(workers.__file__).resolve().parent.parent
PROFILE_DIR = REPO / "data" / "profiles" / "vidur"
PROFILED_DEVICES = {"a100": "a100-80gb", "h100": "h100-80gb"}
"""Vidur device directory -> our GPU type (configs/gpus.yaml) whose peak numbers the fit divides by."""
NETWORK_TOPOLOGY = "dgx"
"""All-reduce tables used: the NVSwitch (DGX/HGX) boxes, the topology of our 8-GPU nodes."""
PREFILL_TOKENS = (512, 2048, 4096)
DECODE_BATCHES = (1, 8, 32, 128)


# -- reading the profiles ------------------------------------------------------------------------------------------
def compute_files(root: Path = PROFILE_DIR) -> list[Path]:
    return sorted(root.glob("compute/*/*/*/mlp.csv"))


def network_files(root: Path = PROFILE_DIR) -> list[Path]:
    return sorted(root.glob(f"network/*_{NETWORK_TOPOLOGY}/all_reduce.csv"))


def read_compute_rows(path: Path) -> Iterator[ProfileRow]:
    """Rows of one `compute/<device>/<org>/<model>/mlp.csv` (median per-layer times in ms)."""
    device, model = path.parts[-4], path.parts[-2]
    with path.open(newline="", encoding="utf-8") as fh:
        for rec in csv.DictReader(fh):
            heads, hidden = int(rec["n_head"]), int(rec["n_embd"])
            shape = LayerShape(hidden=hidden, heads=heads, kv_heads=int(rec["n_kv_head"]),
                               intermediate=int(rec["n_expanded_embd"]), vocab=int(rec["vocab_size"]))
            times = {op: float(rec[f"time_stats.{op}.median"]) for op in PROFILED_OPS}
            yield ProfileRow(device, model, shape, int(rec["num_tokens"]), int(rec["num_tensor_parallel_workers"]),
                             times)


def read_all_reduce_rows(path: Path) -> Iterator[AllReduceRow]:
    device = path.parent.name.split("_", 1)[0]
    with path.open(newline="", encoding="utf-8") as fh:
        for rec in csv.DictReader(fh):
            yield AllReduceRow(device, int(rec["num_workers"]), int(rec["devices_per_node"]), int(rec["size"]),
                               float(rec["time_stats.all_reduce.median"]))


@dataclass(frozen=True)
class Profiles:
    rows: list[ProfileRow]
    all_reduce: list[AllReduceRow]
    devices: dict[str, GpuSpec]
    sources: list[dict[str, str]]


def read_profiles(gpus: Mapping[str, GpuSpec], root: Path = PROFILE_DIR) -> Profiles:
    files = compute_files(root) + network_files(root)
    if not compute_files(root):
        raise CalibrationError(f"no profiles under {root} (expected compute/<device>/<org>/<model>/mlp.csv)")
    missing = sorted({g for g in PROFILED_DEVICES.values() if g not in gpus})
    if missing:
        raise CalibrationError(f"the profiled GPU types {missing} are not in the config's gpus")
    rows = [r for p in compute_files(root) for r in read_compute_rows(p)]
    net = [r for p in network_files(root) for r in read_all_reduce_rows(p)]
    devices = {d: gpus[g] for d, g in PROFILED_DEVICES.items()}
    sources = [{"path": p.relative_to(REPO).as_posix() if p.is_relative_to(REPO) else str(p),
                "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in files]
    return Profiles(rows, net, devices, sources)


# -- the calibration file ------------------------------------------------------------------------------------------
def calibration_document(profiles: Profiles, calibration: Calibration) -> dict[str, Any]:
    """The content of configs/calibration.json: a header naming the inputs, then the fitted numbers."""
    return {
        "generated_by": "rackflow perf calibrate (workers/sim/perf.py; fit in pipeline/costmodel/calibration.py)",
        "note": "generated file, do not edit; regenerate with `rackflow perf calibrate`",
        "sources": profiles.sources,
        "reference_gpus": {
            d: {"gpu": PROFILED_DEVICES[d], **profiles.devices[d].model_dump(include={"arch", "bf16_tflops",
                                                                                   "hbm_tbps"})}
            for d in sorted(profiles.devices)
        },
        "calibration": calibration.to_dict(),
    }


def render(document: Mapping[str, Any]) -> str:
    """Stable text of the file: sorted keys, one line per list of numbers (diffs stay readable)."""
    text = json.dumps(document, indent=1, sort_keys=True)
    return re.sub(r"\[\s+([-0-9.e,\s]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"


def fresh_document(gpus: Mapping[str, GpuSpec]) -> tuple[dict[str, Any], Profiles, Calibration]:
    profiles = read_profiles(gpus)
    cal = fit(profiles.rows, profiles.all_reduce, profiles.devices)
    return calibration_document(profiles, cal), profiles, cal


def calibration_path(config_dir: Path) -> Path:
    """`<config_dir>/calibration.json` when the config directory has one, else the repository's."""
    own = Path(config_dir) / "calibration.json"
    return own if own.exists() else CALIBRATION_FILE


def cost_model(config: RackflowConfig, node: str | NodeSpec | tuple[str, str, int],
               calibration: Calibration | None = None) -> CalibratedCostModel:
    """The calibrated model of a node (or of a (gpu, model, tp) triple), from the committed calibration."""
    return CalibratedCostModel.for_node(config, node, calibration or load_calibration())



# -- reports -------------------------------------------------------------------------------------------------------
def error_tables(profiles: Profiles, cal: Calibration) -> tuple[list[OperatorError], list[IterationError]]:
    ops = operator_errors(cal, profiles.rows, profiles.devices)
    it = iteration_errors(cal, profiles.rows, profiles.devices, (*PREFILL_TOKENS, *DECODE_BATCHES))
    return ops, it


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_fit(cal: Calibration) -> str:
    lines = ["fitted coefficients (per layer-operator call): eff_c = fraction of peak BF16 FLOP/s, "
             "eff_m = fraction of peak HBM bandwidth, c0 = fixed ms",
             f"{'arch':<8} {'operator':<26} {'eff_c':>7} {'eff_m':>7} {'c0 (us)':>8}"]
    for arch, a in sorted(cal.archs.items()):
        for op in PROFILED_OPS:
            f = a.ops[op]
            ec = f"{f.eff_compute:.3f}" if f.eff_compute else "-"
            lines.append(f"{arch:<8} {op:<26} {ec:>7} {f.eff_memory:>7.3f} {f.fixed_ms * 1e3:>8.2f}")
    return "\n".join(lines)


def format_operator_errors(errors: Sequence[OperatorError]) -> str:
    models = sorted({(e.arch, e.model) for e in errors})
    by = {(e.arch, e.model, e.op): e for e in errors}
    head = f"{'operator':<26}" + "".join(f" {a + ' ' + m.removesuffix('-hf'):>26}" for a, m in models)
    lines = ["relative error per operator (median / p90 over all num_tokens and TP degrees)", head]
    for op in PROFILED_OPS:
        cells = []
        for a, m in models:
            e = by.get((a, m, op))
            cells.append(f" {(_pct(e.median) + ' / ' + _pct(e.p90)) if e else '-':>26}")
        lines.append(f"{op:<26}" + "".join(cells))
    return "\n".join(lines)


def format_iteration_errors(errors: Sequence[IterationError]) -> str:
    counts = sorted({e.tokens for e in errors})
    lines = ["layer time (sum of the profiled operators) at N tokens: signed error predicted vs measured",
             f"{'arch':<7} {'model':<14} {'tp':>2} " + " ".join(f"{'N=' + str(n):>8}" for n in counts)]
    keys = sorted({(e.arch, e.model, e.tp) for e in errors})
    by = {(e.arch, e.model, e.tp, e.tokens): e for e in errors}
    for a, m, tp in keys:
        cells = [f"{100 * by[(a, m, tp, n)].rel_error:+7.1f}%" if (a, m, tp, n) in by else f"{'-':>8}"
                 for n in counts]
        lines.append(f"{a:<7} {m.removesuffix('-hf'):<14} {tp:>2} " + " ".join(cells))
    return "\n".join(lines)


def all_reduce_errors(profiles: Profiles, cal: Calibration) -> dict[tuple[str, int], float]:
    """Median relative error of the tabulated all-reduce against every raw measurement it summarises."""
    out: dict[tuple[str, int], list[float]] = {}
    densest: dict[tuple[str, int], int] = {}
    for r in profiles.all_reduce:
        key = (r.device, r.num_workers)
        densest[key] = max(densest.get(key, 0), r.devices_per_node)
    for r in profiles.all_reduce:
        arch = profiles.devices[r.device].arch
        table = cal.for_arch(arch).all_reduce.get(r.num_workers)
        if table is None or r.devices_per_node != densest[(r.device, r.num_workers)] or r.time_ms <= 0:
            continue
        out.setdefault((arch, r.num_workers), []).append(abs(table.time_ms(r.size_bytes) - r.time_ms) / r.time_ms)
    return {k: sorted(v)[len(v) // 2] for k, v in sorted(out.items())}


def format_all_reduce_errors(errors: Mapping[tuple[str, int], float]) -> str:
    cells = ", ".join(f"{arch} x{w} {_pct(e)}" for (arch, w), e in errors.items())
    return f"all-reduce tables vs every raw measurement (median relative error): {cells}"


# -- `rackflow perf` -----------------------------------------------------------------------------------------------
class DoesNotFit(RackflowError, ValueError):
    """The model's weights do not fit the GPU memory at the requested tensor-parallel degree."""


def check_fits(gpu_name: str, gpu: GpuSpec, model_name: str, model: ModelSpec, tp: int, fraction: float) -> None:
    usable = gpu.memory_gb * 1e9 * fraction
    need = model.weight_bytes / tp
    if need < usable:
        return
    options = [t for t in (1, 2, 4, 8, 16, 32, 64) if model.weight_bytes / t < usable and model.heads % t == 0]
    hint = f"tp={options[0]} would fit" if options else "no tp up to 64 fits; use a GPU with more memory"
    raise DoesNotFit(
        f"{model_name} does not fit {gpu_name} at tp={tp}: {need / 1e9:.0f} GB of weights per GPU, "
        f"{usable / 1e9:.0f} GB usable ({fraction:g} of {gpu.memory_gb:g} GB); {hint}"
    )


def perf_numbers(config: RackflowConfig, model_name: str, gpu_name: str, tp: int, prompt_tokens: int, batch: int,
                 calibration: Calibration) -> dict[str, Any]:
    """Prefill of `batch` prompts of `prompt_tokens` in one iteration, and one decode step of `batch` sequences at
    context `prompt_tokens`."""
    for name, value in (("--tp", tp), ("--prompt-tokens", prompt_tokens), ("--batch", batch)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if model_name not in config.models:
        raise DoesNotFit(f"unknown model {model_name!r}; models: {', '.join(sorted(config.models))}")
    if gpu_name not in config.gpus:
        raise DoesNotFit(f"unknown gpu {gpu_name!r}; gpus: {', '.join(sorted(config.gpus))}")
    model, gpu = config.models[model_name], config.gpus[gpu_name]
    fraction = config.policies.batcher.mem_budget_fraction
    check_fits(gpu_name, gpu, model_name, model, tp, fraction)
    cm = CalibratedCostModel(gpu, model, tp, calibration)
    pre = cm.breakdown([prompt_tokens] * batch, 0, 0)
    dec = cm.breakdown([], batch, batch * prompt_tokens)
    kv_capacity = (gpu.memory_gb * 1e9 * fraction * tp - model.weight_bytes) / model.kv_bytes_per_token
    return {
        "model": model_name,
        "gpu": gpu_name,
        "arch": gpu.arch,
        "calibrated_on": "/".join(calibration.for_arch(gpu.arch).devices),
        "tp": tp,
        "prompt_tokens": prompt_tokens,
        "batch": batch,
        "prefill_ms": round(pre.total_ms, 3),
        "decode_ms_per_token": round(dec.total_ms, 3),
        "prefill_tokens_per_s": round(batch * prompt_tokens / pre.total_ms * 1e3, 1),
        "decode_tokens_per_s": round(batch / dec.total_ms * 1e3, 1),
        "breakdown_ms": {"prefill": pre.as_dict(), "decode": dec.as_dict()},
        "weights_gb_per_gpu": round(model.weight_bytes / tp / 1e9, 2),
        "kv_capacity_tokens": max(0, math.floor(kv_capacity)),
        "kv_fits": batch * (prompt_tokens + 1) <= kv_capacity,
        "overhead_ms": cm.overhead_ms,
    }


def format_perf(n: Mapping[str, Any]) -> str:
    def parts(b: Mapping[str, float]) -> str:
        return ", ".join(f"{k} {v:.2f}" for k, v in b.items() if k != "total")

    return "\n".join([
        f"{n['model']} on {n['gpu']} ({n['arch']}, coefficients from {n['calibrated_on']}) x tp={n['tp']}",
        f"  prefill {n['batch']} x {n['prompt_tokens']} tokens: {n['prefill_ms']:.2f} ms "
        f"({n['prefill_tokens_per_s']:.0f} tokens/s)  [{parts(n['breakdown_ms']['prefill'])}]",
        f"  decode step, batch {n['batch']} at context {n['prompt_tokens']}: {n['decode_ms_per_token']:.2f} ms/token "
        f"({n['decode_tokens_per_s']:.0f} tokens/s)  [{parts(n['breakdown_ms']['decode'])}]",
        f"  weights {n['weights_gb_per_gpu']:.1f} GB/GPU; KV room {n['kv_capacity_tokens']} tokens"
        + ("" if n["kv_fits"] else " (this batch's KV does NOT fit)"),
    ])


# -- held-out validation (`rackflow sim validate`) ----------------------------------------------------------------
PROFILED_LAYERS = {"Llama-2-7b-hf": 32, "Llama-2-70b-hf": 80, "Qwen-72B": 80, "CodeLlama-34b-Instruct-hf": 48,
                   "internlm-20b": 60, "Meta-Llama-3-8B": 32, "Meta-Llama-3-70B": 80}
"""Layer count of each profiled model (the profiles time one layer; the decode step is L of them)."""
HELDOUT_DIR = REPO / "data" / "profiles" / "vidur-heldout"
"""Vidur profiles of models the calibration is never fitted on (data/SOURCES.md): what `sim validate` scores it on."""


def validate_report(gpus: Mapping[str, GpuSpec], root: Path = PROFILE_DIR, heldout: Path = HELDOUT_DIR
                    ) -> dict[str, Any]:
    """The shipped calibration's models fitted, the held-out models scored (pipeline/costmodel/validate.py)."""
    from pipeline.costmodel.validate import shipped_held_out

    profiles = read_profiles(gpus, root)
    held = [r for p in compute_files(heldout) for r in read_compute_rows(p)]
    if not held:
        raise CalibrationError(f"no held-out profiles under {heldout} (compute/<device>/<org>/<model>/mlp.csv)")
    unknown = sorted({r.model for r in [*profiles.rows, *held]} - set(PROFILED_LAYERS))
    if unknown:
        raise CalibrationError(f"no layer count for profiled models {unknown}: add them to PROFILED_LAYERS")
    net = [r for p in sorted(root.glob("network/*_dgx/all_reduce.csv")) for r in read_all_reduce_rows(p)]
    return shipped_held_out(profiles.rows, held, net, profiles.devices, PROFILED_LAYERS)
