"""Uncalibrated roofline cost model of one engine iteration (ARCHITECTURE §8): the first-order reference.

Owns the time of an iteration of a continuous-batching engine for a GPU type, a model shape and a tensor-parallel
degree: prefill is compute bound (2 * params FLOPs per token plus causal attention), decode is memory bound (all
weights plus the KV cache read once per step). Efficiencies (MFU, MBU) and a fixed per-iteration overhead are
parameters, not fitted: `CalibratedCostModel` (calibrated.py) is the model the engines and the simulator use; this
one stays as a whole-model sanity reference. Pure arithmetic, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.config import GpuSpec, ModelSpec


@dataclass(frozen=True, slots=True)
class RooflineCostModel:
    gpu: GpuSpec
    model: ModelSpec
    tp: int = 1
    mfu: float = 0.55
    """Fraction of peak FLOP/s a prefill reaches."""
    mbu: float = 0.80
    """Fraction of peak HBM bandwidth a decode step reaches."""
    overhead_ms: float = 1.5
    """Fixed cost of one iteration (scheduling, kernel launches, sampling)."""

    @property
    def _flops(self) -> float:
        return self.gpu.bf16_tflops * 1e12 * self.mfu * self.tp

    @property
    def _bw(self) -> float:
        return self.gpu.hbm_tbps * 1e12 * self.mbu * self.tp

    def _linear_params(self) -> float:
        return float(self.model.params - self.model.vocab * self.model.hidden)  # input embedding is a lookup

    def step_ms(
        self, prefill_tokens: Sequence[int], decode_seqs: int, decode_kv_tokens: int,
        prefill_cached: Sequence[int] | None = None,
    ) -> float:
        """One iteration: prefill of the given prompts (lengths; `prefill_cached` tokens of each already in the KV
        cache) plus one decode token for `decode_seqs` sequences holding `decode_kv_tokens` tokens of KV in total."""
        m = self.model
        new_tokens = sum(prefill_tokens) + decode_seqs
        if new_tokens == 0:
            return 0.0
        cached = list(prefill_cached) if prefill_cached is not None else [0] * len(prefill_tokens)
        linear_flops = 2.0 * self._linear_params() * new_tokens
        # causal self-attention: QK^T and AV, 2 * 2 * d per (query, key) pair, half the square for prefill
        attn_pairs = sum(t * (t + 1) / 2 + t * c for t, c in zip(prefill_tokens, cached, strict=True))
        attn_pairs += decode_kv_tokens
        attn_flops = 4.0 * m.layers * m.hidden * attn_pairs
        compute_s = (linear_flops + attn_flops) / self._flops
        kv_read = (decode_kv_tokens + sum(prefill_tokens) + sum(cached)) * m.kv_bytes_per_token
        memory_s = (m.weight_bytes + kv_read) / self._bw
        return max(compute_s, memory_s) * 1e3 + self.overhead_ms

    def prefill_ms(self, prompt_tokens: int, batch: int = 1) -> float:
        return self.step_ms([prompt_tokens] * batch, 0, 0)

    def decode_ms_per_token(self, batch: int, context_tokens: int) -> float:
        return self.step_ms([], batch, batch * context_tokens)
