"""Request profiling: token estimate, expected output length, memory estimate, prefix hashes and the RequestEvent
built from them; and the seed's prefix-cache rule applied after routing (`keeps_prefix_cache`)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipeline.config import ProfilingPolicy, TokenRates
from pipeline.events import RequestEvent
from pipeline.profiling import (
    ProfileInput,
    estimate_mem_kb,
    estimate_tokens,
    expected_out_tokens,
    profile_request,
)
from pipeline.routing.rack_affinity import RackAffinityRouter, RouteDecision, keeps_prefix_cache
from pipeline.tokens import prefix_hashes_from_ids, prefix_hashes_from_text
from tests.unit.builders import config, rack_view

QWEN = config().models["qwen2-7b"]
POLICY = ProfilingPolicy()
RATES = TokenRates()  # cjk 1.4, latin 4.0, code 3.0 chars per token
TOKENS = st.integers(0, 200_000)
CJK = st.text(alphabet=st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF), min_size=1, max_size=300)
CODE_SYMBOLS = "{}()[];=<>_/\\*&|#:"
PROSE = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E, blacklist_characters=CODE_SYMBOLS),
    min_size=1, max_size=300,
)
ASCII = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=300)
TOKEN_IDS = st.lists(st.integers(0, 151_999), max_size=120)


def test_default_token_rates_are_1_4_cjk_4_latin_3_code_chars_per_token() -> None:
    assert (RATES.cjk, RATES.latin, RATES.code) == (1.4, 4.0, 3.0)
    assert POLICY.token_rates == RATES


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
def test_request_max_tokens_caps_the_user_history(max_tokens: int, ewma: float | None) -> None:
    got = expected_out_tokens(QWEN, max_tokens, ewma)
    assert got == (max_tokens if ewma is None else min(max_tokens, max(1, round(ewma))))
    assert 1 <= got <= max_tokens  # a cap is never exceeded


def test_a_round_cap_far_above_the_history_expects_the_history() -> None:
    assert expected_out_tokens(QWEN, 4096, 212.4) == 212
    assert expected_out_tokens(QWEN, 100, 212.4) == 100
    assert expected_out_tokens(QWEN, 4096, None) == 4096


@settings(max_examples=100, deadline=None)
@given(ewma=st.floats(0.01, 1e5))
def test_user_ewma_takes_precedence_over_model_default_when_positive(ewma: float) -> None:
    assert expected_out_tokens(QWEN, None, ewma) == max(1, round(ewma))


@pytest.mark.parametrize("ewma", [None, 0.0, -3.0])
def test_model_default_output_length_without_request_or_history(ewma: float | None) -> None:
    assert expected_out_tokens(QWEN, None, ewma) == QWEN.default_out_tokens == 256


# -- token estimate (the estimator itself is tested against a real BPE tokenizer in test_tokens.py) -------------


def test_token_estimate_of_empty_text_is_zero() -> None:
    assert estimate_tokens("", RATES) == 0


@settings(max_examples=100, deadline=None)
@given(text=CJK)
def test_cjk_text_counts_one_token_per_1_4_characters(text: str) -> None:
    assert estimate_tokens(text, RATES) == max(1, round(len(text) / 1.4))


@settings(max_examples=100, deadline=None)
@given(text=PROSE)
def test_prose_without_code_symbols_counts_one_token_per_4_characters(text: str) -> None:
    assert estimate_tokens(text, RATES) == max(1, round(len(text) / 4))


@settings(max_examples=100, deadline=None)
@given(text=ASCII)
def test_any_ascii_text_counts_between_the_prose_and_the_code_rate(text: str) -> None:
    assert max(1, round(len(text) / 4)) <= estimate_tokens(text, RATES) <= max(1, round(len(text) / 3))


def test_code_symbol_density_blends_prose_and_code_rates() -> None:
    assert estimate_tokens("x = f(a);" * 20, RATES) == round(180 / 3)  # 4 symbols in 9 chars: all code
    assert estimate_tokens("(" * 2 + "a" * 98, RATES) == round(100 / 4)  # 2% symbols: still prose
    assert estimate_tokens("(" * 4 + "a" * 96, RATES) == round(100 / 3.5)  # 4%: half way between the rates
    assert estimate_tokens("(" * 6 + "a" * 94, RATES) == round(100 / 3)  # 6%: code


def test_mixed_text_counts_each_script_at_its_own_rate() -> None:
    assert estimate_tokens("你好世界" * 3 + "hello world!" * 2, RATES) == round(12 / 1.4 + 24 / 4)
    assert estimate_tokens("こんにちはカタカナ안녕하세요", RATES) == round(14 / 1.4)  # kana and hangul are CJK
    assert estimate_tokens("a", RATES) == 1  # never zero for non-empty text


def test_token_estimate_follows_the_given_rates() -> None:
    assert estimate_tokens("x" * 100, TokenRates(latin=2.0)) == 50
    assert estimate_tokens("字" * 100, TokenRates(cjk=1.0)) == 100
    assert estimate_tokens("a(b);" * 20, TokenRates(code=2.0)) == 50


# -- profile_request ---------------------------------------------------------------------------------------------


def test_profile_request_builds_a_version_1_event_from_prompt_and_history() -> None:
    inp = ProfileInput(request_id="r-1", tenant="t", user_id="u", model="qwen2-7b", arrival_ms=12.5,
                       prompt="word " * 40, user_avg_out=99.6, priority=2, prefix_cache=False,
                       route_policy="kv_aware")
    ev = profile_request(inp, QWEN, POLICY)
    assert ev == RequestEvent(
        request_id="r-1", version=1, tenant="t", user_id="u", model="qwen2-7b", in_tokens=50, out_tokens=100,
        # no max_tokens: the cap is the room left in the context (OpenAI's and vLLM's), the expectation the EWMA
        max_tokens=QWEN.context - 50, mem_est_kb=(50 + 100) * QWEN.kv_bytes_per_token / 1000, arrival_ms=12.5,
        prompt="word " * 40, priority=2,
        prefix_cache=False, rack=None, routed_ms=0.0, route_policy="kv_aware",
        prefix_hashes=(),  # 200 characters: less than one 512-token block
    )


def test_rates_come_from_the_argument_then_the_model_then_the_policy() -> None:
    inp = ProfileInput("r", "t", "u", "qwen2-7b", 0.0, prompt="x" * 120)
    tuned = QWEN.model_copy(update={"token_rates": TokenRates(latin=2.0)})
    assert profile_request(inp, QWEN, POLICY).in_tokens == 30
    assert profile_request(inp, tuned, POLICY).in_tokens == 60
    assert profile_request(inp, tuned, POLICY, TokenRates(latin=6.0)).in_tokens == 20
    assert profile_request(inp, QWEN, ProfilingPolicy(token_rates=TokenRates(latin=3.0))).in_tokens == 40


@settings(max_examples=50, deadline=None)
@given(ids=TOKEN_IDS, prompt=st.text(max_size=200), block=st.sampled_from([16, 32]))
@example(ids=list(range(40)), prompt="p" * 300, block=16)  # both forms give hashes: the ids' must win
def test_exact_token_ids_give_the_count_and_the_prefix_blocks(ids: list[int], prompt: str, block: int) -> None:
    policy = ProfilingPolicy(prefix_block_tokens=block)
    ev = profile_request(ProfileInput("r", "t", "u", "qwen2-7b", 0.0, prompt=prompt, token_ids=ids), QWEN, policy)
    assert ev.in_tokens == len(ids)
    assert ev.prefix_hashes == prefix_hashes_from_ids(ids, block)
    assert len(ev.prefix_hashes) == len(ids) // block
    assert ev.mem_est_kb == estimate_mem_kb(QWEN, len(ids), ev.out_tokens, policy.estimator, policy.shape_margin)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 30_000), ids=st.one_of(st.none(), TOKEN_IDS), prompt=st.text(max_size=200))
def test_given_prompt_tokens_win_over_token_ids_and_the_estimate(n: int, ids: list[int] | None, prompt: str) -> None:
    inp = ProfileInput("r", "t", "u", "qwen2-7b", 0.0, prompt=prompt, prompt_tokens=n, token_ids=ids)
    assert profile_request(inp, QWEN, POLICY).in_tokens == n


def test_given_prefix_hashes_win_over_token_ids_and_the_prompt() -> None:
    inp = ProfileInput("r", "t", "u", "qwen2-7b", 0.0, prompt="p" * 5000, token_ids=list(range(2048)),
                       prefix_hashes=(7, 8, 9))
    assert profile_request(inp, QWEN, POLICY).prefix_hashes == (7, 8, 9)


@settings(max_examples=50, deadline=None)
@given(prompt=st.text(max_size=400), latin=st.sampled_from([2.0, 4.0]))
def test_without_token_ids_prefix_hashes_come_from_blocks_of_the_prompt_text(prompt: str, latin: float) -> None:
    policy = ProfilingPolicy(prefix_block_tokens=16, token_rates=TokenRates(latin=latin))
    ev = profile_request(ProfileInput("r", "t", "u", "qwen2-7b", 0.0, prompt=prompt), QWEN, policy)
    block_bytes = round(16 * latin)  # a block of prefix_block_tokens tokens at the prose rate
    assert ev.prefix_hashes == prefix_hashes_from_text(prompt, block_bytes)
    assert len(ev.prefix_hashes) == len(prompt.encode("utf-8", "surrogatepass")) // block_bytes


def test_prompts_sharing_a_prefix_share_their_leading_prefix_hashes() -> None:
    policy = ProfilingPolicy(prefix_block_tokens=16)  # 64 characters per block
    system = "You are a helpful assistant. Answer briefly and cite sources. " * 4  # 248 characters: 3 blocks

    def hashes(prompt: str) -> tuple[int, ...]:
        return profile_request(ProfileInput("r", "t", "u", "qwen2-7b", 0.0, prompt=prompt), QWEN, policy).prefix_hashes

    a, b = hashes(system + "What is the capital of France? " * 3), hashes(system + "Name three prime numbers. " * 4)
    assert len(a) >= 4 and len(b) >= 4
    assert a[:3] == b[:3]
    assert a[3] != b[3]


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.text(max_size=50),
    prompt_tokens=st.one_of(st.none(), st.integers(0, 30_000)),
    ids=st.one_of(st.none(), TOKEN_IDS),
    max_tokens=st.one_of(st.none(), st.integers(1, 8_000)),
    ewma=st.one_of(st.none(), st.floats(0.0, 5_000.0)),
    estimator=st.sampled_from(["seed", "shape"]),
)
def test_profiled_request_is_consistent_with_its_parts(
    prompt: str, prompt_tokens: int | None, ids: list[int] | None, max_tokens: int | None, ewma: float | None,
    estimator: str,
) -> None:
    policy = ProfilingPolicy(estimator=estimator)
    inp = ProfileInput("r", "t", "u", "qwen2-7b", 0.0, prompt=prompt, prompt_tokens=prompt_tokens, token_ids=ids,
                       max_tokens=max_tokens, user_avg_out=ewma)
    ev = profile_request(inp, QWEN, policy)
    assert ev.version == 1
    if prompt_tokens is not None:
        assert ev.in_tokens == prompt_tokens
    elif ids is not None:
        assert ev.in_tokens == len(ids)
    else:
        assert ev.in_tokens == estimate_tokens(prompt, policy.token_rates)
    # the expectation, never more than can come (a long prompt leaves little room in the context)
    assert ev.out_tokens == min(expected_out_tokens(QWEN, max_tokens, ewma), ev.max_tokens)
    assert ev.max_tokens == (max_tokens if max_tokens is not None else max(1, QWEN.context - ev.in_tokens))
    assert ev.out_tokens <= ev.max_tokens
    assert ev.mem_est_kb == estimate_mem_kb(QWEN, ev.in_tokens, ev.out_tokens, estimator)
    assert all(0 <= h < 2**63 for h in ev.prefix_hashes)


# -- prefix-cache rule (pipeline/routing/rack_affinity.py) ------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    enabled=st.booleans(),
    min_tokens=st.integers(0, 4096),
    in_tokens=st.integers(0, 8192),
    rack=st.sampled_from(["r0", "r1"]),
    asked=st.booleans(),
)
def test_prefix_cache_is_off_only_for_a_long_prompt_routed_away_from_its_affinity_rack_when_enabled(
    enabled: bool, min_tokens: int, in_tokens: int, rack: str, asked: bool
) -> None:
    decision = RouteDecision(rack=rack, primary="r0", reason="affinity" if rack == "r0" else "walked")
    kept = keeps_prefix_cache(enabled, min_tokens, in_tokens, decision, asked)
    off = enabled and rack != "r0" and in_tokens > min_tokens
    assert kept == (False if off else asked)


@pytest.mark.parametrize(
    ("enabled", "in_tokens", "rack", "asked", "kept"),
    [
        (True, 513, "r1", True, False),  # long, walked away: off
        (True, 512, "r1", True, True),  # exactly min_tokens is not longer than it
        (True, 513, "r0", True, True),  # at its affinity rack
        (False, 9999, "r1", True, True),  # rule disabled
        (True, 10, "r1", False, False),  # a request that asked for no caching keeps that
        (True, 513, "r0", False, False),
    ],
)
def test_prefix_cache_rule_examples(enabled: bool, in_tokens: int, rack: str, asked: bool, kept: bool) -> None:
    assert keeps_prefix_cache(enabled, 512, in_tokens, RouteDecision(rack, "r0", "x"), asked) is kept


def test_prefix_cache_rule_after_a_real_route_that_walks_past_an_overloaded_primary() -> None:
    racks = ["r0", "r1", "r2"]
    router = RackAffinityRouter({"qwen2-7b": racks}, 160, 1.25)
    rule = config().policies.router.prefix_cache_rule.model_copy(update={"enabled": True})  # the seed's rule
    calm = {r: rack_view(r, load=5.0) for r in racks}
    home = router.route("user-1", "qwen2-7b", calm)
    assert home.reason == "affinity"
    assert keeps_prefix_cache(rule.enabled, rule.min_tokens, 4000, home, True)
    busy = dict(calm, **{home.primary: rack_view(home.primary, load=500.0)})
    away = router.route("user-1", "qwen2-7b", busy)
    assert away.rack != away.primary == home.primary
    assert not keeps_prefix_cache(rule.enabled, rule.min_tokens, 4000, away, True)
    assert keeps_prefix_cache(rule.enabled, rule.min_tokens, 100, away, True)
