"""Prefix caching: the engine's tiered prefix cache and its block events, the precise block index they feed, and the
ideal hit rate of a trace (an unbounded cache)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.kv.prefix_cache import PrefixCache, ideal_hit_rate
from pipeline.routing.prefix_index import BlockIndex


def test_lookup_counts_the_leading_run_across_both_tiers_and_stops_at_the_first_miss() -> None:
    c = PrefixCache(gpu_blocks=2, host_blocks=2)
    c.insert([1, 2, 3])  # 3 is inserted first (tail first), so it is the LRU block: it goes to host memory
    assert 3 in c.host and {1, 2} <= set(c.gpu)
    hit = c.lookup([1, 2, 3, 4])
    assert (hit.blocks, hit.host_blocks) == (3, 1)
    assert c.lookup([9, 1]).blocks == 0  # the run stops at the first miss


def test_eviction_goes_gpu_to_host_to_gone_and_reports_each_change_once() -> None:
    events: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    c = PrefixCache(gpu_blocks=2, host_blocks=1, listener=lambda s, r: events.append((s, r)))
    c.insert([1, 2])
    c.insert([5, 6])  # 1, 2 leave GPU memory; one fits in host memory, the other is gone
    assert events[0] == ((2, 1), ())
    stored, removed = events[1]
    assert stored == (6, 5) and len(removed) == 1
    assert len(c) == 3 and removed[0] not in c
    c.insert([5, 6])  # already held: nothing to report
    assert len(events) == 2
    c.clear()
    assert events[-1][0] == () and sorted(events[-1][1]) == sorted({1, 2, 5, 6} - set(removed))


def test_a_host_hit_moves_back_to_gpu_memory_without_a_stored_event() -> None:
    events: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    c = PrefixCache(gpu_blocks=1, host_blocks=4, listener=lambda s, r: events.append((s, r)))
    c.insert([1])
    c.insert([2])  # 1 to host
    assert 1 in c.host
    events.clear()
    c.insert([1])  # loaded back: it never left the engine
    assert events == [] and 1 in c.gpu and 2 in c.host


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["store", "remove", "clear"]), st.sampled_from("abc"),
                              st.lists(st.integers(0, 12), max_size=6)), max_size=40),
       query=st.lists(st.integers(0, 12), max_size=8))
def test_block_index_matches_what_each_owner_holds_by_leading_run(
    ops: list[tuple[str, str, list[int]]], query: list[int]
) -> None:
    idx = BlockIndex()
    held: dict[str, set[int]] = {"a": set(), "b": set(), "c": set()}
    for op, owner, hashes in ops:
        if op == "store":
            idx.stored(owner, hashes)
            held[owner] |= set(hashes)
        elif op == "remove":
            idx.removed(owner, hashes)
            held[owner] -= set(hashes)
        else:
            idx.clear(owner)
            held[owner].clear()
    expect = {}
    for owner, hs in held.items():
        k = 0
        for h in query:
            if h not in hs:
                break
            k += 1
        if k:
            expect[owner] = k
    assert idx.matches(query) == expect
    assert {o: idx.size(o) for o in held} == {o: len(hs) for o, hs in held.items()}
    assert idx.owners() == sorted(o for o, hs in held.items() if hs)


def test_ideal_hit_rate_counts_leading_blocks_seen_before_in_tokens() -> None:
    trace = [(1024, (1, 2)), (1024, (1, 2)), (1500, (1, 9, 3)), (10, ())]
    # second: both 512-token blocks, capped at prompt - 1 (one token is always computed); third: block 1 only
    assert ideal_hit_rate(trace, 512) == (1023 + 512) / (1024 + 1024 + 1500 + 10)
    assert ideal_hit_rate([], 512) == 0.0


def test_an_lru_as_large_as_the_trace_reaches_the_ideal_and_a_small_one_does_not() -> None:
    rng = random.Random(1)
    trace = [(2048, tuple(range(rng.randrange(50), rng.randrange(50) + 4))) for _ in range(300)]
    ideal = ideal_hit_rate(trace, 512)

    def lru(blocks: int) -> float:
        c = PrefixCache(blocks)
        hit = total = 0
        for tokens, hashes in trace:
            k = c.lookup(hashes).blocks
            hit += min(tokens - 1, k * 512) if k else 0
            total += tokens
            c.insert(hashes)
        return hit / total

    assert lru(10_000) == ideal
    assert lru(4) < ideal


def test_resize_evicts_the_least_recently_used_down_a_tier_and_reports_what_is_gone() -> None:
    events: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    c = PrefixCache(gpu_blocks=4, host_blocks=1, listener=lambda s, r: events.append((s, r)))
    c.insert([1, 2, 3, 4])  # tail first: 4 is the least recently used, 1 the most
    c.resize(2)
    assert set(c.gpu) == {1, 2} and set(c.host) == {3} and events[-1] == ((), (4,))
    c.resize(0)  # never below one block
    assert c.gpu_capacity == 1 and set(c.gpu) == {1}
    n = len(events)
    c.resize(8)  # growing evicts nothing and reports nothing
    assert len(events) == n and c.gpu_capacity == 8
