"""`rackflow` command line: services, the role processes, the whole local cluster, the demo.

Connection URLs come from --redis-url/--etcd-url, else RACKFLOW_REDIS_URL/RACKFLOW_ETCD_URL, else the embedded
services started by `rackflow services up` (`.rackflow/services.json`). Everything else comes from configs/.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

from pipeline.config import ConfigError
from pipeline.errors import RackflowError
from workers.cli import bench, jobs, local, replay, roles, sim, tools
from workers.cli.common import add_global_flags, add_global_flags_to_subcommands, version

log = logging.getLogger("rackflow")

COMMANDS: tuple[Callable[[Any], None], ...] = (
    local.add_parser, roles.add_parser, tools.add_parser, jobs.add_parser, sim.add_parser, replay.add_parser,
    bench.add_parser,
)
"""The one registry of subcommands: each command group's module adds its parsers, each with `fn` its command."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rackflow", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"rackflow {version()}")
    add_global_flags(p)
    sub = p.add_subparsers(dest="cmd", required=True)
    for register in COMMANDS:
        register(sub)
    add_global_flags_to_subcommands(p)
    return p


RELATIVE_TIME_FLAGS = ("--since", "--until")
"""Flags whose value may be a relative time like -10m: argparse reads a value that starts with '-' as the next
flag ("expected one argument"), so `--since -10m` is passed on as `--since=-10m`."""


def _join_relative_times(argv: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if a in RELATIVE_TIME_FLAGS and nxt.startswith("-") and nxt[1:2].isdigit():
            out.append(f"{a}={nxt}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def _command_parser(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The deepest parser of the command `args` came from (`rackflow sim run ...`: the `run` parser)."""
    while True:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return p
        chosen = getattr(args, subs[0].dest, None)
        if chosen is None or chosen not in subs[0].choices:
            return p
        p = subs[0].choices[chosen]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(_join_relative_times(sys.argv[1:] if argv is None else list(argv)))
    if extra:  # the command's own usage, not the top level's: what it takes is what the user needs to see
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.log_json:
        import os

        os.environ["RACKFLOW_LOG_JSON"] = "1"  # the role processes `up`/`demo` start inherit it
    try:
        rc = int(args.fn(args) or 0)
        sys.stdout.flush()  # here, not at exit: a reader that went away is handled below, not by a traceback
        return rc
    except ConfigError as e:
        print(f"rackflow: {e}", file=sys.stderr)
        return 2
    except RackflowError as e:  # ours, with a message that says what to change (a missing peer, a bad input)
        print(f"rackflow: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`rackflow jobs status --json | head`): stop quietly, as a Unix filter does; stdout
        # is pointed at /dev/null so that the interpreter's own flush at exit does not raise again
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
