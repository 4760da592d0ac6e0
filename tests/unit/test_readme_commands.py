"""The README's snippets as written: every `rackflow ...` line parses with the CLI's own parser (no unknown flag, no
missing argument), its Python compiles, its curl body is JSON, and every link points at a file of the repository.
Their behaviour is tested where each command is (the gateway's curl in tests/integration/test_cli.py)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from workers.cli.main import _join_relative_times, build_parser

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, flags=re.S)


def _commands() -> list[str]:
    out = []
    for _lang, body in BLOCKS:
        for line in body.splitlines():
            cmd = line.split("#", 1)[0].strip()
            if cmd.startswith("rackflow "):
                out.append(cmd)
    return out


@pytest.mark.parametrize("cmd", [c for c in _commands() if c != "rackflow --help"])
def test_each_rackflow_line_parses(cmd: str) -> None:
    argv = _join_relative_times(shlex.split(cmd)[1:])
    args, extra = build_parser().parse_known_args(argv)
    assert not extra, (cmd, extra)
    assert callable(getattr(args, "fn", None)), cmd


def test_the_readme_names_a_dozen_commands_at_least() -> None:
    assert len(_commands()) >= 12


def test_python_compiles_and_curl_sends_json() -> None:
    py = [body for lang, body in BLOCKS if lang == "python"]
    assert py
    for body in py:
        compile(body, "README.md", "exec")
    bodies = re.findall(r"-d '(\{.*?\})'", README, flags=re.S)
    assert bodies
    for b in bodies:
        json.loads(b)


def test_every_link_points_at_a_file() -> None:
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if target.startswith("http"):
            continue
        assert (REPO / target).exists(), target


def test_the_readme_reads_in_five_minutes() -> None:
    """About 1,100 words: five minutes at a reader's 230 words a minute."""
    words = len(re.sub(r"```.*?```", "", README, flags=re.S).split())
    assert words <= 1150, words
