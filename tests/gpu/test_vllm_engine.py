"""The `vllm` engine on a real GPU (skipped, with the reason, where vLLM or CUDA is missing)."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install '.[vllm]' on a GPU host)")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU on this machine", allow_module_level=True)
MODEL = os.environ.get("RACKFLOW_VLLM_TEST_MODEL")
if not MODEL:
    pytest.skip("set RACKFLOW_VLLM_TEST_MODEL to a local model directory (nothing is downloaded)",
                allow_module_level=True)

from pipeline.config import VllmEngineConfig  # noqa: E402
from pipeline.events import RequestEvent  # noqa: E402
from workers.engines.vllm_engine import VllmEngine  # noqa: E402
from workers.shell.runtime import WALL  # noqa: E402


def _req(prompt: str, n: int) -> RequestEvent:
    return RequestEvent(str(uuid.uuid4()), 1, "t", "u", "m", 8, n, n, 1000.0, WALL.now_ms(), prompt=prompt)


def test_generates_streams_and_resumes_exactly() -> None:
    async def body() -> None:
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
