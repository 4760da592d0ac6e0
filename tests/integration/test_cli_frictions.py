"""The CLI as a newcomer meets it: what used to trip a first user, each checked the way they would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.cli.main import _join_relative_times, build_parser
from workers.local.services import EmbeddedServices, ServiceEndpoints

pytestmark = pytest.mark.integration

RF = [sys.executable, "-m", "workers.cli"]


def rf(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RACKFLOW_")}
    return subprocess.run([*RF, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_version(tmp_path: Path) -> None:
    res = rf("--version", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("rackflow ") and len(res.stdout.split()) == 2


def test_global_flags_also_after_the_subcommand() -> None:
    p = build_parser()
    after = p.parse_args(["config", "check", "--config", "a.yaml", "--log-level", "DEBUG"])
    assert after.config == ["a.yaml"] and after.log_level == "DEBUG"
    before = p.parse_args(["--config", "b.yaml", "--log-level", "WARNING", "config", "check"])
    assert before.config == ["b.yaml"] and before.log_level == "WARNING"
    neither = p.parse_args(["config", "check"])
    assert neither.config == [] and neither.log_level == "INFO" and neither.redis_url is None
    nested = p.parse_args(["jobs", "status", "--redis-url", "redis://h:1/0", "0" * 8 + "-0000-0000-0000-" + "0" * 12])
    assert nested.redis_url == "redis://h:1/0"


def test_a_bad_config_named_after_the_subcommand_is_read(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("policies: {batcher: {window_ms: -5}}\n")
    res = rf("config", "check", "--config", str(bad), cwd=tmp_path)
    assert res.returncode == 2 and "window_ms" in res.stderr


def test_relative_times_are_values_not_flags() -> None:
    assert _join_relative_times(["replay", "export", "--since", "-5m", "-o", "x"]) == \
        ["replay", "export", "--since=-5m", "-o", "x"]
    assert _join_relative_times(["replay", "export", "--since", "-o"]) == ["replay", "export", "--since", "-o"]
    args = build_parser().parse_args(_join_relative_times(["replay", "export", "--since", "-10m", "-o", "f.rfr"]))
    assert args.since == "-10m"


def test_replay_export_since_minus_5m(tmp_path: Path, clean_services: ServiceEndpoints) -> None:
    out = tmp_path / "w.rfr"
    res = rf("--redis-url", clean_services.redis_url, "--etcd-url", clean_services.etcd_url, "replay", "export",
             "--since", "-5m", "-o", str(out), "--no-progress", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert out.exists() and out.stat().st_size > 0


def test_fault_list_without_node_lists_every_node(tmp_path: Path, clean_services: ServiceEndpoints) -> None:
    urls = ["--redis-url", clean_services.redis_url, "--etcd-url", clean_services.etcd_url]
    for node in ("r0-n0", "r1-n1"):
        res = rf(*urls, "fault", "inject", "--node", node, "--kind", "slow", "--duration", "60", cwd=tmp_path)
        assert res.returncode == 0, res.stderr
    res = rf(*urls, "fault", "list", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert sorted(r["node"] for r in rows) == ["r0-n0", "r1-n1"] and {r["kind"] for r in rows} == {"slow"}


def test_commands_find_the_servers_of_rackflow_up(tmp_path: Path) -> None:
    """`rackflow up` keeps its servers' state in .rackflow/up/services.json: a second terminal's `fault`, `jobs`
    and `replay` in the same directory must use them, not ask for `rackflow services up` (a second, empty pair)."""
    svc = EmbeddedServices(tmp_path / ".rackflow" / "up")
    svc.start()
    try:
        res = rf("fault", "list", "--node", "r0-n0", cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        out = tmp_path / "w.rfr"
        res = rf("replay", "export", "--since", "-1m", "-o", str(out), "--no-progress", cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        assert out.exists() and out.stat().st_size > 0
    finally:
        svc.stop()
    res = rf("fault", "list", "--node", "r0-n0", cwd=tmp_path)
    assert res.returncode != 0 and "rackflow up" in res.stderr and "--redis-url" in res.stderr


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """`rackflow ... | head` where head has gone: exit 0 and no traceback (the write end's reader is closed before
    the command starts, so every write meets a broken pipe)."""
    import os as _os

    r, w = _os.pipe()
    _os.close(r)
    env = {k: v for k, v in _os.environ.items() if not k.startswith("RACKFLOW_")}
    try:
        res = subprocess.run([*RF, "config", "check"], cwd=tmp_path, env=env, stdout=w, stderr=subprocess.PIPE,
                             text=True, timeout=60)
    finally:
        _os.close(w)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "BrokenPipeError" not in res.stderr, res.stderr


def test_a_wrong_flag_shows_the_commands_own_usage(tmp_path: Path) -> None:
    res = rf("fault", "inject", "--node", "r0-n0", "--kind", "xid", "--bogus", cwd=tmp_path)
    assert res.returncode == 2
    assert "usage: rackflow fault inject" in res.stderr and "--bogus" in res.stderr, res.stderr
    res = rf("--log-level", "LOUD", "config", "check", cwd=tmp_path)
    assert res.returncode == 2 and "invalid choice: 'LOUD'" in res.stderr, res.stderr


def test_each_sim_and_fault_subcommand_has_its_own_flags(tmp_path: Path) -> None:
    """`rackflow sim run --help` lists run's flags, not matrix's or validate's; an experiment's names are the
    experiments module's."""
    from workers.cli.sim import EXPERIMENT_NAMES
    from workers.sim.experiments import EXPERIMENTS

    assert tuple(EXPERIMENT_NAMES) == tuple(EXPERIMENTS)
    run_help = rf("sim", "run", "--help", cwd=tmp_path).stdout
    assert "--superpose" in run_help and "--digest" in run_help
    assert "--loads" not in run_help and "--live-requests" not in run_help and "--sizes" not in run_help
    matrix_help = rf("sim", "matrix", "--help", cwd=tmp_path).stdout
    assert "--loads" in matrix_help and "--digest" not in matrix_help
    bad = rf("sim", "validate", "--superpose", "3", cwd=tmp_path)
    assert bad.returncode == 2 and "usage: rackflow sim validate" in bad.stderr, bad.stderr


def test_each_bench_has_its_own_flags(tmp_path: Path) -> None:
    soak = rf("bench", "soak", "--help", cwd=tmp_path).stdout
    assert "--minutes" in soak and "--clients" not in soak and "--entries" not in soak
    gateway = rf("bench", "gateway", "--help", cwd=tmp_path).stdout
    assert "--peer" in gateway and "--minutes" not in gateway
    bad = rf("bench", "route", "--minutes", "3", cwd=tmp_path)
    assert bad.returncode == 2 and "usage: rackflow bench route" in bad.stderr, bad.stderr
