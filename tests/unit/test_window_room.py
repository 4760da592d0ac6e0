"""The batcher's window as configured by default: it closes as soon as a node can start a waiting request, never
sends a node more sequences than it runs, lets a request wait for the node its prefix is cached on, and, with late
binding, keeps the queue in the batcher instead of in one engine."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipeline.batching.ledger import ReservationLedger
from pipeline.batching.window import CloseReason, WindowBatcher, _Packing
from pipeline.config import BatcherPolicy, WorkAwareParams
from pipeline.routing.prefix_index import BlockIndex
from pipeline.routing.registry import NodePolicySet, PolicyContext
from tests.unit.builders import node_selection, node_view, pending, request


def batcher(policy: str = "work_aware", blocks: BlockIndex | None = None, caps: float = 1e6,
            nodes: tuple[str, ...] = ("a", "b"), **bp: Any) -> WindowBatcher:
    ctx = PolicyContext(block_tokens=16, blocks=blocks if blocks is not None else BlockIndex())
    pols = NodePolicySet(node_selection(policy=policy), 0, "r0", {}, 16, context=ctx)
    return WindowBatcher(BatcherPolicy(**bp), pols, {n: caps for n in nodes})


def test_a_window_closes_at_once_when_a_busy_node_still_has_room() -> None:
    b = batcher()
    b.offer(pending(request(mem_est_kb=10.0), enqueued_ms=0.0))
    busy = [node_view("a", running=3, kv_free_kb=100.0), node_view("b", running=2, kv_free_kb=100.0)]
    assert b.close_reason(1.0, busy) is CloseReason.ROOM
    full = [node_view("a", running=3, kv_free_kb=5.0), node_view("b", running=2, kv_free_kb=5.0)]
    assert b.close_reason(1.0, full) is not CloseReason.ROOM  # no node can take it now
    assert batcher(close_when_room=False).close_reason(1.0, busy) is not CloseReason.ROOM


def test_a_node_running_its_most_sequences_takes_one_more_then_nothing() -> None:
    b = batcher(policy="least_outstanding")
    for i in range(4):
        b.offer(pending(request(request_id=f"q{i}", mem_est_kb=1.0)))
    nodes = [node_view("a", max_seqs=4, running=4, waiting=0, kv_free_kb=1e6),
             node_view("b", max_seqs=4, running=3, waiting=1, kv_free_kb=1e6)]
    out = b.close(1.0, nodes)
    placed = {plan.node: len(plan.requests) for plan in out.plans}
    assert placed == {"a": 1, "b": 1} and out.waiting == 2  # one queued behind each full engine, the rest here


def test_a_request_waits_in_the_batcher_for_the_node_holding_its_prefix() -> None:
    blocks = BlockIndex()
    hashes = tuple(range(64))
    blocks.stored("a", hashes)  # 64 x 16 = 1,024 tokens cached on a
    b = batcher(blocks=blocks)
    r = request(request_id="q", in_tokens=1024, out_tokens=10, mem_est_kb=1.0, prefix_hashes=hashes)
    b.offer(pending(r, enqueued_ms=0.0))
    # a has no slot now, b has room but would prefill 1,024 tokens and is busy prefilling: q waits for a
    nodes = [node_view("a", max_seqs=2, running=2, waiting=1, kv_free_kb=1e6),
             node_view("b", prefill_tokens=4096, kv_free_kb=1e6)]
    out = b.close(1.0, nodes)
    assert out.plans == () and out.waiting == 1
    # a frees a slot: q goes there
    nodes[0] = node_view("a", max_seqs=2, running=1, kv_free_kb=1e6)
    out = b.close(2.0, nodes)
    assert [(plan.node, len(plan.requests)) for plan in out.plans] == [("a", 1)]


def test_a_node_with_nothing_to_prefill_takes_a_request_unless_its_cheapest_node_saves_more_than_the_idle_margin(
) -> None:
    blocks = BlockIndex()
    hashes = tuple(range(64))
    blocks.stored("a", hashes)
    r = request(request_id="q", in_tokens=1024, out_tokens=10, mem_est_kb=1.0, prefix_hashes=hashes)
    full_a = node_view("a", max_seqs=2, running=2, waiting=1, kv_free_kb=1e6)
    idle_b = node_view("b", kv_free_kb=1e6)
    probe = batcher(blocks=blocks).policies.get("work_aware")
    costs = probe.costs([full_a, idle_b], r)
    saving = costs["b"] - costs["a"]  # what waiting for a (its prefix cached) saves over prefilling on b now
    assert saving > 0
    for margin, placed in ((saving * 2, ["b"]), (saving / 2, [])):
        b = WindowBatcher(BatcherPolicy(), NodePolicySet(
            node_selection(work_aware=WorkAwareParams(idle_margin_ms=margin)), 0, "r0", {}, 16,
            context=PolicyContext(block_tokens=16, blocks=blocks)), {"a": 1e6, "b": 1e6})
        b.offer(pending(r, enqueued_ms=0.0))
        assert [plan.node for plan in b.close(1.0, [full_a, idle_b]).plans] == placed
    b = batcher(blocks=blocks)
    b.offer(pending(r, enqueued_ms=0.0))
    busy_b = node_view("b", prefill_tokens=4096, kv_free_kb=1e6)
    assert b.close(1.0, [full_a, busy_b]).waiting == 1
    out = b.close(30_000.0, [full_a, busy_b])  # past max_wait_ms (20 s): wherever there is room
    assert [plan.node for plan in out.plans] == ["b"]


def test_late_binding_holds_requests_while_every_node_has_its_prefill_horizon_queued() -> None:
    b = batcher(policy="least_outstanding", late_binding="all", max_queued_prefill_tokens=1000)
    for i in range(3):
        b.offer(pending(request(request_id=f"q{i}", in_tokens=600, mem_est_kb=1.0)))
    nodes = [node_view("a", prefill_tokens=1200, kv_free_kb=1e6), node_view("b", prefill_tokens=0, kv_free_kb=1e6)]
    assert b.close_reason(1.0, nodes) is CloseReason.NODE_IDLE
    out = b.close(1.0, nodes)
    # b takes two (0 + 600 < 1000, then 1200 >= 1000: no more); a is over its horizon; one waits here
    assert [(plan.node, len(plan.requests)) for plan in out.plans] == [("b", 2)] and out.waiting == 1
    # the same without late binding: everything goes out at once
    eager = batcher(policy="least_outstanding", late_binding="none", max_queued_prefill_tokens=1000)
    for i in range(3):
        eager.offer(pending(request(request_id=f"q{i}", in_tokens=600, mem_est_kb=1.0)))
    assert eager.close(1.0, nodes).waiting == 0


def test_reservations_in_flight_count_their_prompts_as_queued_prefill() -> None:
    ledger = ReservationLedger()
    ledger.record("a", "5-0", 100.0, 2, 3000)
    v = ledger.apply(node_view("a", kv_free_kb=1000.0, prefill_tokens=500), last_admitted="4-0")
    assert (v.kv_free_kb, v.waiting, v.prefill_tokens) == (900.0, 2, 3500)
    assert ledger.apply(node_view("a", prefill_tokens=500), last_admitted="5-0").prefill_tokens == 500


def test_work_aware_holds_only_requests_cached_nowhere_smallest_first_until_they_age() -> None:
    """With `late_binding: policy`: a work_aware request whose prefix no node has cached waits in the batcher
    while every node has its prefill horizon queued, and the held ones go smallest first; one with a cached prefix
    goes at once to its node; a held one that waited `late_age_after_windows` windows goes wherever memory and a
    slot allow."""
    blocks = BlockIndex()
    hashes = tuple(range(64))
    blocks.stored("a", hashes)
    b = batcher(blocks=blocks, late_binding="policy", max_queued_prefill_tokens=1000, late_age_after_windows=3)
    b.offer(pending(request(request_id="big", in_tokens=900, mem_est_kb=9.0)))
    b.offer(pending(request(request_id="hit", in_tokens=1024, mem_est_kb=5.0, prefix_hashes=hashes)))
    b.offer(pending(request(request_id="small", in_tokens=100, mem_est_kb=1.0)))
    busy = [node_view("a", prefill_tokens=2000, kv_free_kb=1e6), node_view("b", prefill_tokens=2000, kv_free_kb=1e6)]
    out = b.close(1.0, busy)
    assert [(plan.node, [q.request.request_id for q in plan.requests]) for plan in out.plans] == [("a", ["hit"])]
    assert out.waiting == 2
    # b drains below its horizon: the small one goes first (it arrived last), then the big one (100 < 1000)
    nodes = [busy[0], node_view("b", prefill_tokens=0, kv_free_kb=1e6)]
    out = b.close(2.0, nodes)
    assert [(plan.node, [q.request.request_id for q in plan.requests]) for plan in out.plans] == [
        ("b", ["small", "big"])]
    # held long enough, a request ages and no longer waits for a node under its horizon
    b = batcher(blocks=blocks, late_binding="policy", max_queued_prefill_tokens=1000, late_age_after_windows=3)
    b.offer(pending(request(request_id="big", in_tokens=900, mem_est_kb=9.0)))
    for k in range(2):
        assert b.close(float(k), busy).waiting == 1
    out = b.close(10.0, busy)  # its third window
    assert out.waiting == 0 and [q.request.request_id for plan in out.plans for q in plan.requests] == ["big"]


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 400), st.integers(1, 3000), st.sampled_from(["m", "m", "x", "other"]),
                             st.booleans(), st.integers(0, 50)), min_size=1, max_size=60),
    views=st.lists(st.tuples(st.sampled_from([0, 4000, 9000, 20_000]), st.integers(0, 600), st.integers(0, 5)),
                   min_size=2, max_size=2),
    horizon=st.sampled_from([0, 8192]),
    late_binding=st.sampled_from(["none", "policy", "all"]),
    b_serves=st.sampled_from(["m", "x"]),
)
@example(sizes=[(10, 100, "m", False, 0), (20, 100, "m", True, 0)], views=[(9000, 500, 1), (9000, 500, 1)],
         horizon=8192, late_binding="policy", b_serves="m")
@example(sizes=[(5, 100, "m", False, 0), (100, 100, "m", False, 1), (10, 100, "m", False, 2)],
         views=[(9000, 50, 1), (9000, 500, 1)],
         horizon=8192, late_binding="policy", b_serves="x")
def test_skipping_requests_known_to_find_no_node_changes_no_close(
    sizes: list[tuple[int, int, str, bool, int]], views: list[tuple[int, int, int]], horizon: int, late_binding: str,
    b_serves: str,
) -> None:
    """A close remembers, per model and per hold, the smallest request that found no node, and skips the larger ones
    for the rest of the close, because placing only takes room (a flood holds thousands behind full nodes: each close
    tried every one of them). The closes are the same with and without the shortcut: the same plans, the same choices,
    the same requests left waiting, over a sequence of closes with cached prefixes, two models and aged requests.
    The examples: a held request's miss must not skip a later one that is not held (its prefix is cached), and an
    aged request too large for the nodes of its model must not skip a smaller one after it (aged ones go oldest
    first)."""
    blocks = BlockIndex()
    blocks.stored("a", tuple(range(8)))

    def run(skip: bool) -> list[Any]:
        _Packing.skip_known_misses = skip
        try:
            b = WindowBatcher(BatcherPolicy(late_binding=late_binding, max_queued_prefill_tokens=horizon,
                                            late_age_after_windows=3, age_after_windows=3),
                              NodePolicySet(node_selection(policy="work_aware"), 0, "r0", {}, 16,
                                            context=PolicyContext(block_tokens=16, blocks=blocks)),
                              {"a": 500.0, "b": 500.0}, node_models={"a": frozenset({"m"}), "b": frozenset({b_serves})})
            for i, (mem, tokens, model, cached, t) in enumerate(sizes):
                b.offer(pending(request(request_id=f"q{i}", mem_est_kb=float(mem), in_tokens=tokens, model=model,
                                        arrival_ms=float(t), prefix_hashes=tuple(range(4)) if cached else ()),
                                enqueued_ms=float(t)))
            nodes = [node_view(n, prefill_tokens=p, kv_free_kb=float(free), max_seqs=4, running=run_)
                     for n, (p, free, run_) in zip(("a", "b"), views, strict=True)]
            seen = []
            for k in range(5):
                out = b.close(100.0 * (k + 1), nodes)
                seen.append(([(plan.node, [q.request.request_id for q in plan.requests],
                               [(c.node, c.request_ids) for c in plan.choices]) for plan in out.plans],
                             sorted(p.request.request_id for p in b.pending), [r.reason for r in out.rejections]))
            return seen
        finally:
            _Packing.skip_known_misses = True

    assert run(True) == run(False)
