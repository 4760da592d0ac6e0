"""Node policies (pipeline/routing/node_policies/) built by name through the registry, and NodePolicySet.

Every policy: no nodes -> None; only ever one of the given nodes; a seeded set reproduces its sequence whatever the
order of the nodes it is given. Then each policy's own rule: round robin's cycle, random's uniformity, least
outstanding's order, power of two's balance (balls into bins), static weights, the live weight W, and kv_aware's
prefix-hit-versus-load cost. The W formula itself is tested in test_node_weight.py.
"""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import ALL_NODE_POLICIES, NodePolicyName
from pipeline.events import RequestEvent
from pipeline.routing.node_policies.base import NodeChoice, NodePolicy, outstanding
from pipeline.routing.registry import NODE_POLICIES, PolicyContext, make_node_policy
from pipeline.routing.views import NodeView
from tests.unit.builders import BLOCK_TOKENS, node_selection, node_view, policy_set, request

ALL: tuple[NodePolicyName, ...] = ALL_NODE_POLICIES
RANDOMISED = ("random", "power_of_two", "static_weight", "weighted")
DETERMINISTIC = ("round_robin", "least_outstanding", "kv_aware", "work_aware", "sglang", "lmetric")
TIES_AT_RANDOM = ("llm_d", "dynamo")
"""Deterministic but for ties, which they break with a draw (llm-d's max-score picker, Dynamo's selector)."""
NODE_GPUS = {"n0": "h100-80gb", "n1": "h200-141gb", "n2": "h200-141gb", "n3": "a100-80gb"}


def make(name: str, seed: int = 0, **params: Any) -> NodePolicy:
    return make_node_policy(name, node_selection(**params), random.Random(seed),
                            PolicyContext(node_gpus=NODE_GPUS, block_tokens=BLOCK_TOKENS))


def choose(pol: NodePolicy, nodes: Sequence[NodeView], req: RequestEvent | None = None) -> NodeChoice:
    """One decision as the batcher makes it: choose (with the request for per-request policies), then observe."""
    req = req if req is not None else request()
    ch = pol.choose(nodes, req if pol.per_request else None)
    if ch.node is not None:
        pol.observe(ch.node, req)
    return ch


def run(pol: NodePolicy, nodes: Sequence[NodeView], reqs: Sequence[RequestEvent]) -> list[tuple[Any, ...]]:
    out = []
    for r in reqs:
        ch = choose(pol, nodes, r)
        out.append((ch.node, ch.draw, sorted(ch.scores.items())))
    return out


# Node views every policy can choose (W > 0, so `weighted` never has to return None).
LIVE_NODE = st.builds(
    lambda free, pcie, lat, running, waiting, kv: (free, pcie, lat, running, waiting, kv),
    st.floats(1.0, 80.0), st.floats(0.0, 99.0), st.floats(0.0, 200.0), st.integers(0, 20), st.integers(0, 20),
    st.sampled_from([0.0, 1e6, 5e6]),
)
LIVE_NODES = st.lists(LIVE_NODE, min_size=1, max_size=6)


def live_views(specs: Sequence[tuple[float, float, float, int, int, float]]) -> list[NodeView]:
    return [
        node_view(f"n{i}", free_vram_gb=f, pcie_util_pct=p, avg_latency_ms=lat, running=r, waiting=w, kv_free_kb=kv)
        for i, (f, p, lat, r, w, kv) in enumerate(specs)
    ]


def prefixed_requests(n: int, seed: int) -> list[RequestEvent]:
    """Requests drawn from three shared prompt prefixes of 4 blocks, plus a unique tail block each."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randrange(3)
        hashes = (*range(k * 10, k * 10 + 4), 1_000 + i)
        out.append(request(request_id=f"q{i}", in_tokens=5 * BLOCK_TOKENS + rng.randrange(8), prefix_hashes=hashes))
    return out


# -- every policy ------------------------------------------------------------------------------------------------


def test_the_registry_holds_exactly_the_configurable_policies() -> None:
    assert sorted(NODE_POLICIES) == sorted(ALL)
    assert {name: make(name).name for name in ALL} == {name: name for name in ALL}
    assert [n for n in ALL if make(n).per_request] == ["kv_aware", "work_aware", "llm_d", "dynamo", "sglang",
                                                       "lmetric"]


def test_unknown_policy_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown node policy 'fastest'; valid: dynamo, kv_aware, "
                                         r"least_outstanding, llm_d, lmetric, power_of_two, random, round_robin, "
                                         r"sglang, static_weight, weighted, work_aware"):
        make("fastest")
    with pytest.raises(ValueError, match="unknown node policy 'weighted-random'"):
        policy_set().get("weighted-random")


@pytest.mark.parametrize("name", ALL)
def test_no_nodes_gives_no_choice(name: str) -> None:
    pol = make(name)
    assert pol.choose([], request()).node is None
    assert pol.choose([], None).node is None


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=40, deadline=None)
@given(specs=LIVE_NODES, seed=st.integers(0, 2**32))
def test_choice_is_always_one_of_the_given_nodes(name: str, specs: list[Any], seed: int) -> None:
    nodes = live_views(specs)
    names = {v.name for v in nodes}
    pol = make(name, seed)
    for ch in (choose(pol, nodes, r) for r in prefixed_requests(8, seed)):
        assert ch.node in names
        assert set(ch.scores) <= names
        if name in DETERMINISTIC:
            assert ch.draw == -1.0
        elif name in TIES_AT_RANDOM:
            assert ch.draw == -1.0 or 0.0 <= ch.draw < 1.0
        elif len(nodes) > 1 or name != "power_of_two":
            assert 0.0 <= ch.draw < 1.0


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=25, deadline=None)
@given(specs=LIVE_NODES, seed=st.integers(0, 2**63 - 1), data=st.data())
def test_same_seed_and_scope_reproduce_the_sequence_whatever_the_node_order(
    name: str, specs: list[Any], seed: int, data: st.DataObject
) -> None:
    nodes = live_views(specs)
    shuffled = data.draw(st.permutations(nodes))
    reqs = prefixed_requests(12, seed)
    a = policy_set(seed, scope="r7", node_gpus=NODE_GPUS, policy=name).get(name)
    b = policy_set(seed, scope="r7", node_gpus=NODE_GPUS, policy=name).get(name)
    seq_a, seq_b = run(a, nodes, reqs), run(b, shuffled, reqs)
    assert [x[:2] for x in seq_a] == [x[:2] for x in seq_b]  # the same nodes and the same draws
    for (_, _, sa), (_, _, sb) in zip(seq_a, seq_b, strict=True):  # what it saw, up to float summation order
        assert dict(sa) == pytest.approx(dict(sb), rel=1e-12)


@pytest.mark.parametrize("name", RANDOMISED)
def test_seed_and_scope_each_change_the_sequence_of_a_randomised_policy(name: str) -> None:
    nodes = [node_view(f"n{i}", free_vram_gb=10.0 + 10 * i, running=i % 3) for i in range(4)]
    reqs = [request() for _ in range(40)]

    def seq(seed: int, scope: str) -> list[Any]:
        return [c[:2] for c in run(policy_set(seed, scope=scope, node_gpus=NODE_GPUS).get(name), nodes, reqs)]

    assert seq(1, "r0") == seq(1, "r0")
    assert seq(1, "r0") != seq(2, "r0")
    assert seq(1, "r0") != seq(1, "r1")


def test_each_policy_of_a_set_has_its_own_random_source() -> None:
    """Replay: using one policy (a request's override) does not shift another policy's draws."""
    nodes = [node_view(f"n{i}", free_vram_gb=10.0 + 10 * i) for i in range(4)]
    alone, mixed = policy_set(5), policy_set(5)
    expected = [alone.get("weighted").choose(nodes, None).draw for _ in range(20)]
    got = []
    for _ in range(20):
        mixed.get("random").choose(nodes, None)
        mixed.get("power_of_two").choose(nodes, None)
        got.append(mixed.get("weighted").choose(nodes, None).draw)
    assert got == expected


def test_a_set_builds_each_policy_once_and_keeps_its_state() -> None:
    s = policy_set()
    assert s.get("round_robin") is s.get("round_robin")
    assert s.get("kv_aware") is s.get("kv_aware")
    nodes = [node_view("a"), node_view("b")]
    assert [choose(s.get("round_robin"), nodes).node for _ in range(3)] == ["a", "b", "a"]


# -- NodePolicySet.resolve ---------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    default=st.sampled_from(ALL),
    allowed=st.lists(st.sampled_from(ALL), unique=True),
    allow=st.booleans(),
    asked=st.one_of(st.sampled_from(["", *ALL]), st.text(max_size=12)),
)
def test_resolve_honours_allowed_overrides_and_falls_back_to_the_default(
    default: NodePolicyName, allowed: list[NodePolicyName], allow: bool, asked: str
) -> None:
    s = policy_set(policy=default, allowed_overrides=tuple(allowed), allow_request_override=allow)
    assert s.default == default
    assert s.resolve(asked) == (asked if allow and asked in allowed else default)


@pytest.mark.parametrize(
    ("params", "asked", "expect"),
    [
        ({}, "kv_aware", "kv_aware"),
        ({}, "", "work_aware"),
        ({}, "Least_Outstanding", "work_aware"),  # unknown spelling: the default, no error
        ({}, "weighted-random", "work_aware"),
        ({"allowed_overrides": ("random",)}, "kv_aware", "work_aware"),
        ({"allowed_overrides": ("random",)}, "random", "random"),
        ({"allow_request_override": False}, "random", "work_aware"),
        ({"policy": "round_robin", "allowed_overrides": ()}, "kv_aware", "round_robin"),
    ],
)
def test_resolve_examples(params: dict[str, Any], asked: str, expect: str) -> None:
    assert policy_set(**params).resolve(asked) == expect


# -- round_robin ---------------------------------------------------------------------------------------------------


def test_round_robin_cycles_through_all_nodes_in_name_order_whatever_their_order() -> None:
    pol = make("round_robin")
    nodes = [node_view(n) for n in ("c", "a", "e", "b", "d")]
    assert [choose(pol, nodes).node for _ in range(12)] == [*"abcdeabcdeab"]


def test_round_robin_skips_missing_nodes_and_picks_up_new_ones_in_name_order() -> None:
    pol = make("round_robin")
    nodes = {n: node_view(n) for n in ("n0", "n1", "n2", "n3")}
    assert [choose(pol, list(nodes.values())).node for _ in range(2)] == ["n0", "n1"]
    without_n2 = [nodes[n] for n in ("n3", "n0", "n1")]
    assert [choose(pol, without_n2).node for _ in range(4)] == ["n3", "n0", "n1", "n3"]
    assert choose(pol, [*without_n2, node_view("n30")]).node == "n30"  # "n3" < "n30"
    only_n1 = [nodes["n1"]]
    assert [choose(pol, only_n1).node for _ in range(2)] == ["n1", "n1"]


@settings(max_examples=50, deadline=None)
@given(names=st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=6, unique=True), rounds=st.integers(1, 4))
def test_round_robin_gives_every_node_one_turn_per_round(names: list[str], rounds: int) -> None:
    pol = make("round_robin")
    nodes = [node_view(n) for n in names]
    got = [choose(pol, nodes).node for _ in range(rounds * len(names))]
    assert got == sorted(names) * rounds


# -- random ----------------------------------------------------------------------------------------------------------


def test_random_is_uniform_over_the_nodes_over_20k_draws() -> None:
    pol = make("random", 20231116)
    nodes = [node_view(f"n{i}", free_vram_gb=1.0 + 15 * i, running=3 * i) for i in range(5)]  # load is ignored
    draws = 20_000
    counts = collections.Counter(choose(pol, nodes).node for _ in range(draws))
    assert set(counts) == {v.name for v in nodes}
    for c in counts.values():
        assert c / draws == pytest.approx(0.2, abs=0.015), counts
    assert dict(pol.choose(nodes, None).scores) == {v.name: 0.2 for v in nodes}


# -- least_outstanding ---------------------------------------------------------------------------------------------


def test_least_outstanding_picks_fewest_running_plus_waiting_then_more_free_kv_then_name() -> None:
    pol = make("least_outstanding")
    a = node_view("a", running=1, waiting=2, kv_free_kb=9e6)
    b = node_view("b", running=0, waiting=2, kv_free_kb=1e6)
    c = node_view("c", running=2, waiting=0, kv_free_kb=3e6)
    d = node_view("d", running=2, waiting=0, kv_free_kb=3e6)
    assert pol.choose([a, b, c], None).node == "c"  # b and c tie at 2: c has more free KV
    assert pol.choose([d, a, c], None).node == "c"  # c and d tie on both: name
    assert pol.choose([a, node_view("z", running=0, waiting=1, kv_free_kb=0.0)], None).node == "z"
    assert dict(pol.choose([a, b, c], None).scores) == {"a": 3.0, "b": 2.0, "c": 2.0}


@settings(max_examples=100, deadline=None)
@given(specs=LIVE_NODES)
def test_least_outstanding_never_picks_a_node_with_more_work_than_another(specs: list[Any]) -> None:
    nodes = live_views(specs)
    chosen = next(v for v in nodes if v.name == make("least_outstanding").choose(nodes, None).node)
    for v in nodes:
        assert outstanding(chosen) <= outstanding(v)
        if outstanding(v) == outstanding(chosen):
            assert (-chosen.kv_free_kb, chosen.name) <= (-v.kv_free_kb, v.name)


# -- power_of_two -------------------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(specs=st.lists(LIVE_NODE, min_size=2, max_size=8), seed=st.integers(0, 2**32))
def test_power_of_two_keeps_the_less_loaded_of_two_distinct_samples(specs: list[Any], seed: int) -> None:
    nodes = live_views(specs)
    load = {v.name: float(outstanding(v)) for v in nodes}
    pol = make("power_of_two", seed)
    for _ in range(10):
        ch = pol.choose(nodes, None)
        assert len(ch.scores) == 2  # two distinct samples
        assert ch.node is not None and ch.node in ch.scores
        assert {n: load[n] for n in ch.scores} == dict(ch.scores)
        assert ch.scores[ch.node] == min(ch.scores.values())  # never the worse of the two


def test_power_of_two_with_one_node_takes_it_without_a_draw() -> None:
    ch = make("power_of_two").choose([node_view("only", running=7)], None)
    assert (ch.node, ch.draw, dict(ch.scores)) == ("only", -1.0, {"only": 7.0})


def balls_into_bins(name: str, seed: int, bins: int = 100, balls: int = 1000) -> int:
    """Max load after placing `balls` one by one on `bins` nodes whose running count grows with each ball."""
    pol = make(name, seed)
    views = {f"b{i:03d}": node_view(f"b{i:03d}") for i in range(bins)}
    for _ in range(balls):
        node = pol.choose(list(views.values()), None).node
        assert node is not None
        views[node] = replace(views[node], running=views[node].running + 1)
    assert sum(v.running for v in views.values()) == balls
    return max(v.running for v in views.values())


def test_power_of_two_choices_has_a_much_lower_max_load_than_one_random_choice() -> None:
    """Balls into bins (Azar et al.; Mitzenmacher): 1000 balls in 100 bins give a max load of about
    m/n + sqrt(2 (m/n) ln n) ~ 19 with one random choice but m/n + ln ln n / ln 2 + O(1) ~ 12 with the better of two
    (measured: random 16-22, power of two 12 on ten seeds)."""
    seeds = range(5)
    one = [balls_into_bins("random", s) for s in seeds]
    two = [balls_into_bins("power_of_two", s) for s in seeds]
    assert max(two) <= 13, two
    assert min(one) >= 15, one
    assert all(t < o for t, o in zip(two, one, strict=True))
    assert sum(one) / len(one) - sum(two) / len(two) >= 4


# -- static_weight --------------------------------------------------------------------------------------------------

STATIC = {"n0": 3.0, "n1": 0.5, "h200-141gb": 2.0}  # n1 (an H200) has its own weight: the node name wins


def test_static_weight_per_node_name_then_gpu_type_then_1() -> None:
    pol = make("static_weight", static_weights=STATIC)
    nodes = [node_view(n) for n in ("n3", "n2", "n1", "n0")]
    ch = pol.choose(nodes, None)
    total = 3.0 + 0.5 + 2.0 + 1.0
    assert dict(ch.scores) == pytest.approx({"n0": 3.0 / total, "n1": 0.5 / total, "n2": 2.0 / total,
                                             "n3": 1.0 / total})


def test_static_weight_frequencies_follow_the_configured_weights_over_20k_draws() -> None:
    pol = make("static_weight", 7, static_weights=STATIC)
    nodes = [node_view(n, free_vram_gb=1.0 + 20 * i, running=5 * i) for i, n in enumerate(("n0", "n1", "n2", "n3"))]
    draws = 20_000
    counts = collections.Counter(choose(pol, nodes).node for _ in range(draws))
    total = 6.5
    for name, w in {"n0": 3.0, "n1": 0.5, "n2": 2.0, "n3": 1.0}.items():
        assert counts[name] / draws == pytest.approx(w / total, abs=0.015), counts


def test_static_weight_zero_is_never_chosen_and_all_zero_gives_no_choice() -> None:
    pol = make("static_weight", static_weights={"n0": 0.0, "a100-80gb": 0.0})
    nodes = [node_view("n0"), node_view("n3"), node_view("n2")]
    assert {choose(pol, nodes).node for _ in range(200)} == {"n2"}
    assert pol.choose([node_view("n0"), node_view("n3")], None).node is None


# -- weighted -----------------------------------------------------------------------------------------------------


def test_weighted_uses_the_configured_latency_decay() -> None:
    a = node_view("a", free_vram_gb=40.0, pcie_util_pct=0.0, avg_latency_ms=0.0)
    b = node_view("b", free_vram_gb=40.0, pcie_util_pct=0.0, avg_latency_ms=10.0)
    for k in (0.05, 0.1, 0.0):
        ratio = math.exp(-k * 10.0)
        scores = make("weighted", latency_decay_per_ms=k).choose([a, b], None).scores
        assert scores["b"] / scores["a"] == pytest.approx(ratio, rel=1e-12)
        assert scores["a"] + scores["b"] == pytest.approx(1.0)


def test_weighted_frequencies_follow_w_and_skip_nodes_with_zero_w() -> None:
    nodes = [
        node_view("a", free_vram_gb=60.0, pcie_util_pct=0.0, avg_latency_ms=20_000.0),  # W underflows to 0.0 ...
        node_view("b", free_vram_gb=20.0, pcie_util_pct=0.0, avg_latency_ms=20_010.0),  # ... for both
        node_view("c", free_vram_gb=70.0, pcie_util_pct=100.0, avg_latency_ms=0.0),  # saturated link: W = 0
    ]
    pol = make("weighted", 3)
    expected_a = 1.0 / (1.0 + math.exp(-0.05 * 10.0) / 3.0)
    counts = collections.Counter(choose(pol, nodes).node for _ in range(10_000))
    assert counts["c"] == 0
    assert counts["a"] / 10_000 == pytest.approx(expected_a, abs=0.02)


# -- kv_aware -------------------------------------------------------------------------------------------------------

PROMPT_BLOCKS = 64  # a 1024-token prompt in blocks of 16 tokens


def prompt(tag: int, blocks: int = PROMPT_BLOCKS, **over: Any) -> RequestEvent:
    return request(in_tokens=blocks * BLOCK_TOKENS, prefix_hashes=tuple(range(tag, tag + blocks)), **over)


def test_kv_aware_cost_is_uncached_prompt_tokens_plus_decode_weight_times_outstanding() -> None:
    pol = make("kv_aware", kv_aware={"decode_weight_tokens": 100.0})
    pol.observe("b", prompt(0, 40))  # b holds the first 40 blocks of the prefix
    req = request(in_tokens=1030, prefix_hashes=tuple(range(0, 64)))
    ch = pol.choose([node_view("a", running=1), node_view("b", running=2, waiting=1)], req)
    assert dict(ch.scores) == {"a": 1030.0 + 100.0, "b": 1030.0 - 40 * BLOCK_TOKENS + 300.0}
    assert ch.node == "b" and ch.draw == -1.0


def test_kv_aware_follows_the_cached_prefix_to_a_somewhat_busier_node() -> None:
    pol = make("kv_aware")  # decode weight 256 tokens per outstanding sequence
    pol.observe("b", prompt(0))
    follow = prompt(0, PROMPT_BLOCKS + 4)  # the cached 64 blocks and 4 new ones
    nodes = [node_view("a", running=0), node_view("b", running=2, waiting=1)]
    ch = pol.choose(nodes, follow)
    assert ch.node == "b"  # 64 uncached tokens + 3 x 256 = 832 beats 1088 + 0
    assert dict(ch.scores) == {"a": 1088.0, "b": 64.0 + 768.0}


def test_kv_aware_goes_elsewhere_when_the_cached_node_is_much_busier() -> None:
    pol = make("kv_aware")
    pol.observe("b", prompt(0))
    nodes = [node_view("a", running=0), node_view("b", running=4, waiting=1)]
    assert pol.choose(nodes, prompt(0, PROMPT_BLOCKS + 4)).node == "a"  # b: 64 + 5 x 256 = 1344 > 1088


def test_kv_aware_matches_only_the_leading_blocks_of_the_prefix() -> None:
    pol = make("kv_aware", kv_aware={"decode_weight_tokens": 0.0})
    pol.observe("b", prompt(0))
    changed_start = request(in_tokens=1024, prefix_hashes=(999, *range(1, 64)))  # first block differs
    ch = pol.choose([node_view("a"), node_view("b")], changed_start)
    assert dict(ch.scores) == {"a": 1024.0, "b": 1024.0}
    assert ch.node == "a"  # tie: fewer outstanding, then name


def test_kv_aware_ties_go_to_fewer_outstanding_then_name_and_without_a_request_to_least_load() -> None:
    pol = make("kv_aware", kv_aware={"decode_weight_tokens": 0.0})
    nodes = [node_view("b", running=1), node_view("a", running=3), node_view("c", running=1)]
    assert pol.choose(nodes, prompt(0)).node == "b"
    assert make("kv_aware").choose(nodes, None).node == "b"  # cost = 256 x outstanding only


def test_kv_aware_index_is_bounded_per_node_by_config() -> None:
    pol = make("kv_aware", kv_aware={"decode_weight_tokens": 0.0, "index_blocks_per_node": 8})
    pol.observe("b", prompt(0, 16))  # only 8 blocks are remembered: the leading 8 (tail evicted first)
    scores = dict(pol.choose([node_view("a"), node_view("b")], prompt(0, 16)).scores)
    assert scores["b"] == scores["a"] - 8 * BLOCK_TOKENS
