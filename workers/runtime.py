"""Process plumbing shared by every role: wall clock, logging, signals, connections, consumer names.

Owns what a role process needs around its policy objects; never decides anything about requests itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pipeline.config import RackflowConfig, load_config

T = TypeVar("T")


class WallClock:
    """The live pipeline's Clock: milliseconds since the Unix epoch."""

    def now_ms(self) -> float:
        return time.time() * 1000.0


WALL = WallClock()


def setup_logging(level: str = "INFO", role: str = "rackflow") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s {role}[%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("asyncio", "grpc", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def consumer_name(role: str) -> str:
    return f"{role}@{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class RoleSettings:
    config: RackflowConfig
    redis_url: str
    etcd_url: str


def load_role_config(config_dir: Path | None, overrides: list[Path]) -> RackflowConfig:
    from pipeline.config import DEFAULT_CONFIG_DIR

    return load_config(config_dir or DEFAULT_CONFIG_DIR, overrides)


def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[int | None]]) -> int:
    """Run `main(stop_event)`; SIGTERM/SIGINT set the event so the role can stop cleanly."""

    async def runner() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        rc = await main(stop)
        return int(rc or 0)

    return run_async(runner())


def run_async(coro: Awaitable[T]) -> T:
    """asyncio.run on uvloop when it is installed (a faster event loop for the stream roles), else the default."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep working without it
        return asyncio.run(coro)
    return uvloop.run(coro)
