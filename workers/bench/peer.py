"""Peers for `rackflow bench gateway`: another gateway, and the bare HTTP stack, under the same load generator.

Measured, each in its own processes on loopback, by the closed-loop load generator of `workers/bench/gateway.py`
(`closed_loop`: N concurrent clients, non-streamed completions with small `max_tokens`, every k-th one streamed and
read to `[DONE]`), with the same warm-up run and the same medians over repeats as `bench_gateway`:

- `bench_peer`: SMG (`smg launch --policy round_robin`, a Rust OpenAI-compatible gateway; a benchmark dependency,
  the `peers` extra, installed into `.venv-peers` on first use) in front of 2 zero-time engines, each a thin
  OpenAI-compatible shim process (below);
- `bench_bare`: one shim, no gateway in front: the ceiling of the HTTP stack (FastAPI on uvicorn) on this machine,
  with uvicorn's `httptools` parser (what the gateway runs by default, `gateway.http_parser`) or `h11`.

The shim (`python -m workers.bench.peer shim --port N [--http h11|httptools]`) is the zero-time engine: FastAPI on
uvicorn answering POST /v1/completions at once, `max_tokens` tokens, as one JSON body or as one SSE chunk per token,
a finish chunk and `data: [DONE]`; plus GET /health and /v1/models, all that SMG needs to register a worker (it also
probes /version, /server_info, /model_info and /loads, whose 404s make it register a generic OpenAI backend).

Reported per peer, as medians over repeats: `rps` (completed, correct answers per second), `p50_ms` / `p99_ms`
(request sent -> full answer, or -> `[DONE]`), `added_ttft_p50_ms` / `added_ttft_p99_ms` (streamed requests: sent ->
first chunk with text; the engine takes no time, so all of it is added by the HTTP path), `errors` (must be 0), and
`cpu_us_per_request`: the CPU time (user + system) that the load generator (`client`) and each role's processes
spent per completed request. The load generator shares the machine's cores with the processes it measures, as in
`bench_gateway`; on a busy or small machine the CPU times are the steadier figure, and where `client` costs more
than the server the req/s are the load generator's ceiling, not the server's.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.metadata
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from tqdm import tqdm

from pipeline.errors import RackflowError
from pipeline.stats import percentile
from workers.bench.gateway import MODEL, Outcome, shown_closed_loop, summarize
from workers.bench.idle import tree_cpu_s
from workers.local.supervise import LOOPBACK, ServiceError, _log_tail, _ServerProcess, free_port
from workers.shell.runtime import run_async

SMG_VERSION = "1.13.0"
SMG_SPEC = f"smg=={SMG_VERSION}"
VLLM_ROUTER_VERSION = "0.1.17"
PEER_SPECS: dict[str, tuple[str, str]] = {
    "smg": ("smg", SMG_VERSION),
    "vllm-router": ("vllm-router", VLLM_ROUTER_VERSION),
}
"""The peer gateways `rackflow bench gateway --peer` runs, by name: (the PyPI package and its executable, the pinned
version). Both are Rust routers shipped as wheels: SMG (`smg launch`) and vLLM's router (`vllm-router`)."""
REPO = Path(__file__).resolve().parents[2]
PEERS_VENV = REPO / ".venv-peers"
"""Where `ensure_peer` installs a peer when this environment lacks it (git-ignored by its own .gitignore)."""
FLOORS = REPO / "deploy" / "security" / "advisory-floors.txt"

Parser = Literal["h11", "httptools"]
PARSERS: tuple[Parser, ...] = ("h11", "httptools")
TOKEN = " x"
"""The text of each generated token."""
_START_TIMEOUT_S = 60.0
_NO_HTTPTOOLS = "uvicorn's httptools parser is not installed here (pip install httptools)"


class PeerUnavailable(RackflowError, RuntimeError):
    """A peer cannot run here: it could not be installed, or the HTTP parser asked for is not installed."""


def peer_names(text: str) -> list[str]:
    """`smg,vllm-router` -> ["smg", "vllm-router"]: the peers of `--peer`, each once, in order; a ValueError that
    names the known ones for any other."""
    names = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    unknown = [n for n in names if n not in PEER_SPECS]
    if unknown or not names:
        raise ValueError(f"unknown peer {', '.join(unknown) or repr(text)}: give a comma list of "
                         f"{', '.join(PEER_SPECS)}")
    return names


# -- the zero-time engine shim ---------------------------------------------------------------------------------

_MODELS = json.dumps({"object": "list", "data": [
    {"id": MODEL, "object": "model", "created": 0, "owned_by": "rackflow-shim"}]}).encode()


@dataclass(frozen=True)
class _ShimAnswer:
    """What the shim answers to one completion body: `status` and `body` (JSON) when it is not a stream, else the
    `n` token chunks (`token`) and the closing chunk (`last`) of an SSE stream."""

    status: int
    body: bytes = b""
    n: int = 0
    token: bytes = b""
    last: bytes = b""


def _shim_answer(raw: bytes, rid: str) -> _ShimAnswer:
    """The zero-time completion of `raw` (both shims: the FastAPI app and the bare ASGI callable answer alike)."""
    try:
        body = json.loads(raw)
        n = int(body.get("max_tokens") or 16)
        model = str(body.get("model") or MODEL)
    except (ValueError, TypeError, AttributeError) as e:
        return _ShimAnswer(400, json.dumps({"error": {"message": f"bad request: {e}",
                                                       "code": "invalid_request"}}).encode())
    created = int(time.time())

    def choice(text: str, finish: str | None) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

    if not body.get("stream"):
        out = choice(TOKEN * n, "length")
        out["usage"] = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
        return _ShimAnswer(200, json.dumps(out).encode())
    return _ShimAnswer(200, n=n, token=f"data: {json.dumps(choice(TOKEN, None))}\n\n".encode(),
                       last=f"data: {json.dumps(choice('', 'length'))}\n\ndata: [DONE]\n\n".encode())


def shim_app() -> FastAPI:
    """The zero-time OpenAI-compatible engine: a FastAPI app with raw responses (no response models, no
    validation beyond what a completion needs), so that what it costs is the HTTP stack's."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    ids = itertools.count()
    pid = os.getpid()

    @app.get("/health")
    async def health() -> Response:
        return Response()

    @app.get("/v1/models")
    async def list_models() -> Response:
        return Response(_MODELS, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        a = _shim_answer(await request.body(), f"cmpl-{pid}-{next(ids)}")
        if not a.token:
            return Response(a.body, status_code=a.status, media_type="application/json")

        async def sse() -> AsyncIterator[bytes]:
            for _ in range(a.n):
                yield a.token
            yield a.last

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app


def shim_asgi() -> Any:
    """The same zero-time engine as `shim_app`, as a bare ASGI callable (no framework): what a thin handler costs,
    against FastAPI/Starlette, under the same server."""
    ids = itertools.count()
    pid = os.getpid()
    json_h = [(b"content-type", b"application/json")]
    sse_h = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

    async def reply(send: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/health":
            return await reply(send, 200, [], b"")
        if method == "GET" and path == "/v1/models":
            return await reply(send, 200, json_h, _MODELS)
        if method != "POST" or path != "/v1/completions":
            return await reply(send, 404, json_h, b'{"error": {"message": "not found"}}')
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        a = _shim_answer(raw, f"cmpl-{pid}-{next(ids)}")
        if not a.token:
            return await reply(send, a.status, json_h, a.body)
        await send({"type": "http.response.start", "status": 200, "headers": sse_h})
        for _ in range(a.n):
            await send({"type": "http.response.body", "body": a.token, "more_body": True})
        await send({"type": "http.response.body", "body": a.last})

    return app


Server = Literal["uvicorn", "granian"]
SERVERS: tuple[Server, ...] = ("uvicorn", "granian")
App = Literal["fastapi", "asgi"]
APPS: tuple[App, ...] = ("fastapi", "asgi")
_NO_GRANIAN = "granian (a Rust HTTP server for Python) is not installed here: pip install -e '.[peers]'"


def granian_installed() -> bool:
    return importlib.util.find_spec("granian") is not None


def serve_shim(port: int, http: Parser = "httptools", host: str = LOOPBACK, server: Server = "uvicorn",
               app: App = "fastapi") -> None:
    """Run the shim (`app`: FastAPI, or the bare ASGI callable) until SIGTERM/SIGINT, on uvicorn (uvloop and the
    `http` parser, as the gateway runs) or on granian (its Rust HTTP/1.1 stack, one worker, the ASGI interface)."""
    if server == "granian":
        if not granian_installed():
            raise PeerUnavailable(_NO_GRANIAN)
        from granian import Granian
        from granian.constants import HTTPModes, Interfaces

        target = "workers.bench.peer:shim_app" if app == "fastapi" else "workers.bench.peer:shim_asgi"
        Granian(target, address=host, port=port, interface=Interfaces.ASGI, workers=1, http=HTTPModes.http1,
                factory=True, log_access=False).serve()
        return
    if http == "httptools" and not httptools_installed():
        raise PeerUnavailable(_NO_HTTPTOOLS)
    uvicorn.run(shim_app() if app == "fastapi" else shim_asgi(), host=host, port=port, http=http, loop="auto",
                log_level="warning", access_log=False, server_header=False, date_header=False)


def httptools_installed() -> bool:
    return importlib.util.find_spec("httptools") is not None


# -- processes ---------------------------------------------------------------------------------------------------

def _get_ok(url: str, timeout_s: float = 1.0) -> bytes | None:
    """The body of a 200 answer to GET `url`, else None."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return bytes(resp.read()) if resp.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


class _HttpProcess(_ServerProcess):
    """One HTTP server as a child process on a free loopback port (a port lost to a race is picked again)."""

    def __init__(self, name: str, data_dir: Path) -> None:
        super().__init__(data_dir, ())
        self.service = name
        self.log_file = self.data_dir / f"{name}.log"
        self.port = free_port()

    def _ports_chosen_here(self) -> bool:
        return True

    def _repick_ports(self) -> None:
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


class ShimProcess(_HttpProcess):
    """`python -m workers.bench.peer shim`, healthy once GET /health answers."""

    def __init__(self, name: str, data_dir: Path, http: Parser = "httptools", server: Server = "uvicorn",
                 app: App = "fastapi") -> None:
        super().__init__(name, data_dir)
        self.http = http
        self.server = server
        self.app = app

    def _argv(self) -> list[str]:
        return [sys.executable, "-m", "workers.bench.peer", "shim", "--port", str(self.port), "--http", self.http,
                "--server", self.server, "--app", self.app]

    def healthy(self) -> bool:
        return _get_ok(f"{self.url}/health") is not None


class _RouterProcess(_HttpProcess):
    """A peer gateway executable in front of `worker_urls`, with its own loopback metrics port (both routers bind
    a fixed metrics port by default)."""

    def __init__(self, name: str, exe: Path, worker_urls: Sequence[str], data_dir: Path,
                 policy: str = "round_robin") -> None:
        super().__init__(name, data_dir)
        self.exe = exe
        self.worker_urls = tuple(worker_urls)
        self.policy = policy
        self.metrics_port = free_port()

    def _repick_ports(self) -> None:
        super()._repick_ports()
        self.metrics_port = free_port()


class SmgProcess(_RouterProcess):
    """`smg launch` in front of `worker_urls`, healthy once it lists every worker as healthy (SMG's own /health
    answers before any worker is registered)."""

    def __init__(self, smg: Path, worker_urls: Sequence[str], data_dir: Path, policy: str = "round_robin") -> None:
        super().__init__("smg", smg, worker_urls, data_dir, policy)

    def _argv(self) -> list[str]:
        return [
            str(self.exe), "launch", "--host", LOOPBACK, "--port", str(self.port),
            "--worker-urls", *self.worker_urls, "--policy", self.policy,
            # its metrics listener binds 0.0.0.0:29000 by default: loopback, and a port of its own per run
            "--prometheus-host", LOOPBACK, "--prometheus-port", str(self.metrics_port),
            # it logs every request at info: warn, as the gateway's bench runs at WARNING without an access log
            "--log-level", "warn",
            # it waits up to 180 s for in-flight requests on SIGTERM
            "--shutdown-grace-period-secs", "1",
        ]

    def healthy(self) -> bool:
        body = _get_ok(f"{self.url}/workers")
        if body is None:
            return False
        try:
            workers = json.loads(body)["workers"]
            return sum(1 for w in workers if w.get("is_healthy")) == len(self.worker_urls)
        except (ValueError, KeyError, TypeError, AttributeError):
            return False


class VllmRouterProcess(_RouterProcess):
    """`vllm-router` (vLLM's Rust router) in front of `worker_urls`. It waits for every worker's /health before it
    binds its port, so its own GET /health answering means the workers are registered."""

    def __init__(self, exe: Path, worker_urls: Sequence[str], data_dir: Path, policy: str = "round_robin") -> None:
        super().__init__("vllm-router", exe, worker_urls, data_dir, policy)

    def _argv(self) -> list[str]:
        return [
            str(self.exe), "--host", LOOPBACK, "--port", str(self.port),
            "--worker-urls", *self.worker_urls, "--policy", self.policy,
            "--prometheus-host", LOOPBACK, "--prometheus-port", str(self.metrics_port),
            "--log-level", "warning",
            # its admission queue holds 100 by default and its concurrency cap is its own: the bench's clients
            # (32 by default) stay under both
        ]

    def healthy(self) -> bool:
        return _get_ok(f"{self.url}/health") is not None


@contextlib.contextmanager
def _running(procs: Sequence[_HttpProcess]) -> Iterator[None]:
    """Start `procs` in order, each healthy before the next; stop them all (reverse order) however the block ends,
    Ctrl-C included. Each runs in its own session and gets SIGKILL if this process dies."""
    try:
        for p in procs:
            p.start(timeout_s=_START_TIMEOUT_S)
        yield
    finally:
        for p in reversed(procs):
            p.stop(timeout_s=5.0)


def _check_alive(procs: Sequence[_HttpProcess]) -> None:
    dead = [p for p in procs if p.pid is None]
    if dead:
        tails = "\n".join(f"--- {p.service} ({p.log_file}):\n{_log_tail(p.log_file)}" for p in dead)
        raise RuntimeError(f"died during the benchmark: {', '.join(p.service for p in dead)}\n{tails}")


# -- installing a peer ---------------------------------------------------------------------------------------

def _peer_here(name: str) -> Path | None:
    """Peer `name` at its pinned version in this environment (the `peers` extra), else None."""
    package, version = PEER_SPECS[name]
    try:
        if importlib.metadata.version(package) != version:
            return None
    except importlib.metadata.PackageNotFoundError:
        return None
    exe = Path(sys.executable).parent / package
    return exe if exe.exists() else None


def ensure_peer(name: str, progress: bool = True, timeout_s: float = 600.0) -> Path:
    """The executable of peer `name` (`PEER_SPECS`): this environment's (`pip install -e '.[peers]'`), else the one
    in `.venv-peers`, which is created and given the peer on first use (pip, from the registry: 5 to 60 s here)
    and reused after. Raises PeerUnavailable, with pip's output, when it cannot be installed within `timeout_s`."""
    here = _peer_here(name)
    if here is not None:
        return here
    package, version = PEER_SPECS[name]
    spec = f"{package}=={version}"
    exe = PEERS_VENV / "bin" / package
    stamp = PEERS_VENV / f".installed-{package}"
    PEERS_VENV.mkdir(exist_ok=True)
    (PEERS_VENV / ".gitignore").write_text("*\n")  # a scratch environment, never committed
    with (PEERS_VENV / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two benchmarks starting at once install it once
        if exe.exists() and stamp.exists() and stamp.read_text().strip() == spec:
            return exe
        if progress:
            print(f"installing {spec} into {PEERS_VENV} (once: the peer benchmarks' own environment, not a "
                  "dependency of rackflow)...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        python = PEERS_VENV / "bin" / "python"
        # the advisory floors hold here as in .venv (the Makefile installs with them): no dependency below them
        floors = ["-c", str(FLOORS)] if FLOORS.exists() else []
        steps = [[str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *floors, spec]]
        if not python.exists():
            steps.insert(0, [sys.executable, "-m", "venv", str(PEERS_VENV)])
        for argv in steps:
            try:
                done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False,
                                      timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as e:
                raise PeerUnavailable(f"could not install {spec} into {PEERS_VENV}: `{' '.join(argv)}` did not "
                                      f"finish within {timeout_s:.0f}s") from e
            if done.returncode != 0:
                out = (done.stdout + done.stderr).strip().splitlines()[-20:]
                raise PeerUnavailable(f"could not install {spec} into {PEERS_VENV}: `{' '.join(argv)}` exited "
                                      f"with {done.returncode}:\n" + "\n".join(out))
        if not exe.exists():
            raise PeerUnavailable(f"{spec} installed into {PEERS_VENV}, but {exe} is missing")
        stamp.write_text(spec + "\n")
        if progress:
            print(f"installed {spec} in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
        return exe


def ensure_smg(progress: bool = True, timeout_s: float = 600.0) -> Path:
    """`ensure_peer("smg")`."""
    return ensure_peer("smg", progress, timeout_s)


# -- measuring ---------------------------------------------------------------------------------------------------

def _cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system, all threads) that process `pid` and its live children (granian's worker) have
    used so far; 0.0 when it is gone."""
    return tree_cpu_s(pid) if pid is not None else 0.0


def _cpu_by_role(roles: dict[str, Sequence[_HttpProcess]]) -> dict[str, float]:
    """CPU seconds used so far by this process (the load generator: `client`) and by each role's processes."""
    return {"client": time.process_time(), **{r: sum(_cpu_s(p.pid) for p in ps) for r, ps in roles.items()}}


def _run_summary(outcomes: list[Outcome], window_s: float, cpu_s: dict[str, float]) -> dict[str, Any]:
    """`summarize`, plus the time to the first text chunk of the streamed answers and the CPU time per completed
    request of each role."""
    out = summarize(outcomes, window_s)
    out["cpu_us_per_request"] = {r: round(c * 1e6 / out["completed"]) if out["completed"] else None
                                 for r, c in cpu_s.items()}
    ttft = [o.ttft_s * 1000 for o in outcomes if o.ok and o.ttft_s is not None]
    out["ttft_p50_ms"] = round(percentile(ttft, 50), 2) if ttft else None
    out["ttft_p99_ms"] = round(percentile(ttft, 99), 2) if ttft else None
    out["first_error"] = next((o.error or f"HTTP {o.status}" for o in outcomes if not o.ok and not o.shed), None)
    return out


def _measure(url: str, roles: dict[str, Sequence[_HttpProcess]], clients: int, duration_s: float, repeats: int,
             max_tokens: int, stream_every: int, desc: str, progress: bool) -> list[dict[str, Any]]:
    """Run 0 warms up (connections, caches) and is not counted; then `repeats` measured closed-loop runs, each
    with the CPU time that the load generator and each role's processes spent on it."""
    runs: list[dict[str, Any]] = []
    bar = tqdm(total=round((repeats + 1) * duration_s), desc=desc, unit="s", disable=not progress,
               file=sys.stderr)
    try:
        for k in range(repeats + 1):
            t0, cpu0 = time.monotonic(), _cpu_by_role(roles)
            outcomes = run_async(shown_closed_loop(url, clients, duration_s, max_tokens, stream_every, bar,
                                                   f"run {k}/{repeats}"))
            cpu = {r: c - cpu0[r] for r, c in _cpu_by_role(roles).items()}
            window = max(duration_s, max((o.start + o.latency_s for o in outcomes), default=t0) - t0)
            if k > 0:
                runs.append(_run_summary(outcomes, window, cpu))
    finally:
        bar.close()
    return runs


def _result(name: str, runs: list[dict[str, Any]], clients: int, duration_s: float, repeats: int,
            max_tokens: int, stream_every: int, **setup: Any) -> dict[str, Any]:
    def med_of(values: list[float | None]) -> float | None:
        vals = [v for v in values if v is not None]
        return round(statistics.median(vals), 2) if vals else None

    def med(key: str) -> float | None:
        return med_of([r[key] for r in runs])

    return {
        "name": name,
        "rps": med("rps"),
        "p50_ms": med("p50_ms"),
        "p99_ms": med("p99_ms"),
        "added_ttft_p50_ms": med("ttft_p50_ms"),
        "added_ttft_p99_ms": med("ttft_p99_ms"),
        "errors": sum(r["errors"] for r in runs),
        "first_error": next((r["first_error"] for r in runs if r["first_error"]), None),
        "shed": sum(r["shed"] for r in runs),
        "requests": sum(r["requests"] for r in runs),
        "streamed": sum(r["streamed"] for r in runs),
        "rps_runs": [r["rps"] for r in runs],
        "p99_runs_ms": [r["p99_ms"] for r in runs],
        "cpu_us_per_request": {role: med_of([r["cpu_us_per_request"][role] for r in runs])
                               for role in (runs[0]["cpu_us_per_request"] if runs else {})},
        "clients": clients,
        "duration_s": duration_s,
        "repeats": repeats,
        "max_tokens": max_tokens,
        "stream_share": round(1 / stream_every, 3) if stream_every else 0.0,
        **setup,
    }


def bench_peer(clients: int = 32, duration_s: float = 8.0, repeats: int = 3, max_tokens: int = 8,
               stream_every: int = 5, progress: bool = True, http: Parser = "httptools",
               policy: str = "round_robin", peer: str = "smg") -> dict[str, Any]:
    """Peer gateway `peer` (`PEER_SPECS`: SMG or vLLM's router) in front of 2 zero-time shim engines (uvicorn with
    the `http` parser), under `closed_loop`. When httptools is asked for and not installed, the result says so
    (`unavailable`) instead of failing; a peer that cannot be installed raises PeerUnavailable."""
    package, version = PEER_SPECS[peer]
    name = f"{peer} {version}"
    if http == "httptools" and not httptools_installed():
        return {"name": name, "http": http, "unavailable": _NO_HTTPTOOLS}
    exe = ensure_peer(peer, progress)
    with tempfile.TemporaryDirectory(prefix="rackflow-peer-") as tmp:
        shims = [ShimProcess(f"shim{i}", Path(tmp), http) for i in range(2)]
        with _running(shims):
            urls = [s.url for s in shims]  # the ports the shims bound
            gateway: _RouterProcess = (SmgProcess(exe, urls, Path(tmp), policy) if peer == "smg"
                                       else VllmRouterProcess(exe, urls, Path(tmp), policy))
            with _running([gateway]):
                runs = _measure(gateway.url, {peer: [gateway], "shims": shims}, clients, duration_s, repeats,
                                max_tokens, stream_every, f"bench {name}", progress)
                _check_alive([*shims, gateway])
    launch = "smg launch" if peer == "smg" else package
    return _result(name, runs, clients, duration_s, repeats, max_tokens, stream_every, http=http,
                   setup=f"{launch} --policy {policy} -> 2 zero-time shims (FastAPI on uvicorn, {http})")


def bench_bare(clients: int = 32, duration_s: float = 8.0, repeats: int = 3, max_tokens: int = 8,
               stream_every: int = 5, progress: bool = True, http: Parser = "httptools", server: Server = "uvicorn",
               app: App = "fastapi") -> dict[str, Any]:
    """One zero-time shim, no gateway: the ceiling of an HTTP stack on this machine: `app` (FastAPI, or a bare ASGI
    callable) on `server` (uvicorn with the parser `http`, or granian's Rust HTTP/1.1). When httptools or granian
    is asked for and not installed, the result says so (`unavailable`) instead of failing."""
    stack = f"uvicorn, {http}" if server == "uvicorn" else "granian"
    name = f"bare {'FastAPI' if app == 'fastapi' else 'ASGI'} ({stack})"
    if server == "uvicorn" and http == "httptools" and not httptools_installed():
        return {"name": name, "http": http, "unavailable": _NO_HTTPTOOLS}
    if server == "granian" and not granian_installed():
        return {"name": name, "http": http, "unavailable": _NO_GRANIAN}
    with tempfile.TemporaryDirectory(prefix="rackflow-peer-") as tmp:
        shim = ShimProcess("shim", Path(tmp), http, server, app)
        with _running([shim]):
            runs = _measure(shim.url, {"shim": [shim]}, clients, duration_s, repeats, max_tokens, stream_every,
                            f"bench {name}", progress)
            _check_alive([shim])
    return _result(name, runs, clients, duration_s, repeats, max_tokens, stream_every, http=http, server=server,
                   app=app, setup=f"1 zero-time shim ({name.removeprefix('bare ')}), no gateway")


# -- command line ------------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workers.bench.peer", description="peers for `rackflow bench gateway`")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("shim", help="run one zero-time OpenAI-compatible engine shim")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--host", default=LOOPBACK)
    s.add_argument("--http", choices=PARSERS, default="httptools", help="uvicorn's HTTP/1.1 parser")
    s.add_argument("--server", choices=SERVERS, default="uvicorn", help="the HTTP server")
    s.add_argument("--app", choices=APPS, default="fastapi", help="FastAPI, or the bare ASGI callable")
    b = sub.add_parser("bench", help="measure peers and print their figures as JSON")
    b.add_argument("--peer", choices=[*PEER_SPECS, "bare"], action="append",
                   help="what to measure (repeatable; default: smg and bare)")
    b.add_argument("--http", choices=PARSERS, action="append",
                   help="the shims' parser (repeatable; default: both, httptools reported unavailable where it is "
                        "not installed)")
    b.add_argument("--server", choices=SERVERS, action="append",
                   help="bare: the HTTP server (repeatable; default: uvicorn)")
    b.add_argument("--app", choices=APPS, action="append",
                   help="bare: FastAPI or the bare ASGI callable (repeatable; default: fastapi)")
    b.add_argument("--clients", type=int, default=32)
    b.add_argument("--duration", type=float, default=8.0, help="seconds per run")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--max-tokens", type=int, default=8)
    b.add_argument("--stream-every", type=int, default=5, help="every k-th request is streamed (0: none)")
    b.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "shim":
            serve_shim(args.port, args.http, args.host, args.server, args.app)
            return 0
        results = []
        for peer in args.peer or ["smg", "bare"]:
            for http in args.http or list(PARSERS):
                kw: dict[str, Any] = {"clients": args.clients, "duration_s": args.duration, "repeats": args.repeats,
                                      "max_tokens": args.max_tokens, "stream_every": args.stream_every,
                                      "progress": not args.no_progress, "http": http}
                if peer != "bare":
                    results.append(bench_peer(**kw, peer=peer))
                    continue
                for server in args.server or ["uvicorn"]:
                    for app in args.app or ["fastapi"]:
                        if server == "granian" and http != (args.http or list(PARSERS))[0]:
                            continue  # granian has its own parser: once, whatever uvicorn's
                        results.append(bench_bare(**kw, server=server, app=app))
        print(json.dumps(results, indent=2))
        return 0
    except (PeerUnavailable, ServiceError) as e:
        print(f"{ap.prog}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover - `python -m workers.bench.peer shim|bench`
    sys.exit(main())
