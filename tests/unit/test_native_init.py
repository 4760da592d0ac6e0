"""The hot dataclasses of the simulator write their `__init__` out (compiled by mypyc it is native; the one
`dataclasses` generates stays interpreted, about 6x slower, and the 10 k GPU hour builds tens of millions of them).
A written-out `__init__` must take exactly the dataclass's fields, in order, with the same defaults (a
`default_factory` field defaults to None and gets a fresh object), and set every field from its argument."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from pipeline.admission import Verdict
from pipeline.batching.window import BatchPlan, DispatchChoice, WindowOutcome
from pipeline.routing.node_policies.base import NodeChoice
from pipeline.routing.rack_affinity import RackSummary, RouteDecision
from pipeline.routing.views import NodeView, RackView
from pipeline.sim.node import FinishedSeq, SimSeq, StepResult
from pipeline.sim.traces import TraceRequest

WRITTEN_OUT = (RackView, NodeView, RackSummary, RouteDecision, SimSeq, FinishedSeq, StepResult, TraceRequest,
               DispatchChoice, BatchPlan, WindowOutcome, NodeChoice, Verdict)


@pytest.mark.parametrize("cls", WRITTEN_OUT, ids=lambda c: c.__name__)
def test_init_is_written_out_and_takes_the_fields(cls: type) -> None:
    assert "__init__" in cls.__dict__
    code = getattr(cls.__init__, "__code__", None)
    if code is not None:  # pure Python: not the one dataclasses generates (its code comes from a string)
        assert code.co_filename != "<string>", f"{cls.__name__}.__init__ is the generated one"
    fields = dataclasses.fields(cls)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields, strict=True):
        if f.default is not dataclasses.MISSING:
            assert p.default == f.default, f"{cls.__name__}.{f.name}: default {p.default!r} != {f.default!r}"
        elif f.default_factory is not dataclasses.MISSING:
            assert p.default is None, f"{cls.__name__}.{f.name}: a factory field must default to None"
        else:
            assert p.default is inspect.Parameter.empty, f"{cls.__name__}.{f.name} has no default"


@pytest.mark.parametrize("cls", WRITTEN_OUT, ids=lambda c: c.__name__)
def test_init_sets_every_field_from_its_argument(cls: type) -> None:
    fields = dataclasses.fields(cls)
    # a distinct sentinel per field: a field set from the wrong argument, or not set, shows
    values = {f.name: _sample(f.type, i) for i, f in enumerate(fields)}
    obj = cls(**values)
    for f in fields:
        assert getattr(obj, f.name) == values[f.name], f"{cls.__name__}.{f.name}"
    assert obj == cls(**values)
    if cls.__hash__ is not None and _hashable(values):  # unsafe_hash kept: equal values, equal hashes
        assert hash(obj) == hash(cls(**values))


def test_factory_defaults_are_fresh() -> None:
    a, b = StepResult(), StepResult()
    a.finished.append(FinishedSeq(1, 2.0))
    assert b.finished == [] and b.first_tokens == []
    assert NodeChoice("n").scores == {} and NodeChoice("n").scores is not NodeChoice("n").scores


def _hashable(values: dict[str, object]) -> bool:
    try:
        hash(tuple(values.values()))
    except TypeError:
        return False
    return True


def _sample(annotation: object, i: int) -> object:
    t = str(annotation)
    if t.startswith("bool"):
        return i % 2 == 0
    if t.startswith("int"):
        return 1000 + i
    if t.startswith("float"):
        return 0.5 + i
    if t.startswith("str"):
        return f"v{i}"
    if t.startswith("tuple"):
        return (i,)
    if t.startswith("list"):
        return [(i, 0.5)]
    if t.startswith("Mapping") or t.startswith("dict"):
        return {f"k{i}": 0.5}
    return f"other{i}"  # enums and classes: any distinct value does (nothing checks the type in pure Python)
