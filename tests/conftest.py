"""Shared fixtures: REAL Valkey and etcd, started once per session on free loopback ports (or existing servers
given with --redis-url / --etcd-url; their DB is flushed between tests, so point them at scratch servers only)."""

from __future__ import annotations

import os

# as workers/cli/boot.py does for every rackflow process, and for the same reason: this process holds etcd channels
# while it starts role processes, and gRPC's fork handlers lose some children before their exec (grpc/grpc#43055)
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.local.services import EmbeddedServices, ServiceEndpoints

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--redis-url", default=os.environ.get("RACKFLOW_TEST_REDIS_URL"),
                     help="use this (scratch!) Redis/Valkey instead of starting one; it is flushed between tests")
    parser.addoption("--etcd-url", default=os.environ.get("RACKFLOW_TEST_ETCD_URL"),
                     help="use this (scratch!) etcd instead of starting one; /rackflow/ is deleted between tests")


@pytest.fixture(scope="session")
def services(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceEndpoints]:
    redis_url = request.config.getoption("--redis-url")
    etcd_url = request.config.getoption("--etcd-url")
    if redis_url and etcd_url:
        yield ServiceEndpoints(redis_url, etcd_url)
        return
    # no fsync for the suite's throwaway etcd: on this machine kind its WAL fdatasync stalls for seconds while vLLM
    # workers and the suite load the disk (measured: "slow fdatasync" 2.2 s in the vLLM tier; an etcd silent ~12 s in
    # CI, which expired healthy workers' leases and failed tests/vllm/test_failover.py twice)
    svc = EmbeddedServices(tmp_path_factory.mktemp("services"), etcd_args=["--unsafe-no-fsync"])
    ep = svc.start()
    try:
        yield ServiceEndpoints(redis_url or ep.redis_url, etcd_url or ep.etcd_url)
    finally:
        svc.stop()


async def _clean(ep: ServiceEndpoints) -> None:
    from streams.runner import connect
    from workers.stores.etcd import NodeRegistry

    r = connect(ep.redis_url)  # retried: the previous test's processes may still be busy exiting
    await r.flushdb()
    await r.aclose()
    reg = NodeRegistry(ep.etcd_url)
    await reg.client.delete_prefix(b"/rackflow/")
    await reg.close(revoke=False)


@pytest.fixture
def clean_services(services: ServiceEndpoints) -> ServiceEndpoints:
    """The session's servers, emptied of everything rackflow wrote before this test."""
    asyncio.run(_clean(services))
    return services


@pytest.fixture
def config_file(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Write a YAML override merged over configs/ and return its path."""
    import yaml

    def write(data: dict, name: str = "override.yaml") -> Path:  # type: ignore[type-arg]
        p = tmp_path / name
        p.write_text(yaml.safe_dump(data))
        return p

    return write


def _descendants(pid: int) -> list[tuple[int, str]]:
    """Live (non-zombie) processes whose parent chain leads to `pid`, with their command lines."""
    parents: dict[int, int] = {}
    cmd: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] == "Z":
                continue
            parents[int(d.name)] = int(fields[1])
            cmd[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
    out = []
    for p in parents:
        q = parents.get(p)
        while q is not None and q != pid:
            q = parents.get(q)
        if q == pid:
            out.append((p, cmd.get(p, "")))
    return out


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The suite must leave no process behind (servers, role processes)."""
    left = [(p, c) for p, c in _descendants(os.getpid()) if any(
        k in c for k in ("valkey-server", "etcd", "workers.cli", "rackflow"))]
    if left:
        print("\nprocesses left behind by the test session:\n" + "\n".join(f"  {p} {c[:150]}" for p, c in left))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
