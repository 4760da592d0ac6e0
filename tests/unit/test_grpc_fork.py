"""A process that holds a gRPC channel and starts subprocesses loses none of them before their exec: rackflow turns
gRPC's fork handlers off (workers/cli/boot.py; grpc/grpc#43055). With them on, 6 of 300 children died here with
"epoll_wait error: Bad file descriptor" (SIGABRT), the crash that failed a CI run's valkey-cluster test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SPAWNER = """
import os, subprocess, sys, threading
import workers.cli.boot  # what every rackflow process imports first
import grpc
ch = grpc.insecure_channel("127.0.0.1:1")  # a channel whose poller is busy, like an etcd client's
def spin():
    while True:
        try:
            grpc.channel_ready_future(ch).result(timeout=0.01)
        except Exception:
            pass
threading.Thread(target=spin, daemon=True).start()
lost = 0
for _ in range(int(sys.argv[1])):  # fork + exec with a preexec_fn and close_fds, as the launcher starts roles
    p = subprocess.Popen([sys.executable, "-c", "pass"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         preexec_fn=lambda: None)
    lost += p.wait() != 0
print(os.environ["GRPC_ENABLE_FORK_SUPPORT"], lost)
"""


def test_rackflow_turns_grpcs_fork_handlers_off_and_loses_no_child() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    p = subprocess.run([sys.executable, "-c", _SPAWNER, "150"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    setting, lost = p.stdout.split()
    assert setting == "false"
    assert lost == "0"
    assert "skipping fork() handlers" not in p.stderr  # the handlers did not run at all


def test_a_users_own_setting_is_kept() -> None:
    env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "true"}
    code = "import os, workers.cli.boot; print(os.environ['GRPC_ENABLE_FORK_SUPPORT'])"
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "true"
