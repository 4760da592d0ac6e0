"""The `vllm` engine on a real GPU (skipped, with the reason, where vLLM or CUDA is missing)."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

from pipeline.config import VllmEngineConfig
from pipeline.events import RequestEvent
from workers.shell.runtime import WALL

MODEL = os.environ.get("RACKFLOW_VLLM_TEST_MODEL", "")


@pytest.fixture(autouse=True)
def _gpu_host() -> None:
    """Skips where the GPU tier cannot run, with the reason, when a test of this module is selected (not at
    collection: a run that deselects these tests, `-m openai_semantics` say, reports no skip of theirs)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install '.[vllm]' on a GPU host)")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine")
    if not MODEL:
        pytest.skip("set RACKFLOW_VLLM_TEST_MODEL to a local model directory (nothing is downloaded)")


def _req(prompt: str, n: int) -> RequestEvent:
    return RequestEvent(str(uuid.uuid4()), 1, "t", "u", "m", 8, n, n, 1000.0, WALL.now_ms(), prompt=prompt)


def test_generates_streams_and_resumes_exactly() -> None:
    async def body() -> None:
        from workers.engines.vllm_engine import VllmEngine

        eng = VllmEngine(VllmEngineConfig(model=MODEL, gpu_memory_utilization=0.5, kv_connector=None), WALL.now_ms)
        await eng.start()
        try:
            whole = _req("The capital of France is", 24)
            eng.submit(whole)
            full: list[int] = []
            while eng.has_work():
                out = await eng.step()
                full += [t.token_id for t in out.tokens if t.request_id == whole.request_id]
            assert len(full) == 24
            part = _req("The capital of France is", 24)
            eng.submit(part)
            got: list[int] = []
            while len(got) < 8:
                out = await eng.step()
                got += [t.token_id for t in out.tokens if t.request_id == part.request_id]
            snap = eng.export_kv(part.request_id, 2, remove=True)
            eng.import_kv(snap, part)
            while eng.has_work():
                out = await eng.step()
                got += [t.token_id for t in out.tokens if t.request_id == part.request_id]
            assert got == full, "greedy continuation after export/import"
        finally:
            await eng.stop()

    asyncio.run(body())
