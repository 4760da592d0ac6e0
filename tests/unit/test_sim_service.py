"""Per-request figures of a simulation by tenant and class: the tokens served over time, the shares of tenants, the
P99 TTFT by arrival bin, the per-request arrays of SimResult they read, and batch work alone waiting for a slot."""

from __future__ import annotations

import pytest

from pipeline.priority import BATCH
from pipeline.sim.report import equal_share_error, served_tokens, service_bins, ttft_percentile_bins
from pipeline.sim.simulator import SHED_REASON, SimParams, SimResult
from pipeline.sim.traces import TraceRequest
from tests.unit.test_sim import cfg, run


def result(arrival: list[float], first: list[float], finish: list[float], ins: list[int], outs: list[int],
           dropped: list[bool] | None = None) -> SimResult:
    n = len(arrival)
    return SimResult(arrival, first, finish, [0] * n, ins, outs, dropped or [False] * n, ["n"], ["h100-80gb"], [], [],
                     [], [], 0, 0, 0, 0, [], [], max(finish), 0)


def test_prompt_tokens_count_at_the_first_token_and_generated_ones_spread_to_the_finish() -> None:
    # request 0: prompt 100 at t=10 s, 60 generated tokens from 10 s to 70 s (one a second);
    # request 1: dropped, counts nowhere; request 2: one token, all at its first token (t=65 s)
    res = result([0.0, 0.0, 60_000.0], [10_000.0, 5_000.0, 65_000.0], [70_000.0, 8_000.0, 65_000.0],
                 [100, 999, 7], [60, 10, 1], [False, True, False])
    bins = service_bins(res, [0, 1, 2], 0.0, 30_000.0, 3)
    assert bins == pytest.approx([100 + 20, 30, 10 + 8])
    assert sum(bins) == pytest.approx(100 + 60 + 7 + 1), "every served token once, the dropped request's none"
    assert served_tokens(res, [0], 40_000.0, 55_000.0) == pytest.approx(15)
    assert served_tokens(res, [0], 0.0, 10_000.0) == 0, "the prompt counts when its prefill ends, not before"
    weighted = service_bins(res, [0], 0.0, 30_000.0, 3, out_weight=2.0)
    assert weighted == pytest.approx([100 + 40, 60, 20])


def test_equal_shares_score_zero_and_a_tenant_left_out_scores_one() -> None:
    shares, err = equal_share_error({"a": [10.0, 30.0], "b": [10.0, 10.0]})
    assert shares == [{"a": 0.5, "b": 0.5}, {"a": 0.75, "b": 0.25}]
    assert err == pytest.approx(0.5)
    assert equal_share_error({"a": [5.0], "b": [0.0]})[1] == pytest.approx(1.0)
    assert equal_share_error({"a": [0.0], "b": [0.0]})[1] == 1.0, "a bin where nobody was served is no fair bin"


def test_p99_ttft_per_arrival_bin() -> None:
    res = result([0.0, 1_000.0, 31_000.0], [100.0, 1_900.0, 31_050.0], [500.0, 2_000.0, 32_000.0], [1, 1, 1],
                 [2, 2, 2])
    assert ttft_percentile_bins(res, [0, 1, 2], 0.0, 30_000.0, 3, q=100) == [900.0, 50.0, None]


def test_a_run_reports_each_requests_tenant_class_and_why_it_was_dropped() -> None:
    # 500 requests a second on one node, a quarter of them batch: the gateway sheds some, the engine preempts batch
    # sequences for interactive ones
    reqs = [TraceRequest(i * 2.0, 2000, 200, user_id=f"u{i % 7}", tenant="a" if i % 3 else "b",
                         priority=BATCH if i % 4 == 0 else 0) for i in range(4000)]
    res = run(cfg(racks=1, nodes=1, policy="round_robin"), reqs)
    assert res.tenant == [r.tenant for r in reqs] and res.priority == [r.priority for r in reqs]
    assert all(bool(r) == d for r, d in zip(res.drop_reason, res.dropped, strict=True))
    assert res.shed > 0 and sum(1 for r in res.drop_reason if r == SHED_REASON) == res.shed
    assert {r for r in res.drop_reason if r} <= set(res.drop_reasons)
    assert 0 < res.priority_preemptions <= res.preemptions


def test_batch_work_alone_with_no_free_slot_waits_for_one_and_completes() -> None:
    # 40 batch requests at once on one node with 4 sequence slots and no interactive work: the window has no
    # interactive request open, so the simulator waits for a slot to free (it asserted an open window before)
    reqs = [TraceRequest(0.0, 500, 50, user_id=f"j{i}", tenant="job", priority=BATCH) for i in range(40)]
    params = SimParams(max_num_seqs=4, check_invariants=True)
    res = run(cfg(racks=1, nodes=1, policy="round_robin"), reqs, params=params)
    assert all(f >= 0 for f in res.finish) and not any(res.dropped)
