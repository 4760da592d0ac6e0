"""Every exception class rackflow defines derives from pipeline.errors.RackflowError and says if it is retryable."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pipeline
import streams
import workers
from pipeline.errors import RackflowError

# modules that need an optional engine stack to import (vLLM, torch): checked where it is installed
OPTIONAL = ("workers.engines.vllm_engine", "workers.engines.vllm_plugin", "workers.engines.torch_engine")


def _exception_classes() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for pkg in (pipeline, streams, workers):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if info.name.endswith(".__main__"):  # runs the CLI when imported
                continue
            try:
                mod = importlib.import_module(info.name)
            except ImportError:
                assert info.name in OPTIONAL, f"{info.name} does not import"
                continue
            for _, obj in inspect.getmembers(mod, inspect.isclass):
                if issubclass(obj, BaseException) and obj.__module__ == mod.__name__:
                    found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(found.values())


def test_every_rackflow_exception_derives_from_rackflow_error() -> None:
    classes = _exception_classes()
    assert len(classes) >= 20, f"found only {len(classes)} exception classes: the walk is broken"
    outside = sorted(f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, RackflowError))
    assert outside == [], f"not under RackflowError: {outside}"


def test_transient_errors_are_retryable_and_input_errors_are_not() -> None:
    from pipeline.config import ConfigError
    from pipeline.events import EventValidationError
    from streams.errors import DecodeError, TransientStreamError
    from workers.stores.etcd import EndpointsExhausted, EtcdUnavailable

    for transient in (TransientStreamError, EtcdUnavailable, EndpointsExhausted):
        assert transient.retryable, transient
    for bad_input in (ConfigError, EventValidationError, DecodeError):
        assert not bad_input.retryable, bad_input
    assert issubclass(ConfigError, ValueError), "existing `except ValueError` callers must keep working"
