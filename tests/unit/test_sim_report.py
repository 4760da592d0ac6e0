"""The run summary (pipeline/sim/report.py) computes its per-request figures over arrays: the same numbers, to the
last bit, as the plain pass over every request it replaced (`reference` below), on real runs and on edge cases."""

from __future__ import annotations

import random
import statistics
from collections import defaultdict
from typing import Any

import pytest

from pipeline.sim.report import summarize
from pipeline.sim.simulator import Fault, SimParams, SimResult
from pipeline.stats import percentile, percentiles
from tests.unit.test_sim import azure, cfg, run

PER_REQUEST = ("requests", "completed", "dropped", "p50_ms", "p95_ms", "p99_ms", "ttft_p50_ms", "ttft_p95_ms",
               "ttft_p99_ms", "small_p95_ms", "small_ttft_p95_ms", "small_requests", "throughput_rps",
               "steady_throughput_rps", "output_tokens_per_s", "node_p95_std_ms", "expected_out_error_median")


def reference(res: SimResult, small_tokens: int = 256) -> dict[str, Any]:
    """The summary's per-request figures, one request at a time (the code before the arrays)."""
    done = [i for i in range(len(res.arrival)) if res.finish[i] >= 0 and not res.dropped[i]]
    e2e = [res.finish[i] - res.arrival[i] for i in done]
    ttft = [res.first_token[i] - res.arrival[i] for i in done if res.first_token[i] >= 0]
    is_small = [res.in_tokens[i] + res.out_tokens[i] <= small_tokens for i in range(len(res.arrival))]
    small = [res.finish[i] - res.arrival[i] for i in done if is_small[i]]
    small_ttft = [res.first_token[i] - res.arrival[i] for i in done if is_small[i] and res.first_token[i] >= 0]
    per_node: dict[int, list[float]] = defaultdict(list)
    for i in done:
        per_node[res.node_of[i]].append(res.finish[i] - res.arrival[i])
    node_p95 = [percentile(v, 95) for v in per_node.values() if v]
    first = min(res.arrival) if res.arrival else 0.0
    last = max((res.finish[i] for i in done), default=first)
    span_s = max(1e-9, (last - first) / 1000.0)
    finishes = sorted(res.finish[i] for i in done)
    steady = 0.0
    if len(finishes) >= 8:
        a, b = finishes[len(finishes) // 4], finishes[3 * len(finishes) // 4]
        steady = (3 * len(finishes) // 4 - len(finishes) // 4) / max(1e-9, (b - a) / 1000.0)
    e50, e95, e99 = percentiles(e2e, (50, 95, 99))
    t50, t95, t99 = percentiles(ttft, (50, 95, 99))
    errs = [abs(e / t - 1.0) for e, t in zip(res.expected_out, res.out_tokens, strict=False) if e > 0 and t > 0]
    return {
        "requests": len(res.arrival), "completed": len(done), "dropped": sum(1 for d in res.dropped if d),
        "p50_ms": round(e50, 1), "p95_ms": round(e95, 1), "p99_ms": round(e99, 1),
        "ttft_p50_ms": round(t50, 1), "ttft_p95_ms": round(t95, 1), "ttft_p99_ms": round(t99, 1),
        "small_p95_ms": round(percentile(small, 95), 1), "small_ttft_p95_ms": round(percentile(small_ttft, 95), 1),
        "small_requests": len(small), "throughput_rps": round(len(done) / span_s, 3),
        "steady_throughput_rps": round(steady, 3),
        "output_tokens_per_s": round(sum(res.out_tokens[i] for i in done) / span_s, 1),
        "node_p95_std_ms": round(statistics.pstdev(node_p95), 1) if len(node_p95) > 1 else 0.0,
        "expected_out_error_median": round(statistics.median(errs), 4) if errs else None,
    }


def same(res: SimResult) -> None:
    got, want = summarize(res), reference(res)
    for k in PER_REQUEST:
        assert got[k] == want[k] and type(got[k]) is type(want[k]), (k, got[k], want[k])


def test_a_run_with_a_node_dying() -> None:
    res = run(cfg(), azure(1500, rate=12.0), faults=[Fault(20_000.0, "r0-n1", "death")])
    assert res.migrations > 0  # its live sequences moved: more than the happy path
    same(res)


def test_an_oracle_run() -> None:
    same(run(cfg(), azure(600, rate=4.0), params=SimParams(oracle=True)))


def synthetic(n: int, seed: int, drop: float, no_first: float) -> SimResult:
    rng = random.Random(seed)
    arrival = sorted(rng.uniform(0, 1e6) for _ in range(n))
    finish, first, dropped = [], [], []
    for a in arrival:
        d = rng.random() < drop
        f = -1.0 if d or rng.random() < 0.05 else a + rng.expovariate(1 / 900.0)
        finish.append(f)
        first.append(-1.0 if f < 0 or rng.random() < no_first else a + (f - a) * rng.random())
        dropped.append(d)
    out = [rng.randint(1, 400) for _ in range(n)]
    nodes = [rng.randrange(7) for _ in range(n)]
    prompts = [rng.randint(1, 300) for _ in range(n)]
    return SimResult(arrival, first, finish, nodes, prompts, out, dropped, [f"n{i}" for i in range(7)],
                     ["h100-80gb"] * 7, [0.5] * 7, [0.4] * 7, [1.0] * 7, [1.0] * 7, 0, 0, 0, 0, [0.5], [1], 1e6, 0,
                     expected_out=[rng.randint(0, 500) for _ in range(n - 3)])


@pytest.mark.parametrize("n,drop,no_first", [(0, 0.0, 0.0), (1, 0.0, 0.0), (5, 0.0, 0.0), (9, 1.0, 0.0),
                                             (2001, 0.1, 0.02), (2000, 0.0, 0.5)])
def test_edge_cases(n: int, drop: float, no_first: float) -> None:
    same(synthetic(n, n + 7, drop, no_first))
