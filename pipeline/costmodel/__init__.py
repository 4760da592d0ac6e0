"""Engine cost models: how long one continuous-batching iteration takes on a GPU type (ARCHITECTURE §8).

- `CalibratedCostModel` (calibrated.py): per-operator model fitted per GPU architecture on the shipped Vidur
  profiles; what the simulator and the `sim` engine use. Its `Calibration` is passed in, or read from the committed
  configs/calibration.json (committed.py, configuration loading); `rackflow perf calibrate` regenerates that file
  with `fit` (calibration.py) on the profiles the shell parses.
- `RooflineCostModel` (roofline.py): the uncalibrated whole-model roofline, a first-order reference.
- `IterationCostModel`: what an engine needs from either.
No clock, no services; the only file read is the committed calibration (docs/COST_MODEL.md describes the model
and its measured error).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pipeline.config import GpuSpec, ModelSpec
from pipeline.costmodel.calibrated import (
    ATTENTION,
    DEFAULT_OVERHEAD_MS,
    AttentionConstants,
    CalibratedCostModel,
    StepBreakdown,
)
from pipeline.costmodel.calibration import (
    AllReduceRow,
    AllReduceTable,
    ArchCalibration,
    Calibration,
    CalibrationError,
    IterationError,
    OperatorError,
    OperatorFit,
    ProfileRow,
    fit,
    iteration_errors,
    operator_errors,
)
from pipeline.costmodel.committed import CALIBRATION_FILE, load_calibration, read_calibration_document
from pipeline.costmodel.operators import LayerShape
from pipeline.costmodel.roofline import RooflineCostModel


class IterationCostModel(Protocol):
    """What an engine (the `sim` engine, the simulator's node) needs from a cost model."""

    @property
    def gpu(self) -> GpuSpec: ...

    @property
    def model(self) -> ModelSpec: ...

    @property
    def tp(self) -> int: ...

    def step_ms(
        self, prefill_tokens: Sequence[int], decode_seqs: int, decode_kv_tokens: int,
        prefill_cached: Sequence[int] | None = None,
    ) -> float: ...


__all__ = [
    "ATTENTION",
    "CALIBRATION_FILE",
    "DEFAULT_OVERHEAD_MS",
    "AllReduceRow",
    "AllReduceTable",
    "ArchCalibration",
    "AttentionConstants",
    "CalibratedCostModel",
    "Calibration",
    "CalibrationError",
    "IterationCostModel",
    "IterationError",
    "LayerShape",
    "OperatorError",
    "OperatorFit",
    "ProfileRow",
    "RooflineCostModel",
    "StepBreakdown",
    "fit",
    "iteration_errors",
    "load_calibration",
    "operator_errors",
    "read_calibration_document",
]
