"""Summary figures of a simulation run (the JSON `rackflow sim run` prints)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pipeline.sim.simulator import SimResult
from pipeline.stats import percentile, sorted_percentiles


def summarize(res: SimResult, small_tokens: int = 256) -> dict[str, Any]:
    # 2 M requests in the 10 k GPU hour: the per-request figures as arrays (5.1 s -> 1.2 s there), the same numbers to
    # the last bit as a pass per request (elementwise IEEE arithmetic; the percentiles and median from the sorted
    # values by the same formula; tests/unit/test_sim_report.py compares the two)
    arrival = np.asarray(res.arrival, dtype=np.float64)
    finish = np.asarray(res.finish, dtype=np.float64)
    first_token = np.asarray(res.first_token, dtype=np.float64)
    dropped_mask = np.asarray(res.dropped, dtype=bool)
    done = (finish >= 0) & ~dropped_mask
    got_first = done & (first_token >= 0)
    is_small = (np.asarray(res.in_tokens, dtype=np.int64) + np.asarray(res.out_tokens, dtype=np.int64)) <= small_tokens
    lat = finish - arrival
    to_first = first_token - arrival
    e2e = lat[done]
    node_p95 = _node_p95(np.asarray(res.node_of, dtype=np.int64)[done], e2e)
    n_done = int(done.sum())
    first = float(arrival.min()) if len(arrival) else 0.0
    finishes = np.sort(finish[done])
    last = float(finishes[-1]) if n_done else first
    span_s = max(1e-9, (last - first) / 1000.0)
    out_tokens = int(np.asarray(res.out_tokens, dtype=np.int64)[done].sum())
    # completions per second between the 25th and 75th percentile of finish times: under sustained overload this
    # is the cluster's capacity, free of the start-up ramp and of the drain tail
    steady = 0.0
    if n_done >= 8:
        a, b = float(finishes[n_done // 4]), float(finishes[3 * n_done // 4])
        steady = (3 * n_done // 4 - n_done // 4) / max(1e-9, (b - a) / 1000.0)
    dropped = int(dropped_mask.sum())
    e50, e95, e99 = sorted_percentiles(np.sort(e2e), (50, 95, 99))
    t50, t95, t99 = sorted_percentiles(np.sort(to_first[got_first]), (50, 95, 99))
    (small_p95,) = sorted_percentiles(np.sort(lat[done & is_small]), (95,))
    (small_ttft_p95,) = sorted_percentiles(np.sort(to_first[got_first & is_small]), (95,))
    return {
        "requests": len(res.arrival),
        "completed": n_done,
        "dropped": dropped,
        "drop_reasons": dict(sorted(res.drop_reasons.items())),
        "p50_ms": round(e50, 1),
        "p95_ms": round(e95, 1),
        "p99_ms": round(e99, 1),
        "ttft_p50_ms": round(t50, 1),
        "ttft_p95_ms": round(t95, 1),
        "ttft_p99_ms": round(t99, 1),
        "small_p95_ms": round(small_p95, 1),
        "small_ttft_p95_ms": round(small_ttft_p95, 1),
        "small_requests": int((done & is_small).sum()),
        "throughput_rps": round(n_done / span_s, 3),
        "steady_throughput_rps": round(steady, 3),
        "output_tokens_per_s": round(out_tokens / span_s, 1),
        "mean_gpu_mem_util": round(statistics.fmean(res.mem_util), 4) if res.mem_util else 0.0,
        "mean_kv_util": round(statistics.fmean(res.kv_util), 4) if res.kv_util else 0.0,
        "mean_concurrency": round(statistics.fmean(res.concurrency), 1) if res.concurrency else 0.0,
        "mean_batch_mem_util": round(statistics.fmean(res.batch_mem_util), 4) if res.batch_mem_util else 0.0,
        "mean_batch_size": round(statistics.fmean(res.batch_sizes), 2) if res.batch_sizes else 0.0,
        "node_p95_std_ms": round(statistics.pstdev(node_p95), 1) if len(node_p95) > 1 else 0.0,
        "node_busy_std_pct": round(statistics.pstdev(
            [100 * b / max(1e-9, res.end_ms) for b in res.busy_ms]), 2) if len(res.busy_ms) > 1 else 0.0,
        "preemptions": res.preemptions,
        "migrations": res.migrations,
        "prefix_hit_rate": round(res.cached_tokens / res.prompt_tokens, 4) if res.prompt_tokens else 0.0,
        "host_hit_rate": round(res.host_hit_tokens / res.prompt_tokens, 4) if res.prompt_tokens else 0.0,
        "kv_util_peak": round(kv_util_peak(res), 4),
        "preempted_frac": round(res.preempted / len(res.arrival), 5) if res.arrival else 0.0,
        "shed": res.shed,
        "shed_frac": round(res.shed / len(res.arrival), 5) if res.arrival else 0.0,
        "simulated_s": round(res.end_ms / 1000.0, 1),
        "events": res.events,
        "nodes": len(res.node_names),
        "oracle": res.oracle,
        "belief_error_median": (round(statistics.median(res.belief_error_tenth), 4)
                                if res.belief_error_tenth else None),
        "belief_error_median_end": round(statistics.median(res.belief_error_end), 4) if res.belief_error_end else None,
        "expected_out_error_median": _expected_error(res),
    } | ({"control_plane": res.control_plane} if res.control_plane else {})


def _expected_error(res: SimResult) -> float | None:
    """Median over requests of |expected output / true output - 1| (0 with the oracle)."""
    e = np.asarray(res.expected_out, dtype=np.float64)
    t = np.asarray(res.out_tokens, dtype=np.float64)
    n = min(len(e), len(t))
    e, t = e[:n], t[:n]
    keep = (e > 0) & (t > 0)
    errs = np.sort(np.abs(e[keep] / t[keep] - 1.0))
    if not len(errs):
        return None
    k = len(errs) // 2  # statistics.median: the middle value, or the mean of the two middle ones
    return round(float(errs[k]) if len(errs) % 2 else (float(errs[k - 1]) + float(errs[k])) / 2, 4)


def _node_p95(nodes: np.ndarray, lat: np.ndarray) -> list[float]:
    """Each node's 95th percentile latency, the nodes in the order of their first completed request (as a dict
    filled in request order lists them)."""
    _, first_seen, counts = np.unique(nodes, return_index=True, return_counts=True)
    by_node = lat[np.lexsort((lat, nodes))]  # by node (ascending, as np.unique lists them), then latency
    ends = np.cumsum(counts)
    p95 = [sorted_percentiles(by_node[e - c:e], (95,))[0] for e, c in zip(ends.tolist(), counts.tolist(), strict=True)]
    return [p95[j] for j in np.argsort(first_seen, kind="stable").tolist()]


def kv_util_peak(res: SimResult) -> float:
    """KV utilisation at saturation: the cluster's KV used over KV capacity, averaged over each `util_bin_ms` of the
    run (the last, partial bin left out), at its fullest bin."""
    if not res.kv_bins:
        return 0.0
    full = int(res.end_ms // res.util_bin_ms)
    if full <= 0:
        return 0.0
    n = len(res.kv_bins)
    best = 0.0
    for k in range(full):
        used = sum(bins[k] for bins in res.kv_bins if k < len(bins))
        best = max(best, used / (n * res.util_bin_ms))
    return best


def per_node_load(res: SimResult) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for i in range(len(res.arrival)):
        if res.node_of[i] >= 0 and res.finish[i] >= 0:
            counts[res.node_names[res.node_of[i]]] += 1
    return dict(sorted(counts.items()))


def latencies(res: SimResult) -> tuple[list[float], list[float]]:
    done = [i for i in range(len(res.arrival)) if res.finish[i] >= 0 and not res.dropped[i]]
    return ([res.finish[i] - res.arrival[i] for i in done],
            [res.first_token[i] - res.arrival[i] for i in done if res.first_token[i] >= 0])


def completed_latencies(res: SimResult) -> list[tuple[float, float]]:
    """(TTFT, TPOT) in ms of every request that completed (finished, not dropped), in request order. TPOT is the
    time per output token after the first, (finish - first token) / (output tokens - 1), 0 for a 1-token output;
    a completed request without a first-token time (none in practice) has TTFT and TPOT infinite, so it meets no
    SLO."""
    out: list[tuple[float, float]] = []
    for i in range(len(res.arrival)):
        if res.finish[i] < 0 or res.dropped[i]:
            continue
        if res.first_token[i] < 0:
            out.append((math.inf, math.inf))
            continue
        n = res.out_tokens[i]
        tpot = (res.finish[i] - res.first_token[i]) / (n - 1) if n > 1 else 0.0
        out.append((res.first_token[i] - res.arrival[i], tpot))
    return out


def slo_met(lat: Sequence[tuple[float, float]], ttft_ms: float, tpot_ms: float) -> int:
    """How many of `lat` ((TTFT, TPOT) pairs, see `completed_latencies`) have TTFT <= ttft_ms and TPOT <= tpot_ms."""
    return sum(1 for t, p in lat if t <= ttft_ms and p <= tpot_ms)


def request_work(res: SimResult, i: int) -> int:
    """The work a request brings to the node it is routed to: its prompt tokens plus its output tokens."""
    return res.in_tokens[i] + res.out_tokens[i]


def rack_work_per_node(res: SimResult, rack_of_node: Mapping[str, str]) -> dict[str, float]:
    """Per rack: the work (`request_work`) of every request routed to one of its nodes (by `res.node_of`, whether
    it completed or not; a request never routed, e.g. shed, counts nowhere), over the rack's number of nodes
    (`rack_of_node`'s nodes, those that received nothing or died included). Nodes missing from `rack_of_node`
    are left out."""
    nodes: dict[str, int] = defaultdict(int)
    for rack in rack_of_node.values():
        nodes[rack] += 1
    work: dict[str, float] = dict.fromkeys(nodes, 0.0)
    names = res.node_names
    for i, k in enumerate(res.node_of):
        if k < 0 or k >= len(names):
            continue
        owner = rack_of_node.get(names[k])
        if owner is not None:
            work[owner] += request_work(res, i)
    return {r: work[r] / nodes[r] for r in sorted(nodes)}


def rack_imbalance(res: SimResult, rack_of_node: Mapping[str, str]) -> float:
    """The most loaded rack's work per node over the cluster's mean work per node (both as `rack_work_per_node`,
    the cluster's mean over every node of `rack_of_node`): 1.0 when every rack's nodes received the same work on
    average, 2.0 on two equal racks when one received all of it. 1.0 when no work was routed at all."""
    per_node = rack_work_per_node(res, rack_of_node)
    if not per_node:
        return 1.0
    counts: dict[str, int] = defaultdict(int)
    for rack in rack_of_node.values():
        counts[rack] += 1
    total = sum(per_node[r] * counts[r] for r in per_node)
    mean = total / sum(counts.values())
    if mean <= 0:
        return 1.0
    return max(per_node.values()) / mean


def served_tokens(res: SimResult, rids: Sequence[int], start_ms: float, end_ms: float) -> float:
    """The tokens the cluster served to the requests `rids` between `start_ms` and `end_ms`: a request's prompt
    tokens when its first token came (its prefill ended), its generated tokens spread evenly between its first token
    and its finish (decode runs at about one token per step). Only requests that finished count (a dropped one
    produced no result); a batch sequence preempted and run again counts its tokens once, over its whole span."""
    return sum(service_bins(res, rids, start_ms, end_ms - start_ms, 1))


def service_bins(res: SimResult, rids: Sequence[int], t0_ms: float, bin_ms: float, bins: int,
                 out_weight: float = 1.0) -> list[float]:
    """`served_tokens` per bin: bin k covers [t0_ms + k * bin_ms, t0_ms + (k + 1) * bin_ms). `out_weight`: a
    generated token's weight, a prompt token's being 1 (the virtual token counter's `w_out`, pipeline/priority.py)."""
    out = [0.0] * bins
    end = t0_ms + bins * bin_ms
    for i in rids:
        ft, fin = res.first_token[i], res.finish[i]
        if fin < 0 or ft < 0 or res.dropped[i]:
            continue
        if t0_ms <= ft < end:
            out[int((ft - t0_ms) // bin_ms)] += res.in_tokens[i]
        n = res.out_tokens[i] * out_weight
        if fin <= ft:  # one token, or all at once: at the first token
            if t0_ms <= ft < end:
                out[int((ft - t0_ms) // bin_ms)] += n
            continue
        if fin <= t0_ms or ft >= end:
            continue
        rate = n / (fin - ft)
        for k in range(max(0, int((ft - t0_ms) // bin_ms)), min(bins, int((fin - t0_ms) // bin_ms) + 1)):
            lo = t0_ms + k * bin_ms
            out[k] += rate * max(0.0, min(fin, lo + bin_ms) - max(ft, lo))
    return out


def ttft_percentile_bins(res: SimResult, rids: Sequence[int], t0_ms: float, bin_ms: float, bins: int,
                         q: float = 99.0) -> list[float | None]:
    """Per bin of arrival time (as `service_bins`), the q-th percentile TTFT (ms) of the requests `rids` that
    arrived in it and got a first token; None where none did."""
    per: list[list[float]] = [[] for _ in range(bins)]
    for i in rids:
        a, ft = res.arrival[i], res.first_token[i]
        if ft < 0 or res.dropped[i] or not t0_ms <= a < t0_ms + bins * bin_ms:
            continue
        per[int((a - t0_ms) // bin_ms)].append(ft - a)
    return [percentile(v, q) if v else None for v in per]


def equal_share_error(service: Mapping[str, Sequence[float]]) -> tuple[list[dict[str, float]], float]:
    """Per bin, each tenant's share of the service (`service`: per tenant, its service per bin; the bins aligned),
    and the largest |share - 1/T| / (1/T) over bins and tenants (T tenants): 0 when every bin is split equally, 1 when
    one of two tenants got nothing in some bin. A bin in which no tenant was served has no shares and counts as 1."""
    tenants = list(service)
    if not tenants:
        return [], 0.0
    fair = 1.0 / len(tenants)
    shares: list[dict[str, float]] = []
    worst = 0.0
    for k in range(min(len(v) for v in service.values())):
        total = sum(service[t][k] for t in tenants)
        if total <= 0:
            shares.append({})
            worst = max(worst, 1.0)
            continue
        row = {t: service[t][k] / total for t in tenants}
        shares.append(row)
        worst = max(worst, *(abs(x - fair) / fair for x in row.values()))
    return shares, worst
