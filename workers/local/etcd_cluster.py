"""A real 3-member etcd cluster on loopback: for the tests of etcd failover (members killed, stopped, restarted) and
for `rackflow sim calibrate-control-plane` (etcd transaction latency under contention). A local run uses one member
(workers/local/etcd.py); production runs its own etcd."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from workers.local.etcd import EtcdProcess
from workers.local.supervise import LOOPBACK, _free_ports, _remove_tree

logger = logging.getLogger("workers.local.services")


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
