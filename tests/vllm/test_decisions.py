"""The `decisions_vllm` tier (`make test-decisions-vllm`; not in `.ci/run` until it passes run after run): node choice
on real engines. Two vLLM CPU workers with prefix caching on, behind the whole pipeline, serve the same prefix-heavy
multi-turn trace once per policy (the default, round robin and an anchor), with the same arrivals, users and client
caps; the oracle-free simulator of the same setup (its engine timed by the profile fitted to these engines) predicts
each run (workers/sim/live_decisions.py). What must hold: every request served in every run, the default ahead of
round robin on P99 TTFT, and the live ranking on P99 TTFT the one the simulator predicts, pair by pair where the
runs' samples order a pair (`ranking_agreement`). The measured and the predicted figures are printed side by side
(`-s`) and written to the run's directory with a plot.

Record (this 2-core host). Until 2026-12-06 the default lost to round robin live (P99 TTFT 0.28-0.90x of round robin's
in 3 runs of 900 requests) while the simulator predicted it 1.4-1.5x better: the vLLM engine published no prefix blocks,
so the default's precise index saw no prefix cached on either node (the simulator's always had them), and its speed
belief counted idle time as prefill. With both fixed and the late-binding hold on by default, at 900 requests per policy
the default beat round robin in 5 runs of 6 (1.20-1.51x live, 1.41-1.53x simulated; once 0.98x, a tie), and the three-
way ranking by point estimates matched in 2 of 4: the pairs that flipped always had overlapping bootstrap intervals (the
P99 of 900 requests is their 9th-worst), hence the pair-by-pair comparison. At 1,800 requests per policy (the default
since 2026-12-06), 4 runs: the default beat round robin by 1.61x, 1.69x and 1.13x live (1.40-1.47x predicted) with no
pair contradicted, but the 1.13x run decided no pair at 97.5% (the default ahead of round robin in 90% of resamples),
which fails the test; in the fourth the host slowed the default's engines from their first minute (median step time
1.29x the profile, the others 0.76-1.0x) and it tied round robin, the case the harness now replays (`HOST_RERUN`). So
one run decides most of the time, not every time, and the tier stays out of `.ci/run`. 2026-12-06, 3 more runs: passed
(1.39x live, the default's first run replayed at 1.13x the profile's step times; this run had no warm-up), then with a
warm-up pass before the measured runs and one replay at most: passed (4.43x live, all three pairs ordered as predicted;
round robin's run replayed and the first kept), failed (1.01x live against 1.52x predicted, no host disturbance: every
run's engines at 0.79-0.86x the profile, and no pair decided at 97.5%: P99s of 476-511 ms). The live P99 of one 3-minute
replay per policy does not separate policies whose predicted margins are 1.2-1.5x on this host; more requests per policy
would, at a cost `.ci/run`'s 45 minutes cannot hold.

2026-12-07, three more runs of 1,800 requests per policy, to find a setup that decides every time (none did):
- 2 engines at load 0.7 (the live engines past their capacity: live P99 TTFT 2.8-4.2 s against 0.4-0.9 s simulated):
  passed once (the default 1.31x round robin live, 1.80x predicted), then failed with the default 0.72x round robin
  live against 2.10x predicted, its engines 1.12x the profile's step times and round robin's 0.95x (under
  HOST_RERUN, so not replayed). Past capacity, a host slowdown of 1.18x decides the run.
- 4 engines at load 0.5 (the default's hit rate 0.71 against round robin's 0.48, predicted, the largest gap this
  trace gives): the default 1.10x round robin live (1.35x predicted), not decided at 97.5% (80% of resamples); the
  anchor kv_aware first, live and simulated; 15 minutes for the run.
In all three the engines found fewer prompts cached than the simulator predicted: the default 0.49-0.58 live against
0.57-0.72 simulated, kv_aware 0.50-0.68 against 0.59-0.75, round robin 0.45-0.47 against 0.48-0.50. Modelling the
prefix cache inside the KV pool that the running sequences use (vLLM's; `SimParams.prefix_shares_kv`, on since then)
brings round robin's prediction to 0.475-0.481 and the others' down by 0.01-0.03 only: the rest of the gap is not
explained yet. Then the step profile learned the prefill's attention to its context (`PREFILL_CONTEXT`: 1,024 new
tokens took 1.9x as long after 2,048 cached ones), and at load 0.5 with 1,200 requests per policy the live and the
simulated P50 TTFT met (101/104 ms for the default, 101/100 for kv_aware, 106/128 for round robin; before, the live
P50 was 2-2.7x the simulated one), but the simulator now prices the engines above what they ran (their step times
0.65-0.73x the profile, scaled for two busy engines) and its P99 is 1.4-1.8x the live one, and live the three
policies' P99 TTFT were 415-436 ms, no pair told apart: at a load the engines keep up with, node choice does not
move the live P99 on this host, and past it the host's speed does. 14 minutes for the run.

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
