"""The peers of `rackflow bench gateway` (workers/bench/peer.py): the zero-time engine shim as a real process
answers what the load generator asks (through `one_request`, streamed and not), and SMG in front of two shims
measures without errors and leaves no process behind, even when the benchmark is interrupted."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from workers.bench import peer
from workers.bench.gateway import MODEL, Outcome, one_request

pytestmark = pytest.mark.integration


def _children() -> set[str]:
    """Command lines of this process's live children that are shims, SMG or vLLM's router (a module fixture's shim
    included)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ours = any(x in cmd for x in ("workers.bench.peer", "smg", "vllm-router"))
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and ours:
            found.add(cmd)
    return found


STACKS = [("h11", "uvicorn", "fastapi"), ("httptools", "uvicorn", "fastapi"), ("httptools", "uvicorn", "asgi"),
          ("h11", "granian", "fastapi"), ("h11", "granian", "asgi")]
"""(uvicorn's parser, the server, the app) of each shim the tests run: FastAPI and the bare ASGI callable, on uvicorn
and on granian (which parses HTTP itself)."""


@pytest.fixture(scope="module", params=STACKS, ids=["-".join(s) for s in STACKS])
def shim(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[peer.ShimProcess]:
    http, server, app = request.param
    if server == "uvicorn" and http == "httptools" and not peer.httptools_installed():
        pytest.skip(peer._NO_HTTPTOOLS)
    proc = peer.ShimProcess("shim", tmp_path_factory.mktemp("shim"), http, server, app)
    with peer._running([proc]):
        yield proc


async def _ask(url: str, max_tokens: int, stream: bool) -> Outcome:
    async with httpx.AsyncClient(timeout=10) as client:
        return await one_request(client, url, 7, max_tokens, stream)


@pytest.mark.parametrize("max_tokens", [1, 8, 64])
def test_the_shim_answers_a_completion_with_max_tokens_tokens(shim: peer.ShimProcess, max_tokens: int) -> None:
    out = asyncio.run(_ask(shim.url, max_tokens, stream=False))
    assert out.ok, out
    assert out.request_id and out.ttft_s is None


@pytest.mark.parametrize("max_tokens", [1, 8])
def test_the_shim_streams_a_chunk_per_token_to_done(shim: peer.ShimProcess, max_tokens: int) -> None:
    out = asyncio.run(_ask(shim.url, max_tokens, stream=True))
    assert out.ok, out
    assert out.request_id
    assert out.ttft_s is not None and 0 < out.ttft_s <= out.latency_s
    body = {"model": MODEL, "prompt": "p", "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", f"{shim.url}/v1/completions", json=body, timeout=10) as resp:
        data = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == peer.TOKEN * max_tokens
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"


def test_the_shim_serves_what_smg_registers_a_worker_with(shim: peer.ShimProcess) -> None:
    assert httpx.get(f"{shim.url}/health").status_code == 200
    models = httpx.get(f"{shim.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]


@pytest.mark.parametrize("bench", [peer.bench_bare, peer.bench_peer])
def test_httptools_is_reported_unavailable_when_not_installed(bench: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peer, "httptools_installed", lambda: False)
    res = bench(clients=1, duration_s=0.5, repeats=1, progress=False, http="httptools")
    assert "httptools parser is not installed" in res["unavailable"]


def test_bare_stops_its_shim_when_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _children()

    def interrupted(*_a: Any, **_k: Any) -> None:
        assert len(_children() - before) == 1, "the shim was not running during the measurement"
        raise KeyboardInterrupt

    monkeypatch.setattr(peer, "_measure", interrupted)
    with pytest.raises(KeyboardInterrupt):
        peer.bench_bare(clients=1, duration_s=0.5, repeats=1, progress=False)
    assert _children() - before == set()


@pytest.fixture(scope="module")
def smg() -> Path:
    """SMG from this environment or `.venv-peers`, installed there on first use (pip, from the registry: 5 to 60 s
    on the project's machines); skipped, with pip's reason, where it cannot be installed within 2 minutes."""
    try:
        return peer.ensure_smg(progress=False, timeout_s=120.0)
    except peer.PeerUnavailable as e:
        pytest.skip(f"SMG ({peer.SMG_SPEC}, the `peers` extra) could not be installed: {e}")


def test_smg_in_front_of_two_shims_measures_without_errors(smg: Path) -> None:
    before = _children()
    res = peer.bench_peer(clients=4, duration_s=1.0, repeats=1, progress=False)
    assert res["name"] == f"smg {peer.SMG_VERSION}"
    assert res["errors"] == 0, res["first_error"]
    assert res["rps"] > 0 and res["streamed"] > 0
    assert res["p50_ms"] <= res["p99_ms"]
    assert res["added_ttft_p50_ms"] is not None
    assert _children() - before == set()


def test_smg_and_its_shims_are_stopped_when_interrupted(smg: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _children()

    def interrupted(url: str, *_a: Any, **_k: Any) -> None:
        assert len(_children() - before) == 3, _children() - before  # SMG and 2 shims
        assert asyncio.run(_ask(url, 4, stream=True)).ok  # through SMG to a shim
        raise KeyboardInterrupt

    monkeypatch.setattr(peer, "_measure", interrupted)
    with pytest.raises(KeyboardInterrupt):
        peer.bench_peer(clients=1, duration_s=0.5, repeats=1, progress=False)
    assert _children() - before == set()


def test_peer_names_take_a_comma_list_and_name_the_known_ones() -> None:
    assert peer.peer_names("smg,vllm-router") == ["smg", "vllm-router"]
    assert peer.peer_names(" vllm-router , smg,smg") == ["vllm-router", "smg"]
    for bad in ("smgx", "smg,nope", ","):
        with pytest.raises(ValueError, match="smg, vllm-router"):
            peer.peer_names(bad)


def test_an_unknown_peer_is_a_usage_error_not_a_traceback() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "workers.cli", "bench", "gateway", "--peer", "smg,nginx"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown peer nginx" in done.stderr and "Traceback" not in done.stderr


def test_a_peer_that_cannot_be_installed_is_one_line_and_the_rest_is_still_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """pip is really asked for a version of SMG that does not exist, in a scratch environment: the bench reports
    that peer unavailable in one stderr line and still measures the bare endpoint (rackflow's own figures, measured
    before the peers, are in `res` untouched)."""
    from workers.bench.micro import _bench_peers

    monkeypatch.setattr(peer, "PEERS_VENV", tmp_path / "peers")
    monkeypatch.setitem(peer.PEER_SPECS, "smg", ("smg", "0.0.0.dev0"))
    res: dict[str, Any] = {"rps": 123.0, "clients": 2, "duration_s": 0.5, "repeats": 1, "max_tokens": 4,
                           "http_parser": "h11"}
    failed = _bench_peers(res, ["smg"], progress=False)
    err = capsys.readouterr().err
    assert failed == ["smg"]
    lines = [ln for ln in err.splitlines() if "unavailable" in ln]
    assert len(lines) == 1 and lines[0].startswith("rackflow bench gateway: peer smg unavailable: could not install")
    assert "Traceback" not in err
    assert "smg==0.0.0.dev0" in res["peers"]["smg"]["unavailable"]
    assert "peer" not in res  # no peer was measured
    assert res["rps"] == 123.0 and res["bare"]["errors"] == 0 and res["bare"]["rps"] > 0


def test_vllm_router_in_front_of_two_shims_measures_without_errors() -> None:
    """vLLM's Rust router (`vllm-router`, installed into .venv-peers on first use) in front of two shims: skipped,
    with pip's reason, where it cannot be installed within 2 minutes."""
    try:
        peer.ensure_peer("vllm-router", progress=False, timeout_s=120.0)
    except peer.PeerUnavailable as e:
        pytest.skip(f"vllm-router could not be installed: {e}")
    before = _children()
    res = peer.bench_peer(clients=4, duration_s=1.0, repeats=1, progress=False, peer="vllm-router")
    assert res["name"] == f"vllm-router {peer.VLLM_ROUTER_VERSION}"
    assert res["errors"] == 0, res["first_error"]
    assert res["rps"] > 0 and res["streamed"] > 0
    assert res["cpu_us_per_request"]["vllm-router"] > 0
    assert _children() - before == set()
