"""Held-out validation of the cost model (pipeline/costmodel/validate.py) on the shipped Vidur profiles: structure
and sanity, not a pinned number (the numbers are the report's job)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.costmodel.operators import PROFILED_OPS, LayerShape
from pipeline.costmodel.validate import decode_attention_ms
from workers.sim.perf import PROFILE_DIR, validate_report

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report() -> dict:
    if not any(PROFILE_DIR.glob("compute/*/*/*/mlp.csv")):
        pytest.skip("no shipped profiles")
    return validate_report(load_config(REPO / "configs").gpus)


def test_both_directions_and_fields(report: dict) -> None:
    assert {tuple(p) for p in report["fit_test"]} == {("Llama-2-7b-hf", "Llama-2-70b-hf"),
                                                      ("Llama-2-70b-hf", "Llama-2-7b-hf")}
    assert 0.0 <= report["median_op_error"] < 1.0
    dec = report["decode_per_token_error"]
    assert dec["points"] > 0 and 0.0 <= dec["median"] <= dec["p90"] <= dec["max"]
    assert isinstance(report["ok"], bool)
    for d in report["per_operator"]:
        assert d["fit_model"] != d["test_model"]
        assert set(d["archs"]) == {"ampere", "hopper"}
        for a in d["archs"].values():
            ops = a["operators"]
            assert set(PROFILED_OPS) | {"all_reduce"} <= set(ops)
            for op in (*PROFILED_OPS, "all_reduce"):
                assert ops[op]["rows"] > 0 and math.isfinite(ops[op]["median"])
            assert ops["attn_decode"]["checked"] is False  # not in the profiles: never reported as measured
            assert all(x["measured_ms"] > 0 and x["predicted_ms"] > 0 for x in a["decode_step"])


def test_decode_attention_roofline_is_the_kv_read() -> None:
    from pipeline.config import GpuSpec

    shape = LayerShape(hidden=8192, heads=64, kv_heads=8, intermediate=28672, vocab=32000)
    gpu = GpuSpec.model_construct(hbm_tbps=2.0)
    # 8 KV heads x 128 x 2 (K and V) x 2 bytes = 4 KiB per token per layer at tp 1; tp 8 keeps one head
    assert decode_attention_ms(shape, 1, 1000, gpu, 1.0) == pytest.approx(1000 * 4096 / 2e9)
    assert decode_attention_ms(shape, 8, 1000, gpu, 0.5) == pytest.approx(1000 * 512 / 1e9)
    assert decode_attention_ms(shape, 16, 1000, gpu, 1.0) == decode_attention_ms(shape, 8, 1000, gpu, 1.0)
