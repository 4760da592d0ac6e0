"""The `decisions_vllm` tier (`make test-decisions-vllm`; not yet in `.ci/run`): node choice on real engines. Two
vLLM CPU workers with prefix caching on, behind the whole pipeline, serve the same prefix-heavy multi-turn trace once
per policy (the default, round robin and an anchor), with the same arrivals, users and client caps; the oracle-free
simulator of the same setup (its engine timed by the profile fitted to these engines) predicts each run
(workers/sim/live_decisions.py). What must hold: every request served in every run, the default ahead of round robin
on P99 TTFT, and the live ranking on P99 TTFT the one the simulator predicts. The measured and the predicted figures
are printed side by side (`-s`) and written to the run's directory with a plot.

Record (900 requests per policy, this 2-core host). Until 2026-12-06 the default lost to round robin live (P99 TTFT
0.28-0.90x of round robin's in 3 runs) while the simulator predicted it 1.4-1.5x better: the vLLM engine published no
prefix blocks, so the default's precise index saw no prefix cached on either node (the simulator's always had them),
and its speed belief counted idle time as prefill. With both fixed (vLLM's own KV events; iterations timed from the
request that woke an idle engine, and summed), the default beat round robin in 3 of 4 runs (1.07-1.44x) and the
three-way ranking matched in none (kv_aware and work_aware, or kv_aware and round robin, within 5-20% of each other
live, in either order); with the late-binding hold on by default (8,192 tokens) the default beat round robin in 3
runs of 3 (1.36x, 1.20x, 1.28x live; 1.50x, 1.47x, 1.53x simulated) and the tier passed whole in 2 of them (in one
kv_aware was 0.8% ahead of round robin; in the third, kv_aware was 13% ahead of the default live, 25% behind it
simulated). The tier stays out of `.ci/run` until it passes run after run: the live P99 of one policy moves by 10-50%
between runs here, more than the simulated margins between the anchor and the others (12-34%), and the default's
live prefix hit rate stays under the simulated one (0.54-0.55 against 0.63; kv_aware 0.60 against 0.64)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from workers.sim.live_decisions import ANCHOR, format_report, live_decisions

pytestmark = [pytest.mark.decisions_vllm, pytest.mark.integration, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_ckpt: Path) -> dict[str, Any]:
    out = live_decisions(progress=False, keep_dir=tmp_path_factory.mktemp("live-decisions"))
    print("\n" + format_report(out))
    return out


def test_every_run_serves_every_request_and_the_simulator_sees_no_oracle(run: dict[str, Any]) -> None:
    assert run["oracle"] is False
    assert run["policies"][0] == run["default"] and "round_robin" in run["policies"] and ANCHOR in run["policies"]
    for pol in run["policies"]:
        live, sim = run["live"][pol], run["sim"][pol]
        assert live["completed"] == run["requests"] and live["lost"] == 0 and live["errors"] == 0, (pol, live)
        assert live["duplicates"] == 0, (pol, live)
        assert sim["completed"] == run["requests"] and sim["dropped"] == 0, (pol, sim)
        assert len(live["per_node"]) == run["nodes"], f"{pol} left a node idle: {live['per_node']}"
    saved = json.loads((Path(run["work_dir"]) / "live-decisions.json").read_text())
    assert set(saved["per_request"]) == set(run["policies"])
    assert Path(run["plot"]).stat().st_size > 10_000


def test_the_default_beats_round_robin_on_p99_ttft(run: dict[str, Any]) -> None:
    live = run["live"]
    assert live[run["default"]]["ttft_p99_ms"] < live["round_robin"]["ttft_p99_ms"], format_report(run)


def test_the_live_ranking_on_p99_ttft_is_the_simulators(run: dict[str, Any]) -> None:
    assert run["live_ranking"] == run["sim_ranking"], format_report(run)
