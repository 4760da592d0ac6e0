"""Engines behind one interface: `sim` (cost-model timing), `torch` (a real small transformer), `vllm` (GPU)."""

from __future__ import annotations

from collections.abc import Callable

from pipeline.batching.window import batch_reserve
from pipeline.config import RackflowConfig
from pipeline.costmodel import CalibratedCostModel
from workers.engines.base import Engine, EngineStats, SeqFinished, StepOutput, TokenOut
from workers.shell.runtime import WALL


def build_engine(config: RackflowConfig, node: str, engine: str, now_ms: Callable[[], float] | None = None) -> Engine:
    """The engine of `node` as its config says: the one factory of the worker, the benchmarks and the tests.
    `now_ms`: the engine's clock (default the wall clock). torch and vLLM are imported only by the workers that
    run them."""
    now_ms = now_ms or WALL.now_ms
    if engine == "sim":
        # the committed fit (configs/calibration.json), read once per process; nothing is re-fitted here
        spec = config.node(node)
        model = config.models[spec.models[0]]
        bt = config.policies.profiling.prefix_block_tokens
        host_gb = config.policies.kv.host_prefix_gb_per_gpu * spec.tp
        from workers.engines.sim import SimEngine

        return SimEngine(
            cost=CalibratedCostModel.for_node(config, node),
            kv_capacity_kb=config.node_kv_capacity_kb(node),
            max_running=config.policies.worker.max_running,
            now_ms=now_ms,
            zero_time=config.policies.worker.zero_time,
            max_batched_tokens=config.policies.worker.max_batched_tokens,
            prefix_block_tokens=bt,
            host_cache_blocks=int(host_gb * 1e9 // model.kv_bytes_per_token) // bt,
            world=_sim_world(config, node),
            preempt_batch=config.policies.batcher.batch_yield == "preempt",
            batch_reserve=batch_reserve(config.policies.batcher, config.policies.worker.max_running),
        )
    if engine == "torch":
        # imported here: torch and transformers load only in workers that run this engine
        from workers.engines.torch_engine import TorchEngine

        tc = config.policies.worker.torch
        spec = config.models.get(tc.model)
        if spec is None and not tc.checkpoint:
            raise ValueError(
                f"policies.worker.torch.model: unknown model {tc.model!r}; allowed: {', '.join(sorted(config.models))}"
            )
        return TorchEngine(tc, spec, now_ms=now_ms, cost=node_cost(config, node))
    if engine == "vllm":
        from workers.engines.vllm_engine import VllmEngine

        vc = config.policies.worker.vllm
        if not vc.model:
            raise ValueError("policies.worker.vllm.model: set the model directory vLLM should serve (--model-dir)")
        return VllmEngine(vc, now_ms, tensor_parallel_size=vc.tensor_parallel_size or config.node(node).tp,
                          prefix_block_tokens=config.policies.profiling.prefix_block_tokens,
                          cost=node_cost(config, node))
    raise ValueError(f"engine {engine!r} not available; available: sim, torch, vllm")


def node_cost(config: RackflowConfig, node: str):  # type: ignore[no-untyped-def]
    """The control plane's price of `node`'s iterations, as its node policies build it (`pipeline.replay.
    policy_context`): the GPU entry's measured step profile where it names one, else the calibrated model."""
    profile = config.gpus[config.node(node).gpu].step_profile
    if profile:
        from pipeline.costmodel.linear import LinearStepCost

        return LinearStepCost.from_profile(profile)
    return CalibratedCostModel.for_node(config, node)


def _sim_world(config: RackflowConfig, node: str):  # type: ignore[no-untyped-def]
    """The node's hidden world (`pipeline.sim.world`), as the oracle-free simulator draws it for the same seed and
    node name; None with `worker.sim_world` off or a zero-time engine."""
    wp = config.policies.worker
    if not wp.sim_world or wp.zero_time:
        return None
    from pipeline.sim.world import WorldSpec

    spec = WorldSpec()
    names = [n.name for rack in config.cluster.racks for n in rack.expanded()]
    return spec.node(node, config.policies.seed, node in spec.slow_nodes(names, config.policies.seed))


__all__ = ["Engine", "EngineStats", "SeqFinished", "StepOutput", "TokenOut", "build_engine"]
