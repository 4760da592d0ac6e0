"""NVML source: the no-NVML path with the real pynvml (no mock), the node aggregation as plain arithmetic, and the
reading code itself only where a real GPU is present."""

from __future__ import annotations

import pynvml
import pytest

from workers.health.nvml_source import NO_LIBRARY, NvmlSource, NvmlUnavailable, aggregate


def _nvml_state() -> str:
    """'absent' (no library), 'ok' (usable, GPUs present) or another reason it cannot be used."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return "absent"
    except pynvml.NVMLError as e:
        return f"unusable: {e}"
    try:
        return "ok" if pynvml.nvmlDeviceGetCount() > 0 else "no GPU"
    finally:
        pynvml.nvmlShutdown()


NVML = _nvml_state()
needs_gpu = pytest.mark.skipif(NVML != "ok", reason=f"needs NVML and a GPU (here: {NVML})")


@pytest.mark.skipif(NVML != "absent", reason=f"the NVML library is present here ({NVML})")
def test_absent_nvml_raises_unavailable_with_what_to_do() -> None:
    with pytest.raises(NvmlUnavailable) as ei:
        NvmlSource(None)
    assert str(ei.value) == NO_LIBRARY
    assert "--source sim" in str(ei.value) and "\n" not in str(ei.value)
    with pytest.raises(NvmlUnavailable):
        NvmlSource([0])


def _gpu(**kw: float) -> dict[str, float]:
    base = {
        "gpu_mem_total_gb": 80.0, "gpu_mem_free_gb": 10.0, "gpu_util_pct": 50.0, "pcie_util_pct": 2.0,
        "pcie_tx_mb_s": 100.0, "pcie_rx_mb_s": 300.0, "temp_c": 60.0, "power_w": 400.0,
        "nvlink_crc_errors": 0, "xid_errors": 0, "ecc_errors": 0, "throttle_reasons": 0,
    }
    base.update(kw)
    return base


def test_aggregate_sums_averages_max_and_or() -> None:
    out = aggregate([
        _gpu(gpu_util_pct=100.0, temp_c=71.0, nvlink_crc_errors=5, xid_errors=1, throttle_reasons=0x4),
        _gpu(gpu_mem_free_gb=30.0, gpu_util_pct=20.0, pcie_util_pct=4.0, temp_c=83.5, power_w=650.5,
             ecc_errors=2, throttle_reasons=0x20),
        _gpu(gpu_util_pct=0.0, pcie_tx_mb_s=0.0, nvlink_crc_errors=7),
    ])
    assert out["gpus"] == 3
    assert out["gpu_mem_total_gb"] == 240.0 and out["gpu_mem_free_gb"] == 50.0
    assert out["gpu_util_pct"] == pytest.approx(40.0)
    assert out["pcie_util_pct"] == pytest.approx(8.0 / 3)
    assert out["pcie_tx_mb_s"] == 200.0 and out["pcie_rx_mb_s"] == 900.0
    assert out["temp_c"] == 83.5
    assert out["power_w"] == pytest.approx(1450.5)
    assert (out["nvlink_crc_errors"], out["xid_errors"], out["ecc_errors"]) == (12, 1, 2)
    assert out["throttle_reasons"] == 0x24
    # counters stay integers (HealthEvent validates their type on the wire)
    assert all(type(out[k]) is int for k in ("nvlink_crc_errors", "xid_errors", "ecc_errors", "throttle_reasons"))


def test_aggregate_of_one_gpu_is_that_gpu() -> None:
    g = _gpu(ecc_errors=3, throttle_reasons=0x40)
    out = aggregate([g])
    assert out == {**g, "gpus": 1}


def test_aggregate_treats_unreadable_metrics_as_zero() -> None:
    # a reading without temperature, power and PCIe (unsupported on that device) does not fail the node's sample
    out = aggregate([{"gpu_mem_total_gb": 40.0, "gpu_mem_free_gb": 40.0}, _gpu(temp_c=50.0)])
    assert out["gpus"] == 2 and out["temp_c"] == 50.0 and out["power_w"] == 400.0
    assert out["gpu_util_pct"] == 25.0 and out["gpu_mem_total_gb"] == 120.0


def test_aggregate_of_no_gpu_is_all_zero() -> None:
    out = aggregate([])
    assert out["gpus"] == 0
    assert all(v == 0 for v in out.values())


@needs_gpu
def test_real_gpus_sample() -> None:
    src = NvmlSource(None, pcie_gbps=64)
    try:
        a = src.sample()
        b = src.sample()
    finally:
        src.close()
    n = len(src.gpus)
    assert a["gpus"] == b["gpus"] == n >= 1
    assert a["gpu_mem_total_gb"] > 0 and 0 <= a["gpu_mem_free_gb"] <= a["gpu_mem_total_gb"]
    assert 0 <= a["gpu_util_pct"] <= 100 and 0 <= a["pcie_util_pct"] <= 100
    assert 0 < a["temp_c"] < 130 and a["power_w"] > 0
    assert a["pcie_tx_mb_s"] >= 0 and a["pcie_rx_mb_s"] >= 0
    # cumulative counters never go backwards between samples
    for k in ("nvlink_crc_errors", "xid_errors", "ecc_errors"):
        assert 0 <= a[k] <= b[k]
    assert a["throttle_reasons"] & 0x1 == 0  # "GPU idle" is masked: an idle GPU is not throttled


@needs_gpu
def test_real_gpu_index_out_of_range_is_unavailable() -> None:
    with pytest.raises(NvmlUnavailable, match="this host has GPUs"):
        NvmlSource([10_000])
