"""Router policy `rack_affinity`: user-affinity consistent hash of user_id over the racks serving the model,
with bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA 2018; the scheme
of Vimeo's and HAProxy's `hash-balance-factor`, and of the load guards of SGLang's and llm-d's cache-aware routers):
a rack that is unhealthy or over a bound is skipped and the ring is walked to the next rack.

Two bounds. The load bound: a rack whose outstanding load (work per node, or requests) is above `load_bound` x the
mean + a slack; it guards queues, but outstanding work is a few hundred tokens per node below capacity against a
32 k slack, so it never binds there. The share guard (`share_bound`, on from the config): a rack that has been sent
more than `share_bound` x the healthy racks' mean of the router's recent requests per node (an exponentially decayed
ledger of its own decisions) is skipped: Mirrokni's capacity ceil((1 + eps) x m / n) with the requests as the balls.
Without it the hash split of users stands, and with Zipf(1.1) users a few heavy users are most of the traffic (the
heaviest alone 17% of the Azure conv trace's work): 2005 of 3000 requests, 0.68 of the work, on one rack of two.
Heavy users (`share_heavy`) walk first, from halfway to the bound, unless the rack holds their prompt's prefix; the
light ones keep their rack up to the bound. The ledger is the router's own state, decayed per decision (no clock):
a replay fed a recording from its start re-decides it exactly; one that starts mid-run starts with an empty ledger."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from pipeline.config import RouterPolicy
from pipeline.routing.hashring import HashRing
from pipeline.routing.views import RackView


@dataclass(slots=True, unsafe_hash=True)
class RackSummary:
    """What a route reads of all the racks before it picks one: the healthy racks (in ring-member order) and their
    sums. A caller whose views do not change between requests (the gateway's admission reads them every
    `saturation_refresh_ms`) computes it once per read (`RackAffinityRouter.summarize`) instead of once per
    request: the same sums in the same order, so the same decisions."""

    model: str
    healthy: tuple[RackView, ...]
    names: tuple[str, ...]
    by_work: bool
    work_sum: float
    load_sum: float
    nodes_sum: int = 0
    """Active nodes of the healthy racks (a rack whose node count is not known counts as one): the share guard's
    per-node mean."""

    def __init__(self, model: str, healthy: tuple[RackView, ...], names: tuple[str, ...], by_work: bool,
                 work_sum: float, load_sum: float, nodes_sum: int = 0) -> None:
        # written out: see pipeline.routing.views.RackView.__init__
        self.model = model
        self.healthy = healthy
        self.names = names
        self.by_work = by_work
        self.work_sum = work_sum
        self.load_sum = load_sum
        self.nodes_sum = nodes_sum


@dataclass(slots=True, unsafe_hash=True)
class RouteDecision:
    rack: str | None
    """None: no rack serving the model is healthy."""
    primary: str
    """The rack the user's hash maps to (affinity); differs from `rack` when the walk skipped it."""
    reason: str

    def __init__(self, rack: str | None, primary: str, reason: str) -> None:
        # written out: see pipeline.routing.views.RackView.__init__
        self.rack = rack
        self.primary = primary
        self.reason = reason


class RackAffinityRouter:
    name: ClassVar[str] = "rack_affinity"

    def __init__(
        self,
        racks_by_model: Mapping[str, Sequence[str]],
        virtual_nodes: int,
        load_bound: float,
        load_slack: float = 1.0,
        *,
        prefix_aware: bool = False,
        affinity_tokens: float = 8192.0,
        work_slack: float = 32768.0,
        share_bound: float = 0.0,
        share_slack: float = 2.0,
        share_window: int = 512,
        share_heavy: float = 0.05,
        share_hit_tokens: float = 2048.0,
    ) -> None:
        if load_bound < 1.0:
            raise ValueError(f"load_bound must be >= 1.0, got {load_bound}")
        if load_slack < 0 or work_slack < 0 or share_slack < 0:
            raise ValueError(f"load_slack, work_slack and share_slack must be >= 0, got {load_slack}, {work_slack}, "
                             f"{share_slack}")
        if share_bound != 0.0 and share_bound < 1.0:
            raise ValueError(f"share_bound must be 0 (off) or >= 1.0, got {share_bound}")
        if share_window < 1:
            raise ValueError(f"share_window must be >= 1, got {share_window}")
        if share_heavy < 0:
            raise ValueError(f"share_heavy must be >= 0, got {share_heavy}")
        self.load_bound = load_bound
        self.load_slack = load_slack
        self.prefix_aware = prefix_aware
        self.affinity_tokens = affinity_tokens
        self.work_slack = work_slack
        self._rings = {m: HashRing(r, virtual_nodes) for m, r in racks_by_model.items() if r}
        self.share_bound = share_bound
        self.share_slack = share_slack
        self.share_heavy = share_heavy
        self.share_hit_tokens = share_hit_tokens
        all_racks = sorted({m for ring in self._rings.values() for m in ring.members})
        self._routed: dict[str, float] = dict.fromkeys(all_racks, 0.0)
        """Per rack, the requests this router sent it, exponentially decayed (in units of `_unit`: the newest
        request weighs `_unit`, one `share_window` x racks requests older weighs half of that)."""
        self._routed_total = 0.0
        self._user_routed: dict[str, float] = {}
        """Per user, its requests this router routed, decayed as `_routed` (up to USER_CACHE users, then it starts
        over): which users are heavy."""
        self._unit = 1.0
        self._growth = 2.0 ** (1.0 / (share_window * max(1, len(all_racks))))

    @classmethod
    def from_config(cls, racks_by_model: Mapping[str, Sequence[str]], rp: RouterPolicy) -> RackAffinityRouter:
        return cls(racks_by_model, rp.virtual_nodes, rp.load_bound, rp.load_slack, prefix_aware=rp.prefix_aware,
                   affinity_tokens=rp.affinity_tokens, work_slack=rp.work_slack_tokens, share_bound=rp.share_bound,
                   share_slack=rp.share_slack, share_window=rp.share_window_requests,
                   share_heavy=rp.share_heavy_user, share_hit_tokens=rp.share_hit_tokens)

    def models(self) -> tuple[str, ...]:
        return tuple(sorted(self._rings))

    def _ring(self, model: str) -> HashRing:
        ring = self._rings.get(model)
        if ring is None:
            raise KeyError(f"no rack serves model {model!r}; served: {', '.join(self.models())}")
        return ring

    def summarize(self, model: str, racks: Mapping[str, RackView]) -> RackSummary:
        """One pass over the racks (a 160-rack cluster routes every request through this): the healthy ones, and
        both means, summed in ring-member order as before so that every decision (and its replay) is the same."""
        healthy: list[RackView] = []
        names: list[str] = []
        by_work = True
        work_sum = 0.0
        load_sum = 0.0
        nodes_sum = 0
        for m in self._ring(model).members:
            v = racks.get(m)
            if v is None or not v.healthy:
                continue
            healthy.append(v)
            names.append(m)
            load_sum += v.load
            if v.nodes > 0:
                work_sum += v.work / v.nodes
                nodes_sum += v.nodes
            else:
                by_work = False
                nodes_sum += 1
        return RackSummary(model, tuple(healthy), tuple(names), by_work, work_sum, load_sum, nodes_sum)

    def index(self, model: str, racks: Mapping[str, RackView]) -> RackIndex:
        """A `RackIndex` of the model's racks, in this router's ring order, from the views now."""
        return RackIndex(model, self._ring(model).members, racks)

    def route(self, user_id: str, model: str, racks: Mapping[str, RackView],
              cached: Mapping[str, float] | None = None, summary: RackSummary | None = None,
              index: RackIndex | None = None) -> RouteDecision:
        """The rack for a request of `user_id`. `cached`: prompt tokens of the request's prefix each rack holds (from
        the racks' block index); used when the router is prefix-aware. `summary`: `summarize(model, racks)` of
        these very views, when the caller keeps it (else it is computed here). `index`: a `RackIndex` of the model
        kept up to date with these views by the caller (the same decision, without a pass over every rack, while
        its sums are exact). With the share guard on, the choice is counted in the router's own share ledger (a
        route is a decision, not a query)."""
        ring = self._ring(model)
        if index is not None and summary is None and index.model == model and index.exact and index.by_work:
            return self._route_indexed(user_id, ring, index, cached)
        if summary is None or summary.model != model:
            summary = self.summarize(model, racks)
        healthy, names, by_work = summary.healthy, summary.names, summary.by_work
        work_sum, load_sum = summary.work_sum, summary.load_sum
        pos = ring.start(user_id)
        primary = ring.owner_at(pos)
        if not healthy:
            return RouteDecision(None, primary, "no healthy rack")
        # no nested functions or lambdas below: compiled (workers.sim.compiled), each would make a reference cycle
        # per request, and the simulator runs with the cyclic collector off
        if by_work:
            bound = self.load_bound * (work_sum / len(healthy)) + self.work_slack
        else:
            bound = self.load_bound * (load_sum / len(healthy)) + self.load_slack
        share_limit, share_hard = self._share_limits(summary, user_id)
        routed = self._routed
        if not self.prefix_aware:
            found = ring.first_from(pos, _WithinBound(racks, by_work, bound, routed, share_limit))
            if found is not None:
                return self._decided(user_id, RouteDecision(found, primary,
                                                            "affinity" if found == primary else "walked"))
            # every healthy rack is over a bound: least loaded healthy rack
            return self._decided(user_id, RouteDecision(_least(healthy, by_work, None), primary,
                                                        "all racks over load bound"))
        hits = cached or {}
        aff = self.affinity_tokens
        # the cheapest acceptable rack; ties go to the first in ring order (its distance from the key's position:
        # no walk of the ring, which costs as much as the racks times their virtual nodes)
        ties: list[str] = []
        best = 0.0
        for m, v in zip(names, healthy, strict=True):
            lv = _load(v, by_work)
            if lv > bound or not _within_share(
                    routed, m, v, share_hard if hits.get(m, 0.0) >= self.share_hit_tokens else share_limit):
                continue
            c = -hits.get(m, 0.0) + (lv if by_work else 0.0) - (aff if m == primary else 0.0)
            if not ties or c < best:
                ties, best = [m], c
            elif c == best:
                ties.append(m)
        if not ties:
            return self._decided(user_id, RouteDecision(_least(healthy, by_work, hits), primary,
                                                        "all racks over load bound"))
        return self._nearest(user_id, ring, pos, primary, ties, hits)

    def _nearest(self, user_id: str, ring: HashRing, pos: int, primary: str, ties: Sequence[str],
                 hits: Mapping[str, float]) -> RouteDecision:
        """The decision among the cheapest acceptable racks `ties` (in ring-member order): the nearest to the key's
        position on the ring, the first of the nearest; and why it was chosen."""
        chosen_m = ties[0]
        if len(ties) > 1:
            near = ring.distance(pos, chosen_m)
            for m in ties[1:]:
                d = ring.distance(pos, m)
                if d < near:
                    chosen_m, near = m, d
        if chosen_m == primary:
            reason = "affinity"
        elif hits.get(chosen_m, 0.0) > hits.get(primary, 0.0):
            reason = "prefix"
        else:
            reason = "walked"
        return self._decided(user_id, RouteDecision(chosen_m, primary, reason))

    def _route_indexed(self, user_id: str, ring: HashRing, index: RackIndex,
                       cached: Mapping[str, float] | None) -> RouteDecision:
        """`route` over a `RackIndex` (exact sums, every healthy rack's node count known): the same decision."""
        pos = ring.start(user_id)
        primary = ring.owner_at(pos)
        n = index.healthy_count
        if n == 0:
            return RouteDecision(None, primary, "no healthy rack")
        bound = self.load_bound * (index.work_sum / n) + self.work_slack
        share_limit, share_hard = self._limits(n, index.nodes_sum, None, index, user_id)
        routed = self._routed
        views = index.views
        if not self.prefix_aware:
            found = ring.first_from(pos, _WithinBound(views, True, bound, routed, share_limit))
            if found is not None:
                return self._decided(user_id, RouteDecision(found, primary,
                                                            "affinity" if found == primary else "walked"))
            return self._decided(user_id, RouteDecision(_least(index.healthy_views(), True, None), primary,
                                                        "all racks over load bound"))
        hits = cached or {}
        aff = self.affinity_tokens
        share_hit = self.share_hit_tokens
        order = index.order
        members = index.members
        # the racks the request names (its prefix's, its primary): priced as the pass prices them
        named = set(hits)
        named.add(primary)
        ties: list[int] = []
        best = math.inf
        for m in named:
            idx = order.get(m, -1)
            v = views.get(m)
            if idx < 0 or v is None or not v.healthy:
                continue
            lv = _load(v, True)
            h = hits.get(m, 0.0)
            if lv > bound or not _within_share(routed, m, v, share_hard if h >= share_hit else share_limit):
                continue
            c = -h + lv - (aff if m == primary else 0.0)
            if c < best:
                ties, best = [idx], c
            elif c == best:
                ties.append(idx)
        # the others cost their load (-0.0 + load - 0.0): the least loaded acceptable ones, in order, until one
        # costs more than the best (or is over the bound: so is every later one)
        plain_limit = share_hard if share_hit <= 0.0 else share_limit
        for lv, idx in index.ascending():
            if lv > bound or lv > best:
                break
            m = members[idx]
            if m in named or not _within_share(routed, m, views[m], plain_limit):
                continue
            if lv < best:
                ties, best = [idx], lv
            else:
                ties.append(idx)
        if not ties:
            return self._decided(user_id, RouteDecision(_least(index.healthy_views(), True, hits), primary,
                                                        "all racks over load bound"))
        ties.sort()  # ring order, as the pass meets them
        return self._nearest(user_id, ring, pos, primary, [members[i] for i in ties], hits)

    def _share_limits(self, summary: RackSummary, user_id: str) -> tuple[float, float]:
        return self._limits(len(summary.names), summary.nodes_sum, summary.names, None, user_id)

    def _limits(self, n_names: int, nodes_sum: int, names: Sequence[str] | None, index: RackIndex | None,
                user_id: str) -> tuple[float, float]:
        """The share guard's bound on a rack's routed requests per node, for a request of `user_id`: share_bound x
        the healthy racks' mean per node + share_slack requests; halfway to it (1 + epsilon/2) for a heavy user, one
        with at least `share_heavy` of a rack's fair share of the requests to itself, so that an over-full rack sheds
        its heavy users first and its light users keep their rack; infinite with the guard off. `n_names`,
        `nodes_sum`: the healthy racks and their nodes; `names` (or, None, `index`): the healthy racks in ring
        order, summed when they are not every rack the router routes to."""
        if self.share_bound <= 0.0 or nodes_sum <= 0:
            return math.inf, math.inf
        routed = self._routed
        if n_names == len(routed):
            total = self._routed_total
        else:
            total = 0.0
            for m in (names if names is not None else index.healthy_names() if index is not None else ()):
                total += routed[m]
        mean = total / nodes_sum
        slack = self.share_slack * self._unit
        hard = self.share_bound * mean + slack
        if self.share_heavy > 0.0 and self._user_routed.get(user_id, 0.0) >= self.share_heavy * total / n_names:
            return (1.0 + (self.share_bound - 1.0) / 2.0) * mean + slack, hard
        return hard, hard

    def _decided(self, user_id: str, d: RouteDecision) -> RouteDecision:
        """Count a decision in the share ledger (every older entry decays by one step: the unit grows instead, and
        the ledger is rescaled, exactly, by a power of two when it gets large)."""
        if self.share_bound > 0.0 and d.rack is not None:
            self._unit *= self._growth
            unit = self._unit
            self._routed[d.rack] += unit
            self._routed_total += unit
            users = self._user_routed
            if len(users) >= USER_CACHE and user_id not in users:
                users.clear()
            users[user_id] = users.get(user_id, 0.0) + unit
            if unit > _RESCALE:
                for m in self._routed:
                    self._routed[m] *= _RESCALE_BY
                for u in users:
                    users[u] *= _RESCALE_BY
                self._routed_total *= _RESCALE_BY
                self._unit *= _RESCALE_BY
        return d

    def shares(self) -> dict[str, float]:
        """Each rack's fraction of the (decayed) requests this router has routed (empty before any)."""
        total = self._routed_total
        return {m: w / total for m, w in self._routed.items()} if total > 0 else {}


class RackIndex:
    """The views of one model's racks as its router reads them, kept as they change: the healthy racks ordered by
    load (work per node), and their sums. A caller that owns the views and says which one changed (the simulator:
    `update`) lets `RackAffinityRouter.route` read a few racks per request instead of all of them, and decide exactly
    as the pass over every rack would:
    - the sums: a float sum depends on its order in its last bits, and the pass sums in ring-member order. The sums
      kept here are used only while every term is a multiple of 1/8 under 2^40 (token counts over 1, 2, 4 or 8
      nodes): then every partial sum is exact whatever the order, and equal to the pass's. Otherwise (a rack of 3
      nodes, say), `exact` is False and the router sums in ring order as before;
    - the choice: the cheapest acceptable rack is among the ones the request names (its cached prefix, its primary)
      and the least loaded acceptable one of the rest; a tie is broken as the pass breaks it (ring distance, then
      ring order), over every rack at the winning cost."""

    __slots__ = (
        "_dirty",
        "_key",
        "_small",
        "_sorted",
        "_term",
        "_unknown",
        "by_work",
        "exact_terms",
        "load_sum",
        "members",
        "model",
        "nodes_sum",
        "order",
        "views",
        "work_sum",
    )

    def __init__(self, model: str, members: Sequence[str], views: Mapping[str, RackView]) -> None:
        self.model = model
        self.members = tuple(members)
        self.order = {m: i for i, m in enumerate(self.members)}
        """Each member's place in ring-member order."""
        self._small = len(self.members) < 1024
        """Few enough terms (each under 2^40) for an exact sum under 2^50 (1/8 resolution within 53 bits)."""
        self.views: dict[str, RackView] = {}
        """The current view of each member (healthy or not)."""
        self._sorted: list[tuple[float, int]] = []
        """(work per node, ring index) of the healthy members that know their node count, ascending."""
        self._key: dict[str, tuple[float, int]] = {}
        self._term: dict[str, tuple[float, float]] = {}
        """Per healthy member: (work per node, load) as added to the sums."""
        self._unknown = 0
        """Healthy members with no node count (balance on load: the pass's `by_work` is False)."""
        self.exact_terms = 0
        """Healthy members whose terms are NOT on the exact grid (the sums are exact while this is 0)."""
        self._dirty = False
        """A term off the grid was in the sums: summed again from the terms once none is left."""
        self.work_sum = 0.0
        self.load_sum = 0.0
        self.nodes_sum = 0
        self.by_work = True
        for m in self.members:
            v = views.get(m)
            if v is not None:
                self.update(v)

    @property
    def exact(self) -> bool:
        return self._small and self.exact_terms == 0

    def healthy_names(self) -> list[str]:
        """The healthy members, in ring-member order."""
        term = self._term
        return [m for m in self.members if m in term]

    def healthy_views(self) -> list[RackView]:
        """Their views, in the same order."""
        return [self.views[m] for m in self.healthy_names()]

    @property
    def healthy_count(self) -> int:
        return len(self._term)

    def update(self, v: RackView) -> None:
        """The view of member `v.name` is now `v` (a name not on this ring is ignored)."""
        m = v.name
        idx = self.order.get(m)
        if idx is None:
            return
        old = self.views.get(m)
        if old is not None and old.healthy and v.healthy and old.nodes == v.nodes and v.nodes > 0:
            self._replace(m, idx, v)  # the common change: its load or work moved, nothing else
        else:
            self._remove(m)
            self.views[m] = v
            if v.healthy:
                self._add(m, idx, v)
        if self._dirty and self.exact_terms == 0:
            self._resum()

    def _replace(self, m: str, idx: int, v: RackView) -> None:
        wpn0, load0 = self._term[m]
        wpn = v.work / v.nodes
        if wpn != wpn0:
            sorted_ = self._sorted
            del sorted_[bisect.bisect_left(sorted_, self._key[m])]
            key = (wpn, idx)
            bisect.insort(sorted_, key)
            self._key[m] = key
            self.work_sum += wpn - wpn0  # on the grid, both exact
        if v.load != load0:
            self.load_sum += v.load - load0
        self.views[m] = v
        self._term[m] = (wpn, v.load)
        on0 = _on_grid(wpn0) and _on_grid(load0)
        on1 = _on_grid(wpn) and _on_grid(v.load)
        if on0 != on1 or not on1:
            self.exact_terms += int(on0) - int(on1)
            self._dirty = True

    def _add(self, m: str, idx: int, v: RackView) -> None:
        if v.nodes > 0:
            wpn = v.work / v.nodes
            self.nodes_sum += v.nodes
            key = (wpn, idx)
            bisect.insort(self._sorted, key)
            self._key[m] = key
        else:
            wpn = 0.0
            self.nodes_sum += 1
            self._unknown += 1
        self._term[m] = (wpn, v.load)
        if not (_on_grid(wpn) and _on_grid(v.load)):
            self.exact_terms += 1
            self._dirty = True
        self.work_sum += wpn
        self.load_sum += v.load
        self.by_work = self._unknown == 0

    def _remove(self, m: str) -> None:
        term = self._term.pop(m, None)
        if term is None:
            return
        v = self.views[m]
        wpn, load = term
        key = self._key.pop(m, None)
        if key is not None:
            i = bisect.bisect_left(self._sorted, key)
            del self._sorted[i]
            self.nodes_sum -= v.nodes
        else:
            self.nodes_sum -= 1
            self._unknown -= 1
        if not (_on_grid(wpn) and _on_grid(load)):
            self.exact_terms -= 1
            self._dirty = True
        self.work_sum -= wpn
        self.load_sum -= load
        if not self._term:  # empty: start the sums over at exactly 0
            self.work_sum = self.load_sum = 0.0
        self.by_work = self._unknown == 0

    def _resum(self) -> None:
        """The sums again from their terms: a term off the grid has left, and the rounding it brought with it must
        go too (every term is on the grid now, so any order gives the exact sum)."""
        work = load = 0.0
        for wpn, ld in self._term.values():
            work += wpn
            load += ld
        self.work_sum, self.load_sum = work, load
        self._dirty = False

    def ascending(self) -> list[tuple[float, int]]:
        """(work per node, ring index) of the healthy members with a node count, least loaded first (not a copy)."""
        return self._sorted


_GRID = 8.0
_GRID_MAX = 2.0 ** 40


def _on_grid(x: float) -> bool:
    """A multiple of 1/8 under 2^40: sums of fewer than 2^10 such terms are exact in a double, in any order."""
    y = x * _GRID
    return abs(x) < _GRID_MAX and y == math.floor(y)


USER_CACHE = 100_000
"""Users whose recent requests the share guard remembers (then it starts over: heavy users are back within a few
of their requests)."""
_RESCALE = 2.0 ** 512
_RESCALE_BY = 2.0 ** -512


def _within_share(routed: Mapping[str, float], m: str, v: RackView, limit: float) -> bool:
    """A rack whose routed requests per node are at or under the share guard's limit."""
    return routed.get(m, 0.0) / (v.nodes if v.nodes > 0 else 1) <= limit


def _load(v: RackView, by_work: bool) -> float:
    """A rack's load as the bound compares it: prompt-token work per active node, or requests outstanding."""
    if by_work:
        return v.work / v.nodes if v.nodes > 0 else 0.0
    return v.load


def _least(healthy: Sequence[RackView], by_work: bool, hits: Mapping[str, float] | None) -> str:
    """The healthy rack with the least load (less its cached prompt tokens, with `hits`), then the first name: what
    min() by (load, name) picks."""
    best: tuple[float, str] | None = None
    for v in healthy:
        key = (_load(v, by_work) - hits.get(v.name, 0.0) if hits is not None else _load(v, by_work), v.name)
        if best is None or key < best:
            best = key
    assert best is not None
    return best[1]


class _WithinBound:
    """The ring walk's test: a healthy rack at or under the load bound (a class, not a closure: see `route`)."""

    __slots__ = ("bound", "by_work", "racks", "routed", "share_limit")

    def __init__(self, racks: Mapping[str, RackView], by_work: bool, bound: float, routed: Mapping[str, float],
                 share_limit: float) -> None:
        self.racks = racks
        self.by_work = by_work
        self.bound = bound
        self.routed = routed
        self.share_limit = share_limit

    def __call__(self, m: str) -> bool:
        v = self.racks.get(m)
        return (v is not None and v.healthy and _load(v, self.by_work) <= self.bound
                and _within_share(self.routed, m, v, self.share_limit))


def keeps_prefix_cache(enabled: bool, min_tokens: int, in_tokens: int, decision: RouteDecision, asked: bool) -> bool:
    """Seed rule (ARCHITECTURE §2): a prompt longer than `min_tokens` that leaves its affinity rack for load runs
    with prefix caching off; one sent elsewhere because its prefix is cached there keeps it; otherwise the request
    keeps what it asked for."""
    if (enabled and decision.rack is not None and decision.rack != decision.primary and in_tokens > min_tokens
            and decision.reason != "prefix"):
        return False
    return asked


def rack_cached_tokens(node_blocks: Mapping[str, int], rack_of: Mapping[str, str], block_tokens: int,
                       in_tokens: int) -> dict[str, float]:
    """Per rack, the prompt tokens of a request its best node holds (from a node-level block match)."""
    out: dict[str, float] = {}
    cap = max(0, in_tokens - 1)
    for node, k in node_blocks.items():
        rack = rack_of.get(node)
        if rack is None:
            continue
        t = float(min(cap, k * block_tokens))
        if t > out.get(rack, 0.0):
            out[rack] = t
    return out
