"""Replay as a library: export a window of the live streams to a replay file, recover the config in force when it
was recorded, decode its records, and re-decide them with `pipeline.replay.Replayer`. `workers/cli/replay.py` parses
arguments around it; `workers/replay/report.py` reports on a rerun."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pipeline.config import RackflowConfig, overlay, parse_config, read_yaml
from pipeline.events import DecisionEvent, RequestEvent
from pipeline.replay import Replayer
from streams import codec, keys
from streams.errors import DecodeError
from streams.replay_file import (
    Header,
    export_streams,
    read_records,
)
from streams.runner import connect

Config = Callable[[], RackflowConfig]


def _bar(total: int | None, desc: str, quiet: bool) -> tqdm:  # type: ignore[type-arg]
    return tqdm(total=total, desc=desc, unit="entry", unit_scale=True, disable=quiet, file=sys.stderr,
                mininterval=0.5)


# ---- export / import -------------------------------------------------------------------------------------------
async def _config_in_force(r: Any, fallback: Config) -> dict[str, Any]:
    raw = await r.get(keys.CONFIG)
    if raw:
        try:
            return dict(json.loads(raw))
        except ValueError:
            pass
    return fallback().model_dump(mode="json")


async def export_window(redis_url: str, path: Path, since: float, until: float, lead_in_ms: float,
                        groups: tuple[str, ...], config: Config, quiet: bool = False) -> Header:
    """Export [since - lead_in, until] of the chosen stream groups with the config in force to `path`."""
    r = connect(redis_url)
    try:
        cfg = await _config_in_force(r, config)
        header = Header(since_ms=since, until_ms=until, lead_in_ms=lead_in_ms, config=cfg,
                        created_ms=time.time() * 1000.0, source=redis_url.split("@")[-1])
        with _bar(None, "export", quiet) as bar:
            return await export_streams(r, path, header, groups, bar.update)
    finally:
        await r.aclose()


# ---- run -------------------------------------------------------------------------------------------------------
def recorded_config(header: Header, override: str | None, fallback: Config) -> RackflowConfig:
    raw = dict(header.config) if header.config else fallback().model_dump(mode="json")
    if override:
        raw = overlay(raw, read_yaml(Path(override)), source=str(override))
    return parse_config(raw, source=override or "recorded config")


def decoded(records: Iterator[tuple[str, str, dict[bytes, bytes]]]) -> Iterator[tuple[str, str, Any]]:
    """(stream, entry id, event or None) — entries that do not decode (DLQ entries, damage) come as None."""
    for stream, eid, flds in records:
        if stream == keys.DLQ:
            yield stream, eid, None
            continue
        try:
            yield stream, eid, codec.decode(flds)
        except DecodeError:
            yield stream, eid, None


def replay(path: Path, config: RackflowConfig, policy: str | None, header: Header,
           quiet: bool = True, max_differences: int = 10_000) -> Replayer:
    rp = Replayer(config, policy, count_from_ms=header.since_ms, max_differences=max_differences)
    with _bar(header.total, "replay", quiet) as bar:
        n = 0
        for stream, _eid, ev in decoded(read_records(path)):
            n += 1
            if n % 2000 == 0:
                bar.update(2000)
            if isinstance(ev, RequestEvent) and (stream in (keys.INGRESS, keys.ADMITTED)
                                                 or stream.startswith("rf:rack:")):
                rp.add_request(ev)
            elif isinstance(ev, DecisionEvent):
                rp.decision(ev)
        bar.update(n % 2000)
    rp.finish()
    return rp
