"""The Vidur peer (`workers/sim/vidur_peer.py`): the trace conversion, the metrics parsing, the settings mapping and
the offline profile cache; and, where `.venv-vidur` exists (`make .venv-vidur`), a real Vidur run on 100 requests."""

from __future__ import annotations

import csv
import io
import json
import lzma
from pathlib import Path

import pytest

from pipeline.sim.traces import TraceRequest
from workers.sim import vidur_peer as vp

VIDUR_PY = vp.REPO / ".venv-vidur" / "bin" / "python"


def test_trace_csv_has_vidur_columns_in_seconds() -> None:
    reqs = [TraceRequest(0.0, 100, 20), TraceRequest(1500.0, 7, 3), TraceRequest(62_250.5, 4000, 1)]
    rows = list(csv.DictReader(io.StringIO(vp.vidur_trace_csv(reqs))))
    assert list(rows[0]) == ["Date", "Time", "PromptTokenCount", "CompletionTokenCount"]
    assert {r["Date"] for r in rows} == {vp.TRACE_DATE}
    assert [float(r["Time"]) for r in rows] == pytest.approx([0.0, 1.5, 62.2505])
    assert [(int(r["PromptTokenCount"]), int(r["CompletionTokenCount"])) for r in rows] == [(100, 20), (7, 3),
                                                                                            (4000, 1)]


def test_clip_gives_way_with_the_prompt_as_vidur_does() -> None:
    out = vp.clip_requests([TraceRequest(0.0, 4000, 200), TraceRequest(1.0, 10, 5), TraceRequest(2.0, 5, 9000)],
                           4096)
    assert [(r.in_tokens, r.out_tokens) for r in out] == [(3896, 200), (10, 5), (1, 4095)]
    assert all(r.in_tokens + r.out_tokens <= 4096 for r in out)


def test_request_metrics_are_parsed_seconds_to_ms(tmp_path: Path) -> None:
    run = tmp_path / "2026-12-02_07-00-00"
    run.mkdir()
    path = run / "request_metrics.csv"
    path.write_text("Request Id,request_e2e_time,prefill_e2e_time,request_num_tokens\n"
                    "0,2.0,0.05,10\n1,1.0,0.25,12\n2,4.0,0.5,30\n")
    assert vp.find_request_metrics(tmp_path) == path
    m = vp.parse_request_metrics(path, [0.0, 1.0, 10.0])
    assert m["e2e_ms"] == pytest.approx([2000.0, 1000.0, 4000.0])
    assert m["ttft_ms"] == pytest.approx([50.0, 250.0, 500.0])
    assert m["completed"] == 3
    # first arrival 0 s, last completion 10 + 4 = 14 s
    assert m["throughput_rps"] == pytest.approx(3 / 14, abs=1e-3)
    s = vp.summary(m["e2e_ms"], m["ttft_ms"])
    assert s["e2e_p50_s"] == pytest.approx(2.0)
    assert s["ttft_p50_s"] == pytest.approx(0.25)


def test_metrics_without_the_latency_columns_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "request_metrics.csv"
    path.write_text("Request Id,request_num_tokens\n0,10\n")
    with pytest.raises(RuntimeError, match="request_e2e_time"):
        vp.parse_request_metrics(path)
    with pytest.raises(RuntimeError, match=r"no request_metrics\.csv"):
        vp.find_request_metrics(tmp_path / "nothing")


def test_settings_map_to_both_sides() -> None:
    setup = vp.PeerSetup()
    args = vp.vidur_args(setup, Path("/t/trace.csv"), Path("/t/cache"), Path("/t/out"))
    flags = dict(zip(args[::2], args[1::2], strict=False))
    assert flags["--replica_scheduler_config_type"] == "sarathi"
    assert flags["--sarathi_scheduler_config_batch_size_cap"] == "128"
    assert flags["--sarathi_scheduler_config_chunk_size"] == "4096"
    assert flags["--cache_config_num_blocks"] == str(setup.num_blocks)
    assert flags["--cache_config_block_size"] == "16"
    assert flags["--replica_config_model_name"] == "meta-llama/Llama-2-7b-hf"
    assert flags["--replica_config_device"] == "h100"
    assert flags["--trace_request_generator_config_time_scale_factor"] == "1"
    assert flags["--trace_request_generator_config_prefill_scale_factor"] == "1"
    assert flags["--trace_request_generator_config_date"] == vp.TRACE_DATE
    p = vp.rackflow_params(setup)
    assert (p.max_num_seqs, p.max_batched_tokens, p.block_size) == (128, 4096, 16)
    assert not p.prefix_cache and not p.host_prefix_cache and not p.admission
    cfg = vp.rackflow_config(setup)
    assert vp.rackflow_blocks(cfg, setup) == setup.num_blocks == 6976


def test_profile_cache_is_a_hub_snapshot_of_the_shipped_profiles(tmp_path: Path) -> None:
    setup = vp.PeerSetup()
    cfg = vp.rackflow_config(setup)
    vp.write_profile_cache(tmp_path, cfg, setup)
    comp = tmp_path / "profiling_data" / "compute" / "datasets--rackflow-local--h100-llama-2-7b-hf"
    assert (comp / "refs" / "main").read_text() == vp.SNAPSHOT
    snap = comp / "snapshots" / vp.SNAPSHOT
    assert json.loads((snap / "config.json").read_text()) == {"model": setup.vidur_model, "device_sku": "h100"}
    shipped = (vp.PROFILES / "compute" / "h100" / setup.vidur_model / "mlp.csv").read_bytes()
    assert lzma.decompress((snap / "mlp.csv.xz").read_bytes()) == shipped
    with lzma.open(snap / "attention.csv.xz", "rt") as fh:
        rows = list(csv.DictReader(fh))
    need = {"n_embd", "n_q_head", "n_kv_head", "block_size", "num_tensor_parallel_workers", "batch_size",
            "prefill_chunk_size", "kv_cache_size", "time_stats.attn_prefill.median", "time_stats.attn_decode.median"}
    assert need <= set(rows[0])
    decode = {(int(r["batch_size"]), int(r["kv_cache_size"])): float(r["time_stats.attn_decode.median"])
              for r in rows if r["prefill_chunk_size"] == "0"}
    assert decode[(64, 4096)] > decode[(64, 512)] > 0
    assert decode[(128, 1024)] > decode[(8, 1024)]
    net = tmp_path / "profiling_data" / "network" / "datasets--rackflow-local--h100-pairwise-nvlink"
    assert json.loads((net / "snapshots" / vp.SNAPSHOT / "config.json").read_text()) == {"sku": setup.vidur_network}
    assert (net / "snapshots" / vp.SNAPSHOT / "all_reduce.csv.xz").exists()


def test_missing_vidur_environment_says_how_to_build_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RACKFLOW_VIDUR_PYTHON", raising=False)
    monkeypatch.setattr(vp, "REPO", tmp_path)
    with pytest.raises(SystemExit, match=r"make \.venv-vidur"):
        vp.vidur_python()
    monkeypatch.setenv("RACKFLOW_VIDUR_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(SystemExit, match="RACKFLOW_VIDUR_PYTHON"):
        vp.vidur_python()


@pytest.mark.vidur
@pytest.mark.slow
@pytest.mark.skipif(not VIDUR_PY.exists(), reason=".venv-vidur is absent: build it with `make .venv-vidur` "
                                                   "(vidur==0.0.26 in its own environment)")
def test_vidur_runs_beside_rackflow_on_100_requests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RACKFLOW_VIDUR_PYTHON", str(VIDUR_PY))
    r = vp.compare(100, tmp_path, progress=False)
    t = r["table"]
    assert t["vidur"]["completed"] == t["rackflow"]["completed"] == 100
    for side in ("vidur", "rackflow"):
        row = t[side]
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] < row["e2e_p99_s"]
        assert row["e2e_p50_s"] <= row["e2e_p99_s"]
        assert row["throughput_rps"] > 0
    # same requests, same hardware: the two simulators agree within a factor of two on the medians
    assert 0.5 < t["vidur"]["e2e_p50_s"] / t["rackflow"]["e2e_p50_s"] < 2.0
    assert 0.5 < t["vidur"]["throughput_rps"] / t["rackflow"]["throughput_rps"] < 2.0
    # without its 2 ms of CPU time per iteration rackflow's requests finish sooner
    assert t["rackflow-0cpu"]["e2e_p50_s"] < t["rackflow"]["e2e_p50_s"]
    assert t["rackflow-0cpu"]["completed"] == 100
    assert Path(r["plot"]).exists()
    assert "--cache_config_num_blocks" in r["settings"]["vidur_args"]
