"""The offline dependency check (deploy/security/check_floors.py): the environment `make` installed is at or above
every advisory floor, and a package below its floor is reported."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_floors", REPO / "deploy" / "security" / "check_floors.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_installed_environment_is_at_or_above_every_floor() -> None:
    bad, checked = _checker().below_floor()
    assert not bad, bad
    assert checked >= 20, f"only {checked} of the listed packages are installed: is the floors file stale?"


def test_a_package_below_its_floor_is_reported(tmp_path: Path) -> None:
    floors = tmp_path / "floors.txt"
    floors.write_text("# comment\npytest>=999.0  # an advisory from the future\nno-such-package-xyz>=1.0\n")
    mod = _checker()
    bad, checked = mod.below_floor(floors)
    assert checked == 1 and len(bad) == 1 and "pytest" in bad[0] and "an advisory from the future" in bad[0]
    assert mod.main(["check_floors.py", str(floors)]) == 1


def test_a_line_without_a_floor_is_refused(tmp_path: Path) -> None:
    floors = tmp_path / "floors.txt"
    floors.write_text("pytest\n")
    with pytest.raises(ValueError, match="no version floor"):
        _checker().read_floors(floors)
