"""HealthScorer: the score of a node's GPU metrics and the hysteresis of its drain/recover verdicts.

The promises checked (pipeline/health.py and HealthPolicy): score = max(0, 1 - sum(weight x penalty)) with
penalties in [0, 1] taken from counter *differences*; a node is drained when its score falls below `drain_below`;
it is active again only after `recover_samples` consecutive samples above `recover_above` (a flapping node does not
bounce); the latency baseline follows a healthy node slowly and never learns from a sick one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pipeline.config import HealthPolicy, HealthWeights
from pipeline.health import HealthSample, HealthScorer, HealthVerdict

PENALTY_KEYS = frozenset({"xid", "ecc", "nvlink", "temperature", "latency", "heartbeat"})
WARN_C, LIMIT_C = 80.0, 90.0
"""The default temperature band: the penalty grows linearly from 0 at WARN_C to 1 at LIMIT_C."""


def sample(node: str = "n", ts: float = 0.0, **fields: Any) -> HealthSample:
    return HealthSample(node, ts, **fields)


def feed(scorer: HealthScorer, samples: Sequence[HealthSample]) -> list[HealthVerdict]:
    return [scorer.observe(s) for s in samples]


def temp_for_score(score: float) -> float:
    """Temperature whose penalty alone gives `score` under a policy whose temperature weight is 1."""
    return WARN_C + (1.0 - score) * (LIMIT_C - WARN_C)


def temp_only_policy(**overrides: Any) -> HealthPolicy:
    """Only the temperature counts (weight 1), so a sample's score is set exactly through its temperature."""
    w = HealthWeights(xid=0, ecc=0, nvlink=0, temperature=1.0, latency=0, heartbeat=0)
    return HealthPolicy(weights=w, temp_warn_c=WARN_C, temp_limit_c=LIMIT_C, **overrides)


# -- scoring --------------------------------------------------------------------------------------------------------


def test_a_clean_node_scores_one_and_stays_active() -> None:
    s = HealthScorer(HealthPolicy())
    for v in feed(s, [sample(ts=i * 200.0, temp_c=60.0, avg_latency_ms=5.0) for i in range(5)]):
        assert (v.node, v.score, v.draining, v.changed, v.reasons) == ("n", 1.0, False, False, ())
    assert not s.is_draining("n")
    assert not s.is_draining("never-seen")


def test_counters_are_cumulative_and_only_their_increase_is_penalised() -> None:
    s = HealthScorer(HealthPolicy())
    # the first sample has nothing to compare with: big totals are history, not new errors
    v = s.observe(sample(xid_errors=5, ecc_errors=3, nvlink_crc_errors=10_000))
    assert (v.score, v.reasons, v.draining) == (1.0, (), False)
    v = s.observe(sample(xid_errors=5, ecc_errors=3, nvlink_crc_errors=10_000))
    assert (v.score, v.reasons) == (1.0, ())
    # a counter that goes down (driver reload resets NVML counters) is no error either
    v = s.observe(sample(xid_errors=0, ecc_errors=0, nvlink_crc_errors=0))
    assert (v.score, v.reasons) == (1.0, ())


def test_a_new_xid_event_drains_a_node_at_once() -> None:
    s = HealthScorer(HealthPolicy())
    s.observe(sample(xid_errors=2))
    v = s.observe(sample(xid_errors=3))
    assert v.score == pytest.approx(1.0 - 0.6)
    assert (v.reasons, v.draining, v.changed) == (("xid",), True, True)
    assert s.is_draining("n")
    # several new events in one sample are the same full penalty
    s2 = HealthScorer(HealthPolicy())
    s2.observe(sample(xid_errors=0))
    assert s2.observe(sample(xid_errors=40)).score == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("fields", "score", "reasons"),
    [
        ({"ecc_errors": 1}, 1.0 - 0.5, ("ecc",)),
        ({"nvlink_crc_errors": 50}, 1.0 - 0.3 * 0.5, ("nvlink",)),  # 50 of the 100-errors limit
        ({"nvlink_crc_errors": 5000}, 1.0 - 0.3, ("nvlink",)),  # clamped at the full penalty
        ({"temp_c": 85.0}, 1.0 - 0.3 * 0.5, ("temperature",)),  # halfway between 80 and 90 C
        ({"temp_c": 120.0}, 1.0 - 0.3, ("temperature",)),
        ({"temp_c": 79.9}, 1.0, ()),
        ({"heartbeat_ok": False}, 0.0, ("heartbeat",)),
        ({"xid_errors": 1, "ecc_errors": 1, "temp_c": 100.0}, 0.0, ("ecc", "temperature", "xid")),  # floored at 0
        ({"ecc_errors": 1, "temp_c": 85.0}, 1.0 - 0.5 - 0.15, ("ecc", "temperature")),
    ],
)
def test_each_penalty_is_weighted_into_the_score(fields: dict[str, Any], score: float,
                                                 reasons: tuple[str, ...]) -> None:
    s = HealthScorer(HealthPolicy())
    s.observe(sample())
    v = s.observe(sample(**fields))
    assert v.score == pytest.approx(score)
    assert v.reasons == reasons


def test_latency_is_judged_against_a_baseline_learnt_from_healthy_samples() -> None:
    s = HealthScorer(HealthPolicy())
    v = s.observe(sample(avg_latency_ms=10.0))  # no baseline yet: no penalty; it becomes the baseline
    assert (v.score, s.nodes["n"].baseline_latency_ms) == (1.0, 10.0)
    v = s.observe(sample(avg_latency_ms=20.0))  # 2x baseline: half of the way to slow_factor 3 -> 0.4 x 0.5
    assert v.score == pytest.approx(0.8) and v.reasons == ("latency",)
    assert s.nodes["n"].baseline_latency_ms == pytest.approx(10.5)  # still healthy: the baseline moves, <= 5%
    v = s.observe(sample(avg_latency_ms=30.0))
    assert v.score == pytest.approx(1.0 - 0.4 * ((30.0 / 10.5 - 1.0) / 2.0))
    assert s.nodes["n"].baseline_latency_ms == pytest.approx(10.5)  # sick sample: not learnt
    v = s.observe(sample(avg_latency_ms=0.0))  # no latency measured: no penalty, baseline kept
    assert v.score == 1.0 and s.nodes["n"].baseline_latency_ms == pytest.approx(10.5)


# -- hysteresis, by example -----------------------------------------------------------------------------------------


def test_a_drained_node_returns_only_after_recover_samples_consecutive_good_samples() -> None:
    s = HealthScorer(HealthPolicy(recover_samples=4))
    s.observe(sample(xid_errors=0))
    assert s.observe(sample(xid_errors=1)).changed
    clean = sample(xid_errors=1)
    for _ in range(3):
        v = s.observe(clean)
        assert v.draining and not v.changed and v.score == 1.0
    v = s.observe(sample(xid_errors=1, temp_c=85.0))  # 0.85 > 0.8: still a good sample
    assert v.draining is False and v.changed is True
    v = s.observe(clean)
    assert v.draining is False and v.changed is False


def test_a_slow_sampled_node_recovers_after_the_same_time_not_the_same_count() -> None:
    """An agent whose node is idle and quiet samples every second instead of every 200 ms: its recovery takes the
    hysteresis' time ((recover_samples - 1) x interval_ms: 4.8 s at 25 x 200 ms), not 25 of its slow samples."""
    s = HealthScorer(HealthPolicy(recover_samples=25, interval_ms=200))
    s.observe(sample(ts=0.0, xid_errors=0))
    assert s.observe(sample(ts=200.0, xid_errors=1)).draining
    t, states = 1000.0, []
    while t <= 8000.0:
        v = s.observe(sample(ts=t, xid_errors=1))
        states.append((t, v.draining, v.changed))
        t += 1000.0
    recovered = [t for t, draining, changed in states if changed]
    assert recovered == [6000.0]  # good since 1,000: 5,000 ms >= 4,800 - 100, at the 6th slow sample
    assert all(d for t, d, _ in states if t < 6000.0)


def test_at_the_agents_own_rate_time_and_count_agree() -> None:
    s = HealthScorer(HealthPolicy(recover_samples=25, interval_ms=200))
    s.observe(sample(ts=0.0, xid_errors=0))
    s.observe(sample(ts=200.0, xid_errors=1))
    changed_at = [k for k in range(1, 40) if s.observe(sample(ts=200.0 + 200.0 * k, xid_errors=1)).changed]
    assert changed_at == [25]  # the 25th good sample, as the count alone says


def test_one_mediocre_sample_restarts_the_recovery_count() -> None:
    s = HealthScorer(HealthPolicy(recover_samples=3))
    s.observe(sample(heartbeat_ok=False))
    good, mediocre = sample(temp_c=60.0), sample(temp_c=89.0)  # 1.0 and 0.73 (between 0.5 and 0.8)
    assert [v.draining for v in feed(s, [good, good, mediocre, good, good])] == [True] * 5
    v = s.observe(good)
    assert (v.draining, v.changed) == (False, True)


def test_the_thresholds_are_strict() -> None:
    # binary-exact weights and thresholds, so the boundary scores are hit exactly
    w = HealthWeights(xid=0.25, ecc=0.5, nvlink=0, temperature=0, latency=0, heartbeat=1.0)
    s = HealthScorer(HealthPolicy(weights=w, drain_below=0.5, recover_above=0.75, recover_samples=2))
    s.observe(sample())
    v = s.observe(sample(ecc_errors=1))
    assert (v.score, v.draining) == (0.5, False)  # exactly drain_below: not below it
    s.observe(sample(ecc_errors=1, heartbeat_ok=False))
    assert s.is_draining("n")
    xid = 1
    for _ in range(5):  # exactly recover_above, again and again: never above it
        xid += 1
        v = s.observe(sample(ecc_errors=1, xid_errors=xid))
        assert (v.score, v.draining) == (0.75, True)


def test_a_node_flapping_faster_than_the_hysteresis_is_drained_once_and_stays_drained() -> None:
    s = HealthScorer(HealthPolicy(recover_samples=5))
    bad, good = sample(temp_c=100.0, ecc_errors=0), sample(temp_c=60.0)
    s.observe(good)
    seq: list[HealthSample] = []
    for ecc in range(1, 21):  # 4 good samples, then a new ECC error (score 1 - 0.5 - 0.3), over and over
        seq += [good] * 4
        seq.append(replace(bad, ecc_errors=ecc))
        good = replace(good, ecc_errors=ecc)
    verdicts = feed(s, seq)
    assert sum(v.changed for v in verdicts) == 1
    assert all(v.draining for v in verdicts[4:])


def test_a_policy_with_inverted_thresholds_is_refused() -> None:
    """Inverted, drain_below > recover_above made a steady node bounce forever: a score of 0.7 under drain_below=0.8
    and recover_above=0.5 was drained, recovered after recover_samples samples, drained again at once."""
    with pytest.raises(ValidationError, match="drain_below"):
        HealthPolicy(drain_below=0.8, recover_above=0.5, recover_samples=3)
    with pytest.raises(ValidationError, match="temp_limit_c"):
        HealthPolicy(temp_warn_c=90.0, temp_limit_c=85.0)
    HealthPolicy(drain_below=0.6, recover_above=0.6)  # equal is no bounce: drain below it, recover above it


# -- hysteresis, properties -----------------------------------------------------------------------------------------

CLEAN_STEP = (0, 0, 0, False, 50.0, 0.0, True)
RANDOM_STEP = st.tuples(
    st.sampled_from([0, 0, 0, 0, 1, 3]),  # new Xid events
    st.sampled_from([0, 0, 0, 0, 1]),  # new ECC errors
    st.sampled_from([0, 0, 0, 10, 60, 500]),  # new NVLink errors
    st.sampled_from([False] * 15 + [True]),  # the counters reset (to the new errors only)
    st.floats(20.0, 110.0),  # temperature
    st.one_of(st.just(0.0), st.floats(1.0, 80.0)),  # step latency (0: not measured)
    st.sampled_from([True] * 9 + [False]),  # heartbeat
)
STEPS = st.lists(st.one_of(st.just(CLEAN_STEP), RANDOM_STEP), min_size=1, max_size=60)


def build_samples(node: str, steps: Sequence[tuple[int, int, int, bool, float, float, bool]]) -> list[HealthSample]:
    out: list[HealthSample] = []
    xid = ecc = crc = 0
    for i, (dx, de, dc, reset, temp, lat, hb) in enumerate(steps):
        if reset:
            xid = ecc = crc = 0
        xid, ecc, crc = xid + dx, ecc + de, crc + dc
        out.append(HealthSample(node, i * 200.0, xid, ecc, crc, temp, lat, hb))
    return out


@st.composite
def policies(draw: st.DrawFn) -> HealthPolicy:
    """Any policy with a real hysteresis band (drain_below <= recover_above)."""
    drain = draw(st.floats(0.05, 0.9))
    recover = draw(st.floats(drain, 0.99))
    weights = HealthWeights(**{k: draw(st.floats(0.0, 1.0)) for k in sorted(PENALTY_KEYS)})
    warn = draw(st.floats(40.0, 95.0))
    return HealthPolicy(
        weights=weights, drain_below=drain, recover_above=recover, recover_samples=draw(st.integers(1, 6)),
        temp_warn_c=warn, temp_limit_c=warn + draw(st.floats(0.5, 30.0)),
        nvlink_errors_limit=draw(st.floats(1.0, 1000.0)), slow_factor=draw(st.floats(1.1, 10.0)),
    )


def check_hysteresis(verdicts: Sequence[HealthVerdict], pol: HealthPolicy) -> None:
    """The drain/recover rule, checked on the verdict stream of one node from its first sample on."""
    n = pol.recover_samples
    prev = False
    drained_at = -1
    drains: list[int] = []
    for i, v in enumerate(verdicts):
        assert v.changed == (v.draining != prev), (i, v)
        if not prev:
            # an active node is drained exactly when its score falls below drain_below
            assert v.draining == (v.score < pol.drain_below), (i, v)
            if v.draining:
                drained_at = i
                drains.append(i)
            prev = v.draining
            continue
        good_run = i - drained_at >= n and all(w.score > pol.recover_above for w in verdicts[i - n + 1:i + 1])
        if v.draining:
            # ... and it is not held back once the hysteresis is satisfied
            assert not good_run, (i, v, "recover_samples good samples in a row and still draining")
        else:
            # a drained node is back only after recover_samples consecutive samples above recover_above, all of
            # them taken while it was drained (the sample that drained it does not count)
            assert good_run, (i, v, "recovered too early")
        if v.score <= pol.recover_above:
            assert v.draining, (i, v)
        prev = v.draining
    # drains are at least recover_samples + 1 samples apart: a node cannot bounce faster than the hysteresis
    assert all(b - a >= n + 1 for a, b in itertools.pairwise(drains)), drains


@settings(max_examples=300, deadline=None)
@given(pol=policies(), steps=STEPS)
def test_verdicts_follow_the_hysteresis_and_scores_stay_in_range(
    pol: HealthPolicy, steps: list[tuple[int, int, int, bool, float, float, bool]]
) -> None:
    s = HealthScorer(pol)
    verdicts: list[HealthVerdict] = []
    for smp in build_samples("n", steps):
        v = s.observe(smp)
        assert 0.0 <= v.score <= 1.0
        assert v.node == "n"
        assert list(v.reasons) == sorted(set(v.reasons)) and set(v.reasons) <= PENALTY_KEYS
        if not v.reasons:
            assert v.score == 1.0  # no penalty: perfect health
        if not smp.heartbeat_ok:
            assert "heartbeat" in v.reasons
        assert s.is_draining("n") == v.draining
        verdicts.append(v)
    check_hysteresis(verdicts, pol)


@st.composite
def banded(draw: st.DrawFn) -> tuple[HealthPolicy, list[float], list[float]]:
    """A temperature-only policy, scores that set its state, then scores inside its hysteresis band."""
    drain = draw(st.floats(0.05, 0.85))
    recover = draw(st.floats(drain + 0.02, 0.98))
    pol = temp_only_policy(drain_below=drain, recover_above=recover, recover_samples=draw(st.integers(1, 6)))
    prefix = draw(st.lists(st.floats(0.0, 1.0), max_size=20))
    if draw(st.booleans()):
        prefix.append(0.0)  # end the prefix drained (maybe part way through a recovery)
        prefix += [1.0] * draw(st.integers(0, pol.recover_samples - 1))
    eps = 1e-6
    band = draw(st.lists(st.floats(drain + eps, recover - eps), min_size=1, max_size=60))
    return pol, prefix, band


@settings(max_examples=200, deadline=None)
@given(case=banded())
def test_scores_inside_the_band_never_change_the_state(case: tuple[HealthPolicy, list[float], list[float]]) -> None:
    pol, prefix, band = case
    s = HealthScorer(pol)
    feed(s, [sample(temp_c=temp_for_score(x)) for x in prefix])
    before = s.is_draining("n")
    for x in band:
        v = s.observe(sample(temp_c=temp_for_score(x)))
        assert pol.drain_below <= v.score <= pol.recover_above  # the sample really is in the band
        assert (v.draining, v.changed) == (before, False)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(2, 8), runs=st.lists(st.integers(0, 30), min_size=1, max_size=15), data=st.data())
def test_a_node_that_never_stays_good_for_recover_samples_is_drained_once(
    n: int, runs: list[int], data: st.DataObject
) -> None:
    """Good runs shorter than recover_samples, split by bad samples: one drain, no recovery, however long."""
    pol = temp_only_policy(recover_samples=n)
    good = data.draw(st.lists(st.floats(0.81, 1.0), min_size=n - 1, max_size=n - 1))
    seq = [0.0]
    for r in runs:
        seq += [*good[: r % n], data.draw(st.floats(0.0, 0.79))]
    verdicts = feed(HealthScorer(pol), [sample(temp_c=temp_for_score(x)) for x in seq])
    assert verdicts[0].changed and all(v.draining for v in verdicts)
    assert sum(v.changed for v in verdicts) == 1
    # ... and the first full run of good samples brings it back, on its last sample
    s = HealthScorer(pol)
    feed(s, [sample(temp_c=temp_for_score(x)) for x in seq])
    back = feed(s, [sample(temp_c=60.0)] * n)
    assert [v.draining for v in back] == [True] * (n - 1) + [False]


@settings(max_examples=100, deadline=None)
@given(pol=policies(), a=STEPS, b=STEPS, order=st.lists(st.booleans(), max_size=120))
def test_nodes_are_scored_independently(
    pol: HealthPolicy, a: list[tuple[int, int, int, bool, float, float, bool]],
    b: list[tuple[int, int, int, bool, float, float, bool]], order: list[bool],
) -> None:
    sa, sb = build_samples("a", a), build_samples("b", b)
    alone = {"a": feed(HealthScorer(pol), sa), "b": feed(HealthScorer(pol), sb)}
    mixed = HealthScorer(pol)
    got: dict[str, list[HealthVerdict]] = {"a": [], "b": []}
    queues = {"a": list(sa), "b": list(sb)}
    picks = iter(order)
    while queues["a"] or queues["b"]:
        node = "a" if not queues["b"] or (queues["a"] and next(picks, True)) else "b"
        got[node].append(mixed.observe(queues[node].pop(0)))
    assert got == alone


@settings(max_examples=200, deadline=None)
@given(
    pol=policies(), history=STEPS, last=RANDOM_STEP,
    more_temp=st.floats(0.0, 40.0), more_latency=st.floats(0.0, 80.0),
    more_errors=st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 300)), lose_heartbeat=st.booleans(),
)
def test_a_worse_sample_never_scores_better(
    pol: HealthPolicy, history: list[tuple[int, int, int, bool, float, float, bool]],
    last: tuple[int, int, int, bool, float, float, bool], more_temp: float, more_latency: float,
    more_errors: tuple[int, int, int], lose_heartbeat: bool,
) -> None:
    samples = build_samples("n", [*history, last])
    better = samples[-1]
    worse = replace(
        better, temp_c=better.temp_c + more_temp, avg_latency_ms=better.avg_latency_ms + more_latency,
        xid_errors=better.xid_errors + more_errors[0], ecc_errors=better.ecc_errors + more_errors[1],
        nvlink_crc_errors=better.nvlink_crc_errors + more_errors[2],
        heartbeat_ok=better.heartbeat_ok and not lose_heartbeat,
    )
    s1, s2 = HealthScorer(pol), HealthScorer(pol)
    feed(s1, samples[:-1])
    feed(s2, samples[:-1])
    vb, vw = s1.observe(better), s2.observe(worse)
    assert vw.score <= vb.score
    assert set(vb.reasons) <= set(vw.reasons)
    assert vw.draining or not vb.draining


@settings(max_examples=200, deadline=None)
@given(pol=policies(), steps=STEPS)
def test_the_latency_baseline_moves_slowly_and_only_on_healthy_samples(
    pol: HealthPolicy, steps: list[tuple[int, int, int, bool, float, float, bool]]
) -> None:
    s = HealthScorer(pol)
    for smp in build_samples("n", steps):
        old = s.nodes["n"].baseline_latency_ms if "n" in s.nodes else 0.0
        v = s.observe(smp)
        new = s.nodes["n"].baseline_latency_ms
        x = smp.avg_latency_ms
        if v.score < pol.recover_above or x == 0:
            assert new == old  # a sick sample (or one without a latency) teaches nothing
        elif old == 0:
            assert new == x  # the first healthy measurement is the baseline
        else:
            assert new <= old * 1.05 * (1 + 1e-12)  # rises at most 5% a sample
            assert min(old, x) * (1 - 1e-12) <= new <= max(old, x) * (1 + 1e-12)  # towards the sample
