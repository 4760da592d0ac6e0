"""pipeline/sequences.py: the version rule and the node lifecycle table."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from pipeline.sequences import (
    NODE_TRANSITIONS,
    Delivered,
    Intake,
    NodeState,
    NodeTrigger,
    intake,
    intake_batch,
    node_transition,
)


def test_node_lifecycle() -> None:
    A, D, X = NodeState.ACTIVE, NodeState.DRAINING, NodeState.DEAD
    assert node_transition(A, NodeTrigger.UNHEALTHY) is D
    assert node_transition(A, NodeTrigger.HEARTBEAT_LOST) is D
    assert node_transition(D, NodeTrigger.RECOVERED) is A
    assert node_transition(A, NodeTrigger.LEASE_LOST) is X and node_transition(D, NodeTrigger.LEASE_LOST) is X
    assert node_transition(X, NodeTrigger.REGISTERED) is A
    assert node_transition(D, NodeTrigger.UNHEALTHY) is D  # the drain is sent again
    # what must never happen: health samples of a dead node make it draining, or revive it
    assert node_transition(X, NodeTrigger.UNHEALTHY) is None and node_transition(X, NodeTrigger.RECOVERED) is None
    assert node_transition("active", NodeTrigger.REGISTERED) is None  # strings of etcd records work too


def test_only_a_registered_worker_brings_a_dead_node_back() -> None:
    for trigger in NodeTrigger:
        nxt = node_transition(NodeState.DEAD, trigger)
        assert nxt is None or (trigger is NodeTrigger.REGISTERED and nxt is NodeState.ACTIVE)
    for (state, _trigger), nxt in NODE_TRANSITIONS.items():
        assert isinstance(state, NodeState) and isinstance(nxt, NodeState)


def test_version_rule_examples() -> None:
    new, resume = Delivered("a", 2), Delivered("a", 2, resume=True)
    assert intake(new, None, done=True, cancelled=False, refusal="") is Intake.SKIP
    assert intake(new, None, done=False, cancelled=True, refusal="") is Intake.CANCEL
    assert intake(new, None, done=False, cancelled=False, refusal="too long") is Intake.REFUSE
    assert intake(new, None, done=False, cancelled=False, refusal="") is Intake.START
    assert intake(new, 2, done=False, cancelled=False, refusal="") is Intake.JOIN
    assert intake(new, 3, done=False, cancelled=False, refusal="") is Intake.JOIN
    assert intake(new, 1, done=False, cancelled=False, refusal="") is Intake.IGNORE
    assert intake(resume, 2, done=False, cancelled=False, refusal="") is Intake.STALE
    assert intake(resume, 1, done=False, cancelled=False, refusal="") is Intake.REPLACE
    assert intake(resume, 1, done=False, cancelled=True, refusal="x") is Intake.REPLACE  # running: no cancel/refuse


@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 4), st.booleans()), max_size=12),
       st.dictionaries(st.sampled_from("abc"), st.integers(1, 4)))
def test_a_node_never_runs_two_versions_nor_an_older_one(reqs: list[tuple[str, int, bool]],
                                                         held: dict[str, int]) -> None:
    delivered = [Delivered(r, v, resume) for r, v, resume in reqs]
    running = dict(held)
    for d, decision in zip(delivered, intake_batch(delivered, held, set(), set(), {}), strict=True):
        before = running.get(d.request_id)
        if decision in (Intake.START, Intake.REPLACE):
            assert before is None or d.version > before
            running[d.request_id] = d.version
        else:
            assert before is not None  # without markers or refusals, only a held request is not started
    for rid, v in held.items():
        assert running[rid] >= v  # versions only go up


def test_finished_requests_are_never_started_again() -> None:
    for version, resume, held in itertools.product((1, 2, 5), (False, True), (None, 1, 9)):
        assert intake(Delivered("r", version, resume), held, done=True, cancelled=False, refusal="") is Intake.SKIP
