"""Failover planning: where the live sequences of a failing node go (ARCHITECTURE §5).

Targets are healthy nodes of the SAME rack serving the same model (the rack holds the user's KV snapshots and
prefixes), chosen greedily by free KV budget so a big sequence is not squeezed into a nearly full node; when the
rack has no room, other racks serving the model are used. Each move carries the sequence's next version: the
target accepts it only if it holds no higher version (idempotent migration, seed §5). Pure data in, plan out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.routing.views import NodeView


@dataclass(frozen=True, slots=True)
class LiveSequence:
    seq_id: str
    version: int
    model: str
    mem_est_kb: float


@dataclass(frozen=True, slots=True)
class Migration:
    seq_id: str
    version: int
    """The version the sequence will have on the target (source version + 1)."""
    src: str
    dst: str | None
    """None: no node can take it now (it is requeued through the normal path)."""


def plan_migrations(
    src: str,
    seqs: Sequence[LiveSequence],
    same_rack: Sequence[NodeView],
    other_racks: Sequence[NodeView],
    serves: Mapping[str, frozenset[str]],
) -> list[Migration]:
    free = {v.name: v.kv_free_kb for v in [*same_rack, *other_racks] if v.active and v.name != src}
    tiers = [[v.name for v in same_rack if v.name in free], [v.name for v in other_racks if v.name in free]]
    plan: list[Migration] = []
    for s in sorted(seqs, key=lambda q: (-q.mem_est_kb, q.seq_id)):  # biggest first: best-fit decreasing
        dst = None
        for tier in tiers:
            fits = [n for n in tier if s.model in serves.get(n, frozenset()) and free[n] >= s.mem_est_kb]
            if fits:
                dst = max(fits, key=lambda n: (free[n], n))
                free[dst] -= s.mem_est_kb
                break
        plan.append(Migration(s.seq_id, s.version + 1, src, dst))
    return plan
