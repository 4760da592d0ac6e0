"""The monitor's heartbeat failure detector (pipeline/health.py: HeartbeatWatch) and its configuration: time is the
stream's (the entries' ids), so a late reader or a silent stream never makes a live node look dead."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.config import ConfigError, Policies, RackflowConfig, load_config
from pipeline.health import HeartbeatWatch


def _beats(w: HeartbeatWatch, nodes: list[str], start: float, end: float, every: float = 200.0,
           skew: float = 25.0) -> None:
    """Each node beats every `every` ms from `start` to `end`, the nodes `skew` ms apart (stream order)."""
    t = start
    while t <= end:
        for k, n in enumerate(nodes):
            w.observe(t + k * skew, n)
        t += every


def test_a_node_that_stops_beating_is_missed_after_the_timeout_and_not_before() -> None:
    w = HeartbeatWatch(timeout_ms=800)
    _beats(w, ["a", "b", "c"], 0, 2000)
    assert w.missed() == []
    last_a = w.last["a"]
    # a dies; b and c go on, and the stream's clock with them
    t = 2200.0
    while t - last_a <= 800:
        assert w.missed() == [], f"a missed after only {w.clock_ms - last_a} ms"
        w.observe(t, "b")
        w.observe(t + 25, "c")
        t += 200
    missed = w.missed()
    assert [n for n, _ in missed] == ["a"]
    assert 800 < missed[0][1] <= 800 + 200 + 25  # within one heartbeat of the timeout


def test_a_reader_that_falls_behind_sees_no_death() -> None:
    """The monitor reads two seconds of backlog at once: the clock is the entries', so nobody looks silent."""
    w = HeartbeatWatch(timeout_ms=800)
    _beats(w, ["a", "b"], 0, 1000)
    backlog = []
    t = 1200.0
    while t <= 3200:
        backlog += [(t, "a"), (t + 25, "b")]
        t += 200
    for ts, n in backlog:  # delivered late, in one batch: judged after the batch
        w.observe(ts, n)
    assert w.missed() == []


def test_a_silence_of_the_whole_stream_is_nobodys_fault_until_it_settles() -> None:
    """A Valkey outage: every writer is silent for 5 s, then they come back one by one (reconnect backoff)."""
    w = HeartbeatWatch(timeout_ms=800, settle_ms=3000)
    _beats(w, ["a", "b", "c"], 0, 1000)
    # back after the outage: a at once, b 1.5 s later, c never (it died during the outage)
    w.observe(6000, "a")
    assert w.missed() == []
    _beats(w, ["a"], 6200, 7400)
    assert w.missed() == [], "judged before the stream settled"
    _beats(w, ["a", "b"], 7600, 8800)
    assert w.missed() == [], "still settling"
    _beats(w, ["a", "b"], 9000, 9400)  # settled (6000 + 3000): c, silent since before the outage, is missed
    assert [n for n, _ in w.missed()] == ["c"]


def test_entries_of_other_writers_move_the_clock_and_only_heartbeats_count_for_a_node() -> None:
    w = HeartbeatWatch(timeout_ms=800)
    w.observe(0, "a")
    for t in range(25, 1000, 25):  # health agents' samples: not a's heartbeat
        w.observe(float(t))
    assert [n for n, _ in w.missed()] == ["a"]


def test_an_old_entry_claimed_late_moves_neither_the_clock_nor_a_heartbeat_back() -> None:
    w = HeartbeatWatch(timeout_ms=800)
    _beats(w, ["a"], 0, 1000)
    w.observe(100, "a")  # an entry claimed from a dead consumer's pending list, long after
    assert w.clock_ms == 1000 and w.last["a"] == 1000


def test_a_node_never_heard_or_forgotten_is_not_judged_and_fresh_needs_a_new_beat() -> None:
    w = HeartbeatWatch(timeout_ms=800)
    _beats(w, ["a", "b"], 0, 1000)
    _beats(w, ["b"], 1200, 3000)
    assert [n for n, _ in w.missed()] == ["a"]
    w.forget("a")  # declared dead
    assert w.missed() == [] and not w.fresh("a")
    _beats(w, ["b"], 3200, 6000)
    assert w.missed() == [], "a forgotten node is judged again only once heard again"
    w.observe(6100, "a")  # a stalled worker wakes up and beats
    assert w.fresh("a")


def test_reset_gives_a_node_back_in_service_a_full_window() -> None:
    w = HeartbeatWatch(timeout_ms=800)
    _beats(w, ["b"], 0, 3000)
    w.reset("a")  # registered again, no heartbeat yet
    _beats(w, ["b"], 3200, 3800)
    assert w.missed() == []
    _beats(w, ["b"], 4000, 4000)
    assert [n for n, _ in w.missed()] == ["a"]


@given(st.lists(st.tuples(st.floats(0, 150), st.sampled_from(["a", "b", "c", None])), min_size=1, max_size=300))
def test_with_every_node_beating_within_the_timeout_nobody_is_missed(steps: list[tuple[float, str | None]]) -> None:
    """Any interleaving of entries in which each node beats at least every 700 ms of stream time: no death."""
    w = HeartbeatWatch(timeout_ms=800)
    t = 0.0
    last = dict.fromkeys("abc", 0.0)
    for n in "abc":
        w.observe(0.0, n)
    for dt, node in steps:
        t += dt
        for n, at in last.items():  # whoever is due beats first
            if t - at >= 700:
                w.observe(at + 700, n)
                last[n] = at + 700
        w.observe(t, node)
        if node is not None:
            last[node] = t
        assert w.missed() == []


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        HeartbeatWatch(timeout_ms=0)


def _policies(**health: object) -> dict[str, object]:
    return {"health": health}


def test_default_window_is_four_heartbeats_and_off_when_the_lease_was_raised_for_a_starved_host() -> None:
    assert Policies().worker_heartbeat_timeout_ms() == 800
    assert Policies.model_validate({"worker": {"status_interval_ms": 100}}).worker_heartbeat_timeout_ms() == 400
    assert Policies.model_validate({"worker": {"lease_ttl_s": 15}}).worker_heartbeat_timeout_ms() == 0
    assert Policies.model_validate(_policies(worker_heartbeat_timeout_ms=0)).worker_heartbeat_timeout_ms() == 0
    assert Policies.model_validate({"worker": {"lease_ttl_s": 15},
                                    "health": {"worker_heartbeat_timeout_ms": 5000}}).worker_heartbeat_timeout_ms() \
        == 5000


def test_repository_config_detects_a_dead_worker_in_under_a_second() -> None:
    config: RackflowConfig = load_config()
    timeout = config.policies.worker_heartbeat_timeout_ms()
    assert 0 < timeout < 1000
    assert timeout >= 3 * config.policies.worker.status_interval_ms  # three missed beats before a verdict


def test_a_window_shorter_than_two_heartbeats_is_refused_naming_both_fields(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "o.yaml"
    path.write_text("policies:\n  health:\n    worker_heartbeat_timeout_ms: 300\n")
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[path])
    assert "worker_heartbeat_timeout_ms" in str(e.value) and "status_interval_ms" in str(e.value)


def test_an_idle_node_is_judged_against_the_interval_it_announced() -> None:
    """An idle worker beats every second and says so (`next_ms`): silent 2 s it is not missed (4 of its beats make
    its timeout, as 4 of 200 ms do for a busy one); silent past 4 s it is."""
    w = HeartbeatWatch(timeout_ms=800, interval_ms=200)
    t = 0.0
    while t <= 3000:  # a idles (1 s beats), b works (200 ms beats)
        if t % 1000 == 0:
            w.observe(t, "a", 1000.0)
        w.observe(t + 25, "b", 200.0)
        t += 200
    assert w.limit_ms("a") == 4000 and w.limit_ms("b") == 800
    last_a = w.last["a"]
    while w.clock_ms - last_a <= 4000:  # a died after its beat at 3000; b goes on
        assert w.missed() == []
        w.observe(t + 25, "b", 200.0)
        t += 200
    assert [n for n, _ in w.missed()] == ["a"]
    w.observe(t, "a", 200.0)  # it beats fast again (work arrived): the default timeout again
    assert w.limit_ms("a") == 800 and w.fresh("a")


def test_a_quiet_idle_cluster_is_not_an_outage_but_a_silence_after_fast_beats_is() -> None:
    w = HeartbeatWatch(timeout_ms=800, settle_ms=3000, interval_ms=200)
    for t in range(0, 10_001, 1000):  # every node idle: one beat a second, the stream quiet in between
        w.observe(float(t), "a", 1000.0)
        w.observe(float(t) + 300, "b", 1000.0)
    assert w.quiet_until_ms == 0.0  # gaps of 700 ms: not taken for an outage
    w.observe(10_500, "b", 200.0)  # b works again
    w.observe(11_300, "a", 1000.0)  # 800 ms of silence with a fast beater: the stream itself went quiet
    assert w.quiet_until_ms == 11_300 + 3000
    assert w.missed() == []


@given(st.lists(st.integers(min_value=1, max_value=5), min_size=2, max_size=6), st.integers(0, 999))
def test_idle_beaters_are_never_missed_while_they_beat(periods: list[int], phase: int) -> None:
    """Nodes beating at any announced interval (200 ms to 1 s) are never missed while they keep to it."""
    w = HeartbeatWatch(timeout_ms=800, interval_ms=200)
    nodes = {f"n{i}": 200.0 * p for i, p in enumerate(periods)}
    events = sorted((k * every + (i * 37 + phase) % 200, n, every) for i, (n, every) in enumerate(nodes.items())
                    for k in range(int(20_000 // every)))
    for ts, n, every in events:
        w.observe(ts, n, every)
        assert w.missed() == []


def test_a_reader_may_let_entries_gather_only_while_every_node_beats_at_its_idle_pace() -> None:
    w = HeartbeatWatch(timeout_ms=800, interval_ms=200)
    assert w.idle_pace_ms() == 0.0  # nobody heard yet
    w.observe(0, "a", 1000.0)
    w.observe(100, "b", 200.0)  # b works
    assert w.idle_pace_ms() == 0.0
    w.observe(200, "b", 600.0)  # both idle: a quarter of the shortest announced interval
    assert w.idle_pace_ms() == 150.0
    w.observe(900, "b", 2000.0)
    assert w.idle_pace_ms() == 250.0  # at most the cap (a quarter of a's 1 s)
    assert w.idle_pace_ms(cap_ms=100.0) == 100.0
    w.observe(1000, "a", 200.0)  # a works again: read at once
    assert w.idle_pace_ms() == 0.0


@given(st.integers(min_value=2, max_value=8), st.integers(0, 999), st.integers(1, 30))
def test_idle_beaters_read_in_paced_batches_are_never_missed_and_a_dead_one_is_within_a_pace(
        count: int, phase: int, dies_after: int) -> None:
    """The stream read in batches, each read `idle_pace_ms` after the last (the monitor's pacing): live idle nodes
    are never missed, and a node that stops beating is missed at the first read after its stretched timeout has
    gone by on the stream's clock (which moves with the other nodes' beats)."""
    w = HeartbeatWatch(timeout_ms=800, interval_ms=200)
    nodes = {f"n{i}": 1000.0 for i in range(count)}  # an idle cluster: every worker at the 1 s idle pace
    dead = "n0"
    death = dies_after * nodes[dead]
    events = sorted((k * every + (i * 37 + phase) % 200, n, every) for i, (n, every) in enumerate(nodes.items())
                    for k in range(int(40_000 // every)) if n != dead or k * every <= death)
    read_at, i, missed_at = 0.0, 0, None
    while i < len(events):
        while i < len(events) and events[i][0] <= read_at:
            w.observe(*events[i])
            i += 1
        gone = [n for n, _ in w.missed()]
        assert set(gone) <= {dead}
        if gone and missed_at is None:
            missed_at = read_at
        read_at += max(w.idle_pace_ms(), 1.0)
    limit = 800.0 * nodes[dead] / 200.0
    last_beat = max(t for t, n, _ in events if n == dead)
    grain = max(every for n, every in nodes.items() if n != dead) + 200.0  # the clock's steps: the others' beats
    assert missed_at is not None and last_beat + limit < missed_at <= last_beat + limit + grain + 250.0
