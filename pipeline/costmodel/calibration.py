"""Calibration of the cost model on measured operator profiles: the fitted numbers, their fit, their error.

Owns `Calibration` (per GPU architecture: efficiencies, a fixed cost and, for element-wise operators, a cache knee
per operator, and the measured all-reduce time tables), the pure `fit()` that derives it from parsed Vidur profile
rows, and the error report of a calibration against those rows. Efficiencies attach to the architecture, not to the
profiled GPU, so a GPU that was never profiled (H200) is predicted from its own peak numbers with its architecture's
efficiencies.
It must never read a file: the shell (`workers/sim/perf.py`) parses the CSVs and passes rows in, and writes the result.

The fit, per architecture and operator, over every row (all num_tokens, both models, every TP degree):
- linear operators: t = max(flops / (peak_flops * eff_c), bytes / (hbm_bw * eff_m)) + c0, by a log-spaced grid over
  (eff_c, eff_m) refined once around the best point, with c0 >= 0 in closed form at each point;
- element-wise operators: t = bytes / (hbm_bw * eff_m) + c0 with a knee: the first `cache_bytes` of the working
  set move at a higher, L2-served rate (the profiles show the slope of norms and adds rising about 1.7x once
  input + output outgrow the L2), linear least squares (closed form) for each knee of a log grid;
both minimising the weighted sum of squared RELATIVE errors (sum w ((pred - t) / t)^2), so a 4-microsecond launch
and a 16-millisecond GEMM weigh the same, and w (OCTAVE_WEIGHT_POWER) keeps the few decode-sized rows from being
outvoted by the many prefill-sized ones. Results are rounded (4 significant digits for efficiencies, 3 for knees,
6 elsewhere) so the committed calibration file is reproducible across machines.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline.config import GpuSpec
from pipeline.costmodel.operators import (
    ELEMENTWISE_OPS,
    LAYER_OPS,
    LINEAR_OPS,
    PROFILED_OPS,
    LayerShape,
    op_work,
)
from pipeline.errors import RackflowError

FORMAT_VERSION = 1
ARCH_FALLBACK = {"blackwell": "hopper"}
"""Architectures without a profile borrow the efficiencies and network tables of the nearest profiled one."""

_F = npt.NDArray[np.float64]


class CalibrationError(RackflowError, ValueError):
    """The calibration cannot serve a request (no data for an architecture, a malformed calibration file)."""


def _sig(x: float, digits: int = 6) -> float:
    return float(f"{x:.{digits}g}")


# -- inputs: parsed profile rows ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ProfileRow:
    """One row of a Vidur `mlp.csv`: per-layer median times (ms) of the profiled operators at one token count."""

    device: str
    """Profiled device, a key of the `devices` mapping given to `fit` (e.g. `a100`)."""
    model: str
    """Profiled model, for the error report (e.g. `Llama-2-7b-hf`)."""
    shape: LayerShape
    num_tokens: int
    tp: int
    times_ms: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class AllReduceRow:
    """One row of a Vidur `all_reduce.csv` (median time of an all-reduce of `size_bytes` over `num_workers`)."""

    device: str
    num_workers: int
    devices_per_node: int
    size_bytes: int
    time_ms: float


# -- the fitted numbers ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class OperatorFit:
    """Roofline coefficients of one operator on one architecture."""

    eff_compute: float
    """Fraction of peak BF16 FLOP/s reached (0: memory-bound operator, no compute term)."""
    eff_memory: float
    """Fraction of peak HBM bandwidth reached."""
    fixed_ms: float
    """Fixed cost of one call (launch, tail effects), ms."""
    cache_bytes: float = 0.0
    """Element-wise ops: working set (bytes) served from on-chip cache at `eff_memory_hot`; beyond it the bytes
    stream from HBM at `eff_memory` (0: no knee). Fitted: it lands near the L2 size (40 MB A100, 50 MB H100)."""
    eff_memory_hot: float = 0.0
    """Fraction of peak HBM bandwidth the cache-resident bytes appear to reach (may exceed 1: they are in L2)."""

    def memory_ms(self, nbytes: float, hbm_tbps: float) -> float:
        bw = hbm_tbps * 1e9  # bytes per ms
        if self.cache_bytes > 0:
            hot = min(nbytes, self.cache_bytes)
            return hot / (bw * self.eff_memory_hot) + (nbytes - hot) / (bw * self.eff_memory)
        return nbytes / (bw * self.eff_memory)

    def time_ms(self, flops: float, nbytes: float, gpu: GpuSpec) -> float:
        mem = self.memory_ms(nbytes, gpu.hbm_tbps)
        if self.eff_compute > 0:
            mem = max(mem, flops / (gpu.bf16_tflops * 1e9 * self.eff_compute))
        return mem + self.fixed_ms


@dataclass(frozen=True, slots=True)
class AllReduceTable:
    """Measured all-reduce time by message size for one group size: log-spaced sizes, increasing; the time as
    measured (it falls where NCCL switches algorithm, see `_all_reduce_table`)."""

    sizes: tuple[float, ...]
    times_ms: tuple[float, ...]

    def time_ms(self, size_bytes: float) -> float:
        """Log-log interpolation; below the smallest message the latency floor, above the largest the last
        measured bandwidth (time proportional to size: a bigger message is bandwidth-bound, never cheaper)."""
        sizes, times = self.sizes, self.times_ms
        if size_bytes <= sizes[0]:
            return times[0]
        if size_bytes >= sizes[-1]:
            return times[-1] * size_bytes / sizes[-1]
        i = bisect.bisect_right(sizes, size_bytes)
        s0, s1, t0, t1 = sizes[i - 1], sizes[i], times[i - 1], times[i]
        w = math.log(size_bytes / s0) / math.log(s1 / s0)
        return float(t0 * (t1 / t0) ** w)


@dataclass(frozen=True)
class ArchCalibration:
    devices: tuple[str, ...]
    """Profiled devices the numbers were fitted on."""
    ops: Mapping[str, OperatorFit]
    all_reduce: Mapping[int, AllReduceTable]
    """Measured tables by group size (single node, as many GPUs per node as the group allows)."""

    def all_reduce_ms(self, size_bytes: float, workers: int) -> float:
        """Time of one all-reduce over `workers` GPUs; 0 for one GPU. A group size that was not measured uses
        the nearest measured one scaled by the ring all-reduce's 2(w-1)/w bytes per GPU (an extrapolation)."""
        if workers <= 1:
            return 0.0
        table = self.all_reduce.get(workers)
        if table is not None:
            return table.time_ms(size_bytes)
        if not self.all_reduce:
            raise CalibrationError(f"no all-reduce measurements for devices {', '.join(self.devices)}")
        near = min(self.all_reduce, key=lambda m: (abs(math.log(m / workers)), m))
        scale = ((workers - 1) / workers) / ((near - 1) / near)
        return self.all_reduce[near].time_ms(size_bytes) * scale


@dataclass(frozen=True)
class Calibration:
    archs: Mapping[str, ArchCalibration]

    def for_arch(self, arch: str) -> ArchCalibration:
        got = self.archs.get(arch) or self.archs.get(ARCH_FALLBACK.get(arch, ""))
        if got is None:
            raise CalibrationError(
                f"no calibration for GPU architecture {arch!r}; calibrated: {', '.join(sorted(self.archs))} "
                f"(fallbacks: {ARCH_FALLBACK}); add a profile of such a GPU and run `rackflow perf calibrate`"
            )
        return got

    def source_arch(self, arch: str) -> str:
        """Architecture whose numbers serve `arch` (itself, or its fallback)."""
        return arch if arch in self.archs else ARCH_FALLBACK.get(arch, arch)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "archs": {
                arch: {
                    "devices": list(a.devices),
                    "ops": {
                        op: {"eff_compute": f.eff_compute, "eff_memory": f.eff_memory, "fixed_ms": f.fixed_ms,
                             "cache_bytes": f.cache_bytes, "eff_memory_hot": f.eff_memory_hot}
                        for op, f in sorted(a.ops.items())
                    },
                    "all_reduce": {
                        str(w): {"sizes": list(t.sizes), "times_ms": list(t.times_ms)}
                        for w, t in sorted(a.all_reduce.items())
                    },
                }
                for arch, a in sorted(self.archs.items())
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        if data.get("format") != FORMAT_VERSION:
            raise CalibrationError(
                f"calibration format {data.get('format')!r} is not {FORMAT_VERSION}; regenerate it with "
                "`rackflow perf calibrate`"
            )
        try:
            archs = {
                arch: ArchCalibration(
                    devices=tuple(a["devices"]),
                    ops={op: OperatorFit(float(f["eff_compute"]), float(f["eff_memory"]), float(f["fixed_ms"]),
                                         float(f["cache_bytes"]), float(f["eff_memory_hot"]))
                         for op, f in a["ops"].items()},
                    all_reduce={int(w): AllReduceTable(tuple(map(float, t["sizes"])), tuple(map(float, t["times_ms"])))
                                for w, t in a["all_reduce"].items()},
                )
                for arch, a in data["archs"].items()
            }
        except (KeyError, TypeError, ValueError) as e:
            raise CalibrationError(
                f"malformed calibration ({e!r}); regenerate it with `rackflow perf calibrate`"
            ) from None
        for arch, a in archs.items():
            missing = [op for op in PROFILED_OPS if op not in a.ops]
            if missing:
                raise CalibrationError(f"calibration of {arch} lacks operators {missing}")
        return cls(archs)


# -- the fit -----------------------------------------------------------------------------------------------------
def _closed_form_c0(r: _F, y: _F, weight: _F) -> _F:
    """Fixed cost >= 0 minimising sum(weight * ((r + c0) - y) / y)^2) along the last axis, per leading index."""
    w = weight / (y * y)
    c0: _F = np.maximum(((y - r) * w).sum(axis=-1) / w.sum(), 0.0)
    return c0


def _rel_sse(pred: _F, y: _F, weight: _F) -> _F:
    return (weight * (pred / y - 1.0) ** 2).sum(axis=-1)  # type: ignore[no-any-return]


def _fit_linear(xc: _F, xm: _F, y: _F, weight: _F) -> OperatorFit:
    """xc, xm: time in ms at peak FLOP/s and at peak bandwidth; y: measured ms."""

    def search(ec: _F, em: _F) -> tuple[float, float, float]:
        best = (math.inf, 0.0, 0.0)
        for c in ec:
            r = np.maximum(xc[None, :] / c, xm[None, :] / em[:, None])  # (len(em), N)
            c0 = _closed_form_c0(r, y, weight)
            score = _rel_sse(r + c0[:, None], y, weight)
            j = int(np.argmin(score))
            if score[j] < best[0]:
                best = (float(score[j]), float(c), float(em[j]))
        return best

    coarse = np.geomspace(0.02, 1.0, 49)
    _, ec, em = search(coarse, coarse)
    step = float(coarse[1] / coarse[0])
    _, ec, em = search(
        np.geomspace(ec / step, min(ec * step, 1.0), 33), np.geomspace(em / step, min(em * step, 1.0), 33)
    )
    ec, em = _sig(ec, 4), _sig(em, 4)
    c0 = float(_closed_form_c0(np.maximum(xc / ec, xm / em), y, weight))
    return OperatorFit(ec, em, _sig(c0))


def _fit_elementwise(xm: _F, y: _F, bw: _F, weight: _F) -> OperatorFit:
    """Memory-bound op with an on-chip cache knee: t = min(B, K) / (bw * eff_hot) + max(0, B - K) / (bw * eff) + c0
    for a working set of B bytes. For each K of a log grid (K = 0: no knee, plain bandwidth), linear least squares
    of the relative error gives the two slopes and c0 in closed form; the best K wins.
    xm: ms at peak bandwidth; bw: the row's peak bytes per ms (so B = xm * bw)."""
    nbytes = xm * bw
    sw = np.sqrt(weight)
    best: tuple[float, float, float, float, float] | None = None  # score, K, a_hot, a_cold, c0
    for k in [0.0, *np.geomspace(1e6, 256e6, 65)]:
        hot, cold = np.minimum(nbytes, k) / bw, np.maximum(nbytes - k, 0.0) / bw
        cols = [cold / y, 1.0 / y] if k == 0 else [hot / y, cold / y, 1.0 / y]
        x = np.stack(cols, axis=1)
        coef = np.linalg.lstsq(x * sw[:, None], sw, rcond=None)[0]
        if coef[-1] < 0:  # c0 >= 0: refit without it
            coef = np.append(np.linalg.lstsq(x[:, :-1] * sw[:, None], sw, rcond=None)[0], 0.0)
        if np.any(coef[:-1] <= 0):
            continue
        score = float((weight * (x @ coef - 1.0) ** 2).sum())
        a_hot, a_cold = (0.0, float(coef[0])) if k == 0 else (float(coef[0]), float(coef[1]))
        if best is None or score < best[0]:
            best = (score, float(k), a_hot, a_cold, float(coef[-1]))
    if best is None:
        raise CalibrationError("no element-wise fit with positive bandwidths")
    _, k, a_hot, a_cold, _ = best
    em, k = _sig(1.0 / a_cold, 4), _sig(k, 3)
    em_hot = _sig(1.0 / a_hot, 4) if k > 0 else 0.0
    f = OperatorFit(0.0, em, 0.0, cache_bytes=k, eff_memory_hot=em_hot)
    r = np.array([f.memory_ms(b, float(w) * 1e-9) for b, w in zip(nbytes, bw, strict=True)])
    c0 = float(_closed_form_c0(r, y, weight))
    return OperatorFit(0.0, em, _sig(c0), cache_bytes=k, eff_memory_hot=em_hot)


OCTAVE_WEIGHT_POWER = 0.5
"""Rows weigh (log2-span of their num_tokens) ** this: 0 weighs every row alike, so the 8-token-step prefill sizes
(~220 of the ~260 token counts) decide the fit; 1 gives every octave the same say, so decode sizes (1-64 tokens)
fit to ~3% but mid-size chunks (64-1024) degrade to 15-20% on H100; 0.5 keeps both within about 10% (median)."""


def _octave_weights(rows: Sequence[ProfileRow]) -> _F:
    """Weight of each row: the span of log2(num_tokens) it stands for among its series' token counts (duplicates
    share it), so every octave of batch size counts the same and the few decode-sized rows are not outvoted."""
    series: dict[tuple[str, str, int], list[int]] = defaultdict(list)
    for r in rows:
        series[(r.device, r.model, r.tp)].append(r.num_tokens)
    span: dict[tuple[str, str, int, int], float] = {}
    for key, counts in series.items():
        uniq = sorted(set(counts))
        logs = [math.log2(t) for t in uniq]
        for i, t in enumerate(uniq):
            lo = logs[i - 1] if i > 0 else logs[0] - 1.0
            hi = logs[i + 1] if i + 1 < len(uniq) else logs[-1] + 1.0
            span[(*key, t)] = 0.5 * (hi - lo) / counts.count(t)
    return np.array([span[(r.device, r.model, r.tp, r.num_tokens)] for r in rows])


ALL_REDUCE_BINS_PER_OCTAVE = 32
"""Bins of the all-reduce table per octave of message size. Chosen by cross-validation on the fit half of the
measured sizes only (`split_sizes` in pipeline/costmodel/validate.py, that half split again the same way, each
quarter's table scored on the other quarter, tests/unit/test_calibration.py reproduces it): the p90 error on sizes
the table was not built from falls from 9.3% at 4 bins to 6.3% at 32 and is flat beyond (6.3% at 48, 64 and 128).
The profile measures a size every 8 KiB, so above 2 MB a bin still pools several measurements; below, bins hold one
or two."""


def _all_reduce_table(rows: Sequence[AllReduceRow], bins_per_octave: int = ALL_REDUCE_BINS_PER_OCTAVE
                      ) -> AllReduceTable:
    """Median time per log-spaced size bin. Not forced non-decreasing: NCCL changes algorithm and protocol with
    the message size, and the measured time falls where it does (A100 2 x 8: 3.23 ms at 12.8 MB, 1.67 ms at
    13.0 MB); pooling the bins around such a switch into one non-decreasing value put a 17% p90 error on the sizes
    the table was not built from, against 6.4% for the bins' own medians (`rackflow sim validate`)."""
    lo = min(r.size_bytes for r in rows)
    bins: dict[int, list[AllReduceRow]] = defaultdict(list)
    for r in rows:
        bins[math.floor(math.log2(r.size_bytes / lo) * bins_per_octave + 1e-9)].append(r)
    sizes: list[float] = []
    times: list[float] = []
    for k in sorted(bins):
        b = bins[k]
        sizes.append(_sig(math.exp(sum(math.log(r.size_bytes) for r in b) / len(b))))
        times.append(_sig(float(np.median([r.time_ms for r in b]))))
    return AllReduceTable(tuple(sizes), tuple(times))


def fit(
    rows: Iterable[ProfileRow], all_reduce: Iterable[AllReduceRow], devices: Mapping[str, GpuSpec]
) -> Calibration:
    """Fit the per-architecture, per-operator coefficients on profile rows and tabulate the all-reduce rows.

    `devices` maps each profiled device name of the rows (e.g. `a100`) to its GpuSpec: its peak numbers turn
    FLOPs and bytes into times at 100% efficiency, and its `arch` says which architecture the rows calibrate."""
    rows = list(rows)
    unknown = sorted({r.device for r in rows} - set(devices))
    if unknown:
        raise CalibrationError(f"profile rows of devices {unknown} have no GpuSpec; known: {sorted(devices)}")
    by_arch: dict[str, list[ProfileRow]] = defaultdict(list)
    for r in rows:
        by_arch[devices[r.device].arch].append(r)
    net_by_arch: dict[str, list[AllReduceRow]] = defaultdict(list)
    for n in all_reduce:
        if n.device in devices:
            net_by_arch[devices[n.device].arch].append(n)

    archs: dict[str, ArchCalibration] = {}
    for arch, arows in sorted(by_arch.items()):
        ops: dict[str, OperatorFit] = {}
        for op in PROFILED_OPS:
            sel = [r for r in arows if r.times_ms.get(op, 0.0) > 0.0]
            if not sel:
                raise CalibrationError(f"no positive times of {op} for architecture {arch}")
            xc, xm = _peak_times(op, sel, devices)
            y = np.array([r.times_ms[op] for r in sel])
            bw = np.array([devices[r.device].hbm_tbps * 1e9 for r in sel])
            wt = _octave_weights(sel) ** OCTAVE_WEIGHT_POWER
            ops[op] = _fit_linear(xc, xm, y, wt) if op in LINEAR_OPS else _fit_elementwise(xm, y, bw, wt)
        tables: dict[int, AllReduceTable] = {}
        net = net_by_arch.get(arch, [])
        for w in sorted({n.num_workers for n in net}):
            wrows = [n for n in net if n.num_workers == w]
            densest = max(n.devices_per_node for n in wrows)
            tables[w] = _all_reduce_table([n for n in wrows if n.devices_per_node == densest])
        archs[arch] = ArchCalibration(tuple(sorted({r.device for r in arows})), ops, tables)
    assert set(ELEMENTWISE_OPS) | set(LINEAR_OPS) == set(PROFILED_OPS)
    return Calibration(archs)


def _peak_times(op: str, rows: Sequence[ProfileRow], devices: Mapping[str, GpuSpec]) -> tuple[_F, _F]:
    """Per row: ms at peak FLOP/s and ms at peak HBM bandwidth of its device."""
    xc = np.empty(len(rows))
    xm = np.empty(len(rows))
    for i, r in enumerate(rows):
        flops, nbytes = op_work(op, r.shape, r.num_tokens, r.tp)
        g = devices[r.device]
        xc[i] = flops / (g.bf16_tflops * 1e9)
        xm[i] = nbytes / (g.hbm_tbps * 1e9)
    return xc, xm


# -- error report ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class OperatorError:
    arch: str
    model: str
    op: str
    rows: int
    median: float
    """Median relative error |pred - measured| / measured."""
    p90: float


@dataclass(frozen=True, slots=True)
class IterationError:
    """Error of the sum of a layer's profiled operators at one token count (a prefill chunk or a decode batch)."""

    arch: str
    model: str
    tp: int
    tokens: int
    measured_ms: float
    predicted_ms: float

    @property
    def rel_error(self) -> float:
        return (self.predicted_ms - self.measured_ms) / self.measured_ms


def predict_op_ms(cal: Calibration, op: str, row: ProfileRow, gpu: GpuSpec) -> float:
    flops, nbytes = op_work(op, row.shape, row.num_tokens, row.tp)
    return cal.for_arch(gpu.arch).ops[op].time_ms(flops, nbytes, gpu)


def operator_errors(
    cal: Calibration, rows: Iterable[ProfileRow], devices: Mapping[str, GpuSpec]
) -> list[OperatorError]:
    """Median and p90 relative error per architecture x model x operator."""
    errs: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for r in rows:
        g = devices[r.device]
        for op in PROFILED_OPS:
            y = r.times_ms.get(op, 0.0)
            if y > 0:
                errs[(g.arch, r.model, op)].append(abs(predict_op_ms(cal, op, r, g) - y) / y)
    out = []
    for (arch, model, op), e in sorted(errs.items(), key=lambda kv: (kv[0][0], kv[0][1], PROFILED_OPS.index(kv[0][2]))):
        a = np.array(e)
        out.append(OperatorError(arch, model, op, len(e), float(np.median(a)), float(np.percentile(a, 90))))
    return out


def iteration_errors(
    cal: Calibration, rows: Iterable[ProfileRow], devices: Mapping[str, GpuSpec], token_counts: Sequence[int]
) -> list[IterationError]:
    """Measured vs predicted time of one layer's profiled operators (everything but attention and all-reduce) at
    the given token counts (a prefill of N tokens, or a decode step of batch B = B tokens), per arch x model x tp.
    Duplicate measurements of a point are averaged."""
    acc: dict[tuple[str, str, int, int], list[tuple[float, float]]] = defaultdict(list)
    wanted = set(token_counts)
    for r in rows:
        if r.num_tokens not in wanted:
            continue
        g = devices[r.device]
        measured = sum(r.times_ms[op] for op in LAYER_OPS)
        predicted = sum(predict_op_ms(cal, op, r, g) for op in LAYER_OPS)
        acc[(g.arch, r.model, r.tp, r.num_tokens)].append((measured, predicted))
    return [
        IterationError(arch, model, tp, tokens, sum(m for m, _ in v) / len(v), sum(p for _, p in v) / len(v))
        for (arch, model, tp, tokens), v in sorted(acc.items())
    ]
