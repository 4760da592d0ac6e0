"""KV exactness ACROSS PROCESSES: a sequence generated partly in one process and resumed from its KV snapshot in
another continues with exactly the tokens an uninterrupted run gives (ARCHITECTURE §4, greedy decoding).

Process A (a subprocess) runs the torch engine on a prompt, generates k tokens, exports the KV snapshot and hands it
on: through a file, through the node's L1 tier (shared-memory files), or through L2 (Valkey, read by a process of
another node). Process B (another subprocess) takes it, imports it and generates the remaining N-k tokens. Process C
(a third subprocess) and this test process each run the N tokens uninterrupted: the concatenation A+B must equal both.

This file is also the helper the subprocesses run: `python -m tests.integration.test_kv_exactness '<json>'`.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PROMPT = "Migrate me: Grüße aus dem Rechenzentrum, 東京ラック 7 — 🚀"
N = 32
K = 11


# -- the helper run in subprocesses ------------------------------------------------------------------------------
def _request(job: dict[str, Any]) -> Any:
    from pipeline.events import RequestEvent

    return RequestEvent(
        request_id=job["rid"], version=1, tenant="t", user_id="u", model="tiny-qwen2", in_tokens=job["in_tokens"],
        out_tokens=job["n"], max_tokens=job["n"], mem_est_kb=0.0, arrival_ms=0.0, prompt=job["prompt"],
    )


def _engine() -> Any:
    from pipeline.config import load_config
    from workers.engines.torch_engine import TorchEngine
    from workers.shell.runtime import WALL

    config = load_config()
    tc = config.policies.worker.torch
    return TorchEngine(tc, config.models[tc.model], now_ms=WALL.now_ms)


def _tiers(job: dict[str, Any]) -> Any:
    import redis.asyncio as aioredis

    from pipeline.config import KvTierConfig
    from workers.kv.l1 import SharedMemoryStore
    from workers.kv.l2 import ValkeyStore
    from workers.kv.manager import KvTierManager

    cfg = KvTierConfig(l1_dir=job["l1_root"], l1_capacity_mb=64, l2="valkey", l2_capacity_mb=64)
    r = aioredis.Redis.from_url(job["redis_url"])
    manager = KvTierManager(SharedMemoryStore(Path(job["l1_root"]), job["node"]), ValkeyStore(r, cfg.l2_ttl_s), cfg)
    return manager, r


async def _run(job: dict[str, Any]) -> dict[str, Any]:
    from pipeline.kv.snapshot import decode, encode

    engine = _engine()
    req = _request(job)
    tokens: list[tuple[int, int]] = []
    out: dict[str, Any] = {"model_id": engine.model_id}
    if job["role"] == "rest":
        if job["via"] == "file":
            snap = decode(Path(job["path"]).read_bytes())
        else:
            manager, r = _tiers(job)
            snap = await manager.get(job["rid"])  # the newest version, L1 first, then L2
            out["in_l1_after_get"] = await manager.get_from("L1", job["rid"]) is not None
            await r.aclose()
        assert snap is not None, f"process B found no snapshot of {job['rid']} via {job['via']}"
        engine.import_kv(snap, req)
        out["resumed_at"] = len(snap.generated)
    else:
        engine.submit(req)
    while engine.has_work():
        step = await engine.step()
        tokens += [(t.index, t.token_id) for t in step.tokens]
        if job["role"] == "first" and len(tokens) == job["k"]:
            snap = engine.export_kv(job["rid"], version=2, remove=True)
            if job["via"] == "file":
                Path(job["path"]).write_bytes(encode(snap))
            else:
                manager, r = _tiers(job)
                out["stored"] = await manager.put(snap, tier=job["via"])
                out["in_tier"] = await manager.get_from(job["via"], job["rid"]) is not None
                await r.aclose()
            break
    out["tokens"] = tokens
    return out


def _subprocess(job: dict[str, Any]) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "tests.integration.test_kv_exactness", json.dumps(job)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    assert p.returncode == 0, f"subprocess failed ({p.returncode}):\n{stderr[-4000:]}"
    result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return result


def _uninterrupted_here(job: dict[str, Any]) -> list[int]:
    out = asyncio.run(_run({**job, "role": "full"}))
    return [t for _, t in out["tokens"]]


def _job(rid: str, prompt: str = PROMPT, in_tokens: int = 0, **extra: Any) -> dict[str, Any]:
    return {"rid": rid, "prompt": prompt, "in_tokens": in_tokens, "n": N, "k": K, **extra}


def _check(a: dict[str, Any], b: dict[str, Any], reference: list[int]) -> None:
    assert [i for i, _ in a["tokens"]] == list(range(K))
    assert b["resumed_at"] == K and [i for i, _ in b["tokens"]] == list(range(K, N))
    resumed = [t for _, t in a["tokens"]] + [t for _, t in b["tokens"]]
    assert resumed == reference
    assert a["model_id"] == b["model_id"]


# -- tests -------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_snapshot_file_from_process_a_resumes_exactly_in_process_b(tmp_path: Path) -> None:
    job = _job("xproc-text", via="file", path=str(tmp_path / "seq.kvsnap"))
    c = _subprocess({**job, "role": "full"})  # process C runs alongside A and B
    a = _result(_subprocess({**job, "role": "first"}))
    assert (tmp_path / "seq.kvsnap").stat().st_size > 0
    b = _result(_subprocess({**job, "role": "rest"}))
    full = [t for _, t in _result(c)["tokens"]]
    assert len(full) == N and full == _uninterrupted_here(job)
    _check(a, b, full)


@pytest.mark.slow
def test_trace_driven_sequence_without_prompt_text_resumes_exactly_in_another_process(tmp_path: Path) -> None:
    """An empty prompt: both processes synthesize the same 300 prompt tokens from the request id; the uninterrupted
    reference is this test process."""
    job = _job("xproc-trace", prompt="", in_tokens=300, via="file", path=str(tmp_path / "seq.kvsnap"))
    a = _result(_subprocess({**job, "role": "first"}))
    b = _result(_subprocess({**job, "role": "rest"}))
    _check(a, b, _uninterrupted_here(job))


def _tier_modules() -> None:
    """The KV tiers are part of the tree: importing them here fails the test if one is broken, never skips it."""
    import workers.kv.l1
    import workers.kv.l2
    import workers.kv.manager  # noqa: F401


@pytest.mark.integration
@pytest.mark.slow
def test_snapshot_through_l1_shared_memory_resumes_exactly_in_another_process(services: Any, tmp_path: Path) -> None:
    """A and B are two processes of one node (a hot-swapped worker): the snapshot goes through the node's L1."""
    _tier_modules()
    job = _job("via-l1", via="L1", l1_root=str(tmp_path / "shm"), node="r0-n0", redis_url=services.redis_url)
    a = _result(_subprocess({**job, "role": "first"}))
    assert a["stored"] is True and a["in_tier"] is True
    assert list((tmp_path / "shm" / "r0-n0").iterdir())  # the blob is a file in the node's L1 directory
    b = _result(_subprocess({**job, "role": "rest"}))
    _check(a, b, _uninterrupted_here(job))


@pytest.mark.integration
@pytest.mark.slow
def test_snapshot_through_l2_valkey_resumes_exactly_on_another_node(services: Any, tmp_path: Path) -> None:
    """A runs on node r0-n0 and parks the snapshot in L2 (Valkey); B runs on node r1-n0, whose L1 never held it:
    it finds it in L2 (and promotes it into its own L1)."""
    _tier_modules()
    job = _job("via-l2", via="L2", l1_root=str(tmp_path / "shm"), redis_url=services.redis_url)
    a = _result(_subprocess({**job, "role": "first", "node": "r0-n0"}))
    assert a["stored"] is True and a["in_tier"] is True
    assert not (tmp_path / "shm" / "r0-n0").exists() or not any((tmp_path / "shm" / "r0-n0").iterdir())
    b = _result(_subprocess({**job, "role": "rest", "node": "r1-n0"}))
    assert b["in_l1_after_get"] is True
    _check(a, b, _uninterrupted_here(job))


if __name__ == "__main__":
    print(json.dumps(asyncio.run(_run(json.loads(sys.argv[1])))))
