"""Work of one transformer operator: FLOPs and bytes moved, from the model shape and the tensor-parallel degree.

Owns the one definition of what each operator of a decoder layer costs in arithmetic and memory traffic, per GPU of
a tensor-parallel group; the fit (calibration.py) and the predictions (calibrated.py) both use it, so a fitted
efficiency always means the same thing as the prediction it feeds. The operator names are those of the Vidur
profiles (`time_stats.<op>` columns). It must never hold a fitted number or a measured time.

Conventions: activations are 2 bytes (bf16/fp16) whatever the weight dtype; weights and KV use the model's dtype.
Column-parallel matrices (QKV, gate+up) split their output columns across the group, row-parallel ones (O, down)
their input rows; when the group is larger than the number of KV heads each GPU keeps one KV head (replicated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.config import ModelSpec

ACT_BYTES = 2
"""Bytes of one activation element (bf16/fp16 compute)."""
GEMM_TILE_M = 128
"""Rows (tokens) of a tensor-core GEMM tile: a matmul over T tokens executes the FLOPs of T rounded up to a multiple
of this. Fitting with it lowers the median error of the linear operators in the 64-1024 token range by 20-30%."""

LINEAR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
"""Matrix multiplications: compute bound at many tokens, weight-read bound at few."""
ELEMENTWISE_OPS = ("emb", "input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")
"""Memory-bound operators: bytes proportional to the tokens, plus a fixed launch cost."""
PROFILED_OPS = (
    "emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
    "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add",
)
"""Operators with measured times in the Vidur `mlp.csv` profiles, in the order of the CSV columns."""
LAYER_OPS = tuple(op for op in PROFILED_OPS if op != "emb")
"""Profiled operators that run once per layer (the embedding runs once per iteration)."""


@dataclass(frozen=True, slots=True)
class LayerShape:
    """The shape numbers the operator costs depend on (a profile row carries these, not a full ModelSpec)."""

    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2

    @classmethod
    def of(cls, model: ModelSpec) -> LayerShape:
        return cls(model.hidden, model.heads, model.kv_heads, model.intermediate, model.vocab, model.dtype_bytes)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def q_cols(self, tp: int) -> float:
        """Query (and attention output) columns held by one GPU."""
        return self.heads * self.head_dim / tp

    def kv_cols(self, tp: int) -> float:
        """Key (or value) columns held by one GPU: at least one head, replicated when tp > kv_heads."""
        return max(self.kv_heads / tp, 1.0) * self.head_dim


def linear_dims(op: str, shape: LayerShape, tp: int) -> tuple[float, float]:
    """(K, N) of the per-GPU weight matrix of a linear operator: tokens x K times K x N."""
    h = float(shape.hidden)
    if op == "attn_pre_proj":
        return h, shape.q_cols(tp) + 2.0 * shape.kv_cols(tp)
    if op == "attn_post_proj":
        return shape.q_cols(tp), h
    if op == "mlp_up_proj":
        return h, 2.0 * shape.intermediate / tp  # gate and up, fused
    if op == "mlp_down_proj":
        return shape.intermediate / tp, h
    if op == "lm_head":
        return h, shape.vocab / tp
    raise KeyError(f"{op!r} is not a linear operator; linear operators: {', '.join((*LINEAR_OPS, 'lm_head'))}")


def linear_work(op: str, shape: LayerShape, tp: int) -> tuple[float, float, float]:
    """(FLOPs per GEMM row, weight bytes, activation bytes per token) of a linear operator on one GPU."""
    k, n = linear_dims(op, shape, tp)
    return 2.0 * k * n, k * n * shape.dtype_bytes, (k + n) * ACT_BYTES


def elementwise_bytes_per_token(op: str, shape: LayerShape, tp: int) -> float:
    """Bytes one token moves through a memory-bound operator on one GPU (reads + writes)."""
    h = float(shape.hidden)
    if op == "emb":
        return 2.0 * h * ACT_BYTES  # gather a table row, write it
    if op in ("input_layernorm", "post_attention_layernorm"):
        return 2.0 * h * ACT_BYTES  # replicated on every GPU of the group
    if op == "attn_rope":
        return 2.0 * (shape.q_cols(tp) + shape.kv_cols(tp)) * ACT_BYTES  # rotate q and k in place
    if op == "mlp_act":
        return 3.0 * shape.intermediate / tp * ACT_BYTES  # read gate and up, write act(gate) * up
    if op == "add":
        return 3.0 * h * ACT_BYTES  # residual: read two, write one
    raise KeyError(f"{op!r} is not an element-wise operator; element-wise operators: {', '.join(ELEMENTWISE_OPS)}")


def gemm_rows(tokens: float) -> float:
    """Rows a GEMM over `tokens` tokens computes: `tokens` rounded up to the tile (GEMM_TILE_M)."""
    return math.ceil(tokens / GEMM_TILE_M) * GEMM_TILE_M


def op_work(op: str, shape: LayerShape, tokens: float, tp: int) -> tuple[float, float]:
    """(FLOPs executed, bytes moved) of one profiled operator for `tokens` tokens on one GPU of a `tp` group."""
    if op in LINEAR_OPS:
        flops, weights, act = linear_work(op, shape, tp)
        return flops * gemm_rows(tokens), weights + act * tokens
    return 0.0, elementwise_bytes_per_token(op, shape, tp) * tokens


def allreduce_bytes(shape: LayerShape, tokens: float) -> float:
    """Message of one tensor-parallel all-reduce (after O and after the down projection): tokens x hidden."""
    return tokens * shape.hidden * ACT_BYTES
