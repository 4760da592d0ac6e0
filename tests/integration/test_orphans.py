"""Children of rackflow processes die with them, even on kill -9 (no server or role adopted by PID 1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from workers.shell.runtime import die_with_parent

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped by its new parent
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _kill_parent_and_check(code: str, cwd: str | None = None) -> list[int]:
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=cwd)
    assert parent.stdout is not None
    line = parent.stdout.readline()
    assert line, "the parent printed no child pids"
    pids = json.loads(line)
    assert pids and all(not _gone(p, 0.0) for p in pids), "the children were not running before the kill"
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    return [p for p in pids if not _gone(p)]


def test_a_child_started_with_die_with_parent_dies_on_kill_9_of_its_parent() -> None:
    code = (
        "import json, subprocess, time\n"
        "from workers.shell.runtime import die_with_parent\n"
        "p = subprocess.Popen(['sleep', '120'], preexec_fn=die_with_parent(), start_new_session=True)\n"
        "print(json.dumps([p.pid]), flush=True)\n"
        "time.sleep(120)\n"
    )
    assert _kill_parent_and_check(code) == []


def test_embedded_valkey_and_etcd_die_with_the_process_that_started_them(tmp_path) -> None:
    code = (
        "import json, time\n"
        "from pathlib import Path\n"
        "from workers.local.services import EmbeddedServices\n"
        f"svc = EmbeddedServices(Path({str(tmp_path)!r}))\n"
        "svc.start()\n"
        "st = svc.status()\n"
        "print(json.dumps([st['redis']['pid'], st['etcd']['pid']]), flush=True)\n"
        "time.sleep(120)\n"
    )
    assert _kill_parent_and_check(code) == []


def test_detached_services_outlive_the_command(tmp_path) -> None:
    """`rackflow services up` returns at once: its servers must stay (detach=True)."""
    from workers.local.services import EmbeddedServices

    code = (
        "import json\n"
        "from pathlib import Path\n"
        "from workers.local.services import EmbeddedServices\n"
        f"svc = EmbeddedServices(Path({str(tmp_path)!r}), detach=True)\n"
        "svc.start()\n"
        "st = svc.status()\n"
        "print(json.dumps([st['redis']['pid'], st['etcd']['pid']]), flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    pids = json.loads(proc.stdout.strip().splitlines()[-1])
    try:
        time.sleep(0.5)
        assert all(not _gone(p, 0.0) for p in pids), "detached services died with the command that started them"
    finally:
        EmbeddedServices(tmp_path).stop()
    assert all(_gone(p) for p in pids)


def test_from_a_thread_other_than_main_no_death_signal_is_set() -> None:
    """PR_SET_PDEATHSIG follows the forking thread: a pool thread's end must not kill the child."""
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(die_with_parent()))
    t.start()
    t.join()
    assert got == [None]
    assert callable(die_with_parent())
