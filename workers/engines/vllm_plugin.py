"""A vLLM general plugin (entry point `vllm.general_plugins`, loaded by vLLM in every one of its processes): on vLLM's
CPU build, its executor's shared-memory readers stop busy-polling after each step.

vLLM 0.32's `SpinCondition` (vllm/distributed/device_communicators/shm_broadcast.py) keeps a reader spinning on
`sched_yield()` for `busy_loop_s = 1` second after every read before it sleeps on its ZMQ notify socket. On a GPU
host that costs one otherwise idle CPU core per worker. On a CPU-only host the spinning core is one that the model
and the control plane need: measured on this 2-core machine, an idle vLLM worker burns 1.0 CPU-second after each
request, and two vLLM workers next to the routing roles starved the health agents until their heartbeats expired.
Here the spin lasts `RACKFLOW_VLLM_SPIN_S` seconds (default 0.05: the steps of a decode still skip the socket).
Measured with `rackflow bench engines` at batch 16: 5.2 k tokens/s with the 1 s spin, 4.7 k at 0.05 s, 3.9 k at
0.002 s; an idle worker then burns 0.07 CPU-seconds after a request instead of 1.0. Nothing changes on a GPU or
when vLLM's class is not what this expects.

In every process vLLM spawns (its engine core, its executor's workers) it also asks Linux for SIGKILL when the
parent dies: a rackflow worker killed with -9 used to leave vLLM's executor running as a 1.5 GB orphan.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def register() -> None:
    import multiprocessing

    if multiprocessing.parent_process() is not None:  # a process vLLM spawned, not the rackflow worker itself
        from workers.shell.runtime import die_with_parent_now

        die_with_parent_now()
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from vllm.distributed.device_communicators import shm_broadcast
    except Exception:  # another vLLM layout: leave it alone
        return
    cls = getattr(shm_broadcast, "SpinCondition", None)
    if cls is None or getattr(cls, "_rackflow_spin", False):
        return
    spin_s = float(os.environ.get("RACKFLOW_VLLM_SPIN_S", "0.05"))
    original = cls.__init__

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        original(self, *args, **kwargs)
        if getattr(self, "is_reader", False) and hasattr(self, "busy_loop_s"):
            self.busy_loop_s = min(self.busy_loop_s, spin_s)

    cls.__init__ = __init__
    cls._rackflow_spin = True
