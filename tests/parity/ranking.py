"""The decision comparison both ways: the simulator and the live pipeline on the same requests, the same cluster and
the same arrival times, and the order of the node policies by P99 time to first token."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from pipeline.config import DEFAULT_CONFIG_DIR, RackflowConfig, load_config
from pipeline.sim.report import summarize
from pipeline.sim.simulator import SimParams, Simulator
from pipeline.sim.traces import TraceRequest, assign_users, parse_mooncake, scale_rate
from pipeline.stats import percentile
from workers.sim.harness import cost_factory

REPO = Path(__file__).resolve().parents[2]


def window(path: Path, start: int, n: int, config: RackflowConfig, model: str = "qwen2-7b",
           seed: int = 2) -> list[TraceRequest]:
    """`n` requests of a Mooncake-format trace from `start` on, that the gateway accepts (prompt + output within
    the model's context: the live gateway answers the others 400, the simulator would run them), with Zipf users
    for those without one; arrivals from 0."""
    context = config.models[model].context
    with open(path, encoding="utf-8") as fh:
        rows = [r for r in parse_mooncake(fh, start + 4 * n) if r.in_tokens + r.out_tokens <= context][start:]
    rows = rows[:n]
    t0 = rows[0].arrival_ms
    rows = [replace(r, arrival_ms=r.arrival_ms - t0) for r in rows]
    return assign_users(rows, 500, 1.1, random.Random(seed))


def with_policy(config: RackflowConfig, policy: str) -> RackflowConfig:
    ns = config.policies.node_selection.model_copy(update={"policy": policy})
    return config.model_copy(update={"policies": config.policies.model_copy(update={"node_selection": ns})})


def capacity(config: RackflowConfig, reqs: Sequence[TraceRequest]) -> float:
    """Round robin's steady-state throughput under a flood of these requests (as `rackflow sim matrix`)."""
    flood = list(scale_rate(reqs, 100.0))
    sim = Simulator(with_policy(config, "round_robin"), flood, cost_factory(config), params=SimParams(admission=False))
    return float(summarize(sim.run())["steady_throughput_rps"])


def at_load(reqs: Sequence[TraceRequest], load: float, capacity_rps: float) -> list[TraceRequest]:
    span_s = reqs[-1].arrival_ms / 1000.0
    native = (len(reqs) - 1) / span_s
    return list(scale_rate(reqs, load * capacity_rps / native))


def sim_ttft_p99(config: RackflowConfig, reqs: Sequence[TraceRequest], policy: str) -> float:
    res = Simulator(with_policy(config, policy), list(reqs), cost_factory(config)).run()
    ttft = [res.first_token[i] - res.arrival[i] for i in range(len(reqs)) if res.first_token[i] >= 0
            and not res.dropped[i]]
    return percentile(ttft, 99)


def ranking(p99: dict[str, float]) -> list[str]:
    return sorted(p99, key=lambda p: p99[p])


def config_with(override: Path) -> RackflowConfig:
    return load_config(DEFAULT_CONFIG_DIR, [override])
