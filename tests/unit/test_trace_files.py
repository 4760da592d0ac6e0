"""The trace files shipped in data/traces/: each parses with its parser and has the figures data/SOURCES.md gives."""

from __future__ import annotations

import hashlib
import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from pipeline.kv.prefix_cache import ideal_hit_rate
from pipeline.sim.traces import TraceRequest, parse_azure, parse_mooncake

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "data" / "traces"

Parser = Callable[[Iterable[str], int | None], Iterator[TraceRequest]]


@dataclass(frozen=True)
class Shipped:
    path: str
    """Relative to data/traces/."""
    parse: Parser
    requests: int
    in_mean: float
    out_mean: float
    span_min: float
    ideal_hit: float
    """`ideal_hit_rate` with 512-token blocks (0 for traces without prefix hashes)."""
    sha256: str = ""
    """Third-party files: the digest of the upstream copy (data/SOURCES.md)."""


SHIPPED = [
    Shipped("azure-llm-2023/AzureLLMInferenceTrace_conv.csv", parse_azure, 19_366, 1154.7, 211.1, 58.36, 0.0),
    Shipped("azure-llm-2023/AzureLLMInferenceTrace_code.csv", parse_azure, 8_819, 2047.8, 27.9, 57.27, 0.0),
    Shipped("mooncake-fast25/synthetic_trace.jsonl", parse_mooncake, 3_993, 15325.5, 149.1, 17.03, 0.6512,
            "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"),
    Shipped("mooncake-fast25/conversation_trace.jsonl", parse_mooncake, 12_031, 12035.1, 342.6, 58.95, 0.3736,
            "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"),
    Shipped("synthetic/multiturn.jsonl", parse_mooncake, 3_937, 3995.8, 252.1, 21.51, 0.8142),
    Shipped("servegen/deepseek-r1-busiest-hour.jsonl", parse_mooncake, 13_012, 700.0, 811.2, 60.0, 0.0),
]
IDS = [s.path for s in SHIPPED]


@cache
def parsed(path: str) -> tuple[TraceRequest, ...]:
    spec = next(s for s in SHIPPED if s.path == path)
    with open(TRACES / path, newline="", encoding="utf-8") as fh:
        return tuple(spec.parse(fh, None))


def test_every_shipped_trace_is_listed() -> None:
    on_disk = sorted(str(p.relative_to(TRACES)) for p in TRACES.rglob("*") if p.is_file())
    assert on_disk == sorted(IDS)


def test_every_shipped_trace_has_a_sources_entry() -> None:
    sources = (REPO / "data" / "SOURCES.md").read_text(encoding="utf-8")
    for path in IDS:
        assert f"## traces/{path} " in sources, path


@pytest.mark.parametrize("spec", SHIPPED, ids=IDS)
def test_counts_and_lengths(spec: Shipped) -> None:
    reqs = parsed(spec.path)
    assert len(reqs) == spec.requests
    assert statistics.fmean(r.in_tokens for r in reqs) == pytest.approx(spec.in_mean, rel=0.01)
    assert statistics.fmean(r.out_tokens for r in reqs) == pytest.approx(spec.out_mean, rel=0.01)
    assert all(r.in_tokens >= 1 and r.out_tokens >= 1 for r in reqs)


@pytest.mark.parametrize("spec", SHIPPED, ids=IDS)
def test_timestamps_start_at_zero_and_never_decrease(spec: Shipped) -> None:
    t = [r.arrival_ms for r in parsed(spec.path)]
    assert t[0] == 0.0
    assert all(a <= b for a, b in itertools.pairwise(t))
    assert t[-1] / 60_000 == pytest.approx(spec.span_min, abs=0.01)


@pytest.mark.parametrize("spec", SHIPPED, ids=IDS)
def test_ideal_prefix_hit_rate(spec: Shipped) -> None:
    reqs = parsed(spec.path)
    rate = ideal_hit_rate([(r.in_tokens, r.prefix_hashes) for r in reqs], 512)
    assert rate == pytest.approx(spec.ideal_hit, abs=0.001)


@pytest.mark.parametrize("spec", [s for s in SHIPPED if s.path.startswith("mooncake-fast25/")],
                         ids=lambda s: s.path)
def test_mooncake_hash_ids_cover_the_prompt_and_are_reused(spec: Shipped) -> None:
    reqs = parsed(spec.path)
    assert all(len(r.prefix_hashes) == math.ceil(r.in_tokens / 512) for r in reqs)
    assert ideal_hit_rate([(r.in_tokens, r.prefix_hashes) for r in reqs], 512) > 0.2


@pytest.mark.parametrize("spec", [s for s in SHIPPED if s.sha256], ids=lambda s: s.path)
def test_third_party_files_are_the_upstream_bytes(spec: Shipped) -> None:
    assert hashlib.sha256((TRACES / spec.path).read_bytes()).hexdigest() == spec.sha256
