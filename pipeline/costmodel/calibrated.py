"""Calibrated cost model of one engine iteration: the time the simulator and the `sim` engine charge (ARCHITECTURE §8).

Owns the iteration time of a continuous-batching engine (vLLM-like: one forward pass over the prefill chunks and one
decode token per running sequence) for a GPU type, a model shape and a tensor-parallel degree, built per operator:
- per layer, the profiled operators (QKV, O, gate+up, down as linear rooflines; norms, rope, activation, residual
  add as memory-bound ops), with efficiencies and fixed costs fitted per GPU ARCHITECTURE (calibration.py);
- per layer, attention: a FlashAttention-style roofline (causal prefill over the new tokens and any cached prefix;
  decode reads the KV cache). NOT calibrated: the profiles have no attention; its constants are documented below;
- per layer, two tensor-parallel all-reduces of tokens x hidden (measured NVSwitch tables, 0 at tp=1);
- per iteration, the embedding, the final norm, the LM head for the last token of each sequence, and a fixed CPU
  overhead (scheduling, input preparation, sampling).
The hot path (`step_ms`, `decode_span_ms`, `decode_steps_within`) is plain float arithmetic on coefficients
precomputed at construction. A decode-only iteration is `A(n) + max(memory line, compute line)` of the KV tokens, so
a stretch of decode steps sums in closed form. No clock; no file access except `for_node` loading the committed
calibration when the caller passes none.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipeline.config import GpuSpec, ModelSpec, NodeSpec, RackflowConfig
from pipeline.costmodel.calibration import AllReduceTable, Calibration, OperatorFit
from pipeline.costmodel.committed import load_calibration
from pipeline.costmodel.operators import (
    ACT_BYTES,
    GEMM_TILE_M,
    LAYER_OPS,
    LINEAR_OPS,
    LayerShape,
    elementwise_bytes_per_token,
    linear_work,
)

DEFAULT_OVERHEAD_MS = 2.0
"""Fixed CPU cost of one iteration: scheduling, input preparation, sampling, output processing. vLLM measures
about 1-3 ms per step for its Python-side work at moderate batch sizes; 2 ms sits in the middle."""


@dataclass(frozen=True, slots=True)
class AttentionConstants:
    """Attention kernel efficiencies. NOT calibrated (the profiles do not time attention); chosen from public
    FlashAttention numbers: FA2's forward reaches 50-70% of A100 peak and about 35-45% of H100 peak (FA3 reaches
    ~75% on H100, vLLM's default kernels are FA2-class); paged decode attention streams the KV cache at 60-80% of
    HBM bandwidth and its compute (GEMV-shaped, small M) runs far below tensor-core peak."""

    prefill_eff_compute: float
    decode_eff_compute: float
    eff_memory: float
    fixed_ms: float
    """Per attention kernel per layer (launch + split-KV reduction)."""

    def __post_init__(self) -> None:
        effs = (self.prefill_eff_compute, self.decode_eff_compute, self.eff_memory)
        if not all(0 < e <= 1 for e in effs) or self.fixed_ms < 0:
            raise ValueError(f"attention efficiencies must be in (0, 1] and fixed_ms >= 0, got {self}")


ATTENTION = {
    "ampere": AttentionConstants(prefill_eff_compute=0.55, decode_eff_compute=0.25, eff_memory=0.70, fixed_ms=0.010),
    "hopper": AttentionConstants(prefill_eff_compute=0.40, decode_eff_compute=0.25, eff_memory=0.70, fixed_ms=0.010),
    "blackwell": AttentionConstants(prefill_eff_compute=0.40, decode_eff_compute=0.25, eff_memory=0.70,
                                    fixed_ms=0.010),
}


@dataclass(frozen=True, slots=True)
class StepBreakdown:
    """Where one iteration's time goes, ms."""

    linear_ms: float
    """QKV, O, gate+up, down over all layers, and the LM head."""
    attention_ms: float
    allreduce_ms: float
    other_ms: float
    """Element-wise operators (norms, rope, activation, residual add) and the embedding."""
    overhead_ms: float

    @property
    def total_ms(self) -> float:
        return self.linear_ms + self.attention_ms + self.allreduce_ms + self.other_ms + self.overhead_ms

    def as_dict(self) -> dict[str, float]:
        return {
            "linear": round(self.linear_ms, 3), "attention": round(self.attention_ms, 3),
            "allreduce": round(self.allreduce_ms, 3), "other": round(self.other_ms, 3),
            "overhead": round(self.overhead_ms, 3), "total": round(self.total_ms, 3),
        }


class _Coefficients:
    """Precomputed per-model-on-GPU numbers of the hot path, all in ms (already multiplied by the layer count)."""

    __slots__ = (
        "ar_calls", "ar_table", "attn_fixed", "dec_c_kv", "dec_m_kv", "dec_m_seq", "decode_base", "dense", "elem_a",
        "elem_b",
        "elem_fixed", "elem_knees", "layers", "lin", "lm_head", "msg_per_tok", "pre_c_pair", "pre_m_cached",
        "pre_m_tok",
    )

    def __init__(self, gpu: GpuSpec, model: ModelSpec, tp: int, cal: Calibration, attn: AttentionConstants) -> None:
        arch = cal.for_arch(gpu.arch)
        shape = LayerShape.of(model)
        L = float(model.layers)
        flops_ms, bw_ms = gpu.bf16_tflops * 1e9, gpu.hbm_tbps * 1e9  # per ms

        def linear(op: str, fit: OperatorFit, times: float) -> tuple[float, float, float, float]:
            f, w, a = linear_work(op, shape, tp)
            em = bw_ms * fit.eff_memory
            return times * f / (flops_ms * fit.eff_compute), times * w / em, times * a / em, times * fit.fixed_ms

        self.layers = L
        self.decode_base: dict[int, float] = {}
        self.dense: dict[int, tuple[float, float, float]] = {}
        """`_dense_ms` by (tokens << 20) | sequences (one int: no tuple built per lookup): a placement prices full
        chunks and decode steps of the same sizes over and over."""
        # linear ops: time(T) = max(c * rows(T), w + m * T) + c0, rows(T) = T rounded up to the GEMM tile
        self.lin = tuple(linear(op, arch.ops[op], L) for op in LINEAR_OPS)
        self.lm_head = linear("lm_head", arch.ops["mlp_up_proj"], 1.0)
        # element-wise ops per layer, then the embedding and the final norm once per iteration; each is
        # hot * min(T, knee) + cold * max(0, T - knee) + c0 (knee: tokens whose bytes stay in cache), and their sum
        # is one piecewise-linear function: on segment j (j knees <= T) it is elem_a[j] + elem_b[j] * T
        pieces: list[tuple[float, float, float]] = []  # (knee tokens, hot ms/token, cold ms/token)
        fixed = 0.0
        calls = [(op, L) for op in LAYER_OPS if op not in LINEAR_OPS] + [("emb", 1.0), ("input_layernorm", 1.0)]
        for op, times in calls:
            f = arch.ops[op]
            per_tok = elementwise_bytes_per_token(op, shape, tp)
            cold = times * per_tok / (bw_ms * f.eff_memory)
            if f.cache_bytes > 0:
                pieces.append((f.cache_bytes / per_tok, times * per_tok / (bw_ms * f.eff_memory_hot), cold))
            else:
                pieces.append((0.0, cold, cold))
            fixed += times * f.fixed_ms
        pieces.sort()
        self.elem_knees = tuple(k for k, _, _ in pieces)
        # float starts (0 + x == 0.0 + x exactly): mypyc types an int start as int (workers.sim.compiled)
        self.elem_a = tuple(sum(((h - cd) * k for k, h, cd in pieces[:j]), 0.0) for j in range(len(pieces) + 1))
        self.elem_b = tuple(
            sum((cd for _, _, cd in pieces[:j]), 0.0) + sum((h for _, h, _ in pieces[j:]), 0.0)
            for j in range(len(pieces) + 1)
        )
        self.elem_fixed = fixed
        # attention (FlashAttention-style roofline), per layer x L
        q, kv = shape.q_cols(tp), shape.kv_cols(tp)
        kvb = float(model.dtype_bytes)
        pair_flops = 4.0 * q  # QK^T and AV: 2 matmuls x 2 FLOPs x head_dim x heads per GPU, per (query, key) pair
        bw_a = bw_ms * attn.eff_memory
        self.pre_c_pair = L * pair_flops / (flops_ms * attn.prefill_eff_compute)
        # a new token: read q, write o, read its k/v, write k/v to the cache; a cached token: read its k/v
        self.pre_m_tok = L * (2.0 * q * ACT_BYTES + 4.0 * kv * kvb) / bw_a
        self.pre_m_cached = L * 2.0 * kv * kvb / bw_a
        self.dec_c_kv = L * pair_flops / (flops_ms * attn.decode_eff_compute)
        self.dec_m_kv = L * 2.0 * kv * kvb / bw_a
        self.dec_m_seq = L * (2.0 * q * ACT_BYTES + 2.0 * kv * kvb) / bw_a
        self.attn_fixed = L * attn.fixed_ms
        # tensor parallel: two all-reduces per layer of tokens x hidden; the group's table, or the nearest measured
        # group's scaled by the ring factor (ArchCalibration.all_reduce_ms), as a per-call multiplier on a table
        self.msg_per_tok = float(shape.hidden * ACT_BYTES)
        self.ar_calls = 2.0 * L if tp > 1 else 0.0
        self.ar_table: AllReduceTable | None = None
        if tp > 1:
            scaled = arch.all_reduce_ms(1e6, tp)  # raises CalibrationError when the architecture has no table
            near = tp if tp in arch.all_reduce else min(arch.all_reduce, key=lambda m: (abs(math.log(m / tp)), m))
            self.ar_table = arch.all_reduce[near]
            self.ar_calls *= scaled / self.ar_table.time_ms(1e6)


@dataclass(frozen=True, slots=True)
class CalibratedCostModel:
    """Iteration time of `model` on a group of `tp` GPUs of type `gpu`, from a fitted `Calibration`."""

    gpu: GpuSpec
    model: ModelSpec
    tp: int
    calibration: Calibration = field(repr=False, compare=False)
    overhead_ms: float = DEFAULT_OVERHEAD_MS
    """Fixed CPU cost of one iteration (see DEFAULT_OVERHEAD_MS)."""
    attention: AttentionConstants | None = None
    """Attention constants; None: the documented defaults of the GPU's architecture (ATTENTION)."""
    _c: _Coefficients = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.overhead_ms < 0:
            raise ValueError(f"overhead_ms must be >= 0, got {self.overhead_ms}")
        attn = self.attention or ATTENTION.get(self.gpu.arch) or ATTENTION["hopper"]
        object.__setattr__(self, "_c", _Coefficients(self.gpu, self.model, self.tp, self.calibration, attn))

    @classmethod
    def for_node(
        cls,
        config: RackflowConfig,
        node: str | NodeSpec | tuple[str, str, int],
        calibration: Calibration | None = None,
        overhead_ms: float = DEFAULT_OVERHEAD_MS,
    ) -> CalibratedCostModel:
        """The model of a node (its name or spec: its GPU type, tp and FIRST model, the one its engine serves) or
        of a (gpu type, model, tp) triple of config names. Without `calibration`, the committed
        configs/calibration.json (read once per file version; nothing is re-fitted)."""
        if isinstance(node, str):
            node = config.node(node)
        if isinstance(node, NodeSpec):
            gpu_name, model_name, tp = node.gpu, node.models[0], node.tp
        else:
            gpu_name, model_name, tp = node
        if gpu_name not in config.gpus:
            raise KeyError(f"unknown gpu {gpu_name!r}; gpus: {', '.join(sorted(config.gpus))}")
        if model_name not in config.models:
            raise KeyError(f"unknown model {model_name!r}; models: {', '.join(sorted(config.models))}")
        cal = calibration if calibration is not None else load_calibration()
        return cls(config.gpus[gpu_name], config.models[model_name], tp, cal, overhead_ms)

    # -- pieces ------------------------------------------------------------------------------------------------
    def _dense_ms(self, tokens: int, seqs: int) -> tuple[float, float, float]:
        """(linear incl. LM head, all-reduce, element-wise) of a forward over `tokens` tokens of `seqs` sequences
        (memoised)."""
        if not 0 <= seqs < 1 << 20 or tokens < 0:  # off the key's packing (no iteration has as many): not memoised
            return self._dense_uncached(tokens, seqs)
        memo = self._c.dense
        key = (tokens << 20) | seqs
        got = memo.get(key)
        if got is None:
            got = self._dense_uncached(tokens, seqs)
            if len(memo) >= 65536:
                memo.clear()
            memo[key] = got
        return got

    def _dense_uncached(self, tokens: int, seqs: int) -> tuple[float, float, float]:
        c = self._c
        rows = -(-tokens // GEMM_TILE_M) * GEMM_TILE_M  # gemm_rows(), inlined: integer ceil to the GEMM tile
        lin = 0.0
        for cc, w, m, c0 in c.lin:
            lin += max(cc * rows, w + m * tokens) + c0
        head_rows = -(-seqs // GEMM_TILE_M) * GEMM_TILE_M
        hc, hw, hm, h0 = c.lm_head
        lin += max(hc * head_rows, hw + hm * seqs) + h0
        j = bisect.bisect_right(c.elem_knees, tokens)
        other = c.elem_fixed + c.elem_a[j] + c.elem_b[j] * tokens
        ar = 0.0 if c.ar_table is None else c.ar_calls * c.ar_table.time_ms(tokens * c.msg_per_tok)
        return lin, ar, other

    def _decode_lines(self, n: int) -> tuple[float, float, float, float]:
        """Decode attention of n sequences = max(s1 * K + b1, s2 * K + b2) + attn_fixed over K KV tokens:
        line 1 the KV read (memory), line 2 the FLOPs."""
        c = self._c
        return c.dec_m_kv, c.dec_m_seq * n, c.dec_c_kv, 0.0

    def _parts(
        self, prefill_tokens: Sequence[int], decode_seqs: int, decode_kv_tokens: int,
        prefill_cached: Sequence[int] | None,
    ) -> tuple[float, float, float, float] | None:
        """(linear, attention, all-reduce, other) of one iteration; None when it is empty."""
        c = self._c
        if len(prefill_tokens) == 1 and prefill_tokens[0] > 0:  # one chunk (a placement's pricing): the loop below
            return self._chunk_parts(prefill_tokens[0], prefill_cached[0] if prefill_cached is not None else 0,
                                     decode_seqs, decode_kv_tokens)
        if not prefill_tokens:  # decode only: the loop below
            return self._decode_parts(decode_seqs, decode_kv_tokens) if decode_seqs > 0 else None
        tokens = seqs = decode_seqs
        pairs = 0.0
        new = cached_total = 0
        for i, t in enumerate(prefill_tokens):
            if t <= 0:
                continue
            cached = prefill_cached[i] if prefill_cached is not None else 0
            pairs += t * (t + 1) * 0.5 + t * cached
            new += t
            cached_total += cached
            seqs += 1
        tokens += new
        if tokens <= 0:
            return None
        lin, ar, other = self._dense_ms(tokens, seqs)
        attn = 0.0
        if new:
            attn = max(c.pre_c_pair * pairs, c.pre_m_tok * new + c.pre_m_cached * cached_total) + c.attn_fixed
        if decode_seqs > 0:
            s1, b1, s2, b2 = self._decode_lines(decode_seqs)
            attn += max(s1 * decode_kv_tokens + b1, s2 * decode_kv_tokens + b2) + c.attn_fixed
        return lin, attn, ar, other

    # -- iteration time API ------------------------------------------------------------------------------------
    def breakdown(
        self, prefill_tokens: Sequence[int], decode_seqs: int, decode_kv_tokens: int,
        prefill_cached: Sequence[int] | None = None,
    ) -> StepBreakdown:
        """Where the time of one iteration goes (same arguments as `step_ms`)."""
        parts = self._parts(prefill_tokens, decode_seqs, decode_kv_tokens, prefill_cached)
        if parts is None:
            return StepBreakdown(0.0, 0.0, 0.0, 0.0, 0.0)
        return StepBreakdown(*parts, overhead_ms=self.overhead_ms)

    def step_ms(
        self, prefill_tokens: Sequence[int], decode_seqs: int, decode_kv_tokens: int,
        prefill_cached: Sequence[int] | None = None,
    ) -> float:
        """One continuous-batching iteration: prefill of the given prompt chunks (new tokens each; `prefill_cached`
        gives each chunk's tokens already in the KV cache: a cached prefix or earlier chunks), plus one decode token
        for `decode_seqs` sequences holding `decode_kv_tokens` KV tokens in total. 0 for an empty iteration."""
        parts = self._parts(prefill_tokens, decode_seqs, decode_kv_tokens, prefill_cached)
        if parts is None:
            return 0.0
        lin, attn, ar, other = parts
        return lin + attn + ar + other + self.overhead_ms

    def _chunk_parts(self, t: int, cached: int, decode_seqs: int,
                     decode_kv_tokens: int) -> tuple[float, float, float, float]:
        """`_parts` of an iteration prefilling one chunk of `t` > 0 new tokens after `cached` ones."""
        c = self._c
        lin, ar, other = self._dense_ms(decode_seqs + t, decode_seqs + 1)
        attn = max(c.pre_c_pair * (t * (t + 1) * 0.5 + t * cached), c.pre_m_tok * t + c.pre_m_cached * cached)
        attn += c.attn_fixed
        if decode_seqs > 0:
            s1, b1, s2, b2 = self._decode_lines(decode_seqs)
            attn += max(s1 * decode_kv_tokens + b1, s2 * decode_kv_tokens + b2) + c.attn_fixed
        return lin, attn, ar, other

    def _decode_parts(self, n: int, decode_kv_tokens: int) -> tuple[float, float, float, float]:
        """`_parts` of a decode-only iteration of n >= 1 sequences."""
        lin, ar, other = self._dense_ms(n, n)
        s1, b1, s2, b2 = self._decode_lines(n)
        attn = 0.0
        attn += max(s1 * decode_kv_tokens + b1, s2 * decode_kv_tokens + b2) + self._c.attn_fixed
        return lin, attn, ar, other

    def chunk_ms(self, tokens: int, cached: int, decode_seqs: int, decode_kv_tokens: int) -> float:
        """`step_ms([tokens], decode_seqs, decode_kv_tokens, [cached])` for `tokens` > 0, without the lists: a
        placement prices a request's prefill on every node of its rack this way (the same parts, so the same float:
        tests/unit/test_costmodel_chunk.py)."""
        lin, attn, ar, other = self._chunk_parts(tokens, cached, decode_seqs, decode_kv_tokens)
        return lin + attn + ar + other + self.overhead_ms

    def decode_step_ms(self, decode_seqs: int, decode_kv_tokens: int) -> float:
        """`step_ms([], decode_seqs, decode_kv_tokens)` without the list (the same parts, so the same float)."""
        if decode_seqs <= 0:
            return 0.0
        lin, attn, ar, other = self._decode_parts(decode_seqs, decode_kv_tokens)
        return lin + attn + ar + other + self.overhead_ms

    def prefill_ms(self, prompt_tokens: int, batch: int = 1) -> float:
        """One iteration prefilling `batch` prompts of `prompt_tokens` tokens (nothing cached)."""
        return self.step_ms([prompt_tokens] * batch, 0, 0)

    def decode_ms_per_token(self, batch: int, context_tokens: int) -> float:
        """One decode iteration of `batch` sequences of `context_tokens` KV tokens each."""
        return self.step_ms([], batch, batch * context_tokens)

    def _decode_base_ms(self, n: int) -> float:
        """The part of a decode-only iteration of n sequences that does not depend on the KV tokens (memoised: a
        simulator asks for the same batch sizes over and over)."""
        memo = self._c.decode_base
        got = memo.get(n)
        if got is None:
            lin, ar, other = self._dense_ms(n, n)
            got = lin + ar + other + self._c.attn_fixed + self.overhead_ms
            if len(memo) >= 4096:
                memo.clear()
            memo[n] = got
        return got

    def decode_span_ms(self, n: int, kv0: int, steps: int) -> float:
        """Sum over k in [0, steps) of step_ms([], n, kv0 + k * n), in O(1): each step is A(n) plus the larger of
        two affine functions of its KV tokens, so the sum splits at their crossover into two arithmetic series."""
        if steps <= 0 or n <= 0:
            return 0.0
        return _span(self._decode_base_ms(n), *self._decode_lines(n), kv0, n, steps)

    def decode_steps_within(self, n: int, kv0: int, budget_ms: float) -> int:
        """The largest `steps` with decode_span_ms(n, kv0, steps) <= budget_ms (0 if not even one step fits),
        by binary search on the closed form: O(log steps)."""
        if n < 1:
            raise ValueError(f"decode_steps_within needs n >= 1 sequences, got {n} (no sequences: no steps end)")
        if not math.isfinite(budget_ms):
            raise ValueError(f"budget_ms must be finite, got {budget_ms}")
        if budget_ms < 0:
            return 0
        base, (s1, b1, s2, b2) = self._decode_base_ms(n), self._decode_lines(n)  # what decode_span_ms computes

        def span(steps: int) -> float:
            return _span(base, s1, b1, s2, b2, kv0, n, steps) if steps > 0 else 0.0

        hi = int(budget_ms / span(1)) + 1  # every step takes at least the first one's time
        while span(hi) <= budget_ms:
            hi *= 2
        lo = 0  # span(lo) <= budget < span(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if span(mid) <= budget_ms:
                lo = mid
            else:
                hi = mid
        return lo


def _span(base: float, s1: float, b1: float, s2: float, b2: float, kv0: int, n: int, steps: int) -> float:
    """Sum over k in [0, steps) of base + max(s1 * K_k + b1, s2 * K_k + b2) with K_k = kv0 + k n (steps >= 1)."""
    # line 1 - line 2 at step k is (s1 - s2) * (kv0 + k n) + (b1 - b2): its sign changes at most once
    if s1 == s2:
        split, first_is_1 = steps, b1 >= b2
    else:
        root = ((b2 - b1) / (s1 - s2) - kv0) / n  # the k where the lines cross
        if s1 > s2:  # line 1 wins from the crossover on
            split, first_is_1 = _clamp_index(math.ceil, root, steps), False
        else:  # line 1 wins up to the crossover
            split, first_is_1 = _clamp_index(lambda x: math.floor(x) + 1, root, steps), True
    (fs, fb), (ss, sb) = ((s1, b1), (s2, b2)) if first_is_1 else ((s2, b2), (s1, b1))
    return steps * base + _affine_sum(fs, fb, kv0, n, 0, split) + _affine_sum(ss, sb, kv0, n, split, steps)


def _clamp_index(rounder: Callable[[float], int], root: float, steps: int) -> int:
    if not root > 0:  # also NaN
        return 0
    if root >= steps:
        return steps
    return max(0, min(steps, int(rounder(root))))


def _affine_sum(s: float, b: float, kv0: int, n: int, a: int, e: int) -> float:
    """Sum over k in [a, e) of s * (kv0 + k n) + b."""
    cnt = e - a
    if cnt <= 0:
        return 0.0
    return cnt * (s * kv0 + b) + s * n * (a + e - 1) * cnt * 0.5
