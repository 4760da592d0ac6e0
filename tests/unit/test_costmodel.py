"""Calibrated cost model: the properties a scheduler and the simulator rely on (monotone in the work, the
all-reduce as measured, faster hardware is faster, TP splits work and adds all-reduce), the closed-form decode
spans, and sane absolute numbers."""

from __future__ import annotations

import io
import json
import math
from contextlib import redirect_stderr, redirect_stdout

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import GpuSpec, ModelSpec
from pipeline.costmodel import AttentionConstants, CalibratedCostModel, RooflineCostModel
from tests.unit.builders import config
from workers.cli.main import main as rackflow
from workers.sim import perf

CFG = config()
CAL = perf.load_calibration()
H100, A100, H200 = (CFG.gpus[g] for g in ("h100-80gb", "a100-80gb", "h200-141gb"))
LLAMA7, LLAMA70, QWEN7, QWEN72, QWEN1_72 = (
    CFG.models[m] for m in ("llama-2-7b", "llama-2-70b", "qwen2-7b", "qwen2-72b", "qwen-72b")
)
MODELS = st.sampled_from([LLAMA7, LLAMA70, QWEN7, QWEN72, QWEN1_72])
TPS = st.sampled_from([1, 2, 4, 8])


def cm(gpu: GpuSpec, model: ModelSpec, tp: int = 1, **kw: object) -> CalibratedCostModel:
    return CalibratedCostModel(gpu, model, tp, CAL, **kw)  # type: ignore[arg-type]


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = rackflow(list(args))
    return rc, out.getvalue(), err.getvalue()


# -- monotonicity ----------------------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(model=MODELS, tp=TPS, t1=st.integers(1, 16_000), t2=st.integers(1, 16_000), batch=st.integers(1, 8),
       cached=st.integers(0, 8_000))
def test_more_prompt_tokens_take_more_time(model: ModelSpec, tp: int, t1: int, t2: int, batch: int,
                                           cached: int) -> None:
    """Every part but the all-reduce grows with the tokens; the all-reduce follows its measured table, which falls
    where NCCL switches algorithm (test_the_all_reduce_follows_the_measured_table_where_it_falls)."""
    m = cm(H100, model, tp)
    lo, hi = sorted((t1, t2))
    a = m.breakdown([lo] * batch, 0, 0, [cached] * batch)
    b = m.breakdown([hi] * batch, 0, 0, [cached] * batch)
    assert a.total_ms - a.allreduce_ms <= b.total_ms - b.allreduce_ms
    if hi > lo:
        assert a.total_ms - a.allreduce_ms < b.total_ms - b.allreduce_ms
    if tp == 1:
        assert a.allreduce_ms == b.allreduce_ms == 0.0
        assert m.step_ms([lo] * batch, 0, 0, [cached] * batch) <= m.step_ms([hi] * batch, 0, 0, [cached] * batch)


def test_the_all_reduce_follows_the_measured_table_where_it_falls() -> None:
    """A100 2 x 8 measures an all-reduce of 12.8 MB at 3.2 ms and of 13.0 MB at 1.7 ms (NCCL's next algorithm): at TP 16
    a 70B prefill of 780 tokens (12.8 MB per message) costs more all-reduce time than one of 800 (13.1 MB)."""
    m = cm(A100, LLAMA70, 16)
    short, long = m.breakdown([780], 0, 0), m.breakdown([800], 0, 0)
    assert short.allreduce_ms > 1.3 * long.allreduce_ms
    assert short.linear_ms <= long.linear_ms and short.other_ms < long.other_ms  # the same 128-row GEMM tiles


@settings(max_examples=150, deadline=None)
@given(model=MODELS, tp=TPS, n=st.integers(1, 512), k1=st.integers(0, 2_000_000), k2=st.integers(0, 2_000_000))
def test_more_kv_tokens_take_more_time(model: ModelSpec, tp: int, n: int, k1: int, k2: int) -> None:
    m = cm(A100, model, tp)
    lo, hi = sorted((k1, k2))
    assert m.step_ms([], n, lo) <= m.step_ms([], n, hi)
    if hi > lo:
        assert m.step_ms([], n, lo) < m.step_ms([], n, hi)


@settings(max_examples=100, deadline=None)
@given(model=MODELS, tp=TPS, n1=st.integers(1, 1024), n2=st.integers(1, 1024), kv_per_seq=st.integers(0, 8_000))
def test_more_decoding_sequences_take_more_time(model: ModelSpec, tp: int, n1: int, n2: int, kv_per_seq: int) -> None:
    m = cm(H200, model, tp)
    lo, hi = sorted((n1, n2))
    a, b = m.breakdown([], lo, lo * kv_per_seq), m.breakdown([], hi, hi * kv_per_seq)
    assert a.total_ms - a.allreduce_ms <= b.total_ms - b.allreduce_ms  # the all-reduce: as measured (above)


def test_a_cached_prefix_costs_less_than_prefilling_it_but_more_than_nothing() -> None:
    m = cm(H100, QWEN7)
    assert m.step_ms([1000], 0, 0) < m.step_ms([1000], 0, 0, [3000]) < m.step_ms([4000], 0, 0)


def test_empty_step_costs_nothing_and_step_is_the_sum_of_its_breakdown() -> None:
    m = cm(H100, QWEN72, 4)
    assert m.step_ms([], 0, 0) == 0.0
    assert m.step_ms([0, 0], 0, 123) == 0.0
    b = m.breakdown([700, 300], 16, 16 * 900, [0, 512])
    assert m.step_ms([700, 300], 16, 16 * 900, [0, 512]) == pytest.approx(b.total_ms, rel=1e-12)
    assert min(b.linear_ms, b.attention_ms, b.allreduce_ms, b.other_ms) > 0
    assert b.overhead_ms == m.overhead_ms


# -- hardware ------------------------------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(prompts=st.lists(st.integers(1, 8_000), max_size=6), seqs=st.integers(0, 256), kv=st.integers(0, 4_000),
       model=MODELS, tp=TPS)
def test_h100_is_faster_than_a100_for_the_same_work(prompts: list[int], seqs: int, kv: int, model: ModelSpec,
                                                    tp: int) -> None:
    h, a = cm(H100, model, tp), cm(A100, model, tp)
    th, ta = h.step_ms(prompts, seqs, seqs * kv), a.step_ms(prompts, seqs, seqs * kv)
    if not prompts and seqs == 0:
        assert th == ta == 0.0
    else:
        assert th < ta


@settings(max_examples=150, deadline=None)
@given(batch=st.integers(1, 512), context=st.integers(0, 32_000), model=MODELS, tp=TPS)
def test_h200_decodes_faster_than_h100_because_of_bandwidth(batch: int, context: int, model: ModelSpec,
                                                             tp: int) -> None:
    assert cm(H200, model, tp).decode_ms_per_token(batch, context) < cm(H100, model, tp).decode_ms_per_token(
        batch, context)


def test_decode_is_memory_bound_so_the_h200_gain_tracks_bandwidth_on_the_weight_read() -> None:
    h100 = cm(H100, QWEN72, 4, overhead_ms=0.0).breakdown([], 1, 2048)
    h200 = cm(H200, QWEN72, 4, overhead_ms=0.0).breakdown([], 1, 2048)
    ratio = h100.linear_ms / h200.linear_ms
    assert 1.2 < ratio <= H200.hbm_tbps / H100.hbm_tbps + 1e-9
    assert h100.allreduce_ms == h200.allreduce_ms  # same NVLink generation, same measured table


def test_tensor_parallel_splits_the_per_gpu_work_but_adds_all_reduce() -> None:
    prev = None
    for tp in (1, 2, 4, 8):
        b = cm(H200, QWEN72, tp).breakdown([2048], 0, 0)
        d = cm(H200, QWEN72, tp).breakdown([], 32, 32 * 2048)
        if tp == 1:
            assert b.allreduce_ms == d.allreduce_ms == 0.0
        else:
            assert b.allreduce_ms > 0 and d.allreduce_ms > 0
        if prev is not None:
            assert b.linear_ms < prev[0].linear_ms and b.attention_ms < prev[0].attention_ms
            assert d.linear_ms < prev[1].linear_ms and d.attention_ms < prev[1].attention_ms
        prev = (b, d)
    one = cm(H200, QWEN72, 1).breakdown([2048], 0, 0)
    eight = cm(H200, QWEN72, 8).breakdown([2048], 0, 0)
    assert 4 < one.linear_ms / eight.linear_ms <= 8  # fixed costs and replicated KV heads keep it under 8x


# -- closed-form decode spans ------------------------------------------------------------------------------------
SPAN_MODELS = [
    cm(H100, QWEN7), cm(A100, LLAMA7), cm(H100, LLAMA70, 8), cm(H200, QWEN1_72, 4),
    # GEMV-slow attention: the FLOP line overtakes the KV-read line mid-stretch, exercising the crossover split
    cm(H100, LLAMA70, 8, attention=AttentionConstants(0.4, 0.0005, 0.7, 0.01)),
    cm(A100, QWEN7, 1, attention=AttentionConstants(0.5, 0.002, 0.9, 0.0)),
]


@settings(max_examples=300, deadline=None)
@given(m=st.sampled_from(SPAN_MODELS), n=st.integers(1, 300), kv0=st.integers(0, 500_000),
       steps=st.integers(0, 400))
def test_decode_span_equals_the_brute_force_sum(m: CalibratedCostModel, n: int, kv0: int, steps: int) -> None:
    brute = sum(m.step_ms([], n, kv0 + k * n) for k in range(steps))
    assert m.decode_span_ms(n, kv0, steps) == pytest.approx(brute, rel=1e-9, abs=1e-9)


def test_the_crossover_model_really_crosses_over() -> None:
    m = SPAN_MODELS[4]
    s1, b1, s2, b2 = m._decode_lines(8)
    assert s2 > s1 and b1 > b2  # memory line first, FLOP line after K = (b1 - b2) / (s2 - s1)
    cross = (b1 - b2) / (s2 - s1)
    assert 0 < cross < 500_000


@settings(max_examples=300, deadline=None)
@given(m=st.sampled_from(SPAN_MODELS), n=st.integers(1, 300), kv0=st.integers(0, 500_000),
       budget=st.floats(0, 200_000, allow_nan=False))
def test_decode_steps_within_is_the_exact_inverse_of_the_span(m: CalibratedCostModel, n: int, kv0: int,
                                                              budget: float) -> None:
    s = m.decode_steps_within(n, kv0, budget)
    assert s >= 0
    assert m.decode_span_ms(n, kv0, s) <= budget
    assert m.decode_span_ms(n, kv0, s + 1) > budget


def test_decode_steps_within_edge_cases() -> None:
    m = SPAN_MODELS[0]
    assert m.decode_steps_within(4, 1000, -1.0) == 0
    assert m.decode_steps_within(4, 1000, 0.0) == 0
    assert m.decode_span_ms(0, 1000, 10) == 0.0 and m.decode_span_ms(4, 1000, 0) == 0.0
    with pytest.raises(ValueError, match="n >= 1"):
        m.decode_steps_within(0, 0, 10.0)
    with pytest.raises(ValueError, match="finite"):
        m.decode_steps_within(1, 0, math.inf)


# -- absolute numbers ------------------------------------------------------------------------------------------
def test_llama2_70b_tp8_h100_decode_at_small_batch_is_in_the_publicly_reported_range() -> None:
    ms = cm(H100, LLAMA70, 8).decode_ms_per_token(1, 2048)
    assert 10.0 < ms < 30.0


def test_llama2_7b_decode_is_weight_read_bound() -> None:
    a = cm(A100, LLAMA7, overhead_ms=0.0).decode_ms_per_token(1, 512)
    h = cm(H100, LLAMA7, overhead_ms=0.0).decode_ms_per_token(1, 512)
    floor_a = LLAMA7.weight_bytes / (A100.hbm_tbps * 1e9)  # every weight read once at 100% bandwidth
    assert floor_a < a < 1.8 * floor_a  # ~80% of peak bandwidth plus per-kernel fixed costs
    assert 1.2 < a / h < 2.0


@pytest.mark.parametrize("gpu", [H100, H200])
def test_qwen2_72b_tp4_gives_finite_sensible_numbers(gpu: GpuSpec) -> None:
    m = cm(gpu, QWEN72, 4)
    prefill = m.prefill_ms(2048)
    d1, d32 = m.decode_ms_per_token(1, 2048), m.decode_ms_per_token(32, 2048)
    assert all(math.isfinite(x) for x in (prefill, d1, d32))
    assert 60 < prefill < 400  # 2 x 72.7e9 x 2048 FLOPs on 4 x 989 TFLOP/s at 40-80% MFU, plus all-reduce
    assert 10 < d1 < 40 and d1 < d32 < 4 * d1
    # prompt-heavy work is compute bound: per-token prefill is far cheaper than a decode step per token
    assert prefill / 2048 < d1 / 20


def test_for_node_resolves_a_configured_node_or_a_triple_and_lists_the_valid_names() -> None:
    node = CFG.nodes()[0]
    by_node = CalibratedCostModel.for_node(CFG, node.name, CAL)
    assert (by_node.gpu, by_node.model, by_node.tp) == (CFG.gpus[node.gpu], CFG.models[node.models[0]], node.tp)
    by_triple = CalibratedCostModel.for_node(CFG, ("h200-141gb", "qwen2-72b", 4), CAL)
    assert by_triple.step_ms([100], 0, 0) > 0
    with pytest.raises(KeyError, match="gpus: a100-80gb, h100-80gb, h200-141gb"):
        CalibratedCostModel.for_node(CFG, ("b200", "qwen2-72b", 4), CAL)


def test_the_sim_engine_is_built_on_the_calibrated_model() -> None:
    from workers.roles.worker import build_engine

    engine = build_engine(CFG, CFG.nodes()[0].name, "sim")
    assert isinstance(engine.cost, CalibratedCostModel)  # type: ignore[attr-defined]


def test_the_uncalibrated_roofline_still_answers() -> None:
    r = RooflineCostModel(H100, LLAMA7, overhead_ms=0.0)
    assert r.decode_ms_per_token(1, 512) > 0
    assert r.step_ms([100], 0, 0, [50]) > r.step_ms([100], 0, 0)


# -- rackflow perf -------------------------------------------------------------------------------------------------
def test_perf_json_has_prefill_and_decode_times() -> None:
    rc, out, err = run_cli("perf", "--model", "llama-2-70b", "--gpu", "h100-80gb", "--tp", "8",
                           "--prompt-tokens", "2048", "--batch", "1", "--json")
    assert rc == 0, err
    got = json.loads(out)
    assert got["prefill_ms"] > 0 and got["decode_ms_per_token"] > 0
    assert set(got["breakdown_ms"]["decode"]) == {"linear", "attention", "allreduce", "other", "overhead", "total"}
    assert got["decode_ms_per_token"] == pytest.approx(got["breakdown_ms"]["decode"]["total"], abs=1e-3)
    assert got["tp"] == 8 and got["model"] == "llama-2-70b" and got["calibrated_on"] == "h100"


def test_perf_says_when_a_model_does_not_fit_and_which_tp_would() -> None:
    rc, out, err = run_cli("perf", "--model", "qwen2-72b", "--gpu", "a100-80gb", "--tp", "1",
                           "--prompt-tokens", "128")
    assert rc == 2 and out == ""
    assert "does not fit a100-80gb at tp=1" in err and "tp=4 would fit" in err


def test_perf_without_a_model_says_what_is_missing() -> None:
    rc, _, err = run_cli("perf", "--gpu", "h100-80gb")
    assert rc == 2 and "--model" in err and "--prompt-tokens" in err
