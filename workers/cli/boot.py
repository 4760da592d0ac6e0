"""The `rackflow` entry point: before anything imports `pipeline`, a `rackflow sim ...` command puts the compiled
simulator first on the import path (`workers.sim.compiled`: the same source compiled with mypyc), when it was built
from the source as it is now. A missing or stale build is built first, once, with a line every 10 s (about a
minute; where it cannot be built, the pure-Python modules run, which give the same results). Every other command
runs the pure-Python modules.

`RACKFLOW_SIM_COMPILED=0` turns it off; `RACKFLOW_SIM_COMPILED=never-build` uses a current build but never builds
one. The run's JSON says which one ran (`sim_compiled`).
It imports nothing of `pipeline` (nor does `workers.sim.compiled`): it must run first.
"""

from __future__ import annotations

import os
import sys

# gRPC's fork handlers (grpcio >= 1.81, grpc/grpc#43055, open): a process that holds etcd channels and starts a
# subprocess sometimes loses the child before its exec (the handler restarts gRPC's poller in the child, whose epoll
# fd close_fds then closes: "epoll_wait error: Bad file descriptor", SIGABRT). Measured here: 6 of 300 children lost
# with the handlers on, 0 of 300 with them off. Every rackflow process starts children this way (the launcher, the
# supervisor of the embedded services), and none uses a gRPC channel across a fork (Celery's pool processes open their
# own, after it), so the handlers are off unless the environment says otherwise. Set before anything imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from workers.sim.compiled import activate


def _is_sim_command(argv: list[str]) -> bool:
    """The first word that is not a flag, nor the value of a global flag, is the command. The flags that take a
    value are those of workers.cli.common.add_global_flags (not imported here: it imports `pipeline`)."""
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
