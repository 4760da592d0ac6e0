"""Check the installed Python environment against deploy/security/advisory-floors.txt: every listed package that
is installed must be at or above its floor. Exit 1 (and one line per offender) when one is below, 0 otherwise.

    python deploy/security/check_floors.py [FLOORS_FILE]

The offline fallback of `make lint`'s pip-audit (which needs PyPI's JSON API or OSV); see the floors file's header
for what it covers and what it does not."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

FLOORS = Path(__file__).resolve().with_name("advisory-floors.txt")


def read_floors(path: Path = FLOORS) -> list[tuple[Requirement, str]]:
    """(requirement, the advisories it answers) for each line of the floors file."""
    out = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line, _, why = raw.partition("#")
        if not line.strip():
            continue
        req = Requirement(line.strip())
        if not req.specifier:
            raise ValueError(f"{path}:{n}: {line.strip()!r} has no version floor")
        out.append((req, why.strip()))
    return out


def below_floor(path: Path = FLOORS) -> tuple[list[str], int]:
    """(one message per installed package below its floor, how many listed packages are installed)."""
    bad, checked = [], 0
    for req, why in read_floors(path):
        try:
            installed = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            continue
        checked += 1
        try:
            ok = req.specifier.contains(Version(installed), prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            bad.append(f"{req.name} {installed} is below {req.specifier} ({why})")
    return bad, checked


def main(argv: list[str]) -> int:
    path = Path(argv[1]) if len(argv) > 1 else FLOORS
    bad, checked = below_floor(path)
    for line in bad:
        print(f"advisory floors: {line}")
    if bad:
        print(f"advisory floors: {len(bad)} of {checked} installed packages below their floor in {path}")
        return 1
    print(f"advisory floors: {checked} installed packages at or above their floor ({path.name}, collected "
          "2026-11-29; not a full audit: see its header)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
