"""The `decisions_vllm` tier (`make test-decisions-vllm`; not in `.ci/run` until it passes run after run): node choice
on real engines. Two vLLM CPU workers with prefix caching on, behind the whole pipeline, serve the same prefix-heavy
multi-turn trace once per policy (the default, round robin and an anchor), with the same arrivals, users and client
caps; the oracle-free simulator of the same setup (its engine timed by the profile fitted to these engines) predicts
each run (workers/sim/live_decisions.py). What must hold: every request served in every run, the default ahead of
round robin on P99 TTFT, and the live ranking on P99 TTFT the one the simulator predicts, pair by pair where the
runs' samples order a pair (`ranking_agreement`). The measured and the predicted figures are printed side by side
(`-s`) and written to the run's directory with a plot.

Record (900 requests per policy, this 2-core host). Until 2026-12-06 the default lost to round robin live (P99 TTFT
0.28-0.90x of round robin's in 3 runs) while the simulator predicted it 1.4-1.5x better: the vLLM engine published no
prefix blocks, so the default's precise index saw no prefix cached on either node (the simulator's always had them),
and its speed belief counted idle time as prefill. With both fixed and the late-binding hold on by default, the
default beat round robin in 4 runs of 4 (1.36x, 1.20x, 1.28x, 1.51x live; 1.41-1.53x simulated). The three-way
ranking by point estimates matched in 2 of them: in the other two, kv_aware and round robin (0.92x live, 1.19x
simulated), or kv_aware and the default, were ordered one way live and the other simulated, each time a pair whose
P99s one run does not tell apart (bootstrap intervals that overlap, live and simulated alike: the P99 of 900 requests
is their 9th-worst). The ranking is therefore compared pair by pair where both runs order the pair. With that
comparison, 2 runs of 3 passed whole on 2026-12-06; in the third the default tied round robin live (565.7 against
554.1 ms, predicted 1.50x) and kv_aware led both (1.32x round robin's; its live prefix hit rate 0.611 against the
default's 0.546), no pair ordered the other way at 97.5% (kv_aware ahead of the default in 95% of resamples).

What stays apart (measured 2026-12-06): the live P50 TTFT is 2-2.7x the simulated one and the P99 2.5-3.4x. vLLM's own
request stats put it in the engine: a request waits for no slot (queued time 0 at the median), and its prefill, from
scheduled to first token, takes 1.35x the fitted profile's price of its uncached tokens at the median (1.6x for
prompts of 2,048+ uncached tokens), and the engines find fewer of the prompts cached than the simulator's (prefix hit
rate 0.54-0.55 against 0.62-0.63 for the default; 0.57-0.60 against 0.64-0.65 for kv_aware); the pipeline adds about
10 ms (the worker's intake and its first-token report)."""

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
    """Pair by pair, where the run's samples order a pair (`ranking_agreement`, a bootstrap of each P99): no pair the
    simulator orders is ordered the other way live, and at least one pair is ordered alike by both (the comparison
    is never empty). Before the vLLM engine published its KV events the default's live P99 was 0.28-0.90x round
    robin's against a predicted 1.4-1.5x: a reversal this test reports."""
    rp = run["ranking_pairs"]
    assert not rp["contradicted"], format_report(run)
    assert rp["agreed"], format_report(run)
