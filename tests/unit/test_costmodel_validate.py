"""Held-out validation of the cost model (pipeline/costmodel/validate.py) on the shipped Vidur profiles: structure
and sanity, not a pinned number (the numbers are the report's job), and that what it scores is held out."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.costmodel.operators import PROFILED_OPS, LayerShape
from pipeline.costmodel.validate import decode_attention_ms
from workers.sim.perf import HELDOUT_DIR, PROFILE_DIR, read_profiles, validate_report

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report() -> dict:
    if not any(PROFILE_DIR.glob("compute/*/*/*/mlp.csv")):
        pytest.skip("no shipped profiles")
    return validate_report(load_config(REPO / "configs").gpus)


CALIBRATED = {"Llama-2-7b-hf", "Llama-2-70b-hf"}
HELD_OUT = {"Qwen-72B", "CodeLlama-34b-Instruct-hf", "internlm-20b", "Meta-Llama-3-8B", "Meta-Llama-3-70B"}


def test_the_shipped_calibration_is_scored_on_models_it_never_saw(report: dict) -> None:
    assert set(report["fitted_models"]) == CALIBRATED and set(report["held_out_models"]) == HELD_OUT
    assert {(tuple(a), b) for a, b in report["fit_test"]} == {(tuple(sorted(CALIBRATED)), m) for m in HELD_OUT}
    assert 0.0 <= report["median_op_error"] < 1.0
    dec = report["decode_per_token_error"]
    assert dec["points"] > 0 and 0.0 <= dec["median"] <= dec["p90"] <= dec["max"]
    assert isinstance(report["ok"], bool)
    for d in report["per_operator"]:
        assert d["test_model"] not in d["fit_models"]
        # Llama-3 was profiled on A100 only
        assert set(d["archs"]) == ({"ampere"} if d["test_model"].startswith("Meta-Llama-3") else {"ampere", "hopper"})
        for a in d["archs"].values():
            ops = a["operators"]
            assert set(PROFILED_OPS) | {"all_reduce"} <= set(ops)
            for op in (*PROFILED_OPS, "all_reduce"):
                assert ops[op]["rows"] > 0 and math.isfinite(ops[op]["median"])
            assert ops["attn_decode"]["checked"] is False  # not in the profiles: never reported as measured
            assert all(x["measured_ms"] > 0 and x["predicted_ms"] > 0 for x in a["decode_step"])
    assert set(report["per_test_model"]) == HELD_OUT
    # the method on less data: one Llama-2 model fitted, the other scored, both ways
    one = report["one_model_fits"]
    assert {(tuple(a), b) for a, b in one["fit_test"]} == {
        (("Llama-2-7b-hf",), "Llama-2-70b-hf"), (("Llama-2-70b-hf",), "Llama-2-7b-hf")}
    assert 0.0 < one["p90_op_error"] < 1.0 and 0.0 < one["decode_p90_error"] < 1.0


def test_the_fit_scored_is_the_committed_calibration() -> None:
    """What `validate` fits on the calibration's profiles is the cost model that ships (configs/calibration.json),
    operator for operator: the held-out figures are the shipped model's, not another fit's."""
    from pipeline.costmodel import load_calibration
    from pipeline.costmodel.calibration import fit

    cfg = load_config(REPO / "configs")
    profiles = read_profiles(cfg.gpus)
    assert {r.model for r in profiles.rows} == CALIBRATED
    fitted = fit(profiles.rows, [], profiles.devices)
    shipped = load_calibration()
    for arch, a in fitted.archs.items():
        assert dict(a.ops) == dict(shipped.for_arch(arch).ops)


def test_held_out_profiles_never_reach_the_calibration() -> None:
    from workers.sim.perf import compute_files

    held = {p.parts[-2] for p in compute_files(HELDOUT_DIR)}
    assert held == HELD_OUT
    assert not held & {p.parts[-2] for p in compute_files(PROFILE_DIR)}


def test_a_model_both_fitted_and_scored_is_refused() -> None:
    from pipeline.costmodel.validate import held_out

    cfg = load_config(REPO / "configs")
    profiles = read_profiles(cfg.gpus)
    with pytest.raises(ValueError, match="not held out"):
        held_out(profiles.rows, profiles.all_reduce, profiles.devices, {"Llama-2-7b-hf": 32, "Llama-2-70b-hf": 80},
                 [(("Llama-2-7b-hf", "Llama-2-70b-hf"), "Llama-2-7b-hf")])


def test_decode_attention_roofline_is_the_kv_read() -> None:
    from pipeline.config import GpuSpec

    shape = LayerShape(hidden=8192, heads=64, kv_heads=8, intermediate=28672, vocab=32000)
    gpu = GpuSpec.model_construct(hbm_tbps=2.0)
    # 8 KV heads x 128 x 2 (K and V) x 2 bytes = 4 KiB per token per layer at tp 1; tp 8 keeps one head
    assert decode_attention_ms(shape, 1, 1000, gpu, 1.0) == pytest.approx(1000 * 4096 / 2e9)
    assert decode_attention_ms(shape, 8, 1000, gpu, 0.5) == pytest.approx(1000 * 512 / 1e9)
    assert decode_attention_ms(shape, 16, 1000, gpu, 1.0) == decode_attention_ms(shape, 8, 1000, gpu, 1.0)


def test_all_reduce_is_scored_only_on_sizes_its_table_was_not_built_from() -> None:
    from pipeline.costmodel.calibration import AllReduceRow
    from pipeline.costmodel.validate import split_sizes

    grid = range(2048, 200_000, 8192)
    rows = [AllReduceRow("h100", w, 8, size, 0.01 * k) for w in (2, 8) for k, size in enumerate(grid)]
    fit, held = split_sizes(rows)
    assert len(fit) + len(held) == len(rows)
    for w in (2, 8):
        f = sorted(r.size_bytes for r in fit if r.num_workers == w)
        h = sorted(r.size_bytes for r in held if r.num_workers == w)
        assert not set(f) & set(h)  # no size on both sides
        assert abs(len(f) - len(h)) <= 1 and f[0] < h[0] < f[1]  # alternating along the grid


def test_report_pools_every_held_out_point(report: dict) -> None:
    pc = report["per_class"]
    assert {"gemm", "elementwise", "embedding", "all_reduce", "decode_step"} <= set(pc)
    for c in pc.values():
        assert c["rows"] > 0 and 0.0 <= c["median"] <= c["p90"] <= c["worst"]
    assert report["decode_p90_error"] == report["decode_per_token_error"]["p90"] == pc["decode_step"]["p90"]
    assert 0.0 < report["p90_op_error"] < 1.0
    split = report["all_reduce_split"]
    assert split["fit_points"] > 0 and split["held_out_points"] > 0
    # ok asks all three targets
    assert report["ok"] == (report["median_op_error"] <= 0.10 and report["p90_op_error"] <= 0.15
                            and report["decode_p90_error"] <= 0.15)


def test_held_out_profiles_are_the_upstream_files_byte_for_byte() -> None:
    """Each held-out profile has its upstream git blob id in data/SOURCES.md (a copy, never edited)."""
    import hashlib
    import re

    from workers.sim.perf import compute_files

    sources = (REPO / "data" / "SOURCES.md").read_text(encoding="utf-8")
    listed = dict(re.findall(r"`(compute/[^`]+/mlp\.csv)` `([0-9a-f]{40})`", sources))
    files = compute_files(HELDOUT_DIR)
    assert {p.relative_to(HELDOUT_DIR).as_posix() for p in files} == set(listed)
    for p in files:
        data = p.read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's object id
        assert blob == listed[p.relative_to(HELDOUT_DIR).as_posix()], p
