"""What every command shares: the global flags, the config they name, the Valkey/etcd endpoints to use (flags, else
environment, else the embedded services that `rackflow services up` or `rackflow up` started), small argument types."""

from __future__ import annotations

import argparse
import importlib.metadata
import re
from pathlib import Path
from typing import Any

from pipeline.config import DEFAULT_CONFIG_DIR, TOP_LEVEL_KEYS, RackflowConfig, load_config
from workers.local.services import STATE_DIR

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def config_of(args: argparse.Namespace) -> RackflowConfig:
    return load_config(Path(args.config_dir), [Path(p) for p in args.config])


def positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def redact(url: str) -> str:
    """`url` with its password (if any) shown as ***."""
    return re.sub(r"(//[^:/@]*:)[^@/]+@", r"\1***@", url)


def endpoints(args: argparse.Namespace) -> tuple[str, str]:
    from workers.local.services import resolve_endpoints

    ep = resolve_endpoints(args.redis_url, args.etcd_url, STATE_DIR)
    if ep is None:
        raise SystemExit(
            "rackflow: no Redis/etcd to use: no `rackflow up` or `rackflow services up` is running in this "
            f"directory ({STATE_DIR.resolve()}). Run this command where `rackflow up` runs, start the servers "
            "alone with `rackflow services up`, or pass --redis-url/--etcd-url (or set "
            "RACKFLOW_REDIS_URL/RACKFLOW_ETCD_URL)."
        )
    return ep.redis_url, ep.etcd_url


def endpoints_or_none(args: argparse.Namespace) -> tuple[str, str] | None:
    from workers.local.services import resolve_endpoints

    ep = resolve_endpoints(args.redis_url, args.etcd_url, STATE_DIR)
    return (ep.redis_url, ep.etcd_url) if ep else None


def add_global_flags(p: argparse.ArgumentParser, default: Any = None) -> None:
    """The flags every command takes (config, endpoints, logging). On the top parser with their defaults; on each
    subcommand again with `default=argparse.SUPPRESS`, so they may also come after the subcommand
    (`rackflow up --config x.yaml`) and override the top parser's value only when given there."""

    def d(value: Any) -> Any:
        return value if default is None else default

    taken = {o for a in p._actions for o in a.option_strings}  # a subcommand's own flag of that name wins
    add = p.add_argument

    def add_argument(flag: str, **kw: Any) -> None:
        if flag not in taken:
            add(flag, **kw)

    p = argparse.Namespace(add_argument=add_argument)  # type: ignore[assignment]

    p.add_argument("--config-dir", default=d(str(DEFAULT_CONFIG_DIR)), help="directory of gpus/models/cluster/"
                   "policies.yaml (default: the repository's configs/)")
    p.add_argument("--config", action="append", default=d([]), metavar="FILE",
                   help=f"YAML merged over the config directory (keys {', '.join(TOP_LEVEL_KEYS)}); repeatable")
    p.add_argument("--redis-url", default=d(None), help="existing Redis/Valkey (default: env RACKFLOW_REDIS_URL, "
                   "else the embedded services of `rackflow services up` or `rackflow up`)")
    p.add_argument("--etcd-url", default=d(None), help="existing etcd, http://HOST:PORT, or the members of one "
                   "cluster comma-separated, http://H1:P1,http://H2:P2,... (default: env RACKFLOW_ETCD_URL, else "
                   "the embedded services)")
    p.add_argument("--log-level", default=d("INFO"), type=str.upper, choices=LOG_LEVELS,
                   help="DEBUG, INFO (default), WARNING, ERROR or CRITICAL (any case)")
    p.add_argument("--log-json", action="store_true", default=d(False), help="log one JSON object per line (also "
                   "RACKFLOW_LOG_JSON=1 or policies.observability.log_json); role processes started by this "
                   "command log JSON too")


def add_global_flags_to_subcommands(p: argparse.ArgumentParser) -> None:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                add_global_flags(child, default=argparse.SUPPRESS)
                add_global_flags_to_subcommands(child)


def add_subcommands(parent: argparse.ArgumentParser, dest: str, table: dict[str, tuple[str, list[str]]],
                    flags: dict[str, dict[str, Any]], fn: Any,
                    positionals: dict[str, tuple[str, Any, str]] | None = None) -> None:
    """Subcommands of `parent`, one per `table` entry (name -> (help, the flags it reads)), each taking and listing
    only its own flags (`flags`: name -> add_argument keywords). The flags it does not take keep their defaults in
    its namespace, so that one command function (`fn`) reads every subcommand's arguments alike. `positionals`:
    name -> (dest, choices, help) of a subcommand's positional argument (None in the others' namespaces)."""
    positionals = positionals or {}
    subs = parent.add_subparsers(dest=dest, required=True, metavar="{" + ",".join(table) + "}")
    full = argparse.ArgumentParser(add_help=False)
    for flag, kw in flags.items():
        full.add_argument(flag, **kw)
    defaults = vars(full.parse_args([]))
    for p_dest, _c, _h in positionals.values():
        defaults[p_dest] = None
    for name, (help_, own) in table.items():
        c = subs.add_parser(name, help=help_, description=help_[0].upper() + help_[1:] + ".")
        taken = {f.lstrip("-").replace("-", "_") for f in own}
        if name in positionals:
            p_dest, choices, p_help = positionals[name]
            c.add_argument(p_dest, choices=choices, help=p_help)
            taken.add(p_dest)
        for flag in own:
            c.add_argument(flag, **flags[flag])
        c.set_defaults(fn=fn, **{k: v for k, v in defaults.items() if k not in taken})


def version() -> str:
    try:
        return importlib.metadata.version("rackflow")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"
