"""The replay report's plots: a panel without data is left out, a figure without any panel is not drawn, and the
monitor's recorded drains are the markers."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import load_config
from pipeline.events import DecisionEvent, RequestEvent, ResultEvent
from streams import keys
from streams.replay_file import Header
from workers.replay.report import Timeline, _plots

T0 = 1_796_500_000_000.0


def _req(i: int, ts: float) -> RequestEvent:
    return RequestEvent(request_id=f"r{i}", version=1, tenant="t", user_id="u", model="qwen2-7b", in_tokens=10,
                        out_tokens=5, max_tokens=5, mem_est_kb=1.0, arrival_ms=ts)


def test_only_the_panels_with_data_are_drawn(tmp_path: Path) -> None:
    tl = Timeline(Header(since_ms=T0, until_ms=T0 + 60_000, lead_in_ms=0), load_config())
    for i in range(20):
        ts = T0 + i * 2500
        tl.feed(keys.INGRESS, f"{int(ts)}-0", _req(i, ts))
        tl.feed(keys.RESULTS, f"{int(ts) + 300}-0", ResultEvent.of(_req(i, ts), "ok", "r0-n0", "r0", ts + 300,
                                                                    out_tokens=5, first_token_ms=ts + 50))
    assert _plots(tl, tmp_path) == ["latency.png"]  # no load, no queue, no health, no migration: no empty figure


def test_the_recorded_drains_are_the_markers(tmp_path: Path) -> None:
    tl = Timeline(Header(since_ms=T0, until_ms=T0 + 60_000, lead_in_ms=0), load_config())
    tl.feed(keys.DECISIONS, f"{int(T0) + 20_000}-0", DecisionEvent(
        kind="failover", policy="health", choice="r0-n1:draining", request_ids=(), ts_ms=T0 + 20_000,
        batch_id="health 0.40: xid"))
    tl.feed(keys.DECISIONS, f"{int(T0) + 21_000}-0", DecisionEvent(
        kind="migration", policy="failover", choice="r0-n0", request_ids=("s1",), ts_ms=T0 + 21_000, batch_id="r0-n1"))
    assert tl.failovers == [(T0 + 20_000, "r0-n1", "draining: health 0.40: xid")]
    assert tl.migration_times == [T0 + 21_000]
    assert _plots(tl, tmp_path) == ["health.png"]  # the migration count panel alone
    assert (tmp_path / "health.png").read_bytes()[:4] == b"\x89PNG"
