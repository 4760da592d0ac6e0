"""plan_migrations: where the live sequences of a failing node go.

The promises checked (pipeline/failover.py): targets are active nodes other than the failing one that serve the
sequence's model; the failing node's own rack is used first, other racks only when the rack has no room for the
sequence; the biggest sequences are placed first, each on the fitting node with the most free KV; no node is given
more KV than it has free; every sequence gets exactly one move (dst None: not placed), carrying its next version;
the plan is a pure function of its inputs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.failover import LiveSequence, Migration, plan_migrations
from pipeline.routing.views import NodeView
from tests.unit.builders import node_view

SRC = "src"
M = "qwen2-7b"


def seq(seq_id: str, mem: float, model: str = M, version: int = 1) -> LiveSequence:
    return LiveSequence(seq_id, version, model, mem)


def node(name: str, free: float, active: bool = True) -> NodeView:
    return node_view(name, kv_free_kb=free, active=active)


def serving(*names: str, model: str = M) -> dict[str, frozenset[str]]:
    return {n: frozenset({model}) for n in names}


def dsts(plan: Sequence[Migration]) -> dict[str, str | None]:
    return {m.seq_id: m.dst for m in plan}


# -- examples -------------------------------------------------------------------------------------------------------


def test_no_sequences_no_plan() -> None:
    assert plan_migrations(SRC, [], [node("a", 100.0)], [], serving("a")) == []


def test_each_move_carries_the_next_version_and_the_source() -> None:
    plan = plan_migrations(SRC, [seq("q", 10.0, version=7)], [node("a", 100.0)], [], serving("a"))
    assert plan == [Migration("q", 8, SRC, "a")]


def test_the_failing_node_and_draining_nodes_are_never_targets() -> None:
    same = [node(SRC, 1e9), node("draining", 1e9, active=False), node("a", 50.0)]
    others = [node("gone", 1e9, active=False)]
    plan = plan_migrations(SRC, [seq("q1", 40.0), seq("q2", 40.0)], same, others, serving(SRC, "draining", "a", "gone"))
    assert dsts(plan) == {"q1": "a", "q2": None}  # a takes one; nothing else may take the other


def test_a_node_not_serving_the_model_is_not_a_target() -> None:
    serves = {"a": frozenset({"other-model"}), "b": frozenset({M})}
    plan = plan_migrations(SRC, [seq("q", 10.0)], [node("a", 1e9), node("b", 20.0), node("c", 1e9)], [], serves)
    assert dsts(plan) == {"q": "b"}  # c serves nothing (absent from `serves`)


def test_the_own_rack_is_preferred_even_when_another_rack_has_more_room() -> None:
    plan = plan_migrations(SRC, [seq("q", 10.0)], [node("a", 11.0)], [node("x", 1e9)], serving("a", "x"))
    assert dsts(plan) == {"q": "a"}


def test_other_racks_take_what_the_own_rack_has_no_room_for() -> None:
    same, others = [node("a", 100.0)], [node("x", 60.0), node("y", 80.0)]
    plan = plan_migrations(SRC, [seq("big", 90.0), seq("mid", 50.0), seq("small", 10.0)], same, others,
                           serving("a", "x", "y"))
    # big -> a (10 left); mid does not fit a any more -> y, the roomiest elsewhere; small still fits a
    assert dsts(plan) == {"big": "a", "mid": "y", "small": "a"}


def test_biggest_first_on_the_roomiest_node_places_what_input_order_would_not() -> None:
    # in input order the small one would take b (most room) and leave no node for the big one
    seqs = [seq("small", 30.0), seq("big", 70.0)]
    plan = plan_migrations(SRC, seqs, [node("a", 60.0), node("b", 80.0)], [], serving("a", "b"))
    assert [m.seq_id for m in plan] == ["big", "small"]
    assert dsts(plan) == {"big": "b", "small": "a"}


def test_an_exact_fit_is_taken_and_a_tie_goes_to_the_greater_name() -> None:
    plan = plan_migrations(SRC, [seq("q", 50.0)], [node("a", 50.0)], [], serving("a"))
    assert dsts(plan) == {"q": "a"}
    plan = plan_migrations(SRC, [seq("q", 10.0)], [node("b", 50.0), node("a", 50.0)], [], serving("a", "b"))
    assert dsts(plan) == {"q": "b"}


def test_nothing_fits_everything_is_reported_unplaced() -> None:
    seqs = [seq("q1", 500.0), seq("q2", 300.0)]
    plan = plan_migrations(SRC, seqs, [node("a", 200.0)], [node("x", 250.0)], serving("a", "x"))
    assert plan == [Migration("q1", 2, SRC, None), Migration("q2", 2, SRC, None)]
    assert plan_migrations(SRC, seqs, [], [], {}) == [Migration("q1", 2, SRC, None), Migration("q2", 2, SRC, None)]


def test_a_node_with_negative_free_kv_takes_nothing_not_even_an_empty_sequence() -> None:
    plan = plan_migrations(SRC, [seq("q", 0.0)], [node("a", -5.0)], [], serving("a"))
    assert dsts(plan) == {"q": None}


# -- properties -----------------------------------------------------------------------------------------------------

MODELS = ("m0", "m1")
NAMES = [f"n{i}" for i in range(10)]


@st.composite
def cases(draw: st.DrawFn, integral: bool = True) -> tuple[
    list[LiveSequence], list[NodeView], list[NodeView], dict[str, frozenset[str]]
]:
    """Sequences, the two node tiers (the failing node may be listed, active, with room) and the models served."""
    kb = st.integers(0, 400).map(float) if integral else st.floats(0.0, 400.0)
    free_kb = st.integers(-50, 1200).map(float) if integral else st.floats(-50.0, 1200.0)
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=8, unique=True))
    if draw(st.booleans()):
        names.append(SRC)
    names = draw(st.permutations(names))
    split = draw(st.integers(0, len(names)))
    views = [node_view(n, kv_free_kb=draw(free_kb), active=draw(st.sampled_from([True, True, True, False])))
             for n in names]
    serves = {n: frozenset(draw(st.sets(st.sampled_from(MODELS), min_size=draw(st.sampled_from([0, 1, 1, 1])))))
              for n in names if draw(st.sampled_from([True] * 5 + [False]))}
    ids = draw(st.lists(st.text("abcdef", min_size=1, max_size=3), min_size=draw(st.sampled_from([0, 1, 1])),
                        max_size=25, unique=True))
    seqs = [LiveSequence(i, draw(st.integers(0, 1000)), draw(st.sampled_from(MODELS)), draw(kb)) for i in ids]
    return seqs, views[:split], views[split:], serves


Case = tuple[list[LiveSequence], list[NodeView], list[NodeView], dict[str, frozenset[str]]]


def eligible(views: Sequence[NodeView], serves: Mapping[str, frozenset[str]], model: str) -> list[NodeView]:
    return [v for v in views if v.active and v.name != SRC and model in serves.get(v.name, frozenset())]


def placed_kb(seqs: Sequence[LiveSequence], plan: Sequence[Migration]) -> dict[str, float]:
    mem = {s.seq_id: s.mem_est_kb for s in seqs}
    out: dict[str, float] = defaultdict(float)
    for m in plan:
        if m.dst is not None:
            out[m.dst] += mem[m.seq_id]
    return out


@settings(max_examples=250, deadline=None)
@given(case=cases())
def test_every_sequence_gets_one_move_to_an_allowed_target(case: Case) -> None:
    seqs, same, others, serves = case
    plan = plan_migrations(SRC, seqs, same, others, serves)
    by_id = {s.seq_id: s for s in seqs}
    assert sorted(m.seq_id for m in plan) == sorted(by_id)  # each exactly once: placed or reported not placed
    views = {v.name: v for v in [*same, *others]}
    for m in plan:
        s = by_id[m.seq_id]
        assert (m.version, m.src) == (s.version + 1, SRC)
        if m.dst is not None:
            assert m.dst != SRC
            assert views[m.dst].active  # never a draining / unregistered node
            assert s.model in serves[m.dst]
    # biggest first (ties by id): the order in which they were placed
    assert [m.seq_id for m in plan] == [s.seq_id for s in sorted(seqs, key=lambda q: (-q.mem_est_kb, q.seq_id))]


@settings(max_examples=250, deadline=None)
@given(case=cases())
def test_no_node_is_given_more_kv_than_it_has_free(case: Case) -> None:
    seqs, same, others, serves = case
    plan = plan_migrations(SRC, seqs, same, others, serves)
    free = {v.name: v.kv_free_kb for v in [*same, *others]}
    for n, kb in placed_kb(seqs, plan).items():
        assert kb <= free[n], (n, kb, free[n])  # integral kb: exact sums


@settings(max_examples=200, deadline=None)
@given(case=cases(integral=False))
def test_no_node_is_over_committed_with_fractional_sizes(case: Case) -> None:
    seqs, same, others, serves = case
    plan = plan_migrations(SRC, seqs, same, others, serves)
    free = {v.name: v.kv_free_kb for v in [*same, *others]}
    for n, kb in placed_kb(seqs, plan).items():
        assert kb <= free[n] + 1e-9 * max(1.0, abs(free[n])), (n, kb, free[n])


@settings(max_examples=250, deadline=None)
@given(case=cases())
def test_a_sequence_is_left_out_or_sent_away_only_when_nothing_closer_has_room(case: Case) -> None:
    seqs, same, others, serves = case
    plan = plan_migrations(SRC, seqs, same, others, serves)
    used = placed_kb(seqs, plan)
    left = {v.name: v.kv_free_kb - used.get(v.name, 0.0) for v in [*same, *others]}  # room after the plan
    same_names = {v.name for v in same}
    by_id = {s.seq_id: s for s in seqs}
    for m in plan:
        s = by_id[m.seq_id]
        if m.dst is None:  # room only shrinks, so a node with room for it at the end had room when it was tried
            assert all(left[v.name] < s.mem_est_kb for v in eligible([*same, *others], serves, s.model)), m
        elif m.dst not in same_names:
            assert all(left[v.name] < s.mem_est_kb for v in eligible(same, serves, s.model)), m


@settings(max_examples=250, deadline=None)
@given(case=cases())
def test_each_sequence_goes_to_the_fitting_node_with_the_most_free_kv(case: Case) -> None:
    """Replayed in plan order: the target had the most room among the fitting nodes of its tier then."""
    seqs, same, others, serves = case
    plan = plan_migrations(SRC, seqs, same, others, serves)
    by_id = {s.seq_id: s for s in seqs}
    room = {v.name: v.kv_free_kb for v in [*same, *others]}
    for m in plan:
        if m.dst is None:
            continue
        s = by_id[m.seq_id]
        tier = same if m.dst in {v.name for v in same} else others
        fits = [v.name for v in eligible(tier, serves, s.model) if room[v.name] >= s.mem_est_kb]
        assert m.dst in fits
        assert (room[m.dst], m.dst) == max((room[n], n) for n in fits), (m, {n: room[n] for n in fits})
        room[m.dst] -= s.mem_est_kb


@settings(max_examples=200, deadline=None)
@given(case=cases(), data=st.data())
def test_the_plan_is_deterministic_and_ignores_input_order(case: Case, data: st.DataObject) -> None:
    seqs, same, others, serves = case
    snapshot = (list(seqs), list(same), list(others), dict(serves))
    plan = plan_migrations(SRC, seqs, same, others, serves)
    assert (seqs, same, others, serves) == snapshot  # inputs untouched
    assert plan_migrations(SRC, seqs, same, others, serves) == plan
    shuffled = plan_migrations(SRC, data.draw(st.permutations(seqs)), data.draw(st.permutations(same)),
                               data.draw(st.permutations(others)), dict(reversed(list(serves.items()))))
    assert shuffled == plan


@settings(max_examples=100, deadline=None)
@given(case=cases())
def test_room_the_plan_leaves_cannot_take_a_sequence_it_left_out(case: Case) -> None:
    """Placing what was left out on top of the plan, by hand, must fail too (a second planning pass agrees)."""
    seqs, same, others, serves = case
    plan = plan_migrations(SRC, seqs, same, others, serves)
    used = placed_kb(seqs, plan)
    after = [node_view(v.name, kv_free_kb=v.kv_free_kb - used.get(v.name, 0.0), active=v.active)
             for v in [*same, *others]]
    left_out = [s for s in seqs if dsts(plan)[s.seq_id] is None]
    for s in left_out:
        again = plan_migrations(SRC, [s], after, [], serves)
        assert again[0].dst is None, (s, again)


@pytest.mark.parametrize("mem", [0.0, 1.0])
def test_many_tiny_sequences_spread_by_room(mem: float) -> None:
    # (plan_drain in workers.control.failover passes 0 KB per sequence: all of them go to the roomiest node)
    seqs = [seq(f"q{i:02d}", mem) for i in range(30)]
    plan = plan_migrations(SRC, seqs, [node("a", 100.0), node("b", 90.0)], [], serving("a", "b"))
    counts: dict[str | None, int] = defaultdict(int)
    for m in plan:
        counts[m.dst] += 1
    assert counts == ({"a": 30} if mem == 0.0 else {"a": 20, "b": 10})
