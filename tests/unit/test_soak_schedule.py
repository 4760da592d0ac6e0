"""The soak's chaos schedule (workers/bench/soak.py `_schedule`) and its memory summary: a kill every period, the
Valkey and etcd restarts between two kills (never on one), and Valkey's memory read at the first minute and at the
end of the load."""

from __future__ import annotations

from workers.bench.soak import _memory_summary, _schedule


def test_twenty_minutes_have_39_kills_and_one_restart_of_each_server_between_kills() -> None:
    s = _schedule(20 * 60, 30.0, True, True)
    kills = [t for t, what in s if what == "role"]
    assert len(kills) == 39 and kills[0] == 30.0 and kills[-1] == 1170.0
    servers = {what: t for t, what in s if what != "role"}
    assert set(servers) == {"valkey", "etcd"}
    assert all(min(abs(t - k) for k in kills) == 15.0 for t in servers.values()), servers
    assert servers["etcd"] != servers["valkey"] and [t for t, _ in s] == sorted(t for t, _ in s)


def test_a_short_soak_still_restarts_both_servers_before_it_ends() -> None:
    s = _schedule(90, 30.0, True, True)
    assert [w for _t, w in s].count("role") == 2
    assert {w for _t, w in s} == {"role", "valkey", "etcd"} and max(t for t, _ in s) < 90
    assert {w for _t, w in _schedule(90, 30.0, False, False)} == {"role"}


def test_memory_summary_reads_the_first_minute_and_the_end_of_the_load() -> None:
    samples = [(float(t), 10.0 + t / 60) for t in range(0, 700, 5)]
    m = _memory_summary(samples, load_end_s=600.0)
    assert m["after_first_minute"] == 11.0
    assert m["end"] == round(10.0 + 600 / 60, 2) and m["after_drain"] == round(samples[-1][1], 2)
    assert _memory_summary([], 60.0)["after_first_minute"] is None
