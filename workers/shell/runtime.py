"""Process plumbing shared by every role: wall clock, logging, signals, connections, consumer names.

Owns what a role process needs around its policy objects; never decides anything about requests itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import TypeVar

T = TypeVar("T")


class WallClock:
    """The live pipeline's Clock: milliseconds since the Unix epoch."""

    def now_ms(self) -> float:
        return time.time() * 1000.0


WALL = WallClock()


# -- logging -----------------------------------------------------------------------------------------------------
LOG_FIELDS = ("request_id", "seq_id", "batch_id", "node", "rack")
"""Context fields every log line carries (JSON: as keys, null when not set; text: `[k=v ...]` after the message)."""

_EMPTY: Mapping[str, str] = MappingProxyType({})
_log_context: ContextVar[Mapping[str, str]] = ContextVar("rackflow_log_context", default=_EMPTY)
_log_defaults: dict[str, str] = {}


def _fields(fields: Mapping[str, object]) -> dict[str, str]:
    return {k: str(v) for k, v in fields.items() if v is not None and v != ""}


@contextmanager
def log_context(**fields: object) -> Iterator[None]:
    """Within the block (of this task or thread), log lines carry these fields (request_id, seq_id, batch_id, node,
    rack, or any other key). Nests: inner fields are added to the outer ones."""
    token = _log_context.set({**_log_context.get(), **_fields(fields)})
    try:
        yield
    finally:
        _log_context.reset(token)


def bind_log_context(**fields: object) -> None:
    """Add fields for the rest of the current task (an HTTP request's own task; asyncio copies the context into
    tasks it creates, so they carry them too)."""
    _log_context.set({**_log_context.get(), **_fields(fields)})


def set_log_defaults(**fields: object) -> None:
    """Fields of the whole process (a worker's node and rack): every line carries them unless a context overrides."""
    _log_defaults.update(_fields(fields))


def current_log_fields() -> dict[str, str]:
    return {**_log_defaults, **_log_context.get()}


class ContextFilter(logging.Filter):
    """Puts the context fields on each record (`rf_fields`, and `rf_ctx`: the text format's ` [k=v ...]`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        f = current_log_fields()
        record.rf_fields = f
        record.rf_ctx = (" [" + " ".join(f"{k}={v}" for k, v in f.items()) + "]") if f else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601 with ms), level, role, pid, logger, message, the LOG_FIELDS (null
    when not set), any other context field, and `exc` with the traceback when there is one."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "rf_fields", None)
        if fields is None:
            fields = current_log_fields()
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        out: dict[str, object] = {
            "ts": ts, "level": record.levelname, "role": self.role, "pid": record.process, "logger": record.name,
            "message": record.getMessage(),
        }
        for k in LOG_FIELDS:
            out[k] = fields.get(k)
        for k, v in fields.items():
            if k not in out:
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def json_logs_requested(flag: bool = False) -> bool:
    """JSON logs: asked for by the flag/config, or by RACKFLOW_LOG_JSON=1 in the environment."""
    return flag or os.environ.get("RACKFLOW_LOG_JSON", "").strip().lower() in ("1", "true", "yes", "on")


def setup_logging(level: str = "INFO", role: str = "rackflow", json_logs: bool = False, **fields: object) -> None:
    """Log to stderr: text (`ts LEVEL role[pid] logger: message [k=v ...]`) or, with `json_logs` (or
    RACKFLOW_LOG_JSON=1), one JSON object per line. `fields` are the process's fixed context (node, rack)."""
    set_log_defaults(**fields)
    root = logging.getLogger()
    if not root.handlers:  # like logging.basicConfig: a process that already logs somewhere keeps its handlers
        root.setLevel(getattr(logging, level.upper(), logging.INFO))
        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(ContextFilter())
        if json_logs_requested(json_logs):
            handler.setFormatter(JsonFormatter(role))
        else:
            handler.setFormatter(logging.Formatter(
                f"%(asctime)s %(levelname)s {role}[%(process)d] %(name)s: %(message)s%(rf_ctx)s"))
        root.addHandler(handler)
    for noisy in ("asyncio", "grpc", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def consumer_name(role: str) -> str:
    return f"{role}@{socket.gethostname()}:{os.getpid()}"


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


def _prctl() -> Callable[..., int] | None:
    if sys.platform != "linux":
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen: the child gets SIGKILL when this process dies, however it dies (kill -9
    included), so a killed `rackflow up`, demo or test run leaves no server or role behind, adopted by PID 1.

    Linux's PR_SET_PDEATHSIG fires when the *thread* that forked exits, not only the process: from any thread
    other than the main one (a thread pool's, which may end before the process does) this returns None, and the
    child is only in its own session, as before. None as well where prctl is not available (not Linux)."""
    import threading

    prctl = _prctl()
    if prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()

    def preexec() -> None:  # runs in the child between fork and exec: no allocation-heavy work
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def die_with_parent_now() -> bool:
    """The same for this process, from inside it (a child that a library spawned, such as vLLM's engine core and
    its executor's workers): SIGKILL when the parent dies. False where prctl is not available."""
    prctl = _prctl()
    if prctl is None:
        return False
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    return True


def lower_cpu_priority(nice: int) -> str:
    """Yield the CPU to the rest of the host: this process and whatever it spawns from now on (vLLM's engine core and
    executor) run `nice` steps below normal. Returns what was done, for the log.

    With the scheduler's autogroups on (Linux's default on most distributions: each session is one group, and the
    groups share the CPU as equals whatever their members' nice values), only the group's own nice counts against the
    other roles, so a session leader sets its group's (`/proc/self/autogroup`); a process in a shared session leaves
    the group alone, since that would lower its siblings too. `os.nice` covers kernels without autogroups."""
    if nice <= 0:
        return "normal priority"
    done = []
    try:
        os.nice(nice)
        done.append(f"nice +{nice}")
    except OSError as e:
        done.append(f"nice refused ({e.strerror})")
    path = "/proc/self/autogroup"
    try:
        if os.getsid(0) == os.getpid() and os.path.exists(path):
            with open(path, "w") as f:
                f.write(str(nice))
            done.append(f"its session's autogroup nice {nice}")
    except OSError as e:
        done.append(f"autogroup nice refused ({e.strerror})")
    return ", ".join(done)
