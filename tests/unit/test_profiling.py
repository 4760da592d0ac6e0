"""Request profiling: token estimate, expected output length, memory estimate and the RequestEvent built from them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import ProfilingPolicy
from pipeline.events import RequestEvent
from pipeline.profiling import (
    ProfileInput,
    estimate_mem_kb,
    estimate_tokens,
    expected_out_tokens,
    profile_request,
)
from tests.unit.builders import config

QWEN = config().models["qwen2-7b"]
POLICY = ProfilingPolicy()
TOKENS = st.integers(0, 200_000)
CJK = st.text(alphabet=st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF), min_size=1, max_size=300)
LATIN = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=300)


@settings(max_examples=100, deadline=None)
@given(i=TOKENS, o=TOKENS)
def test_seed_memory_estimate_is_in_x_200_plus_out_x_1500_kb(i: int, o: int) -> None:
    assert estimate_mem_kb(QWEN, i, o, "seed") == i * 200 + o * 1500


@settings(max_examples=100, deadline=None)
@given(i=TOKENS, o=TOKENS)
def test_shape_memory_estimate_is_kv_bytes_per_token_of_all_tokens_in_kb(i: int, o: int) -> None:
    assert estimate_mem_kb(QWEN, i, o, "shape") == pytest.approx((i + o) * 57344 / 1000)


def test_memory_estimate_examples() -> None:
    assert estimate_mem_kb(QWEN, 1000, 200, "seed") == 500_000
    assert estimate_mem_kb(QWEN, 1000, 0, "shape") == pytest.approx(57_344)
    assert estimate_mem_kb(QWEN, 0, 0, "seed") == 0


def test_memory_estimate_rejects_negative_tokens_and_unknown_estimators() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        estimate_mem_kb(QWEN, -1, 10, "seed")
    with pytest.raises(ValueError, match="allowed: seed, shape"):
        estimate_mem_kb(QWEN, 1, 10, "tokenizer")


@settings(max_examples=100, deadline=None)
@given(max_tokens=st.integers(1, 100_000), ewma=st.one_of(st.none(), st.floats(0.5, 1e5)))
def test_request_max_tokens_takes_precedence_over_user_history(max_tokens: int, ewma: float | None) -> None:
    assert expected_out_tokens(QWEN, max_tokens, ewma) == max_tokens


@settings(max_examples=100, deadline=None)
@given(ewma=st.floats(0.01, 1e5))
def test_user_ewma_takes_precedence_over_model_default_when_positive(ewma: float) -> None:
    assert expected_out_tokens(QWEN, None, ewma) == max(1, round(ewma))


@pytest.mark.parametrize("ewma", [None, 0.0, -3.0])
def test_model_default_output_length_without_request_or_history(ewma: float | None) -> None:
    assert expected_out_tokens(QWEN, None, ewma) == QWEN.default_out_tokens == 256


def test_token_estimate_of_empty_text_is_zero() -> None:
    assert estimate_tokens("", POLICY) == 0


@settings(max_examples=100, deadline=None)
@given(text=CJK)
def test_cjk_text_counts_one_token_per_1_5_characters(text: str) -> None:
    assert estimate_tokens(text, POLICY) == max(1, round(len(text) / 1.5))


@settings(max_examples=100, deadline=None)
@given(text=LATIN)
def test_latin_text_counts_one_token_per_4_characters(text: str) -> None:
    assert estimate_tokens(text, POLICY) == max(1, round(len(text) / 4))


def test_mixed_text_counts_each_script_at_its_own_rate() -> None:
    assert estimate_tokens("你好世界" * 3 + "hello world!" * 2, POLICY) == round(12 / 1.5 + 24 / 4)
    assert estimate_tokens("こんにちはカタカナ안녕하세요", POLICY) == round(14 / 1.5)  # kana and hangul are CJK
    assert estimate_tokens("a", POLICY) == 1  # never zero for non-empty text


def test_token_estimate_follows_the_policy_rates() -> None:
    assert estimate_tokens("x" * 100, ProfilingPolicy(latin_chars_per_token=2.0)) == 50
    assert estimate_tokens("字" * 100, ProfilingPolicy(cjk_chars_per_token=1.0)) == 100


def test_profile_request_builds_a_version_1_event_from_prompt_and_history() -> None:
    inp = ProfileInput(request_id="r-1", tenant="t", user_id="u", model="qwen2-7b", arrival_ms=12.5,
                       prompt="word " * 40, user_avg_out=99.6, priority=2, prefix_cache=False)
    ev = profile_request(inp, QWEN, POLICY)
    assert ev == RequestEvent(
        request_id="r-1", version=1, tenant="t", user_id="u", model="qwen2-7b", in_tokens=50, out_tokens=100,
        max_tokens=100, mem_est_kb=50 * 200 + 100 * 1500, arrival_ms=12.5, prompt="word " * 40, priority=2,
        prefix_cache=False, rack=None, routed_ms=0.0,
    )


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.text(max_size=50),
    prompt_tokens=st.one_of(st.none(), st.integers(0, 30_000)),
    max_tokens=st.one_of(st.none(), st.integers(1, 8_000)),
    ewma=st.one_of(st.none(), st.floats(0.0, 5_000.0)),
    estimator=st.sampled_from(["seed", "shape"]),
)
def test_profiled_request_is_consistent_with_its_parts(
    prompt: str, prompt_tokens: int | None, max_tokens: int | None, ewma: float | None, estimator: str
) -> None:
    policy = ProfilingPolicy(estimator=estimator)
    inp = ProfileInput("r", "t", "u", "qwen2-7b", 0.0, prompt=prompt, prompt_tokens=prompt_tokens,
                       max_tokens=max_tokens, user_avg_out=ewma)
    ev = profile_request(inp, QWEN, policy)
    assert ev.version == 1
    assert ev.in_tokens == (prompt_tokens if prompt_tokens is not None else estimate_tokens(prompt, policy))
    assert ev.out_tokens == expected_out_tokens(QWEN, max_tokens, ewma)
    assert ev.max_tokens == (max_tokens if max_tokens is not None else ev.out_tokens)
    assert ev.out_tokens <= ev.max_tokens
    assert ev.mem_est_kb == estimate_mem_kb(QWEN, ev.in_tokens, ev.out_tokens, estimator)
