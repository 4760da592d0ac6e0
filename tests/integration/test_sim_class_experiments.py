"""`rackflow sim experiment priority|fairness` at small sizes: the properties the experiments exist to show (priority
classes keep interactive TTFT far below FCFS with a batch backlog and let the backlog use the idle capacity; fair
shares split an overload between two tenants more evenly than no fair shares), and their JSON, table and plot."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import DEFAULT_CONFIG_DIR

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_priority_keeps_interactive_ttft_far_below_fcfs_and_hold_gives_batch_the_idle_capacity(tmp_path: Path) -> None:
    # 1,500 interactive requests (~90 s at 0.7 of capacity), ~1,900 batch requests arriving at once at 22 s
    res = subprocess.run([sys.executable, "-m", "workers.cli", "sim", "experiment", "priority", "--requests", "1500",
                          "--out", str(tmp_path), "--json", "--no-progress"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    d = json.loads(res.stdout.strip().splitlines()[-1])
    t = d["table"]
    assert set(t) == {"saturated", "alone", "preempt", "hold", "no-priority"}
    for key in ("interactive_p99_ttft_ms", "interactive_alone_p99_ttft_ms", "batch_idle_use", "lost", "shed"):
        assert key in d, key
    assert d["interactive_alone_p99_ttft_ms"] == t["alone"]["interactive_p99_ttft_ms"]
    assert d["interactive_p99_ttft_ms"] == t["preempt"]["interactive_p99_ttft_ms"], "the default is preempt"
    count = d["setup"]["backlog_requests"]
    for name in ("preempt", "hold", "no-priority"):
        row = t[name]
        assert row["interactive_lost"] == 0 and row["batch_lost"] == 0 and row["batch_completed"] == count, name
        assert row["saturated"], f"{name}: the backlog outlasts the interactive trace"
    # FCFS puts the interactive requests behind the backlog; either priority mode keeps them far ahead of it
    fcfs = t["no-priority"]["interactive_p99_ttft_ms"]
    assert fcfs > 3 * t["hold"]["interactive_p99_ttft_ms"] and fcfs > 3 * t["preempt"]["interactive_p99_ttft_ms"]
    assert t["no-priority"]["interactive_p50_ttft_ms"] > 20 * t["alone"]["interactive_p50_ttft_ms"]
    assert t["hold"]["interactive_p50_ttft_ms"] < 4 * t["alone"]["interactive_p50_ttft_ms"]
    # hold never preempts and gives the backlog most of what interactive work leaves idle; preempt preempts
    assert t["hold"]["priority_preemptions"] == 0 and t["hold"]["batch_idle_use"] > 0.6
    assert t["preempt"]["priority_preemptions"] > 0
    assert t["saturated"]["batch_idle_use"] == 1.0, "the token capacity is the saturated run's service"
    assert (tmp_path / "priority.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "priority.json").read_text())["batch_idle_use"] == d["batch_idle_use"]


def test_fair_shares_split_an_overload_of_two_tenants_more_evenly(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.sim import experiments as E

    monkeypatch.setattr(E, "FAIR_BIN_MS", 20_000.0)  # 5,000 requests are ~100 s of arrivals: score 20 s bins
    args = argparse.Namespace(config_dir=str(DEFAULT_CONFIG_DIR), config=[], seed=20231116, no_progress=True,
                              requests=5000)
    d: dict[str, Any] = E.fairness(args, tmp_path)
    t = d["table"]
    assert d["max_share_error"] == t["fair"]["max_share_error"]
    for admitted in ("", ", no admission"):
        fair, unfair = t[f"fair{admitted}"], t[f"unfair{admitted}"]
        assert len(fair["tenants"]["tenant-a"]["share_per_minute"]) >= 4
        assert fair["max_share_error"] < 0.25 < 0.4 < unfair["max_share_error"], (admitted, fair, unfair)
        # without fair shares the tenants are served about as they ask (3:1); with them the light one is ahead
        b, b_off = fair["tenants"]["tenant-b"], unfair["tenants"]["tenant-b"]
        assert b["p99_ttft_ms"] < b_off["p99_ttft_ms"]
    for row in t.values():
        for v in row["tenants"].values():
            assert v["completed"] + v["shed"] + v["lost"] == v["requests"] and v["lost"] == 0
    assert t["fair, no admission"]["tenants"]["tenant-a"]["shed"] == 0, "no admission: nobody is shed"
    assert (tmp_path / "fairness.png").stat().st_size > 10_000
