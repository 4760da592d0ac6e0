"""The `rackflow` entry point: before anything imports `pipeline`, a `rackflow sim ...` command puts the compiled
simulator first on the import path (`workers.sim.compiled`: the same source compiled with mypyc), when it was built
from the source as it is now. Every other command, and every stale or missing build, runs the pure-Python modules.

`RACKFLOW_SIM_COMPILED=0` turns it off; the run's JSON says which one ran (`sim_compiled`).
It imports nothing of `pipeline` (nor does `workers.sim.compiled`): it must run first.
"""

from __future__ import annotations

import sys

from workers.sim.compiled import activate


def _is_sim_command(argv: list[str]) -> bool:
    """The first word that is not a flag, nor the value of a global flag, is the command."""
    takes_value = {"--config-dir", "--config", "--redis-url", "--etcd-url", "--log-level"}
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a.startswith("-"):
            skip = a in takes_value
            continue
        return a == "sim"
    return False


def main() -> int:
    if _is_sim_command(sys.argv[1:]):
        activate()
    from workers.cli.main import main as cli_main

    return cli_main()
