"""The cores each local vLLM worker binds its compute threads to (`workers.local.launcher.vllm_cpu_cores`): disjoint
shares in node order, wrapping when there are more workers than cores; the operator's own setting wins, and a
single worker keeps vLLM's binding."""

from __future__ import annotations

import os

import pytest

from workers.local.launcher import vllm_cpu_cores


@pytest.fixture
def cores(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)

    def use(ids: list[int]) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(ids))

    return use


def test_two_workers_on_two_cores_get_one_each(cores) -> None:  # type: ignore[no-untyped-def]
    cores([0, 1])
    assert [vllm_cpu_cores(["r0-n0", "r0-n1"], n) for n in ("r0-n0", "r0-n1")] == ["0", "1"]


def test_shares_are_ranges_and_disjoint(cores) -> None:  # type: ignore[no-untyped-def]
    cores(list(range(8)))
    got = [vllm_cpu_cores(["a", "b", "c"], n) for n in ("a", "b", "c")]
    assert got == ["0-1", "2-3", "4-5"]


def test_only_the_cores_this_process_may_use(cores) -> None:  # type: ignore[no-untyped-def]
    cores([2, 5, 6, 7])
    assert [vllm_cpu_cores(["a", "b"], n) for n in ("a", "b")] == ["2,5", "6-7"]


def test_more_workers_than_cores_wrap(cores) -> None:  # type: ignore[no-untyped-def]
    cores([0, 1])
    assert [vllm_cpu_cores(["a", "b", "c"], n) for n in ("a", "b", "c")] == ["0", "1", "0"]


def test_the_operators_setting_wins(cores, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    cores([0, 1])
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert vllm_cpu_cores(["a", "b"], "a") is None
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    assert vllm_cpu_cores(["a", "b"], "elsewhere") is None
    assert vllm_cpu_cores(["a"], "a") is None  # one worker: vLLM's own binding, which keeps a core for the rest
