"""Priority classes and fair shares (pipeline/priority.py) through the pure path: admission, the window, the engine
model (SimNode, the `sim` engine's and the simulator's), and the tenants' virtual token counters."""

from __future__ import annotations

import pytest

from pipeline.admission import Admission, ShedReason
from pipeline.config import GatewayConfig
from pipeline.priority import (
    BATCH,
    INTERACTIVE,
    FairQueue,
    PriorityError,
    VirtualTokenCounter,
    class_of,
    parse_class,
)
from pipeline.sim.node import SimSeq
from tests.unit.builders import node_view, pending, request, window_batcher
from tests.unit.test_sim_decisions import node


# -- classes -------------------------------------------------------------------------------------------------------
def test_class_names_parse_and_a_wrong_one_says_which_exist() -> None:
    assert parse_class(None) == parse_class("") == parse_class("Interactive") == INTERACTIVE
    assert parse_class("batch") == parse_class(1) == BATCH
    with pytest.raises(PriorityError, match="allowed: interactive, batch"):
        parse_class("urgent", "X-Priority")
    with pytest.raises(PriorityError):
        parse_class(True)  # type: ignore[arg-type]


def test_a_token_claim_is_a_ceiling_and_a_request_may_always_lower_itself() -> None:
    assert class_of(None, None, None) == INTERACTIVE
    assert class_of(None, BATCH, None) == BATCH  # the tenant's class
    assert class_of(INTERACTIVE, BATCH, None) == INTERACTIVE  # the request's own choice wins over the tenant's
    assert class_of(INTERACTIVE, None, BATCH) == BATCH  # a batch token cannot ask for interactive
    assert class_of(BATCH, None, INTERACTIVE) == BATCH


# -- the virtual token counter ---------------------------------------------------------------------------------------
def test_fair_queue_serves_two_tenants_equal_tokens_whatever_their_demand() -> None:
    q: FairQueue[tuple[str, int]] = FairQueue(lambda x: x[0], lambda x: (100, 50))
    for i in range(300):
        q.push(("heavy", i))
        if i % 3 == 0:
            q.push(("light", i))
    served = {"heavy": 0, "light": 0}
    for _ in range(150):
        served[q.pop()[0]] += 1
    assert served == {"heavy": 75, "light": 75}
    # in order within a tenant
    order = [x for x in q.drain_order() if x[0] == "light"]
    assert order == sorted(order, key=lambda x: x[1])


def test_a_tenant_back_from_idle_earns_no_credit() -> None:
    vtc = VirtualTokenCounter()
    q: FairQueue[tuple[str, int]] = FairQueue(lambda x: x[0], lambda x: (10, 0), vtc)
    for i in range(100):
        q.push(("a", i))
    for _ in range(50):
        q.pop()
    assert vtc.get("a") == 500
    q.push(("b", 0))  # b waited nothing while a was served: it starts at a's counter, not at 0
    assert vtc.get("b") == vtc.get("a")
    got = [q.pop()[0] for _ in range(10)]
    assert got.count("b") == 1 and got.count("a") == 9


def test_drain_order_is_what_pops_would_give_and_remove_keeps_the_rest() -> None:
    q: FairQueue[tuple[str, int]] = FairQueue(lambda x: x[0], lambda x: (x[1], 0))
    for i, t in enumerate("aabbbcab"):
        q.push((t, i + 1))
    dry = list(q.drain_order())
    assert len(dry) == len(q) == 8
    popped = [q.pop() for _ in range(8)]
    assert dry == popped


# -- admission -------------------------------------------------------------------------------------------------------
def test_admission_never_sheds_an_interactive_request_for_batch_work_queued() -> None:
    adm = Admission(GatewayConfig(max_rack_queue=100))
    # 500 queued, 450 of them batch: the interactive request sees 50 ahead of it
    assert adm.decide(500, 10.0, 0.0, batch_queued=450, priority=INTERACTIVE).admit
    v = adm.decide(500, 10.0, 0.0, batch_queued=450, priority=BATCH)
    assert not v.admit and v.reason is ShedReason.RACK_QUEUE
    assert not adm.decide(500, 10.0, 0.0, batch_queued=350, priority=INTERACTIVE).admit


# -- the window -------------------------------------------------------------------------------------------------------
def _req(priority: int = 0, tenant: str = "t", mem: float = 1e6, **kw: object):  # type: ignore[no-untyped-def]
    return pending(request(priority=priority, tenant=tenant, mem_est_kb=mem, **kw))


def test_batch_requests_wait_for_free_slots_after_interactive_ones_and_do_not_queue_in_engines() -> None:
    b = window_batcher({"n1": 72e6, "n2": 72e6}, 0, selection={"policy": "round_robin"})
    inter = [_req() for _ in range(3)]
    batch = [_req(BATCH) for _ in range(10)]
    for p in batch + inter:
        b.offer(p)
    assert b.batch_waiting == 10 and b.pending_count == 13
    nodes = [node_view("n1", max_seqs=4, running=2), node_view("n2", max_seqs=4, running=0)]
    out = b.close(0.0, nodes)
    placed = {p.request.request_id: plan.node for plan in out.plans for p in plan.requests}
    assert all(p.request.request_id in placed for p in inter)  # every interactive one, first
    n_batch = sum(1 for p in batch if p.request.request_id in placed)
    # batch work fills the slots left free after the interactive requests, and queues behind no engine
    free = {"n1": 2, "n2": 4}
    for p in inter:
        free[placed[p.request.request_id]] -= 1
    for name in free:
        on = sum(1 for p in batch if placed.get(p.request.request_id) == name)
        assert on == max(0, free[name]), (name, on, free)
    assert n_batch == sum(max(0, f) for f in free.values()) and b.batch_waiting == 10 - n_batch
    assert {c.policy for c in out.choices if c.request_ids[0] in {p.request.request_id for p in batch}} == {
        "batch_fill"}
    # nodes full: batch work stays here and a close is not due
    full = [node_view("n1", max_seqs=4, running=4), node_view("n2", max_seqs=4, running=4)]
    assert b.close_reason(1.0, full).name == "NOT_YET"
    assert b.close(1.0, full).plans == ()
    room = [node_view("n1", max_seqs=4, running=3), node_view("n2", max_seqs=4, running=4)]
    assert b.close_reason(2.0, room).name == "ROOM"


def test_an_interactive_request_takes_the_slots_and_memory_batch_work_holds_when_it_preempts() -> None:
    full = [node_view("n1", max_seqs=4, running=4, kv_free_kb=0.0, batch_seqs=4, batch_kv_kb=8e6)]
    pre = window_batcher({"n1": 72e6}, 0, selection={"policy": "round_robin"})
    p = _req()
    pre.offer(p)
    assert [q.request for plan in pre.close(0.0, full).plans for q in plan.requests] == [p.request]
    hold = window_batcher({"n1": 72e6}, 0, selection={"policy": "round_robin"}, batch_yield="hold")
    hold.offer(_req())
    assert hold.close(0.0, full).plans == ()  # no preemption: it waits for a slot


def test_hold_keeps_a_share_of_slots_free_of_batch_work() -> None:
    b = window_batcher({"n1": 72e6}, 0, selection={"policy": "round_robin"}, batch_yield="hold", batch_hold_slots=0.25)
    for _ in range(10):
        b.offer(_req(BATCH))
    out = b.close(0.0, [node_view("n1", max_seqs=8)])
    assert sum(len(plan.requests) for plan in out.plans) == 6  # 8 slots less ceil(0.25 * 8)


def test_interactive_requests_of_several_tenants_are_placed_least_served_first() -> None:
    b = window_batcher({"n1": 72e6}, 0, selection={"policy": "round_robin"})
    heavy = [_req(tenant="heavy", in_tokens=100, out_tokens=100) for _ in range(9)]
    light = [_req(tenant="light", in_tokens=100, out_tokens=100) for _ in range(3)]
    for p in heavy + light:
        b.offer(p)
    # room for 6: 3 of each, not the 6 smallest or oldest
    out = b.close(0.0, [node_view("n1", max_seqs=5)])
    got = [p.request.tenant for plan in out.plans for p in plan.requests]
    assert sorted(got) == ["heavy"] * 3 + ["light"] * 3


# -- the engine model --------------------------------------------------------------------------------------------------
def test_an_interactive_sequence_is_admitted_ahead_of_batch_ones_and_preempts_one_for_a_slot() -> None:
    n = node(max_num_seqs=2)
    n.submit(SimSeq(1, 100, 50, 1.0, priority=BATCH))
    n.submit(SimSeq(2, 100, 50, 1.0, priority=BATCH))
    n.submit(SimSeq(3, 100, 50, 1.0, priority=BATCH))
    t = n.schedule(0.0) or 0.0  # the two first prefill; both decode after it
    n.finish_phase(t)
    assert n.running == 2 and [s.rid for s in n.waiting] == [3] and n.batch_seqs == 3
    n.submit(SimSeq(4, 100, 5, 1.0))
    assert [s.rid for s in n.waiting] == [4, 3]  # ahead of every batch one
    t = n.schedule(t) or t
    assert any(s.rid == 4 for s in n.prefilling) and n.priority_preemptions == 1
    assert n.waiting[0].rid in (1, 2) and n.batch_seqs == 3  # the preempted one, first of the batch
    res = n.finish_phase(t)
    assert (4, t) in res.first_tokens


def test_without_preemption_an_interactive_sequence_waits_first_in_line() -> None:
    n = node(max_num_seqs=2, preempt_batch=False)
    for rid in (1, 2):
        n.submit(SimSeq(rid, 100, 50, 1.0, priority=BATCH))
    t = n.schedule(0.0) or 0.0
    n.finish_phase(t)
    n.submit(SimSeq(3, 100, 50, 1.0, priority=BATCH))
    n.submit(SimSeq(4, 100, 5, 1.0))
    t = n.schedule(t) or t
    assert n.priority_preemptions == 0 and [s.rid for s in n.waiting] == [4, 3]


def test_aged_requests_of_several_tenants_are_placed_fairly_too_not_oldest_first() -> None:
    """Under sustained overload every request ages: the aged order must be fair as well, or the heavier tenant's
    older requests would take the room in proportion to its demand."""
    b = window_batcher({"n1": 72e6}, 0, selection={"policy": "round_robin"}, age_after_windows=1)
    heavy = [_req(tenant="heavy", arrival_ms=float(i)) for i in range(9)]
    light = [_req(tenant="light", arrival_ms=100.0 + i) for i in range(3)]
    for p in heavy + light:
        b.offer(p)
    full = [node_view("n1", max_seqs=4, running=4, waiting=1)]
    b.close(0.0, full)  # nothing placed: all wait, and age
    b.close(1.0, full)
    out = b.close(2.0, [node_view("n1", max_seqs=5)])
    got = sorted(p.request.tenant for plan in out.plans for p in plan.requests)
    assert got == ["heavy"] * 3 + ["light"] * 3, got
    oldest_heavy = [p.request.arrival_ms for plan in out.plans for p in plan.requests if p.request.tenant == "heavy"]
    assert sorted(oldest_heavy) == [0.0, 1.0, 2.0]  # within a tenant, oldest first


def test_admission_lets_a_tenant_under_its_share_of_a_full_queue_in_and_sheds_the_one_over_it() -> None:
    adm = Admission(GatewayConfig(max_rack_queue=100))
    # 120 queued, 100 of them the heavy tenant's: the light one (20 < 100 / 2) still gets in, the heavy one not
    assert adm.decide(120, 10.0, 0.0, tenant_queued=20, tenants=2).reason is ShedReason.UNDER_SHARE
    assert not adm.decide(120, 10.0, 0.0, tenant_queued=100, tenants=2).admit
    # the queue stays bounded: a tenant at its share of the bound is shed however long the queue
    assert not adm.decide(735, 10.0, 0.0, tenant_queued=50, tenants=2).admit
    assert not adm.decide(120, 10.0, 0.0, tenant_queued=20, tenants=1).admit  # one tenant: the bound alone
    assert not adm.decide(120, 10.0, 0.0).admit  # not known: the bound alone
    # no exemption for batch work: its tenants share through the batchers' batch queue
    assert not adm.decide(120, 10.0, 0.0, tenant_queued=0, tenants=2, priority=BATCH).admit


def test_a_racks_tenant_counts_merge_its_fresh_batchers_and_skip_stale_or_broken_entries() -> None:
    from workers.stores.cluster_view import pending_tokens, tenant_counts

    fields = {b"tenants:b1": b'{"acme": 3, "zeta": 1}', b"ts:b1": b"1000", b"tenants:b2": b'{"acme": 2}',
              b"ts:b2": b"1500", b"tenants:old": b'{"acme": 50}', b"ts:old": b"1", b"tenants:bad": b"{not json",
              b"ts:bad": b"1500", b"batch:b1": b"7", b"batch:b2": b"2"}
    assert tenant_counts(fields, now_ms=2000, stale_ms=1500) == {"acme": 5, "zeta": 1}
    assert pending_tokens(fields, 2000, 1500, "batch") == 9


def test_an_interactive_request_sees_past_batch_prefill_and_with_preemption_past_batch_slots() -> None:
    v = node_view("n1", max_seqs=4, running=3, waiting=2, prefill_tokens=900, kv_free_kb=1e6, batch_seqs=3,
                  batch_kv_kb=6e6, batch_prefill_tokens=700, decode_seqs=3)
    held = v.for_interactive(preempt=False)
    assert (held.prefill_tokens, held.running, held.waiting, held.kv_free_kb) == (200, 3, 2, 1e6)
    pre = v.for_interactive(preempt=True)
    # two of the batch sequences were waiting, one ran: the interactive request sees 2 running, none waiting
    assert (pre.prefill_tokens, pre.running, pre.waiting, pre.kv_free_kb) == (200, 2, 0, 7e6)
    assert pre.decode_seqs == 3  # their decoding still slows every iteration
    plain = node_view("n2")
    assert plain.for_interactive(True) is plain


def test_batch_work_leaves_its_reserve_of_slots_free_in_the_window_and_in_the_engine() -> None:
    from pipeline.batching.window import batch_reserve
    from tests.unit.builders import batcher_policy

    assert batch_reserve(batcher_policy(), 256) == 25  # preempt: 10 %, rounded down
    assert batch_reserve(batcher_policy(), 4) == 0  # a node of few slots keeps none
    assert batch_reserve(batcher_policy(batch_yield="hold"), 4) == 1  # hold: 25 %, rounded up
    n = node(max_num_seqs=8, batch_reserve=2)
    for rid in range(10):
        n.submit(SimSeq(rid, 100, 50, 1.0, priority=BATCH))
    t = n.schedule(0.0) or 0.0
    assert n.running == 6 and len(n.waiting) == 4  # two slots left for interactive arrivals
    n.finish_phase(t)
    n.submit(SimSeq(99, 100, 5, 1.0))
    n.schedule(t)
    assert any(s.rid == 99 for s in n.prefilling) and n.priority_preemptions == 0  # a free slot: no preemption
