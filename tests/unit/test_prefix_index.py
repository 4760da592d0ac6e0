"""PrefixIndex: which chained prefix-block hashes each node probably holds; leading-match, per-node LRU, forget."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.routing.prefix_index import PrefixIndex

NODES = ("a", "b", "c")
HASHES = st.lists(st.integers(0, 15), max_size=8)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.sampled_from(NODES), HASHES),
        st.tuples(st.just("forget"), st.sampled_from(NODES), st.just([])),
    ),
    max_size=40,
)


def test_match_counts_leading_blocks_and_stops_at_the_first_miss() -> None:
    idx = PrefixIndex(100)
    idx.insert("a", [1, 2, 3, 4])
    assert idx.matched_blocks("a", [1, 2, 3, 4]) == 4
    assert idx.matched_blocks("a", [1, 2, 3, 4, 5, 6]) == 4  # a longer prompt: its first 4 blocks are cached
    assert idx.matched_blocks("a", [1, 2]) == 2
    assert idx.matched_blocks("a", [1, 2, 9, 4]) == 2  # a miss in the middle stops the match ...
    assert idx.matched_blocks("a", [9, 2, 3, 4]) == 0  # ... even when every later block is present
    assert idx.matched_blocks("a", []) == 0
    assert idx.matched_blocks("unknown", [1, 2]) == 0


def test_capacity_evicts_a_prompt_from_its_tail_so_its_head_still_matches() -> None:
    idx = PrefixIndex(4)
    idx.insert("a", [1, 2, 3])
    idx.insert("a", [4, 5])  # 5 blocks > 4: the oldest prompt loses its TAIL block (3), not its head
    assert idx.size("a") == 4
    assert idx.matched_blocks("a", [1, 2, 3]) == 2
    assert idx.matched_blocks("a", [4, 5]) == 2
    idx.insert("a", [6, 7])  # then 2 and 1 go: nothing of the first prompt is left
    assert idx.matched_blocks("a", [1]) == 0
    assert idx.matched_blocks("a", [4, 5]) == idx.matched_blocks("a", [6, 7]) == 2


def test_reinserted_blocks_are_touched_and_survive_eviction() -> None:
    idx = PrefixIndex(4)
    idx.insert("a", [1, 2, 3, 4])
    idx.insert("a", [1, 2])  # a request with the same 2-block prefix was dispatched again: 1 and 2 are recent
    idx.insert("a", [8, 9])  # evicts 4 and 3 (tail first), the least recently used, not 1 and 2
    assert idx.size("a") == 4
    assert idx.matched_blocks("a", [1, 2, 3]) == 2
    assert idx.matched_blocks("a", [3]) == idx.matched_blocks("a", [4]) == 0
    assert idx.matched_blocks("a", [8, 9]) == 2


def test_a_repeated_hash_is_stored_once() -> None:
    idx = PrefixIndex(10)
    idx.insert("a", [7, 7, 7])
    idx.insert("a", [7])
    assert idx.size("a") == 1


def test_nodes_are_isolated() -> None:
    idx = PrefixIndex(2)
    idx.insert("a", [1, 2])
    idx.insert("b", [3, 4])
    idx.insert("b", [5, 6])  # b evicts its own blocks only
    assert idx.matched_blocks("a", [1, 2]) == 2
    assert idx.matched_blocks("b", [1, 2]) == 0
    assert idx.matched_blocks("b", [5, 6]) == 2 and idx.matched_blocks("b", [3]) == 0
    assert (idx.size("a"), idx.size("b"), idx.size("c")) == (2, 2, 0)


def test_forget_drops_one_node_only_and_unknown_nodes_are_a_no_op() -> None:
    idx = PrefixIndex(10)
    idx.insert("a", [1, 2])
    idx.insert("b", [1, 2])
    idx.forget("a")
    idx.forget("never-seen")
    assert idx.matched_blocks("a", [1, 2]) == 0 and idx.size("a") == 0
    assert idx.matched_blocks("b", [1, 2]) == 2
    idx.insert("a", [1])  # a node that restarted learns again from scratch
    assert idx.matched_blocks("a", [1, 2]) == 1


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_below_one_is_rejected(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity_blocks must be >= 1"):
        PrefixIndex(capacity)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 6), ops=OPS, queries=st.lists(st.tuples(st.sampled_from(NODES), HASHES), max_size=10))
def test_index_behaves_like_a_per_node_lru_set_with_leading_match(
    capacity: int, ops: list[tuple[str, str, list[int]]], queries: list[tuple[str, list[int]]]
) -> None:
    model: dict[str, OrderedDict[int, None]] = {}
    idx = PrefixIndex(capacity)
    for op, node, hashes in ops:
        if op == "forget":
            idx.forget(node)
            model.pop(node, None)
            continue
        idx.insert(node, hashes)
        lru = model.setdefault(node, OrderedDict())
        for h in reversed(hashes):  # tail first: the head of a prompt is its most recent part
            lru.pop(h, None)
            lru[h] = None
        while len(lru) > capacity:
            lru.popitem(last=False)
    for node in NODES:
        assert idx.size(node) == len(model.get(node, ())) <= capacity
    for node, hashes in queries:
        held = model.get(node, OrderedDict())
        expected = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
        assert idx.matched_blocks(node, hashes) == expected
