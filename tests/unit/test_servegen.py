"""Drawing a trace from ServeGen's client data (workers/sim/servegen.py): each client keeps its rate, arrival
pattern and length distributions; bad data is a clear TraceError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.sim.traces import TraceError, parse_mooncake, to_jsonl
from workers.sim.servegen import LengthDist, busiest_hour, draw, load_clients, summary


def write_client(d: Path, n: int, rows: list[str], lengths: dict[str, dict[str, str]]) -> None:
    (d / f"chunk-{n}-trace.csv").write_text("\n".join(rows) + "\n")
    (d / f"chunk-{n}-dataset.json").write_text(json.dumps(lengths))


@pytest.fixture
def data(tmp_path: Path) -> Path:
    # client 1: 0.5 req/s in the first window of hour 1 (Gamma), nothing after; prompts 100 or 300, outputs 1,000
    write_client(tmp_path, 1, ["3600,0.5,1.0,Gamma,1.0,2.0", "4200,0,0,,0,0"],
                 {"0": {"input_tokens": "{}", "output_tokens": "{}"},
                  "3600": {"input_tokens": "{100: 0.5, 300: 0.5}", "output_tokens": "{1000: 1.0}"}})
    # client 2: 0.1 req/s in both windows of hour 1 (Weibull) and in hour 5
    write_client(tmp_path, 2, ["3600,0.1,2.0,Weibull,0.5,1.0", "4200,0.1,2.0,Weibull,0.5,1.0",
                               "18000,0.05,1.0,Gamma,1.0,1.0"],
                 {"0": {"input_tokens": "{20: 1.0}", "output_tokens": "{7: 1.0}"}})
    return tmp_path


def test_each_client_keeps_its_rate_window_and_lengths(data: Path) -> None:
    clients = load_clients(data)
    assert [c.client_id for c in clients] == ["chunk-1", "chunk-2"]
    assert busiest_hour(clients) == 1
    reqs = draw(clients, 3600, 3600, seed=7)
    by_user: dict[str, list] = {}
    for r in reqs:
        by_user.setdefault(r.user_id, []).append(r)
    assert len(by_user["client-1"]) == 300 and len(by_user["client-2"]) == 120  # rate x 600 s per window
    assert all(0 <= r.arrival_ms < 600_000 for r in by_user["client-1"])  # its one window
    assert {r.in_tokens for r in by_user["client-1"]} == {100, 300}
    assert {r.out_tokens for r in by_user["client-1"]} == {1000}
    assert {(r.in_tokens, r.out_tokens) for r in by_user["client-2"]} == {(20, 7)}
    assert [r.arrival_ms for r in reqs] == sorted(r.arrival_ms for r in reqs)
    assert draw(clients, 3600, 3600, seed=7) == reqs and draw(clients, 3600, 3600, seed=8) != reqs
    # thinned, and written as Mooncake JSONL that the matrix reads back
    kept = draw(clients, 3600, 3600, seed=7, keep=0.25)
    assert 60 < len(kept) < 150
    back = list(parse_mooncake([to_jsonl(r) for r in kept]))
    assert [(b.in_tokens, b.out_tokens, b.user_id) for b in back] == [(r.in_tokens, r.out_tokens, r.user_id)
                                                                       for r in kept]
    assert summary(kept)["users"] == 2


def test_length_draws_follow_the_published_distribution() -> None:
    import random

    dist = LengthDist.parse("{10: 0.25, 20: 0.75}")
    rng = random.Random(1)
    draws = [dist.draw(rng) for _ in range(4000)]
    assert 0.22 < draws.count(10) / 4000 < 0.28


def test_bad_data_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"no chunk-N-trace\.csv"):
        load_clients(tmp_path)
    one = {"0": {"input_tokens": "{1: 1.0}", "output_tokens": "{1: 1.0}"}}
    write_client(tmp_path, 1, ["0,1.0,1.0,Gamma,x,1.0"], one)
    with pytest.raises(TraceError, match="line 1"):
        load_clients(tmp_path)
    write_client(tmp_path, 1, ["0,1.0,1.0,Pareto,1.0,1.0"], one)
    with pytest.raises(TraceError, match="unknown arrival pattern"):
        draw(load_clients(tmp_path), 0, 3600, seed=1)
