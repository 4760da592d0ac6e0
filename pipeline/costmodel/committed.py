"""The committed calibration, `configs/calibration.json`: configuration loading, like `pipeline.config.load_config`.

Owns the one file access of this package: reading the generated calibration that `rackflow perf calibrate`
(workers/sim/perf.py) writes, cached per file version, so building a cost model never re-fits (the fit takes seconds).
It must never write the file, read the profiles or fit: that is the shell's job.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from pipeline.config import DEFAULT_CONFIG_DIR
from pipeline.costmodel.calibration import Calibration, CalibrationError

CALIBRATION_FILE = DEFAULT_CONFIG_DIR / "calibration.json"


def read_calibration_document(path: Path = CALIBRATION_FILE) -> dict[str, Any]:
    """The whole file: the header (sources, reference GPUs) and the `calibration` section."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CalibrationError(f"{path} is missing; generate it with `rackflow perf calibrate`") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CalibrationError(f"cannot read {path} ({e}); regenerate it with `rackflow perf calibrate`") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("calibration"), dict):
        raise CalibrationError(f"{path} has no `calibration` section; regenerate it with `rackflow perf calibrate`")
    return doc


@functools.lru_cache(maxsize=8)
def _load(path: Path, version: tuple[int, int]) -> Calibration:
    return Calibration.from_dict(read_calibration_document(path)["calibration"])


def load_calibration(path: Path | None = None) -> Calibration:
    """The committed calibration (default: the repository's configs/calibration.json), parsed once per file
    version (size and modification time); never re-fits."""
    p = Path(path or CALIBRATION_FILE).resolve()
    try:
        st = p.stat()
    except FileNotFoundError:
        raise CalibrationError(f"{p} is missing; generate it with `rackflow perf calibrate`") from None
    return _load(p, (st.st_mtime_ns, st.st_size))
