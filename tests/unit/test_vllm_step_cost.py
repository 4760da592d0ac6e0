"""The linear step cost fitted to the vLLM engine's measured iterations (workers/engines/vllm_profile.py): the fit
recovers known coefficients, drops a negative one, and the O(1) decode spans agree with step-by-step sums."""

from __future__ import annotations

import random

import pytest

from pipeline.costmodel.linear import prefill_attn
from workers.engines.vllm_profile import LinearStepCost, StepSample, fit_linear


def test_fit_recovers_the_coefficients_of_noisy_samples() -> None:
    true = LinearStepCost(3.0, 0.02, 0.15, 0.0004)
    rng = random.Random(1)
    samples = []
    for p in (16, 64, 256, 1024, 2048):
        samples.append(StepSample(p, 0, 0, true.step_ms([p], 0, 0) * rng.uniform(0.97, 1.03)))
    for b in (1, 2, 4, 8, 16, 32):
        for kv in (32, 800):
            samples.append(StepSample(0, b, b * kv, true.step_ms([], b, b * kv) * rng.uniform(0.97, 1.03)))
    cost, quality = fit_linear(samples)
    assert cost.base_ms == pytest.approx(3.0, rel=0.1)
    assert cost.per_prefill_token_ms == pytest.approx(0.02, rel=0.1)
    assert cost.per_decode_seq_ms == pytest.approx(0.15, rel=0.2)
    assert cost.per_kv_token_ms == pytest.approx(0.0004, rel=0.3)
    assert quality["median_rel_error"] < 0.03


def test_the_fixed_cost_of_an_iteration_that_prefills_is_fitted_apart_from_the_decode_base() -> None:
    true = LinearStepCost(3.0, 0.02, 0.25, 0.0, prefill_base_ms=2.5)
    samples = [StepSample(p, 0, 0, true.step_ms([p], 0, 0)) for p in (16, 256, 1024, 2048)]
    samples += [StepSample(0, b, b * kv, true.step_ms([], b, b * kv)) for b in (1, 2, 4, 8) for kv in (32, 800)]
    cost, quality = fit_linear(samples)
    assert cost.base_ms == pytest.approx(3.0, rel=1e-6) and cost.per_decode_seq_ms == pytest.approx(0.25, rel=1e-6)
    assert cost.prefill_base_ms == pytest.approx(2.5, rel=1e-6)
    assert cost.per_prefill_token_ms == pytest.approx(0.02, rel=1e-6)
    assert quality["median_rel_error"] < 1e-9
    # a decode-only step never pays the prefill's fixed cost; a step that prefills pays it once
    assert cost.step_ms([], 4, 0) == pytest.approx(4.0) and cost.step_ms([10, 10], 4, 0) == pytest.approx(6.9)


def test_the_prefills_attention_to_its_context_is_fitted_and_priced_by_the_tokens_already_cached() -> None:
    """A prompt's new tokens attend to what is cached before them (a conversation's history, a long prompt's earlier
    chunks): the fit recovers the per-pair cost from prefills with and without a cached prefix, and the cost prices
    a chunk after 3,072 cached tokens above the same chunk alone."""
    true = LinearStepCost(3.0, 0.02, 0.15, 0.0004, prefill_base_ms=2.0, per_prefill_attn_ms=2e-6)
    samples = [StepSample(p, 0, 0, true.step_ms([p], 0, 0), prefill_attn([p])) for p in (16, 256, 1024, 2048)]
    samples += [StepSample(n, 0, 0, true.step_ms([n], 0, 0, [k]), prefill_attn([n], [k]))
                for k in (1024, 2048, 3072) for n in (256, 1024)]
    samples += [StepSample(0, b, b * kv, true.step_ms([], b, b * kv)) for b in (1, 2, 4, 8) for kv in (32, 800)]
    cost, quality = fit_linear(samples)
    assert cost.per_prefill_attn_ms == pytest.approx(2e-6, rel=1e-6)
    assert cost.per_prefill_token_ms == pytest.approx(0.02, rel=1e-6) and quality["median_rel_error"] < 1e-9
    alone, after = cost.step_ms([1024], 0, 0), cost.step_ms([1024], 0, 0, [3072])
    assert after - alone == pytest.approx(2e-6 * 1024 * 3072, rel=1e-6)
    # a profile fitted before the term has none: the prefill is priced by its new tokens alone, as it was
    old = LinearStepCost(3.0, 0.02, 0.15, 0.0004, prefill_base_ms=2.0)
    assert old.step_ms([1024], 0, 0, [3072]) == old.step_ms([1024], 0, 0) == pytest.approx(3.0 + 2.0 + 20.48)


def test_a_coefficient_the_data_makes_negative_is_dropped_and_the_rest_refitted() -> None:
    # decode gets cheaper with more sequences in these samples: no negative cost per sequence, the base absorbs it
    samples = [StepSample(0, b, 0, 5.0 - 0.01 * b) for b in (1, 2, 4, 8)] + [StepSample(p, 0, 0, 5.0 + 0.01 * p)
                                                                            for p in (100, 200, 400)]
    cost, _ = fit_linear(samples)
    assert cost.per_decode_seq_ms == 0.0
    assert cost.base_ms == pytest.approx(5.0, abs=0.1) and cost.per_prefill_token_ms == pytest.approx(0.01, rel=0.2)


def test_decode_span_and_steps_within_match_the_step_by_step_sum() -> None:
    cost = LinearStepCost(2.0, 0.01, 0.1, 0.001)
    for n, kv0, steps in ((1, 10, 1), (4, 400, 37), (16, 16_000, 250)):
        direct = sum(cost.step_ms([], n, kv0 + k * n) for k in range(steps))
        assert cost.decode_span_ms(n, kv0, steps) == pytest.approx(direct, rel=1e-9)
        budget = direct + 1e-6
        assert cost.decode_steps_within(n, kv0, budget) == steps
        assert cost.decode_steps_within(n, kv0, direct - 0.5 * cost.step_ms([], n, kv0)) == steps - 1
    assert cost.step_ms([], 0, 0) == 0.0
    assert cost.decode_steps_within(2, 0, 0.0) == 0
    with pytest.raises(ValueError, match="n >= 1"):
        cost.decode_steps_within(0, 0, 10.0)
