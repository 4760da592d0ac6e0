"""`rackflow replay report`: what happened in a recorded window, per 10 s, as an HTML page with PNG plots and a
text summary: arrivals and latency percentiles, per-node load, window queue depth per rack, health scores (the live
monitor's scorer over the recorded samples), migrations and DLQ entries; then the replay's verdict (match rate, or
the decisions a what-if policy makes differently)."""

from __future__ import annotations

import html
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from pipeline.config import RackflowConfig
from pipeline.events import DecisionEvent, HealthEvent, RequestEvent, ResultEvent
from pipeline.health import HealthSample, HealthScorer
from pipeline.replay import summary
from pipeline.stats import percentile, stream_id_ms
from streams import keys
from streams.replay_file import Header, read_records
from workers.replay.rerun import decoded, replay

BIN_MS = 10_000.0


def _bin_pct(xs: list[float], q: float) -> float:
    """A bin's percentile for the plot: NaN (a gap in the line) for a bin without samples."""
    return percentile(xs, q) if xs else math.nan


class Timeline:
    """Per-bin aggregates over the counted window [since, until]."""

    def __init__(self, header: Header, config: RackflowConfig) -> None:
        self.t0 = header.since_ms
        self.t1 = header.until_ms
        self.scorer = HealthScorer(config.policies.health)
        self.arrivals: dict[int, int] = defaultdict(int)
        self.latency: dict[int, list[float]] = defaultdict(list)
        self.ttft: dict[int, list[float]] = defaultdict(list)
        self.errors: dict[int, int] = defaultdict(int)
        self.load: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.queue: dict[str, dict[int, float]] = defaultdict(dict)
        self.health: dict[str, dict[int, float]] = defaultdict(dict)
        self.migrations: dict[int, int] = defaultdict(int)
        self.dlq: dict[int, int] = defaultdict(int)
        self.drained: list[tuple[float, str, str]] = []
        """(ts, node, what): the drains and recoveries the monitor's scorer gives the recorded samples."""
        self.failovers: list[tuple[float, str, str]] = []
        """(ts, node, state: reason): the monitor's own decisions as recorded on `rf:decisions` (drawn when any)."""
        self.migration_times: list[float] = []
        self.totals: dict[str, int] = defaultdict(int)

    def bin(self, ts: float) -> int | None:
        if ts < self.t0 or ts > self.t1:
            return None
        return int((ts - self.t0) // BIN_MS)

    def feed(self, stream: str, eid: str, ev: Any) -> None:
        if isinstance(ev, HealthEvent):
            if ev.source in ("nvml", "sim"):
                v = self.scorer.observe(HealthSample(
                    ev.node, ev.ts_ms, xid_errors=ev.xid_errors, ecc_errors=ev.ecc_errors,
                    nvlink_crc_errors=ev.nvlink_crc_errors, temp_c=ev.temp_c, avg_latency_ms=ev.avg_latency_ms,
                ))
                b = self.bin(ev.ts_ms)
                if b is not None:
                    self.health[ev.node][b] = min(self.health[ev.node].get(b, 1.0), v.score)
                    if v.changed:
                        self.drained.append((ev.ts_ms, ev.node, ("draining: " + ", ".join(v.reasons)) if v.draining
                                             else "recovered"))
            else:
                b = self.bin(ev.ts_ms)
                if b is not None:
                    self.load[ev.node][b].append(float(ev.running + ev.waiting))
            return
        if stream == keys.DLQ:
            b = self.bin(stream_id_ms(eid))
            if b is not None:
                self.dlq[b] += 1
                self.totals["dlq"] += 1
            return
        b = self.bin(stream_id_ms(eid))
        if b is None:
            return
        if isinstance(ev, RequestEvent) and stream in (keys.INGRESS, keys.ADMITTED):
            self.arrivals[b] += 1
            self.totals["requests"] += 1
        elif isinstance(ev, ResultEvent) and stream == keys.RESULTS:
            self.totals["results"] += 1
            if ev.status == "ok":
                self.latency[b].append(ev.finish_ms - ev.arrival_ms)
                if ev.first_token_ms > 0:
                    self.ttft[b].append(ev.first_token_ms - ev.arrival_ms)
            else:
                self.errors[b] += 1
                self.totals["errors"] += 1
        elif isinstance(ev, DecisionEvent):
            if ev.kind == "migration":
                self.migrations[b] += 1
                self.totals["migrations"] += 1
                self.migration_times.append(ev.ts_ms)
            elif ev.kind == "failover":
                node, _, state = ev.choice.partition(":")
                self.failovers.append((ev.ts_ms, node, f"{state}: {ev.batch_id}" if ev.batch_id else state))
            elif ev.kind == "window":
                rack = ev.rack or "?"
                self.queue[rack][b] = max(self.queue[rack].get(b, 0.0), float(ev.scores.get("pending", 0.0)))

    @property
    def bins(self) -> int:
        return max(1, math.ceil((self.t1 - self.t0) / BIN_MS))


def _clock(ms: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(ms / 1000.0).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def _plots(tl: Timeline, out: Path) -> list[str]:
    """latency.png, load.png and health.png, on a wall-clock axis (local time), with the monitor's recorded drains
    and recoveries as vertical lines on every panel and each migration as a tick; a panel without data is left out,
    and a figure without any panel is not drawn."""
    import datetime

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    def when(ms: float) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(ms / 1000.0).astimezone()

    xs = [when(tl.t0 + i * BIN_MS) for i in range(tl.bins)]
    width = BIN_MS / 86_400_000.0  # one bin, in days (matplotlib's date unit)
    names: list[str] = []
    markers = tl.failovers or [(t, node, what) for t, node, what in tl.drained]

    def figure(name: str, panels: list[Any]) -> None:
        panels = [pn for pn in panels if pn is not None]
        if not panels:
            return
        fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels) + 0.4), sharex=True, squeeze=False)
        for ax, draw in zip(axes[:, 0], panels, strict=True):
            draw(ax)
            for t, _node, what in markers:
                c = "#e45756" if "draining" in what or "dead" in what else "#54a24b"
                ax.axvline(when(t), color=c, ls=":", lw=1.2)
            for t in tl.migration_times:
                ax.axvline(when(t), color="#b279a2", lw=0.6, alpha=0.5, ymax=0.06)
        top = axes[0, 0]
        for t, node, what in markers:
            top.annotate(f"{node} {what.split(':')[0]}", (mdates.date2num(when(t)), 1.0), xycoords=("data", "axes "
                         "fraction"), rotation=90, fontsize=7, va="top", ha="right")
        axes[-1, 0].xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=xs[0].tzinfo))
        axes[-1, 0].set_xlabel(f"wall-clock time ({xs[0].strftime('%Z')}), 10 s bins; dotted lines: drains (red) "
                               "and recoveries (green); ticks at the bottom: migrations")
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        names.append(name)

    def arrivals(ax: Any) -> None:
        ax.bar(xs, [tl.arrivals.get(i, 0) / (BIN_MS / 1000) for i in range(tl.bins)], width=width * 0.9,
               align="edge", color="#4c78a8", label="arrivals/s")
        ax.bar(xs, [tl.errors.get(i, 0) / (BIN_MS / 1000) for i in range(tl.bins)], width=width * 0.9,
               align="edge", color="#e45756", label="errors/s")
        ax.set_ylabel("requests / s")
        ax.legend(loc="upper right")

    def latency(ax: Any) -> None:
        for q, c in ((50, "#54a24b"), (95, "#f58518"), (99, "#e45756")):
            ax.plot(xs, [_bin_pct(tl.latency.get(i, []), q) / 1000 for i in range(tl.bins)], marker=".", color=c,
                    label=f"P{q} end-to-end")
        ax.plot(xs, [_bin_pct(tl.ttft.get(i, []), 95) / 1000 for i in range(tl.bins)], ls="--", color="#72b7b2",
                label="P95 TTFT")
        ax.set_ylabel("seconds (by finish time)")
        ax.legend(loc="upper right", fontsize=8)

    def load(ax: Any) -> None:
        for node in sorted(tl.load):
            ax.plot(xs, [(sum(v) / len(v)) if (v := tl.load[node].get(i)) else math.nan for i in range(tl.bins)],
                    label=node)
        ax.set_ylabel("running + waiting")
        ax.set_title("per-node load (worker status)")
        ax.legend(loc="upper right", fontsize=7, ncol=4)

    def queue(ax: Any) -> None:
        for rack in sorted(tl.queue):
            ax.plot(xs, [tl.queue[rack].get(i, 0.0) for i in range(tl.bins)], label=rack)
        ax.set_ylabel("requests waiting")
        ax.set_title("window queue depth per rack (max after a close)")
        ax.legend(loc="upper right", fontsize=7)

    def health(ax: Any) -> None:
        for node in sorted(tl.health):
            ax.plot(xs, [tl.health[node].get(i, math.nan) for i in range(tl.bins)], label=node, marker=".")
        ax.set_ylim(-0.05, 1.05)
        ax.set_ylabel("health score (min per bin)")
        ax.legend(loc="lower left", fontsize=7, ncol=4)

    def counts(ax: Any) -> None:
        ax.bar(xs, [tl.migrations.get(i, 0) for i in range(tl.bins)], width=width * 0.45, align="edge",
               color="#b279a2", label="migrations")
        ax.bar([x + datetime.timedelta(milliseconds=BIN_MS / 2) for x in xs], [tl.dlq.get(i, 0) for i in
                                                                               range(tl.bins)],
               width=width * 0.45, align="edge", color="#9d755d", label="DLQ entries")
        ax.set_ylabel("count per 10 s")
        ax.legend(loc="upper right")

    has_results = any(tl.latency.values()) or any(tl.ttft.values())
    figure("latency.png", [arrivals if (tl.arrivals or tl.errors) else None, latency if has_results else None])
    figure("load.png", [load if tl.load else None, queue if any(tl.queue.values()) else None])
    figure("health.png", [health if tl.health else None,
                          counts if (tl.totals["migrations"] or tl.totals["dlq"]) else None])
    return names


def _table(rows: list[list[Any]], head: list[str]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def write_report(path: Path, header: Header, config: RackflowConfig, policy: str | None, out: Path,
                 quiet: bool = True) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    tl = Timeline(header, config)
    for stream, eid, ev in decoded(read_records(path)):
        tl.feed(stream, eid, ev)
    rp = replay(path, config, policy, header, quiet=quiet, max_differences=500)
    rs = summary(rp.stats, rp.differences, rp.what_if, policy or config.policies.node_selection.policy)
    plots = _plots(tl, out)
    all_lat = [x for v in tl.latency.values() for x in v]
    lat = {f"p{q}_ms": round(percentile(all_lat, q), 1) if all_lat else None for q in (50, 95, 99)}
    facts = {
        "window_s": round((header.until_ms - header.since_ms) / 1000.0, 1),
        "entries": header.total,
        "requests": tl.totals["requests"],
        "results": tl.totals["results"],
        "errors": tl.totals["errors"],
        "migrations": tl.totals["migrations"],
        "dlq": tl.totals["dlq"],
        **lat,
    }
    kind = "What-if" if rs["what_if"] else "Replay"
    lines = [
        f"rackflow incident report: {path.name}",
        f"window {facts['window_s']} s, {facts['entries']} stream entries recorded",
        f"requests {facts['requests']}, final results {facts['results']}, errors {facts['errors']}, "
        f"migrations {facts['migrations']}, DLQ entries {facts['dlq']}",
        f"end-to-end latency P50/P95/P99 {lat['p50_ms']}/{lat['p95_ms']}/{lat['p99_ms']} ms",
        f"{kind} with node policy {rs['policy']}: {rs['matched']}/{rs['decisions']} decisions as recorded "
        f"({100 * float(rs['match_rate']):.2f}%), {rs['differences']} differences",
    ]
    lines.insert(1, f"from {_clock(header.since_ms)} to {_clock(header.until_ms)}")
    lines += [f"health: {_clock(t)} {node} {what}" for t, node, what in (tl.failovers or tl.drained)[:50]]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    diff_rows = [[d.kind, d.request_id, f"{(d.ts_ms - header.since_ms) / 1000:.1f}", d.where, d.recorded,
                  d.replayed] for d in rp.differences[:500]]
    rec_nodes: dict[str, int] = rs["recorded_requests_per_node"]  # type: ignore[assignment]
    rep_nodes: dict[str, int] = rs["replayed_requests_per_node"]  # type: ignore[assignment]
    all_nodes = sorted(set(rec_nodes) | set(rep_nodes))
    nodes_html = _table([[n, rec_nodes.get(n, 0), rep_nodes.get(n, 0)] for n in all_nodes],
                        ["node", "recorded", "replayed"])
    diff_html = (_table(diff_rows, ["kind", "request", "t (s)", "rack / model", "recorded", "replayed"]) if diff_rows
                 else "<p>None: every decision came out as recorded.</p>")
    title = html.escape(path.name)
    captions = {"latency.png": "Arrivals and latency", "load.png": "Load and queue depth",
                "health.png": "Health, migrations, dead letters"}
    figures = "\n".join(f'<h2>{captions[n]}</h2><img src="{n}" alt="{n[:-4]}">' for n in plots)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>rackflow incident {title}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:2px 6px}}img{{max-width:100%}}</style></head><body>
<h1>Incident {title}</h1>
<pre>{html.escape(chr(10).join(lines))}</pre>
{figures}
<h2>{kind}: decisions that differ ({rs['differences']})</h2>
{diff_html}
<h2>Requests per node</h2>
{nodes_html}
</body></html>"""
    (out / "index.html").write_text(page)
    return {"report": str(out / "index.html"), "plots": plots, "summary": str(out / "summary.txt"), **facts,
            "replay": rs}
