"""`rackflow replay export|import|run|report`: record an incident window, load it elsewhere, re-decide it, report it.

The file format is `streams.replay_file`; re-deciding is `pipeline.replay.Replayer` (the live router, batcher and
node-policy code fed the recorded inputs in virtual time); the report is `workers.replay.report`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError
from pipeline.replay import summary
from streams import keys
from streams.replay_file import (
    DEFAULT_GROUPS,
    STREAM_GROUPS,
    RecordingError,
    import_records,
    live_streams,
    read_header,
    read_records,
)
from streams.runner import connect
from workers.replay.rerun import Config, _bar, export_window, recorded_config, replay


def parse_time(text: str, now_ms: float) -> float:
    """Milliseconds since the epoch from: an epoch in s or ms, an ISO-8601 time, `now`, or `-5m` / `-2h` / `-30s`
    / `-1d` (relative to now)."""
    t = text.strip()
    if t == "now":
        return now_ms
    if t.startswith("-") and t[-1:] in ("s", "m", "h", "d") and t[1:-1].replace(".", "", 1).isdigit():
        mult = {"s": 1e3, "m": 60e3, "h": 3600e3, "d": 86400e3}[t[-1]]
        return now_ms - float(t[1:-1]) * mult
    try:
        v = float(t)
        return v if v > 1e11 else v * 1000.0  # seconds before ~1973 as ms would be absurd: a big number is ms
    except ValueError:
        pass
    from datetime import UTC, datetime

    try:
        dt = datetime.fromisoformat(t)
    except ValueError:
        raise SystemExit(f"rackflow replay: cannot read the time {text!r}; use an epoch (s or ms), an ISO-8601 "
                         "time, `now`, or a relative time like -10m") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp() * 1000.0


async def _export(args: argparse.Namespace, redis_url: str, config: Config) -> int:
    now = time.time() * 1000.0
    since = parse_time(args.since, now)
    until = parse_time(args.until, now)
    if until <= since:
        print(f"rackflow replay export: --until ({args.until}) must be after --since ({args.since})", file=sys.stderr)
        return 2
    groups = tuple(args.streams.split(",")) if args.streams else DEFAULT_GROUPS
    bad = set(groups) - set(STREAM_GROUPS)
    if bad:
        print(f"rackflow replay export: unknown --streams {', '.join(sorted(bad))}; valid: "
              f"{', '.join(STREAM_GROUPS)}", file=sys.stderr)
        return 2
    header = await export_window(redis_url, Path(args.output), since, until, args.lead_in_s * 1000.0, groups,
                                 config, quiet=args.no_progress)
    out = {"file": str(args.output), "entries": header.total, "streams": len(header.counts),
           "since_ms": since, "until_ms": until, "bytes": Path(args.output).stat().st_size}
    print(json.dumps(out) if args.json else
          f"wrote {header.total} entries of {len(header.counts)} streams to {args.output} "
          f"({out['bytes'] / 1e6:.1f} MB)")
    return 0


async def _import(args: argparse.Namespace, redis_url: str) -> int:
    header = read_header(Path(args.file))
    r = connect(redis_url)
    try:
        live = await live_streams(r)
        if live and not args.force:
            print(f"rackflow replay import: {redis_url.split('@')[-1]} already holds rackflow streams "
                  f"({', '.join(live[:3])}{', ...' if len(live) > 3 else ''}); import into a scratch server, or "
                  "pass --force to add to them", file=sys.stderr)
            return 2
        with _bar(header.total, "import", args.no_progress) as bar:
            stats = await import_records(r, read_records(Path(args.file)), bar.update)
        await r.set(keys.CONFIG, json.dumps(header.config))
    finally:
        await r.aclose()
    out = {"entries": stats.entries, "skipped": stats.skipped, "streams": len(stats.streams)}
    print(json.dumps(out) if args.json else
          f"imported {stats.entries} entries into {len(stats.streams)} streams"
          + (f" ({stats.skipped} skipped: ids not above what the server held)" if stats.skipped else ""))
    return 0


def _run(args: argparse.Namespace, config: Config) -> int:
    path = Path(args.file)
    header = read_header(path)
    cfg = recorded_config(header, args.replay_config, config)
    rp = replay(path, cfg, args.policy, header, quiet=args.no_progress)
    out = summary(rp.stats, rp.differences, rp.what_if or bool(args.replay_config),
                  args.policy or cfg.policies.node_selection.policy)
    if args.differences:
        Path(args.differences).write_text(
            "".join(json.dumps(dataclasses.asdict(d)) + "\n" for d in rp.differences)
        )
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        kind = "what-if" if out["what_if"] else "replay"
        print(f"{kind} with node policy {out['policy']}: {out['matched']}/{out['decisions']} decisions as recorded "
              f"({100 * float(out['match_rate']):.2f}%); {out['route_matched']}/{out['route_decisions']} routes, "
              f"{out['dispatch_matched']}/{out['dispatch_decisions']} dispatches over {out['windows']} windows; "
              f"{out['requests_same_node']}/{out['requests_dispatched']} requests on the recorded node")
        for d in rp.differences[:10]:
            print(f"  {d.kind:<8} {d.request_id}  recorded {d.recorded:<12} replayed {d.replayed}")
        if len(rp.differences) > 10:
            print(f"  ... {len(rp.differences) - 10} more (--differences FILE writes them all)")
    return 0


def _report(args: argparse.Namespace, config: Config) -> int:
    from workers.replay.report import write_report

    path = Path(args.file)
    header = read_header(path)
    cfg = recorded_config(header, args.replay_config, config)
    out = write_report(path, header, cfg, args.policy, Path(args.output), quiet=args.no_progress)
    print(json.dumps(out, sort_keys=True) if args.json else
          f"report: {Path(args.output) / 'index.html'} ({len(out['plots'])} plots, summary in "
          f"{Path(args.output) / 'summary.txt'})")
    return 0


def cmd_replay_cli(args: argparse.Namespace) -> int:
    from workers.cli.common import config_of, endpoints

    return cmd_replay(args, lambda: config_of(args), lambda: endpoints(args))


def cmd_replay(args: argparse.Namespace, config: Config, endpoints: Callable[[], tuple[str, str]]) -> int:
    try:
        if args.action == "export":
            return asyncio.run(_export(args, endpoints()[0], config))
        if args.action == "import":
            url = args.import_redis_url or args.redis_url or endpoints()[0]
            return asyncio.run(_import(args, url))
        if args.action == "run":
            return _run(args, config)
        return _report(args, config)
    except RecordingError as e:
        print(f"rackflow replay: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"rackflow replay: no such file: {e.filename}", file=sys.stderr)
        return 2
    except (ValueError, ConfigError) as e:
        print(f"rackflow replay: {e}", file=sys.stderr)
        return 2


def add_parser(sub: Any) -> None:
    s = sub.add_parser("replay", help="incident replay: export a time window of the streams, import it, re-run "
                       "routing and batching on it (exact, or a what-if), report it")
    rs = s.add_subparsers(dest="action", required=True)
    e = rs.add_parser("export", help="write every stream entry of a time window and the config to one file")
    e.add_argument("--since", required=True, help="start: epoch s/ms, ISO-8601, or relative (-10m)")
    e.add_argument("--until", default="now", help="end (default: now)")
    e.add_argument("--streams", default="", help=f"comma-separated groups (default: {','.join(DEFAULT_GROUPS)}; "
                   f"valid: {','.join(STREAM_GROUPS)})")
    e.add_argument("--lead-in-s", type=float, default=60.0, help="also take this much before --since, so replay "
                   "starts with the windows and policy state in force at --since (not counted) [60]")
    e.add_argument("-o", "--output", required=True)
    i = rs.add_parser("import", help="load a recording into a scratch Redis/Valkey")
    i.add_argument("file")
    i.add_argument("--force", action="store_true", help="write even into a server that holds rackflow streams")
    i.add_argument("--redis-url", dest="import_redis_url", default=None, help="the scratch server to load into "
                   "(default: the global --redis-url, env, or the embedded services)")
    r = rs.add_parser("run", help="re-run routing and batching over the recording with the same policy code")
    r.add_argument("file")
    r.add_argument("--differences", default=None, metavar="FILE", help="write every differing decision (JSONL)")
    rep = rs.add_parser("report", help="timeline, health, latency, migrations, DLQ and what-if differences as "
                        "HTML + PNG + text")
    rep.add_argument("file")
    rep.add_argument("-o", "--output", required=True, help="directory to write index.html, PNGs and summary.txt")
    for x in (r, rep):
        x.add_argument("--policy", default=None, help="node policy for a what-if (default: the recorded one)")
        x.add_argument("--config", dest="replay_config", default=None, metavar="FILE",
                       help="YAML merged over the recorded config (a what-if)")
    for x in (e, i, r, rep):
        x.add_argument("--json", action="store_true")
        x.add_argument("--no-progress", action="store_true")
    s.set_defaults(fn=cmd_replay_cli)
