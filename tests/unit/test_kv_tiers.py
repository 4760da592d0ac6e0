"""The KV tier policy (pipeline.kv.tiers): examples of each rule, then hypothesis state machines over random
sequences of place / hit / miss / touch / remove / reconcile that check the invariants after every step."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pipeline.kv.tiers import (
    TIERS,
    Entry,
    MoveKind,
    Placement,
    Refusal,
    TierLedger,
    parse_snapshot_key,
    snapshot_key,
)


def ledger(l1: int = 100, l2: int = 300) -> TierLedger:
    return TierLedger({"L1": l1, "L2": l2})


def kinds(p: Placement) -> list[tuple[MoveKind, str, str, str | None]]:
    return [(m.kind, m.seq_id, m.src, m.dst) for m in p.moves]


# --------------------------------------------------------------------------------------------- examples


def test_place_fills_l1_then_demotes_the_least_recently_used() -> None:
    lg = ledger(l1=120)
    for s in "abc":
        assert lg.place(s, 1, 40).accepted
    lg.on_hit("a", "L1")  # b is now the oldest, then c
    p = lg.place("d", 1, 60)
    assert p.accepted and p.write and p.entry is not None and p.entry.tier == "L1"
    assert kinds(p) == [(MoveKind.DEMOTE, "b", "L1", "L2"), (MoveKind.DEMOTE, "c", "L1", "L2")]
    assert [e.seq_id for e in lg.entries("L1")] == ["a", "d"]
    s = lg.stats()
    assert (s.demotions, s.bytes_moved, s.bytes["L1"], s.bytes["L2"], s.entries["L2"]) == (2, 80, 100, 80, 2)


def test_l2_over_capacity_drops_its_oldest_and_a_demoted_oldest_is_dropped_from_l1_directly() -> None:
    lg = ledger(l1=50, l2=100)
    lg.place("old", 1, 50, tier="L2")
    lg.place("a", 1, 50)
    lg.place("b", 1, 50)  # a -> L2 (fits beside old)
    assert lg.entry("a") == Entry("a", 1, 50, "L2", 2)
    p = lg.place("c", 1, 50)  # b -> L2, which is then over: old is the oldest there
    assert kinds(p) == [(MoveKind.DROP, "old", "L2", None), (MoveKind.DEMOTE, "b", "L1", "L2")]
    lg2 = ledger(l1=50, l2=50)
    lg2.place("a", 1, 50)
    lg2.place("young", 1, 50, tier="L2")  # more recent than a
    p2 = lg2.place("b", 1, 50)
    assert kinds(p2) == [(MoveKind.DROP, "a", "L1", None)]  # a would be L2's oldest: no copy for nothing
    assert lg2.stats().drops == 1 and lg2.stats().demotions == 0


def test_versions_stale_refused_equal_replaces_newer_supersedes() -> None:
    lg = ledger()
    lg.place("s", 5, 10)
    before = (lg.entries(), lg.stats())
    p = lg.place("s", 4, 10)
    assert not p.accepted and p.refusal is Refusal.STALE and "version 4 < held version 5" in p.detail
    assert lg.entries() == before[0]
    assert dataclasses.replace(lg.stats(), refused_stale=0) == before[1]
    p = lg.place("s", 5, 12)  # equal version, same tier: overwritten in place
    assert p.accepted and p.deletes == () and lg.used("L1") == 12
    p = lg.place("s", 5, 12, tier="L2")  # equal version elsewhere: the other copy goes
    assert [(m.kind, m.version, m.src) for m in p.deletes] == [(MoveKind.SUPERSEDE, 5, "L1")]
    p = lg.place("s", 6, 20)
    assert [(m.kind, m.version, m.src) for m in p.deletes] == [(MoveKind.SUPERSEDE, 5, "L2")]
    assert lg.entry("s") is not None and lg.entry("s").version == 6  # type: ignore[union-attr]
    assert (lg.used("L1"), lg.used("L2"), lg.stats().superseded) == (20, 0, 2)


def test_too_large_goes_deeper_or_is_refused_with_a_reason() -> None:
    lg = ledger(l1=100, l2=300)
    p = lg.place("big", 1, 200)
    assert p.accepted and p.entry is not None and p.entry.tier == "L2"
    p = lg.place("huge", 1, 301)
    assert not p.accepted and p.refusal is Refusal.TOO_LARGE and "301 bytes" in p.detail
    assert lg.stats().refused_too_large == 1 and "huge" not in lg
    p = lg.place("mid", 1, 50, tier="L2")  # never placed upwards
    assert p.entry is not None and p.entry.tier == "L2"
    off = TierLedger({"L2": 300})  # L1 off (capacity 0): everything lands in L2
    assert off.place("a", 1, 1).entry.tier == "L2"  # type: ignore[union-attr]


def test_hit_promotes_from_l2_and_may_demote_others() -> None:
    lg = ledger(l1=100, l2=300)
    lg.place("a", 1, 60, tier="L2")
    lg.place("b", 1, 60)
    p = lg.on_hit("a", "L2")
    assert p.entry is not None and p.entry.tier == "L1"
    assert kinds(p) == [(MoveKind.DEMOTE, "b", "L1", "L2"), (MoveKind.PROMOTE, "a", "L2", "L1")]
    s = lg.stats()
    assert (s.hits["L2"], s.promotions, s.demotions, s.bytes_moved) == (1, 1, 1, 120)
    assert lg.on_hit("a", "L1").moves == ()  # already in L1: a touch
    lg.place("big", 1, 200, tier="L2")
    assert lg.on_hit("big", "L2").moves == ()  # cannot fit L1: stays, touched
    with pytest.raises(KeyError, match="reconcile"):
        lg.on_hit("a", "L2")
    lg.on_miss("L1")
    assert lg.stats().misses == {"L1": 1, "L2": 0}


def test_reconcile_adopts_the_newest_copy_and_deletes_the_rest() -> None:
    lg = ledger()
    lg.place("s", 3, 10)
    p = lg.reconcile("s", {"L1": {3: 10, 2: 9}, "L2": {4: 30}})
    assert p.entry is not None and (p.entry.version, p.entry.tier, p.entry.size) == (4, "L2", 30)
    assert sorted((m.version, m.src) for m in p.deletes) == [(2, "L1"), (3, "L1")]
    assert (lg.used("L1"), lg.used("L2")) == (0, 30)
    p = lg.reconcile("s", {"L2": {4: 30}})  # consistent: nothing to do
    assert p.moves == () and p.deletes == ()
    p = lg.reconcile("s", {})  # expired or deleted elsewhere
    assert p.entry is None and "s" not in lg and lg.used("L2") == 0
    # A blob this ledger cannot hold (another process, another config) is dropped.
    p = lg.reconcile("t", {"L2": {1: 999}})
    assert p.entry is None and [(m.kind, m.src) for m in p.deletes] == [(MoveKind.DROP, "L2")]


def test_bad_arguments_name_the_fix() -> None:
    with pytest.raises(ValueError, match="valid tiers: L1, L2"):
        TierLedger({"L3": 1})
    with pytest.raises(ValueError, match=">= 0"):
        TierLedger({"L1": -1})
    with pytest.raises(ValueError, match="valid tiers"):
        ledger().place("a", 1, 1, tier="GPU")
    with pytest.raises(ValueError, match="not a KV snapshot key"):
        parse_snapshot_key("no-version")
    with pytest.raises(ValueError, match="non-empty"):
        snapshot_key("", 1)


@given(st.text(min_size=1), st.integers(min_value=-(2**63), max_value=2**63))
def test_snapshot_key_round_trips(seq_id: str, version: int) -> None:
    assert parse_snapshot_key(snapshot_key(seq_id, version)) == (seq_id, version)


# --------------------------------------------------------------------------------------------- properties

SEQS = st.sampled_from(["a", "b", "c", "d", "e", "f", "g"])
VERSIONS = st.integers(min_value=0, max_value=4)
SIZES = st.integers(min_value=0, max_value=120)
TIER_NAMES = st.sampled_from(TIERS)


class LedgerMachine(RuleBasedStateMachine):
    lg: TierLedger

    @initialize(l1=st.integers(min_value=0, max_value=200), l2=st.integers(min_value=0, max_value=400))
    def start(self, l1: int, l2: int) -> None:
        self.lg = TierLedger({"L1": l1, "L2": l2})

    def _check_evictions(self, p: Placement, before: dict[str, Entry], arrived: str) -> None:
        """Every entry that left a tier was the least recently used there: all that stayed are more recent; and
        L1 gave up no more than it had to."""
        after = {e.seq_id: e for e in self.lg.entries()}
        for m in p.moves:
            if m.kind not in (MoveKind.DEMOTE, MoveKind.DROP):
                continue
            assert m.seq_id != arrived
            old = before[m.seq_id]
            assert (old.version, old.tier, old.size) == (m.version, m.src, m.size)
            stayed = [e for e in after.values() if e.tier == m.src and e.seq_id != m.seq_id]
            assert all(e.last_used > old.last_used for e in stayed), (m, stayed)
            if m.dst is not None:
                assert after[m.seq_id].tier == m.dst and after[m.seq_id].last_used == old.last_used
            else:
                assert m.seq_id not in after
        from_l1 = [before[m.seq_id] for m in p.moves if m.kind in (MoveKind.DEMOTE, MoveKind.DROP) and m.src == "L1"]
        if from_l1:
            newest = max(from_l1, key=lambda e: e.last_used)
            assert self.lg.used("L1") + newest.size > self.lg.capacity("L1")

    @rule(seq=SEQS, version=VERSIONS, size=SIZES, tier=TIER_NAMES)
    def place(self, seq: str, version: int, size: int, tier: str) -> None:
        held = self.lg.entry(seq)
        before = {e.seq_id: e for e in self.lg.entries()}
        stats = self.lg.stats()
        p = self.lg.place(seq, version, size, tier)
        if held is not None and held.version > version:
            assert not p.accepted and p.refusal is Refusal.STALE
            assert {e.seq_id: e for e in self.lg.entries()} == before  # nothing changed ...
            assert dataclasses.replace(self.lg.stats(), refused_stale=stats.refused_stale) == stats  # ... but this
            assert self.lg.stats().refused_stale == stats.refused_stale + 1
            return
        if not p.accepted:
            assert p.refusal is Refusal.TOO_LARGE
            assert {e.seq_id: e for e in self.lg.entries()} == before
            assert all(size > self.lg.capacity(t) or self.lg.capacity(t) == 0 for t in TIERS[TIERS.index(tier):])
            return
        e = self.lg.entry(seq)
        assert e is not None and e == p.entry and e.version == version and e.size == size and p.write
        assert TIERS.index(e.tier) >= TIERS.index(tier)  # never placed upwards
        assert all(e.last_used > x.last_used for x in self.lg.entries() if x.seq_id != seq)  # the most recent
        if held is not None and (held.version, held.tier) != (version, e.tier):
            assert [(m.kind, m.version, m.src) for m in p.deletes] == [(MoveKind.SUPERSEDE, held.version, held.tier)]
        else:
            assert p.deletes == ()
        self._check_evictions(p, before, seq)

    @rule(seq=SEQS)
    def hit(self, seq: str) -> None:
        held = self.lg.entry(seq)
        if held is None:
            with pytest.raises(KeyError):
                self.lg.on_hit(seq, "L1")
            return
        before = {e.seq_id: e for e in self.lg.entries()}
        hits = self.lg.stats().hits[held.tier]
        p = self.lg.on_hit(seq, held.tier)
        e = self.lg.entry(seq)
        assert e is not None and e == p.entry and e.version == held.version
        assert self.lg.stats().hits[held.tier] == hits + 1
        fits = [t for t in TIERS if self.lg.capacity(t) > 0 and held.size <= self.lg.capacity(t)]
        assert e.tier == min(fits[0], held.tier, key=TIERS.index)  # promoted as far up as it fits
        if e.tier != held.tier:
            assert p.moves[-1].kind is MoveKind.PROMOTE and p.moves[-1].src == held.tier
        self._check_evictions(dataclasses.replace(p, moves=p.moves[:-1] if e.tier != held.tier else p.moves),
                              before, seq)

    @rule(tier=TIER_NAMES)
    def miss(self, tier: str) -> None:
        n = self.lg.stats().misses[tier]
        self.lg.on_miss(tier)
        assert self.lg.stats().misses[tier] == n + 1

    @rule(seq=SEQS)
    def touch(self, seq: str) -> None:
        self.lg.touch(seq)
        e = self.lg.entry(seq)
        if e is not None:
            assert all(e.last_used > x.last_used for x in self.lg.entries() if x.seq_id != seq)

    @rule(seq=SEQS)
    def remove(self, seq: str) -> None:
        held = self.lg.entry(seq)
        assert self.lg.remove(seq) == held
        assert seq not in self.lg

    @rule(seq=SEQS, found=st.dictionaries(TIER_NAMES, st.dictionaries(VERSIONS, SIZES, max_size=3), max_size=2))
    def reconcile(self, seq: str, found: dict[str, dict[int, int]]) -> None:
        p = self.lg.reconcile(seq, found)
        e = self.lg.entry(seq)
        newest = max((v for vs in found.values() for v in vs), default=None)
        if newest is None:
            assert e is None and p.entry is None
            return
        if e is not None:
            assert e.version == newest
        copies = {(v, t) for t, vs in found.items() for v in vs}
        deleted = {(m.version, m.src) for m in p.deletes}
        assert deleted <= copies
        assert len(copies - deleted) == (1 if e is not None else 0)  # one copy survives, unless it cannot be held

    # ------------------------------------------------------------------------------ invariants

    @invariant()
    def capacity_and_accounting(self) -> None:
        if not hasattr(self, "lg"):
            return
        s = self.lg.stats()
        for t in TIERS:
            es = self.lg.entries(t)
            assert self.lg.used(t) <= self.lg.capacity(t)
            assert self.lg.used(t) == sum(e.size for e in es) == s.bytes[t]
            assert len(es) == s.entries[t]
            assert all(e.size <= self.lg.capacity(t) for e in es)
        times = [e.last_used for e in self.lg.entries()]
        assert len(times) == len(set(times))


class VersionMachine(LedgerMachine):
    """The same machine without `reconcile` (which follows the stores, even backwards): while a sequence is
    held, its version never decreases."""

    reconcile = None  # type: ignore[assignment]

    @initialize(l1=st.integers(min_value=0, max_value=200), l2=st.integers(min_value=0, max_value=400))
    def start(self, l1: int, l2: int) -> None:
        super().start(l1, l2)
        self.seen: dict[str, int] = {}

    @invariant()
    def versions_never_go_backwards(self) -> None:
        if not hasattr(self, "lg"):
            return
        for seq in list(self.seen):
            if seq not in self.lg:
                del self.seen[seq]  # dropped or removed: a later, older put has nothing to overwrite
        for e in self.lg.entries():
            assert e.version >= self.seen.get(e.seq_id, e.version)
            self.seen[e.seq_id] = e.version


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestVersionMachine = VersionMachine.TestCase
TestVersionMachine.settings = settings(max_examples=75, stateful_step_count=50, deadline=None)
