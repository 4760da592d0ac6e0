"""The `vllm` tier: the real vLLM engine (its CPU build on a machine without a GPU) behind the whole pipeline.

Run it with `make test-vllm`: that builds `.venv-vllm` (vLLM's CPU build and rackflow) and the tiny random-weight
Qwen2 checkpoint, then runs `pytest -m vllm tests/vllm` in that environment. Everything is real: Valkey and etcd
(started by the session fixture), the role processes, and vLLM's engine core in every worker.

Fixtures here:
- `tiny_ckpt`: the checkpoint directory (made if missing, never downloaded);
- `vllm_overlay`: a config overlay serving it with the vllm engine on one rack of N nodes;
- `reference`: an in-process vLLM engine of the same checkpoint on a background event loop: what one uninterrupted
  greedy run of a request gives, the ground truth of the exactness checks.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import VllmEngineConfig
from pipeline.events import RequestEvent
from tests.conftest import REPO
from workers.engines.checkpoint import served_name, vllm_overlay, write_tiny_checkpoint
from workers.shell.runtime import WALL

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if not HAVE_VLLM:
    # the main environment has no vLLM (it lives in .venv-vllm: `make test-vllm`); nothing here can run without it
    collect_ignore_glob = ["test_*.py"]

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
TINY = REPO / ".cache" / "tiny-qwen2-vllm"


@pytest.fixture(scope="session")
def tiny_ckpt() -> Path:
    return write_tiny_checkpoint(TINY)


@pytest.fixture(scope="session")
def model_name(tiny_ckpt: Path) -> str:
    return served_name(tiny_ckpt)


def cluster_overlay(ckpt: Path, nodes: int, **policies: Any) -> dict[str, Any]:
    """One rack of `nodes` vLLM workers serving the tiny checkpoint; `policies` merged into policies.*."""
    over = vllm_overlay(ckpt, served_name(ckpt), [{"name": "r0", "node_count": nodes,
                                                   "node": {"gpu": "h100-80gb", "tp": 1}}])
    pol = over["policies"]
    assert isinstance(pol, dict)
    pol["worker"]["token_flush_ms"] = 10
    # two vLLM workers decoding at full speed saturate both cores: 3 s leases expired and the monitor marked healthy
    # nodes dead (measured in this tier); a kill -9 is then detected in 15 s instead of 3
    pol["worker"]["lease_ttl_s"] = 15
    pol["worker"]["vllm"]["max_num_seqs"] = 32
    pol["streams"] = {"claim_idle_ms": 2000}
    # two vLLM workers loading on 2 cores starve the health agents for seconds: a 2 s heartbeat lease expires and
    # the monitor drains healthy nodes (measured in this tier); 15 s rides it out
    pol["health"] = {"agent_heartbeat_ttl_s": 15}
    for k, v in policies.items():
        cur = pol.setdefault(k, {})
        _merge(cur, v)
    return json.loads(json.dumps(over))


def _merge(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(a.get(k), dict):
            _merge(a[k], v)
        else:
            a[k] = v


class Reference:
    """One vLLM engine in this process, on its own event loop thread: `run(reqs)` -> token ids per request of
    one uninterrupted greedy run (each request alone, so nothing depends on batching)."""

    def __init__(self, ckpt: Path, ignore_eos: bool) -> None:
        from workers.engines.vllm_engine import VllmEngine

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-reference", daemon=True)
        self.thread.start()
        # normal priority: this is the test process itself, not a worker beside a control plane
        self.engine = VllmEngine(VllmEngineConfig(model=str(ckpt), dtype="float32", ignore_eos=ignore_eos,
                                                  cpu_nice=0), WALL.now_ms)
        self._call(self.engine.start(), 300)

    def _call(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, reqs: list[RequestEvent], together: bool = False) -> dict[str, list[int]]:
        return {rid: ids for rid, (ids, _text) in self.run_text(reqs, together).items()}

    def run_text(self, reqs: list[RequestEvent], together: bool = False) -> dict[str, tuple[list[int], str]]:
        """Token ids and vLLM's own detokenized text per request: each request alone, or (`together`) all of them
        in one continuous batch, as the cluster runs them (faster for long sequences)."""
        async def body() -> dict[str, tuple[list[int], str]]:
            got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
            text: dict[str, list[str]] = {r.request_id: [] for r in reqs}
            for group in ([reqs] if together else [[r] for r in reqs]):
                for r in group:
                    self.engine.submit(r)
                while self.engine.has_work():
                    for t in (await self.engine.step()).tokens:
                        got[t.request_id].append(t.token_id)
                        text[t.request_id].append(t.text)
            return {rid: (got[rid], "".join(text[rid])) for rid in got}

        return self._call(body(), 900)  # type: ignore[no-any-return]

    def close(self) -> None:
        try:
            self._call(self.engine.stop(), 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


@pytest.fixture(scope="session")
def reference(tiny_ckpt: Path) -> Iterator[Reference]:
    ref = Reference(tiny_ckpt, ignore_eos=True)
    try:
        yield ref
    finally:
        ref.close()
