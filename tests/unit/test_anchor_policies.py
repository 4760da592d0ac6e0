"""The anchors' policies as baselines, each against its published formula: llm-d's default scheduler profile,
Dynamo's KV router cost, SGLang's cache-aware policy and LMetric's product; and the default, `work_aware`."""

from __future__ import annotations

import random
from typing import Any

import pytest

from pipeline.config import WorkAwareParams, load_config
from pipeline.costmodel import CalibratedCostModel
from pipeline.routing.node_policies.dynamo import Dynamo
from pipeline.routing.node_policies.llm_d import LlmD
from pipeline.routing.node_policies.lmetric import LMetric
from pipeline.routing.node_policies.sglang import Sglang
from pipeline.routing.node_policies.work_aware import WorkAware
from pipeline.routing.prefix_index import BlockIndex, PrefixIndex
from tests.unit.builders import node_view, request

B = 16  # prefix block tokens in these tests


def req(blocks: int = 0, tokens: int | None = None, **kw: Any):  # type: ignore[no-untyped-def]
    return request(in_tokens=tokens if tokens is not None else max(1, blocks) * B, prefix_hashes=tuple(range(blocks)),
                   **kw)


# -- llm-d --------------------------------------------------------------------------------------------------------


def test_llm_d_sums_queue_kv_and_prefix_scores_with_weights_2_2_3() -> None:
    idx = PrefixIndex(1000)
    idx.insert("a", (0, 1))  # a holds the first 2 of the request's 4 blocks
    pol = LlmD(idx, random.Random(0))
    nodes = [node_view("a", waiting=4, kv_usage=0.5), node_view("b", waiting=0, kv_usage=0.2),
             node_view("c", waiting=2, kv_usage=0.0)]
    s = pol.scores(nodes, req(4))
    # queue: (4 - q) / (4 - 0); kv: 1 - usage; prefix: matched / 4
    assert s == pytest.approx({"a": 2 * 0.0 + 2 * 0.5 + 3 * 0.5, "b": 2 * 1.0 + 2 * 0.8, "c": 2 * 0.5 + 2 * 1.0})
    assert pol.choose(nodes, req(4)).node == "b"


def test_llm_d_equal_queues_score_one_each_and_ties_are_drawn() -> None:
    pol = LlmD(PrefixIndex(10), random.Random(0))
    nodes = [node_view(n, waiting=3) for n in ("a", "b", "c")]
    picks = {pol.choose(nodes, req(0)).node for _ in range(60)}
    assert picks == {"a", "b", "c"}
    ch = pol.choose(nodes, req(0))
    assert 0.0 <= ch.draw < 1.0 and set(ch.scores.values()) == {2.0 + 2.0}


def test_llm_d_records_every_block_of_a_placed_request_for_the_chosen_pod() -> None:
    idx = PrefixIndex(100)
    pol = LlmD(idx, random.Random(0))
    r = req(3)
    pol.observe("b", r)
    assert idx.matched_blocks("b", r.prefix_hashes) == 3 and idx.matched_blocks("a", r.prefix_hashes) == 0


# -- Dynamo --------------------------------------------------------------------------------------------------------


def test_dynamo_cost_is_prefill_blocks_plus_decode_blocks() -> None:
    blocks = BlockIndex()
    blocks.stored("a", (0, 1, 2))
    pol = Dynamo(blocks, B, random.Random(0))
    a = node_view("a", prefill_tokens=64, decode_tokens=160)
    b = node_view("b", prefill_tokens=0, decode_tokens=32)
    c = pol.costs([a, b], req(4))
    # a: new = 64 - 3*16 = 16 tokens; prefill = (64 + 16)/16 = 5, decode = (160 + 64 + 16)/16 = 15
    # b: new = 64; prefill = 64/16 = 4, decode = (32 + 0 + 64)/16 = 6
    assert c == pytest.approx({"a": 20.0, "b": 10.0})
    assert pol.choose([a, b], req(4)).node == "b"


def test_dynamo_ties_go_to_the_smaller_tree_then_to_a_draw() -> None:
    blocks = BlockIndex()
    blocks.stored("a", (100, 101))
    pol = Dynamo(blocks, B, random.Random(0))
    nodes = [node_view("a"), node_view("b")]
    ch = pol.choose(nodes, req(2, tokens=32))  # same cost on both (nothing of this prompt cached anywhere)
    assert ch.node == "b" and ch.draw == -1.0
    blocks.stored("b", (200, 201))
    assert {pol.choose(nodes, req(2, tokens=32)).node for _ in range(40)} == {"a", "b"}


# -- SGLang --------------------------------------------------------------------------------------------------------


def test_sglang_balances_by_load_only_when_both_thresholds_are_crossed() -> None:
    idx = PrefixIndex(1000)
    idx.insert("a", tuple(range(8)))
    pol = Sglang(idx, B)
    r = req(8)
    # abs gap 70 > 64 and 80 > 1.5 x 10: imbalanced, least loaded wins whatever the cache
    assert pol.choose([node_view("a", running=80), node_view("b", running=10)], r).node == "b"
    # abs gap 60 <= 64: balanced, the cache decides
    assert pol.choose([node_view("a", running=70), node_view("b", running=10)], r).node == "a"
    # gap 70 > 64 but 210 is not above 1.5 x 140: balanced
    assert pol.choose([node_view("a", running=210), node_view("b", running=140)], r).node == "a"


def test_sglang_below_the_cache_threshold_picks_the_smallest_tree() -> None:
    idx = PrefixIndex(1000)
    idx.insert("a", (0, *range(50, 60)))  # a: a big tree, 1 block of this prompt
    idx.insert("b", (200,))
    pol = Sglang(idx, B)
    r = req(4)  # 1 of 4 blocks matched on a: 25% <= 30%
    assert pol.choose([node_view("a"), node_view("b")], r).node == "b"
    pol.observe("b", r)
    assert idx.matched_blocks("b", r.prefix_hashes) == 4


# -- LMetric -------------------------------------------------------------------------------------------------------


def test_lmetric_multiplies_new_prefill_tokens_by_batch_size_counting_the_request() -> None:
    blocks = BlockIndex()
    blocks.stored("a", (0, 1, 2))
    pol = LMetric(blocks, B)
    a = node_view("a", running=9)  # (64 - 48) x 10 = 160
    b = node_view("b", running=1, waiting=1)  # 64 x 3 = 192
    ch = pol.choose([a, b], req(4))
    assert ch.node == "a" and ch.scores == {"a": 160.0, "b": 192.0}


def test_lmetric_rotates_through_tied_nodes() -> None:
    blocks = BlockIndex()
    for n in ("a", "b", "c"):
        blocks.stored(n, (0, 1))
    pol = LMetric(blocks, B)
    nodes = [node_view(n) for n in ("a", "b", "c")]
    assert [pol.choose(nodes, req(2)).node for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


# -- work_aware ----------------------------------------------------------------------------------------------------


CFG = load_config()
H100 = CalibratedCostModel.for_node(CFG, CFG.nodes()[0])


def work_aware(blocks: BlockIndex | None = None, **params: Any) -> WorkAware:
    return WorkAware(WorkAwareParams(**params), lambda _n: H100, 512, random.Random(0),
                     blocks=blocks if blocks is not None else BlockIndex())


def long_req(blocks: int, **kw: Any):  # type: ignore[no-untyped-def]
    return request(in_tokens=blocks * 512, out_tokens=50, prefix_hashes=tuple(range(blocks)), **kw)


def test_work_aware_prices_the_prefill_queue_in_milliseconds_of_the_node_cost_model() -> None:
    pol = work_aware(others_weight=0.0, e2e_weight=0.0)
    r = long_req(8)
    idle = node_view("idle", pcie_util_pct=0.0)
    queued = node_view("queued", prefill_tokens=16384, pcie_util_pct=0.0)
    c = pol.choose([idle, queued], r)
    assert c.node == "idle"
    # the queue ahead costs what the cost model says two full 8k chunks take on an H100
    assert c.scores["queued"] - c.scores["idle"] == pytest.approx(2 * H100.step_ms([8192], 0, 0), rel=0.05)
    # a busy host link (the seed W's 1 - pcie/100) divides the whole cost
    linked = pol.choose([node_view("idle", pcie_util_pct=50.0)], r)
    assert linked.scores["idle"] == pytest.approx(2 * c.scores["idle"])


def test_work_aware_follows_a_cached_prefix_unless_the_queue_there_costs_more_than_it_saves() -> None:
    blocks = BlockIndex()
    blocks.stored("warm", tuple(range(16)))  # the whole 8k-token prompt
    pol = work_aware(blocks)
    r = long_req(16)
    assert pol.choose([node_view("cold"), node_view("warm", prefill_tokens=2048)], r).node == "warm"
    assert pol.choose([node_view("cold"), node_view("warm", prefill_tokens=40_000)], r).node == "cold"


def test_work_aware_gives_a_slow_node_work_in_proportion_to_its_speed() -> None:
    pol = work_aware(others_weight=0.0, e2e_weight=0.0)
    r = long_req(4)
    # the same queue on both: the 1.5x slower node costs 1.5x as much
    c = pol.choose([node_view("fast", prefill_tokens=8192), node_view("slow", prefill_tokens=8192, slowdown=1.5)],
                   r)
    assert c.node == "fast" and c.scores["slow"] == pytest.approx(1.5 * c.scores["fast"])
    # ... and is still chosen when the fast one has more than 1.5x its queue
    assert pol.choose([node_view("fast", prefill_tokens=24576), node_view("slow", prefill_tokens=8192,
                                                                          slowdown=1.5)], r).node == "slow"


def test_work_aware_prices_memory_pressure_above_the_soft_limit_only_when_asked() -> None:
    r = long_req(1, mem_est_kb=1000.0)
    full = node_view("full", kv_capacity_kb=100_000.0, kv_free_kb=2_000.0)  # 99% used after this request
    roomy = node_view("roomy", kv_capacity_kb=100_000.0, kv_free_kb=60_000.0, prefill_tokens=4096)
    assert work_aware(others_weight=0.0, e2e_weight=0.0, kv_weight_ms=2000.0).choose([full, roomy], r).node == "roomy"
    # off by default (WorkAwareParams.kv_weight_ms): the node that starts it first, the batcher's budget keeping
    # its memory
    assert work_aware(others_weight=0.0, e2e_weight=0.0).choose([full, roomy], r).node == "full"


def test_work_aware_waits_for_its_busy_node_only_while_no_node_would_idle_and_not_too_long() -> None:
    blocks = BlockIndex()
    blocks.stored("warm", tuple(range(16)))
    pol = work_aware(blocks, max_wait_ms=1000.0)
    r = long_req(16)
    warm = node_view("warm", max_seqs=2, running=2, waiting=1)  # no slot: the batcher has no room there now
    busy_cold = node_view("cold", prefill_tokens=4096)
    assert pol.waits_for([warm, busy_cold], [busy_cold], r, waited_ms=10.0)
    assert not pol.waits_for([warm, busy_cold], [busy_cold], r, waited_ms=1000.0)
    idle_cold = node_view("cold")
    assert not pol.waits_for([warm, idle_cold], [idle_cold], r, waited_ms=10.0)


def test_work_aware_with_a_temperature_samples_near_ties_and_is_seeded() -> None:
    pol = work_aware(temperature_ms=1e6)
    nodes = [node_view("a"), node_view("b", prefill_tokens=512)]
    picks = [pol.choose(nodes, long_req(2)).node for _ in range(100)]
    assert set(picks) == {"a", "b"}
    again = work_aware(temperature_ms=1e6)
    assert [again.choose(nodes, long_req(2)).node for _ in range(100)] == picks
