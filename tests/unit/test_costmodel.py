"""Roofline cost model: orders of magnitude and monotonicity a scheduler relies on."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import ModelSpec
from pipeline.costmodel import RooflineCostModel
from tests.unit.builders import config

CFG = config()
H100, A100, H200 = (CFG.gpus[g] for g in ("h100-80gb", "a100-80gb", "h200-141gb"))
LLAMA7, QWEN7, QWEN72 = (CFG.models[m] for m in ("llama-2-7b", "qwen2-7b", "qwen2-72b"))

PROMPTS = st.lists(st.integers(1, 8_000), max_size=8)
SEQS = st.integers(0, 256)
KV_PER_SEQ = st.integers(0, 4_000)


@settings(max_examples=100, deadline=None)
@given(prompts=PROMPTS, seqs=SEQS, kv=KV_PER_SEQ, model=st.sampled_from([LLAMA7, QWEN7, QWEN72]))
def test_h100_is_faster_than_a100_for_the_same_work(prompts: list[int], seqs: int, kv: int, model: ModelSpec) -> None:
    h, a = RooflineCostModel(H100, model, tp=8), RooflineCostModel(A100, model, tp=8)
    th, ta = h.step_ms(prompts, seqs, seqs * kv), a.step_ms(prompts, seqs, seqs * kv)
    if not prompts and seqs == 0:
        assert th == ta == 0.0
    else:
        assert th < ta


def test_decode_step_of_llama2_7b_on_h100_at_batch_1_takes_4_to_15_ms() -> None:
    ms = RooflineCostModel(H100, LLAMA7).decode_ms_per_token(batch=1, context_tokens=512)
    assert 4.0 < ms < 15.0


def test_decode_is_memory_bound_so_a100_decode_is_about_the_bandwidth_ratio_slower() -> None:
    h = RooflineCostModel(H100, LLAMA7, overhead_ms=0.0).decode_ms_per_token(1, 512)
    a = RooflineCostModel(A100, LLAMA7, overhead_ms=0.0).decode_ms_per_token(1, 512)
    assert a / h == pytest.approx(H100.hbm_tbps / A100.hbm_tbps, rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(t1=st.integers(1, 32_000), t2=st.integers(1, 32_000), batch=st.integers(1, 16))
def test_prefill_time_grows_with_prompt_tokens(t1: int, t2: int, batch: int) -> None:
    m = RooflineCostModel(H100, QWEN7)
    lo, hi = sorted((t1, t2))
    assert m.prefill_ms(lo, batch) <= m.prefill_ms(hi, batch)
    if hi > lo:
        assert m.prefill_ms(lo, batch) < m.prefill_ms(hi, batch)


def test_long_prefill_is_compute_bound_and_scales_about_linearly() -> None:
    m = RooflineCostModel(H100, QWEN7, overhead_ms=0.0)
    ratio = m.prefill_ms(8_000) / m.prefill_ms(4_000)
    assert 2.0 < ratio < 2.5  # linear layers double; causal attention grows faster


@settings(max_examples=100, deadline=None)
@given(batch=st.integers(1, 256), c1=st.integers(0, 32_000), c2=st.integers(0, 32_000))
def test_decode_time_grows_with_kv_tokens(batch: int, c1: int, c2: int) -> None:
    m = RooflineCostModel(H100, QWEN7)
    lo, hi = sorted((c1, c2))
    assert m.decode_ms_per_token(batch, lo) <= m.decode_ms_per_token(batch, hi)
    if hi > lo:
        assert m.decode_ms_per_token(batch, lo) < m.decode_ms_per_token(batch, hi)


def test_tensor_parallel_2_about_halves_decode_time_net_of_overhead() -> None:
    one = RooflineCostModel(H200, QWEN72, tp=1)
    two = RooflineCostModel(H200, QWEN72, tp=2)
    t1 = one.decode_ms_per_token(8, 2_000) - one.overhead_ms
    t2 = two.decode_ms_per_token(8, 2_000) - two.overhead_ms
    assert t2 / t1 == pytest.approx(0.5, rel=0.05)


def test_empty_step_costs_nothing() -> None:
    assert RooflineCostModel(H100, QWEN7).step_ms([], 0, 0) == 0.0
