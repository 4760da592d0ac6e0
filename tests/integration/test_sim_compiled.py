"""The compiled simulator (workers.sim.compiled: the hot modules through mypyc) makes the very decisions of the
pure-Python one, and a build that no longer matches the source is never used."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from workers.cli.boot import _is_sim_command
from workers.sim.compiled import BUILD, REPO, activate, build, compiled_status, source_digest

MOONCAKE = REPO / "data" / "traces" / "mooncake-fast25" / "synthetic_trace.jsonl"


def _run(compiled: bool, *args: str) -> dict[str, object]:
    env = {**os.environ, "RACKFLOW_SIM_COMPILED": "1" if compiled else "0"}
    p = subprocess.run([sys.executable, "-m", "workers.cli", "sim", "run", *args, "--json", "--no-progress",
                        "--digest"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out: dict[str, object] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def test_the_compiled_simulator_makes_the_same_decisions_to_the_last_bit() -> None:
    if not compiled_status()[0]:  # `make test` builds it first; a bare pytest run builds it here (about a minute)
        build()
    runs = [
        # prefix hashes (the block index, host-tier hits), a node death and an Xid drain (migrations)
        ["--trace", str(MOONCAKE), "--format", "mooncake", "--faults", "r0-n1@30:death,r1-n2@60:xid:20"],
        # 128 nodes in 16 racks, the control-plane stations on
        ["--cluster", "configs/examples/cluster-1024.yaml", "--model", "qwen2-72b", "--requests", "6000",
         "--control-plane"],
    ]
    for args in runs:
        fast, pure = _run(True, *args), _run(False, *args)
        assert fast["sim_compiled"] is True and pure["sim_compiled"] is False
        assert fast["digest"] == pure["digest"], args
        assert fast["completed"] == pure["completed"] and fast["p99_ms"] == pure["p99_ms"]


def test_a_build_that_does_not_match_the_source_is_not_used(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    shutil.copytree(REPO / "pipeline", root / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    fake = tmp_path / "build"
    assert compiled_status(root, fake) == (False, f"no compiled simulator at {fake} (make sim-compiled builds it)")
    fake.mkdir()
    (fake / "SOURCE").write_text(source_digest(root) + "\nmods\n")
    assert compiled_status(root, fake)[0]
    (root / "pipeline" / "sim" / "node.py").write_text((root / "pipeline" / "sim" / "node.py").read_text() + "#\n")
    ok, why = compiled_status(root, fake)
    assert not ok and "older than pipeline/" in why
    saved = list(sys.path)
    assert not activate(root, fake)  # in this process pipeline is imported already: never swapped under it
    assert sys.path == saved
    # in a fresh process (as `rackflow sim` starts), the stale build is refused and the current one taken
    code = ("import sys; from pathlib import Path; from workers.sim.compiled import activate; "
            "r = activate(Path(sys.argv[1]), Path(sys.argv[2])); print(r, sys.path[0] == sys.argv[2])")
    env = {k: v for k, v in os.environ.items() if k != "RACKFLOW_SIM_COMPILED"}
    stale = subprocess.run([sys.executable, "-c", code, str(root), str(fake)], cwd=REPO,
                           env={**env, "RACKFLOW_SIM_COMPILED": "never-build"},
                           capture_output=True, text=True, timeout=60)
    assert stale.stdout.split() == ["False", "False"] and "older than pipeline/" in stale.stderr
    # by default the first command builds it, saying so as it goes, then runs on it
    built = subprocess.run([sys.executable, "-c", code, str(root), str(fake)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=900)
    assert built.stdout.split() == ["True", "True"], built.stderr[-3000:]
    assert "building it now" in built.stderr and "compiled simulator at" in built.stderr
    assert compiled_status(root, fake)[0]
    assert list((fake / "pipeline" / "sim").glob("simulator*.so"))
    fresh = subprocess.run([sys.executable, "-c", code, str(root), str(fake)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=60)
    assert fresh.stdout.split() == ["True", "True"], fresh.stderr
    assert "building" not in fresh.stderr  # once


def test_only_sim_commands_use_it() -> None:
    assert _is_sim_command(["sim", "run"])
    assert _is_sim_command(["--config", "x.yaml", "sim", "validate"])
    assert not _is_sim_command(["worker", "--engine", "sim"])
    assert not _is_sim_command(["--redis-url", "sim", "up"])
    assert not _is_sim_command([])
    assert BUILD.parent == REPO / ".cache"


_CYCLES = """
import gc, sys
gc.disable()
from workers.sim.compiled import activate
compiled = activate() if sys.argv[1] == "1" else False
from workers.cli.main import main
import workers.sim.harness as H, contextlib
H.quiet_gc = contextlib.nullcontext  # the collector stays off through the run: what is left is the run's cycles
import io
with contextlib.redirect_stdout(io.StringIO()):
    main(sys.argv[2:])
gc.collect()  # argparse's and the imports' own cycles
import pipeline.sim.simulator as s
print(compiled, s.__file__.endswith(".py"))
"""


def _leftover(compiled: bool, requests: int) -> int:
    """Objects the cyclic collector finds after a run made with it off: the cycles the run made."""
    code = _CYCLES.replace("gc.collect()  # argparse", "print(gc.collect())  # argparse")
    args = ["sim", "run", "--trace", str(MOONCAKE), "--format", "mooncake", "--requests", str(requests),
            "--faults", "r0-n1@30:death,r1-n2@60:xid:20", "--json", "--no-progress"]
    p = subprocess.run([sys.executable, "-c", code, "1" if compiled else "0", *args], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    found, flags = p.stdout.strip().splitlines()[-2:]
    assert flags == ("True False" if compiled else "False True")
    return int(found)


def test_a_run_makes_no_reference_cycles_per_request_so_it_runs_with_the_collector_off() -> None:
    if not compiled_status()[0]:
        build()
    for compiled in (False, True):
        few, many = _leftover(compiled, 500), _leftover(compiled, 3000)
        # the same few thousand objects whatever the run's length (argparse, the config's models), none per request
        assert abs(many - few) < 100, (compiled, few, many)
