"""The version rule, and the lifecycles of a node and of a sequence on a node: one transition table each.

Rules (what the tables below encode; the worker, the monitor and the failover tasks only look them up):

1. Every request carries a version. It starts at 1 and every move (a migration to another node, a requeue to the
   batcher) increments it; the move itself is a compare-and-swap of the sequence's owner record in etcd
   (`workers/stores/etcd.py: SequenceRegistry.move`), so two movers cannot both win.
2. A request that has its final result is never started again (a redelivered batch, a resume that lost the race
   to the old owner's last token): `SKIP`.
3. A request cancelled before it started here gets its final `cancelled` result and never runs: `CANCEL`.
4. A request this node cannot serve (unknown model, prompt over the context, ...) gets a final error: `REFUSE`.
5. A batch delivery of a request this node already runs at the same or a higher version is the same sequence
   delivered again (a claimed entry, two deliveries of one batch): it joins the running one, whose end settles
   both entries (`JOIN`). A *resume* at the same or a lower version is a duplicate or a conflict: refused and
   reported (`STALE`), the running one continues.
6. A resume at a higher version than the one running here wins: the old incarnation is aborted and the new one
   starts (`REPLACE`). A *batch* delivery at a higher version than the one running here is left alone (`IGNORE`):
   the running incarnation finishes and settles, the newer one belongs to whoever moved it. Otherwise a new
   request starts (`START`).

Node lifecycle (the monitor's verdicts; `active` is the absence of a verdict):
- active --unhealthy or health-agent heartbeat lost--> draining (no new work; its sequences migrate)
- draining --recovered (hysteresis, `pipeline/health.py`)--> active
- active or draining --worker lease lost--> dead (its sequences and unstarted batches move)
- dead --a new worker registered--> active
- draining --unhealthy again--> draining: the drain task is sent again (idempotent)
Anything else changes nothing: a dead node's health samples cannot make it "draining", a healthy sample does not
revive a dead node (only a registered worker does).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class NodeState(enum.StrEnum):
    ACTIVE = "active"
    DRAINING = "draining"
    DEAD = "dead"


class NodeTrigger(enum.StrEnum):
    UNHEALTHY = "unhealthy"
    """The health score fell below drain_below."""
    RECOVERED = "recovered"
    """The score stayed above recover_above for recover_samples samples."""
    HEARTBEAT_LOST = "heartbeat_lost"
    """The node's health agent stopped refreshing its etcd heartbeat."""
    LEASE_LOST = "lease_lost"
    """The node's worker lease expired (the worker is gone)."""
    REGISTERED = "registered"
    """A worker registered for the node."""


NODE_TRANSITIONS: Mapping[tuple[NodeState, NodeTrigger], NodeState] = {
    (NodeState.ACTIVE, NodeTrigger.UNHEALTHY): NodeState.DRAINING,
    (NodeState.ACTIVE, NodeTrigger.HEARTBEAT_LOST): NodeState.DRAINING,
    (NodeState.DRAINING, NodeTrigger.UNHEALTHY): NodeState.DRAINING,
    (NodeState.DRAINING, NodeTrigger.RECOVERED): NodeState.ACTIVE,
    (NodeState.ACTIVE, NodeTrigger.LEASE_LOST): NodeState.DEAD,
    (NodeState.DRAINING, NodeTrigger.LEASE_LOST): NodeState.DEAD,
    (NodeState.DEAD, NodeTrigger.REGISTERED): NodeState.ACTIVE,
}
"""(state, trigger) -> next state. A pair not listed changes nothing."""


def node_transition(state: NodeState | str, trigger: NodeTrigger) -> NodeState | None:
    """The node's next state, or None when `trigger` changes nothing in `state`."""
    return NODE_TRANSITIONS.get((NodeState(state), trigger))


class Intake(enum.StrEnum):
    """What a node does with one delivered request (rules 2-6 of the module docstring)."""

    SKIP = "skip"
    CANCEL = "cancel"
    REFUSE = "refuse"
    JOIN = "join"
    STALE = "stale"
    REPLACE = "replace"
    IGNORE = "ignore"
    START = "start"


@dataclass(frozen=True)
class Delivered:
    """One request of a delivery as the rule sees it."""

    request_id: str
    version: int
    resume: bool = False
    """A ResumeEvent (a sequence moved here) rather than a request of a batch."""


def intake(d: Delivered, held_version: int | None, done: bool, cancelled: bool, refusal: str) -> Intake:
    """The version rule for one request: `held_version` is the version this node runs now (None: not running
    here); `done` / `cancelled`: its result markers; `refusal`: why this node cannot serve it ("" if it can)."""
    if done:
        return Intake.SKIP
    if held_version is None:
        if cancelled:
            return Intake.CANCEL
        if refusal:
            return Intake.REFUSE
        return Intake.START
    if d.version <= held_version:
        return Intake.STALE if d.resume else Intake.JOIN
    return Intake.REPLACE if d.resume else Intake.IGNORE


def intake_batch(requests: Sequence[Delivered], held: Mapping[str, int], done: frozenset[str] | set[str],
                 cancelled: frozenset[str] | set[str], refusals: Mapping[str, str]) -> list[Intake]:
    """`intake` over a whole delivery at once (one read of the markers before, one write of the outcomes after),
    in order: a request started earlier in the same delivery counts as held for the ones after it."""
    running = dict(held)
    out: list[Intake] = []
    for d in requests:
        decision = intake(d, running.get(d.request_id), d.request_id in done, d.request_id in cancelled,
                          refusals.get(d.request_id, ""))
        if decision in (Intake.START, Intake.REPLACE):
            running[d.request_id] = d.version
        out.append(decision)
    return out
