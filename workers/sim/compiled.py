"""Build and use the compiled simulator: a copy of `pipeline/` whose hot modules are compiled with mypyc (the same
source, type-checked, as C extension modules), at `.cache/sim-compiled`. `rackflow sim ...` uses it while it matches
the source (`workers.cli.boot` calls `activate` before anything imports `pipeline`, so this module imports nothing
of it); results are the same to the last bit (tests/integration/test_sim_compiled.py runs both and compares their
digests).

    python -m workers.sim.compiled build      # what `make sim-compiled` runs (about a minute on 2 cores)
    python -m workers.sim.compiled status
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / ".cache" / "sim-compiled"
"""The compiled copy: `pipeline/` with the hot modules as extension modules, and `SOURCE` (the digest of the
`pipeline/` it was built from, then the modules compiled)."""
STAMP = "SOURCE"


def source_digest(root: Path) -> str:
    """sha256 over every `pipeline/**/*.py` under `root` (relative path and bytes, in path order)."""
    h = hashlib.sha256()
    base = root / "pipeline"
    for p in sorted(base.rglob("*.py")):
        h.update(str(p.relative_to(base)).encode())
        h.update(b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def compiled_status(root: Path = REPO, build: Path = BUILD) -> tuple[bool, str]:
    """(usable, why): usable when `build` holds a compiled copy made from `root`'s pipeline/ as it is now."""
    stamp = build / STAMP
    if not stamp.is_file():
        return False, f"no compiled simulator at {build} (make sim-compiled builds it)"
    if stamp.read_text().split("\n")[0].strip() != source_digest(root):
        return False, f"the compiled simulator at {build} is older than pipeline/ (make sim-compiled rebuilds it)"
    return True, "compiled simulator is up to date"


def activate(root: Path = REPO, build: Path = BUILD) -> bool:
    """Put the compiled copy first on sys.path if it is usable and `pipeline` is not imported yet; else say why
    (on stderr) and leave the path alone."""
    if os.environ.get("RACKFLOW_SIM_COMPILED", "auto") in ("0", "off", "no", "false"):
        return False
    if "pipeline" in sys.modules:
        return False
    ok, why = compiled_status(root, build)
    if not ok and os.environ.get("RACKFLOW_SIM_COMPILED", "auto") != "never-build":
        ok, why = _build_once(root, build, why)
    if not ok:
        print(f"rackflow sim: {why}; running the pure-Python simulator (same results, about 2x slower)",
              file=sys.stderr)
        return False
    sys.path.insert(0, str(build))
    return True


def _build_once(root: Path, out: Path, why: str) -> tuple[bool, str]:
    """The first `rackflow sim` on a fresh clone (or after `pipeline/` changed) builds the compiled copy itself,
    saying so, under a lock so that two commands started together build it once. Where it cannot be built (no C
    compiler, no mypyc) it says why, and the pure-Python simulator runs."""
    import fcntl

    try:
        import mypyc  # noqa: F401
    except ImportError:
        return False, f"{why}; mypyc is not installed here, so it cannot be built"
    print(f"rackflow sim: {why}; building it now, once (about a minute; RACKFLOW_SIM_COMPILED=0 skips it)",
          file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / (out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another command building: wait for it, then use what it built
        ok, why2 = compiled_status(root, out)
        if ok:
            return ok, why2
        try:
            build(root, out)
        except (RuntimeError, OSError) as e:
            return False, f"{why}; the build failed ({str(e).strip().splitlines()[0] if str(e).strip() else e})"
    return compiled_status(root, out)


MODULES = (
    "pipeline/sim/simulator.py",
    "pipeline/sim/node.py",
    "pipeline/batching/window.py",
    "pipeline/routing/node_policies/work_aware.py",
    "pipeline/routing/rack_affinity.py",
    "pipeline/routing/hashring.py",
    "pipeline/routing/views.py",
    "pipeline/kv/prefix_cache.py",
    "pipeline/costmodel/calibrated.py",
    "pipeline/routing/node_policies/base.py",
    "pipeline/routing/prefix_index.py",
    "pipeline/routing/registry.py",
    "pipeline/sim/traces.py",
    "pipeline/sim/control_plane.py",
    "pipeline/admission.py",
    "pipeline/sim/world.py",
    "pipeline/costmodel/online.py",
    "pipeline/profiling.py",
    "pipeline/priority.py",
)
"""The modules a large run spends its time in (py-spy of the 10 k GPU hour). `pipeline/costmodel/calibrated.py` is
not among them: mypyc's runtime type checks reject a float where its annotations say int (the calibration's sums),
and its hot path is memoised instead."""


def build(root: Path = REPO, out: Path = BUILD, modules: tuple[str, ...] = MODULES) -> Path:
    """Compile into `out` (replaced whole, atomically: a failed build leaves the old one, or none). Raises
    RuntimeError with mypyc's output when it fails (no C compiler, a type error)."""
    digest = source_digest(root)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copytree(root / "pipeline", tmp / "pipeline", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for shared in ("configs", "data"):  # pipeline/ finds them beside itself (pipeline.config.DEFAULT_CONFIG_DIR)
        (tmp / shared).symlink_to(Path("..", "..", shared) if out.parent == root / ".cache" else root / shared)
    print(f"compiling the simulator's {len(modules)} hot modules with mypyc (about a minute)...", file=sys.stderr,
          flush=True)
    t = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mypyc", *modules], cwd=tmp, stdout=log,
                                stderr=subprocess.STDOUT, text=True)
        while True:  # a line every 10 s, so that a minute of silence never looks like a hang
            try:
                rc = proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                print(f"  compiling ... {time.monotonic() - t:.0f} s", file=sys.stderr, flush=True)
        log.seek(0)
        output = log.read()
    if rc != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"mypyc failed ({rc}):\n{output[-8000:]}")
    for scratch in ("build", ".mypy_cache"):  # the generated C, objects, type cache: the .so files are in place
        shutil.rmtree(tmp / scratch, ignore_errors=True)
    if source_digest(root) != digest:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError("pipeline/ changed during the build; run it again")
    (tmp / STAMP).write_text(digest + "\n" + ",".join(modules) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"compiled simulator at {out} in {time.monotonic() - t:.0f} s", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.sim.compiled", description=__doc__.split("\n")[0])
    p.add_argument("action", choices=("build", "status"))
    p.add_argument("--optional", action="store_true",
                   help="build: a failure is reported and exits 0 (the pure-Python simulator still runs)")
    a = p.parse_args(argv)
    if a.action == "status":
        ok, why = compiled_status()
        print(why)
        return 0 if ok else 1
    if compiled_status()[0] and (BUILD / STAMP).read_text().split("\n")[1] == ",".join(MODULES):
        (BUILD / STAMP).touch()  # newer than what make compares it with
        print("compiled simulator is up to date", file=sys.stderr)
        return 0
    try:
        build()
    except (RuntimeError, OSError) as e:
        print(f"could not compile the simulator: {e}\nrackflow sim runs the pure-Python modules (same results, "
              "about 2x slower)", file=sys.stderr)
        return 0 if a.optional else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
