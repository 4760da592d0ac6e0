"""Engines behind one interface: `sim` (cost-model timing), `torch` (a real small transformer), `vllm` (GPU)."""

from __future__ import annotations

from workers.engines.base import Engine, EngineStats, SeqFinished, StepOutput, TokenOut


def make_engine(name: str, **kwargs: object) -> Engine:
    if name == "sim":
        from workers.engines.sim import SimEngine

        return SimEngine(**kwargs)  # type: ignore[arg-type]
    if name == "torch":
        from workers.engines.torch_engine import TorchEngine

        return TorchEngine(**kwargs)  # type: ignore[arg-type]
    if name == "vllm":
        from workers.engines.vllm_engine import VllmEngine

        return VllmEngine(**kwargs)  # type: ignore[arg-type]
    raise ValueError(f"engine {name!r} is not available in this build; available: sim, torch, vllm")


__all__ = ["Engine", "EngineStats", "SeqFinished", "StepOutput", "TokenOut", "make_engine"]
