"""The vLLM plugin (workers/engines/vllm_plugin.py), loaded as vLLM loads it (`load_general_plugins`, in a fresh
interpreter of .venv-vllm): the shared-memory queues' notifications are no longer dropped (the writer's notify
socket's SNDHWM), the readers spin briefly, and a lost notification costs the re-check, 20 ms, not vLLM's 5 s; and a
reader that never spins is still woken by every notification, message after message."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

PROBE = r"""
import json, os, threading, time
from vllm.plugins import load_general_plugins
load_general_plugins()
import zmq
from vllm.distributed.device_communicators import shm_broadcast as sb
ctx = zmq.Context()
addr = sb.get_open_zmq_ipc_path()
writer = sb.SpinCondition(is_reader=False, context=ctx, notify_address=addr)
reader = sb.SpinCondition(is_reader=True, context=ctx, notify_address=addr)
# the subscription reaches the publisher when it does (a PUB drops what it sends before): notify until one arrives,
# however long a busy machine takes, then drain (the reader's socket conflates to one message)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    writer.notify()
    if reader.local_notify_socket in dict(reader.poller.poll(timeout=100)):
        break
else:
    raise SystemExit("the reader never subscribed")
while reader.local_notify_socket in dict(reader.poller.poll(timeout=50)):
    reader.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)
# a reader that never spins (RACKFLOW_VLLM_SPIN_S=0) waits on the socket every time: each of 200 notifications sent
# back to back wakes a wait that would otherwise last its whole 1 s timeout (with vLLM's SNDHWM 1 most never come)
woken = 0
t0 = time.monotonic()
for _ in range(200):
    writer.notify()
    reader.last_read = 0.0  # idle: no spin
    events = dict(reader.poller.poll(timeout=1000))
    if reader.local_notify_socket in events:
        reader.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)
        woken += 1
print(json.dumps({"sndhwm": writer.local_notify_socket.getsockopt(zmq.SNDHWM), "busy_loop_s": reader.busy_loop_s,
                  "recheck_ms": sb.SHM_READER_RECHECK_INTERVAL_MS, "woken": woken,
                  "patched": bool(getattr(sb.SpinCondition, "_rackflow_spin", False))}))
"""


def _probe(**env: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_notify_socket_drops_nothing_and_a_lost_notify_costs_20_ms() -> None:
    got = _probe(RACKFLOW_VLLM_SPIN_S="0")
    assert got["patched"] is True
    assert got["sndhwm"] == 1000, got
    assert got["busy_loop_s"] == 0.0, got
    assert got["recheck_ms"] == 20, got
    assert got["woken"] == 200, got


def test_the_defaults_spin_50_ms() -> None:
    got = _probe()
    assert got["busy_loop_s"] == 0.05, got
