"""`rackflow sim matrix` (workers/sim/matrix.py): the capacity flood, the same arrivals for every policy of a cell,
goodput within the cell's SLO over every offered request, the best policy per figure, shed requests counted against
goodput and the shed share but not in the latency percentiles, rack imbalance; real simulator runs on small traces."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from pathlib import Path

import pytest

from pipeline.config import ALL_NODE_POLICIES, DEFAULT_CONFIG_DIR
from pipeline.sim.report import completed_latencies, rack_imbalance, rack_work_per_node
from pipeline.sim.simulator import SimResult
from pipeline.sim.traces import SyntheticSpec, synthetic, to_jsonl
from pipeline.stats import percentile
from workers.sim import matrix as M

REPO = Path(__file__).resolve().parents[2]
CONV = str(REPO / "data" / "traces" / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv")
MOONCAKE = str(REPO / "data" / "traces" / "mooncake-fast25" / "synthetic_trace.jsonl")
COMMON = {"config_dir": str(DEFAULT_CONFIG_DIR), "overrides": (), "cluster": None, "users": 200}
SEED = 7
LOOSE = (1e12, 1e12)


def job(trace: str, fmt: str, limit: int, policy: str, scale: float, admission: bool = True) -> M.Job:
    return M.Job(**COMMON, trace=trace, fmt=fmt, limit=limit, seed=SEED, policy=policy, rate_scale=scale,  # type: ignore[arg-type]
                 faults=(), admission=admission)


def at_load(trace: str, fmt: str, limit: int, load: float) -> float:
    """The rate scale of `load` x the trace's capacity."""
    cap = M.measure_capacity(COMMON, trace, fmt, limit, SEED)["capacity_rps"]
    return load * cap / M._span_rate(M._trace(trace, fmt, limit, 200, SEED))


# (a) capacity


def test_the_capacity_flood_offers_at_least_twice_what_it_completes() -> None:
    fl = M.measure_capacity(COMMON, CONV, "azure", 400, SEED)
    assert fl["capacity_rps"] > 0
    assert fl["flood_offered_rps"] >= M.FLOOD_OVER_CAPACITY * fl["capacity_rps"]
    # the flood itself, run again: what it offers (its arrivals) against what it completes
    flood = job(CONV, "azure", 400, "round_robin", fl["flood_scale"], admission=False)
    reqs = M.job_requests(flood)
    offered = (len(reqs) - 1) / ((reqs[-1].arrival_ms - reqs[0].arrival_ms) / 1000.0)
    r = M.run_job(flood)
    assert r["steady_throughput_rps"] == pytest.approx(fl["capacity_rps"], abs=1e-3)
    assert offered >= 2.0 * r["steady_throughput_rps"] > 0
    assert r["shed_429_frac"] == 0.0  # admission off: a flood measures what the cluster serves, not what it sheds


# (b) the same arrivals for every policy of a cell


def test_every_policy_of_a_cell_gets_exactly_the_same_arrivals() -> None:
    spec = M.TraceSpec(CONV, "azure", "tuning", (250.0, 100.0), 200)
    reqs = M._trace(CONV, "azure", 200, 200, SEED)
    plan = M.TracePlan(spec, 200, 150.0, M._span_rate(reqs), reqs[-1].arrival_ms - reqs[0].arrival_ms)
    seeds = [SEED, SEED + 1000]
    jobs, keys = M.build_jobs(COMMON, [plan], [0.5, 1.5], M.STATES, ALL_NODE_POLICIES, seeds, "r0-n1")
    assert len(jobs) == len(keys) == 2 * len(M.STATES) * len(ALL_NODE_POLICIES) * len(seeds)
    cells: dict[tuple[object, ...], list[M.Job]] = {}
    for j, (path, load, state, pol) in zip(jobs, keys, strict=True):
        assert (path, pol) == (j.trace, j.policy)
        cells.setdefault((path, load, state, j.seed), []).append(j)
    assert len(cells) == 2 * len(M.STATES) * len(seeds)
    for group in cells.values():
        assert sorted(j.policy for j in group) == sorted(ALL_NODE_POLICIES)
        first = group[0]
        # the jobs differ in the policy alone ...
        assert all(dataclasses.replace(j, policy=first.policy) == first for j in group)
        # ... so each offers the very same requests: arrival times, lengths, prefixes, users
        want = [(r.arrival_ms, r.in_tokens, r.out_tokens, r.prefix_hashes, r.user_id) for r in M.job_requests(first)]
        assert len(want) == 200
        for j in group[1:]:
            assert [(r.arrival_ms, r.in_tokens, r.out_tokens, r.prefix_hashes, r.user_id)
                    for r in M.job_requests(j)] == want
    # a higher load is the same requests, compressed
    lo = M.job_requests(next(j for j, k in zip(jobs, keys, strict=True) if k[1] == 0.5))
    hi = M.job_requests(next(j for j, k in zip(jobs, keys, strict=True) if k[1] == 1.5))
    assert [r.in_tokens for r in lo] == [r.in_tokens for r in hi]
    assert hi[-1].arrival_ms == pytest.approx(lo[-1].arrival_ms / 3.0)


# (c) scoring


def test_goodput_counts_the_completions_within_both_slo_bounds_over_the_offered_span() -> None:
    runs = [{"_lat": [(100.0, 10.0), (300.0, 10.0), (100.0, 50.0), (200.0, 0.0)], "_span_s": 2.0},
            {"_lat": [(100.0, 10.0)], "_span_s": 4.0}]
    # (100, 10) and (200, 0) meet TTFT <= 200 and TPOT <= 20 (bounds included); (300, 10) and (100, 50) do not
    assert M.goodput_rps(runs[:1], (200.0, 20.0)) == 1.0
    assert M.goodput_rps(runs, (200.0, 20.0)) == round((2 / 2.0 + 1 / 4.0) / 2, 3)  # repeats: the mean
    assert M.goodput_rps(runs, (0.0, 0.0)) == 0.0
    assert M.goodput_rps([{"_lat": [(math.inf, math.inf)], "_span_s": 1.0}], LOOSE) == 0.0


def test_goodput_of_a_real_run_is_zero_under_an_impossible_slo_and_the_served_rate_under_a_loose_one() -> None:
    r = M.run_job(job(CONV, "azure", 300, "least_outstanding", at_load(CONV, "azure", 300, 0.8)))
    assert r["completed"] == len(r["_lat"]) > 0
    assert M.goodput_rps([r], (0.0, 0.0)) == 0.0  # no TTFT is 0
    assert M.goodput_rps([r], LOOSE) == round(r["completed"] / r["_span_s"], 3) == r["served_rps"]
    # in between, exactly the requests meeting both bounds: TPOT = (finish - first token) / (output tokens - 1)
    ttft_mid = percentile([t for t, _ in r["_lat"]], 50)
    tpot_mid = percentile([p for _, p in r["_lat"]], 50)
    met = sum(1 for t, p in r["_lat"] if t <= ttft_mid and p <= tpot_mid)
    assert 0 < met < r["completed"]
    assert M.goodput_rps([r], (ttft_mid, tpot_mid)) == round(met / r["_span_s"], 3)
    p = M.pooled([r], (ttft_mid, tpot_mid))
    assert p["slo_met"] == met and p["goodput_rps"] < p["throughput_rps"]
    assert "belief_error_median" in p and "rack_imbalance" in p and set(p["rack_work_per_node"]) == {"r0", "r1"}


def fig(goodput: float, ttft: float, shed: float, e2e: float = 1000.0, tput: float = 10.0) -> dict[str, float]:
    return {"goodput_rps": goodput, "p99_ttft_ms": ttft, "shed_frac": shed, "p99_ms": e2e, "throughput_rps": tput}


def test_best_picks_goodput_first_and_p99_ttft_only_among_the_low_shed_policies() -> None:
    pols = {
        "sheds_most": fig(10.0, 100.0, 0.05, e2e=500.0),  # the lowest TTFT, by shedding 5 points more
        "lowest_shed": fig(12.0, 200.0, 0.0, tput=11.0),
        "within_a_point": fig(11.0, 150.0, 0.01),  # exactly 1 point above the lowest: still a peer
        "just_over": fig(11.5, 50.0, 0.0101),
    }
    assert M.low_shed_peers(pols) == ["lowest_shed", "within_a_point"]
    best = M.best_of(pols)
    assert best == {"goodput_rps": "lowest_shed", "p99_ttft_ms": "within_a_point", "p99_ms": "sheds_most",
                    "throughput_rps": "lowest_shed"}
    cell = {"policies": pols, "load": 0.8, "split": "tuning"}
    r = M.worst_ratio(cell, "sheds_most")
    assert not r.low_shed and r.goodput == pytest.approx(1.2) and r.ttft == pytest.approx(100 / 150)
    r = M.worst_ratio(cell, "within_a_point")
    assert r.low_shed and r.ttft == 1.0 and r.goodput == pytest.approx(12 / 11)
    s = M.summary({"default": "lowest_shed", "cells": [cell, {**cell, "load": 1.5, "split": "test"}]})
    assert s == {"test": {"cells": 1, "goodput_within": 1, "ttft_cells": 0, "ttft_within": 0},
                 "tuning": {"cells": 1, "goodput_within": 1, "ttft_cells": 1, "ttft_within": 0}}  # TTFT x1.33


# (d) shed requests


def test_shed_requests_count_against_goodput_and_the_shed_share_but_not_in_the_percentiles() -> None:
    r = M.run_job(job(MOONCAKE, "mooncake", 400, "round_robin", at_load(MOONCAKE, "mooncake", 400, 3.0)))
    n, done = r["requests"], r["completed"]
    assert n == 400 and 0 < done < n
    assert r["shed_429_frac"] > 0.05  # the gateway's admission shed (429) ...
    assert r["shed_frac"] == round((n - done) / n, 5) >= r["shed_429_frac"]  # ... and every other loss counts too
    # the percentiles are over what completed
    assert len(r["_ttft"]) == len(r["_e2e"]) == len(r["_lat"]) == done
    p = M.pooled([r], LOOSE)
    assert p["p99_ttft_ms"] == round(percentile(r["_ttft"], 99), 1)
    # goodput, even with every completion within the SLO, is what completed over the offered span, not n over it
    assert p["goodput_rps"] == round(done / r["_span_s"], 3) < n / r["_span_s"]
    assert p["shed_frac"] == r["shed_frac"] and p["completed"] == done and p["requests"] == n


# rack imbalance


def sim_result(node_of: list[int], in_tokens: list[int], out_tokens: list[int], names: list[str]) -> SimResult:
    k = len(node_of)
    return SimResult(arrival=[0.0] * k, first_token=[10.0] * k, finish=[20.0] * k, node_of=node_of,
                     in_tokens=in_tokens, out_tokens=out_tokens, dropped=[False] * k, node_names=names,
                     node_gpus=["h100"] * len(names), mem_util=[], kv_util=[], concurrency=[], busy_ms=[],
                     preemptions=0, prompt_tokens=sum(in_tokens), cached_tokens=0, migrations=0, batch_mem_util=[],
                     batch_sizes=[], end_ms=20.0, events=0)


RACKS = {"a": "r0", "b": "r0", "c": "r1", "d": "r1"}


def test_rack_imbalance_is_the_busiest_racks_work_per_node_over_the_cluster_mean() -> None:
    # a: 300 + 100; c: 100 + 100; b: 0 + 200; a request never routed (shed) counts nowhere; node "x" is in no rack
    res = sim_result([0, 2, -1, 1, 4], [300, 100, 1000, 0, 999], [100, 100, 1000, 200, 1], ["a", "b", "c", "d", "x"])
    assert rack_work_per_node(res, RACKS) == {"r0": 300.0, "r1": 100.0}  # 600 / 2 nodes, 200 / 2 nodes (d idle)
    assert rack_imbalance(res, RACKS) == pytest.approx(300.0 / 200.0)  # cluster: 800 over 4 nodes
    even = sim_result([0, 1, 2, 3], [10] * 4, [5] * 4, ["a", "b", "c", "d"])
    assert rack_imbalance(even, RACKS) == 1.0
    one_rack = sim_result([0, 1], [10, 10], [0, 0], ["a", "b", "c", "d"])
    assert rack_imbalance(one_rack, RACKS) == 2.0
    assert rack_imbalance(sim_result([-1], [10], [1], ["a", "b", "c", "d"]), RACKS) == 1.0
    # completed_latencies: TPOT over the tokens after the first, 0 for a single token
    assert completed_latencies(sim_result([0, 1], [1, 1], [1, 11], ["a", "b"])) == [(10.0, 0.0), (10.0, 1.0)]


# traces, splits, SLOs, and the JSON the acceptance check reads


def write_trace(path: Path, n: int, seed: int) -> str:
    spec = SyntheticSpec(requests=n, rate_rps=20.0, in_mean=3000.0, out_mean=60.0, shared_prefix_users=0.5)
    with open(path, "w", encoding="utf-8") as fh:
        for r in synthetic(spec, random.Random(seed)):
            fh.write(to_jsonl(r) + "\n")
    return str(path)


def test_traces_parse_with_format_split_and_slo(tmp_path: Path) -> None:
    user = write_trace(tmp_path / "user.jsonl", 50, 1)
    [t] = M.parse_traces(f"{user}:mooncake")
    assert (t.split, t.slo, t.limit) == ("test", None, None)  # a user trace is held out, its SLO by default_slo
    [t] = M.parse_traces(f"{user}:mooncake:tuning")
    assert t.split == "tuning"
    [t] = M.parse_traces(f"{CONV}:azure")  # a table trace keeps its split, SLO and limit
    assert (t.split, t.slo, t.limit) == ("tuning", (250.0, 100.0), M.TRACES[0].limit)
    for bad in (f"{user}:jsonl", f"{user}:mooncake:train", user, f"{tmp_path / 'none.jsonl'}:mooncake"):
        with pytest.raises(SystemExit):
            M.parse_traces(bad)
    splits = {t.split for t in M.default_traces()}
    assert "tuning" in splits and all(Path(t.path).exists() for t in M.default_traces())
    assert {t.split for t in M.TRACES} == {"tuning", "test"} and all(t.slo for t in M.TRACES)
    reqs = M._trace(user, "mooncake", None, 10, 1)
    ttft, tpot = M.default_slo(reqs)
    mean = sum(r.in_tokens for r in reqs) / len(reqs)
    assert ttft == pytest.approx(M.TTFT_MS_PER_PROMPT_TOKEN * mean, abs=5.0) and tpot == M.DEFAULT_TPOT_MS
    assert M.default_slo([dataclasses.replace(reqs[0], in_tokens=10)]) == (250.0, M.DEFAULT_TPOT_MS)


def test_a_small_matrix_writes_what_the_acceptance_check_reads(tmp_path: Path) -> None:
    a = write_trace(tmp_path / "a.jsonl", 120, 2)
    b = write_trace(tmp_path / "b.jsonl", 120, 3)
    args = argparse.Namespace(
        traces=f"{a}:mooncake:tuning,{b}:mooncake", loads="0.8,1.5", states="healthy", policies="round_robin",
        config_dir=str(DEFAULT_CONFIG_DIR), config=[], cluster=None, jobs=1, repeats=1, seed=SEED, requests=None,
        users=50, no_progress=True, out=str(tmp_path / "out"), json=False)
    assert M.cmd_matrix(args) == 0
    d = json.loads((tmp_path / "out" / "matrix.json").read_text())
    assert d["oracle"] is False and d["prefix_shares_kv"] is False and d["splits"] == {a: "tuning", b: "test"}
    assert d["policies"] == ["round_robin", d["default"]] and len(d["cells"]) == 4
    for c in d["cells"]:
        assert c["split"] == d["splits"][c["trace"]] and set(c["slo"]) == {"ttft_ms", "tpot_ms"}
        assert c["slo"] == d["slos"][c["trace"]]
        assert set(c["best"]) == {"goodput_rps", "p99_ttft_ms", "p99_ms", "throughput_rps"}
        for p in c["policies"].values():
            assert set(M.METRICS) <= set(p)
            assert 0.0 <= p["goodput_rps"] <= p["throughput_rps"] and 0.0 <= p["shed_frac"] <= 1.0
    assert set(d["summary"]) == {"tuning", "test"}
    assert {Path(p).name for p in d["plots"]} == {"matrix-ttft.png", "matrix-goodput.png", "matrix-pareto.png"}
    assert all(Path(p).stat().st_size > 0 for p in d["plots"])
    table = (tmp_path / "out" / "matrix.txt").read_text()
    assert "best goodput" in table and "tuning: the default is within 3%" in table
    # the args had no `oracle` (the CLI flag is optional): off; on, it goes into every job's SimParams
    spec = M.TraceSpec(a, "mooncake")
    plan = M.TracePlan(spec, None, 10.0, 20.0, 6000.0)
    jobs, _ = M.build_jobs(COMMON, [plan], [1.0], M.STATES, ["round_robin"], [SEED], "r0-n1", oracle=True)
    assert len(jobs) == 3 and all(j.oracle for j in jobs)
    assert [len(j.faults) for j in jobs] == [0, 1, 1]



def test_a_progress_bar_reaches_every_request_when_some_are_shed() -> None:
    """The simulator's progress counts settled requests (completed or shed): on a run that sheds, its bar ends at
    100%, where counting completions alone left it short (a user saw 73%)."""
    from pipeline.sim.simulator import SimParams, Simulator
    from workers.sim.harness import cost_factory

    j = job(MOONCAKE, "mooncake", 400, "round_robin", at_load(MOONCAKE, "mooncake", 400, 3.0))
    cfg = M._config(j.config_dir, j.overrides, j.cluster, j.policy, j.seed)
    seen: list[tuple[int, int]] = []
    res = Simulator(cfg, M.job_requests(j), cost_factory(cfg), params=SimParams(admission=True),
                    progress=lambda _now, arrived, settled: seen.append((arrived, settled))).run()
    assert 0 < sum(res.dropped) < 400
    assert seen and seen[-1] == (400, 400)
    assert all(settled <= 400 for _a, settled in seen)


def test_prefix_shares_kv_reaches_every_job_and_the_json() -> None:
    """`--prefix-shares-kv` (vLLM's pool: cached blocks only in the room the running sequences leave) goes into
    every job's SimParams, and under round robin (placement blind to the cache) never raises the hit rate over the
    separate cache's. The effect itself is tested on one node (test_sim_decisions.py)."""
    mooncake = next(t for t in M.TRACES if t.fmt == "mooncake")
    plan = M.TracePlan(mooncake, 600, 10.0, 20.0, 6000.0)
    shared = {**COMMON, "prefix_shares_kv": True}
    jobs, _ = M.build_jobs(shared, [plan], [1.0], ["healthy"], ["round_robin"], [SEED], "r0-n1")
    assert jobs and all(j.prefix_shares_kv for j in jobs)
    job = M.Job(**COMMON, trace=mooncake.path, fmt="mooncake", limit=600, seed=SEED, policy="round_robin",
                rate_scale=4.0, faults=())
    apart, pooled = M.run_job(job), M.run_job(dataclasses.replace(job, prefix_shares_kv=True))
    assert 0.0 < pooled["prefix_hit_rate"] <= apart["prefix_hit_rate"]
