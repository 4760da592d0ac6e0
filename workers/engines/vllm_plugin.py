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

Past the spin, a reader waits for the writer's notification, and vLLM's writer drops most of them: its notify socket
is a ZMQ PUB with SNDHWM 1, so a notification sent before the previous one's delivery is acknowledged is discarded,
and the reader then sleeps until its periodic re-check of the shared-memory flag (SHM_READER_RECHECK_INTERVAL_MS,
5 s in vLLM). Every step longer than the spin could end in that sleep: in the live decisions tier
(`workers/sim/live_decisions.py`) one engine at a time froze for 4-10 s with its sequences half done, and its
P99 TTFT was 30-50x the simulator's. Measured with one engine alone (the `_throughput` of `rackflow bench
engines`), a reader that never spins (`RACKFLOW_VLLM_SPIN_S=0`) decodes 42 tokens/s at batch 1 and 661 at batch 16
with vLLM's SNDHWM and a 20 ms re-check (almost every notification lost), and 574 and 6,374 with SNDHWM 1,000
(`NOTIFY_HWM`: the readers' socket conflates whatever queues to one message, so nothing piles up). Here the
notify socket gets that high-water mark (`RACKFLOW_VLLM_NOTIFY_HWM`) and the re-check is 20 ms
(`RACKFLOW_VLLM_SHM_RECHECK_MS`): a notification lost any other way costs a step 20 ms, not seconds. Not solved by
this: in the live decisions tier an engine still stalled for seconds in some runs, while both engines' workers shared
the one core vLLM binds them to; the launcher now gives each worker its own cores (`vllm_cpu_cores`), and the workers
run below the control plane (`cpu_nice`): the tier's live P99 TTFT fell from 7.6-9.5 s to 0.41-0.70 s.

In every process vLLM spawns (its engine core, its executor's workers) it also asks Linux for SIGKILL when the
parent dies: a rackflow worker killed with -9 used to leave vLLM's executor running as a 1.5 GB orphan.
"""

from __future__ import annotations

import logging
import os
from typing import Any

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
    notify_hwm = int(os.environ.get("RACKFLOW_VLLM_NOTIFY_HWM", str(NOTIFY_HWM)))
    original = cls.__init__

    def __init__(self, is_reader, context, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not is_reader and notify_hwm > 1:
            context = _NotifyContext(context, notify_hwm)
        original(self, is_reader, context, *args, **kwargs)
        if getattr(self, "is_reader", False) and hasattr(self, "busy_loop_s"):
            self.busy_loop_s = min(self.busy_loop_s, spin_s)

    cls.__init__ = __init__
    cls._rackflow_spin = True
    # a reader that stopped spinning sleeps on its notify socket, re-reading the shared-memory flag every
    # SHM_READER_RECHECK_INTERVAL_MS (vLLM: 5,000 ms, "bounds lost-notify recovery latency to ~5s"): with the
    # notifications no longer dropped that is a safety net only; 20 ms bounds what any other loss would cost
    if hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = int(os.environ.get("RACKFLOW_VLLM_SHM_RECHECK_MS", "20"))


NOTIFY_HWM = 1000
"""The send high-water mark of a shared-memory queue's notify socket (vLLM: 1; the readers' socket conflates
whatever queues to one message anyway)."""


class _NotifyContext:
    """The ZMQ context vLLM's writer-side `SpinCondition` makes its notify socket from, with that socket's SNDHWM
    raised to `hwm` whatever vLLM asks (it asks for 1, before it binds: ZMQ takes the option at bind)."""

    def __init__(self, context: Any, hwm: int) -> None:
        self._context = context
        self._hwm = hwm

    def socket(self, kind: int, **kwargs: Any) -> Any:
        sock = self._context.socket(kind, socket_class=_notify_socket_class(), **kwargs)
        sock.rackflow_min_sndhwm = self._hwm
        return sock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


_NOTIFY_SOCKET: Any = None


def _notify_socket_class() -> Any:
    """A zmq.Socket whose SNDHWM is never set below its `rackflow_min_sndhwm` (made once, zmq imported late)."""
    global _NOTIFY_SOCKET
    if _NOTIFY_SOCKET is None:
        import zmq

        class NotifySocket(zmq.Socket):  # type: ignore[misc]
            rackflow_min_sndhwm = 1

            def setsockopt(self, option: int, value: Any) -> None:  # type: ignore[override]
                if option == zmq.SNDHWM:
                    value = max(int(value), self.rackflow_min_sndhwm)
                super().setsockopt(option, value)

        _NOTIFY_SOCKET = NotifySocket
    return _NOTIFY_SOCKET
