"""A batch's life as OpenAI's Batch API defines it (pure: the record and its transitions, no I/O).

Statuses, with OpenAI's meanings:
- `validating`: the input file is being checked (pipeline/batch_input.py) before anything runs;
- `failed`: the input file failed the check (`errors` lists why, line by line); nothing ran;
- `in_progress`: the requests are running;
- `finalizing`: every request has ended; the output and error files are being written;
- `completed`: the output and error files are ready;
- `expired`: the completion window (24 h) ended first; what finished is in the files, the rest is in the error
  file with `batch_expired`;
- `cancelling`: a cancel was asked for; requests in flight are being cancelled;
- `cancelled`: cancelled; what finished before is in the files.

`TRANSITIONS` is the only way a status changes (`Batch.moved`): a worker that crashed and restarted, or two that
race, cannot move a batch backwards or out of a final status. Timestamps are Unix seconds, as OpenAI's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import RackflowError

STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled")
FINAL = frozenset({"failed", "completed", "expired", "cancelled"})
TRANSITIONS: dict[str, frozenset[str]] = {
    "validating": frozenset({"failed", "in_progress", "cancelling", "expired"}),
    "in_progress": frozenset({"finalizing", "cancelling", "expired"}),
    "finalizing": frozenset({"completed"}),
    "cancelling": frozenset({"cancelled"}),
    "failed": frozenset(), "completed": frozenset(), "expired": frozenset(), "cancelled": frozenset(),
}
_STAMP = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
          "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at", "cancelled": "cancelled_at"}
WINDOW_S = {"24h": 86_400}
"""Completion windows and their length in seconds (OpenAI accepts only 24 h)."""


class BatchTransitionError(RackflowError, ValueError):
    """A status change that OpenAI's life cycle does not allow (for a cancel: 409 on the API)."""


@dataclass(frozen=True, slots=True)
class Batch:
    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    status: str = "validating"
    metadata: dict[str, str] | None = None
    errors: tuple[dict[str, Any], ...] = ()
    output_file_id: str | None = None
    error_file_id: str | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    stamps: dict[str, int] = field(default_factory=dict)

    @property
    def expires_at(self) -> int:
        return self.created_at + WINDOW_S[self.completion_window]

    def moved(self, status: str, now_s: int, **changes: Any) -> Batch:
        """This batch in `status` (stamped at `now_s`), with `changes`; BatchTransitionError when not allowed."""
        if status not in TRANSITIONS.get(self.status, frozenset()):
            raise BatchTransitionError(f"Cannot move a batch with status '{self.status}' to '{status}'.")
        stamps = dict(self.stamps)
        stamps[_STAMP[status]] = now_s
        return dataclasses.replace(self, status=status, stamps=stamps, **changes)

    def cancel(self, now_s: int) -> Batch:
        """A cancel request: a batch not yet final goes to `cancelling`; a cancelling or cancelled one is left as it
        is (OpenAI allows cancelling again); any other final batch cannot be cancelled."""
        if self.status in ("cancelling", "cancelled"):
            return self
        if self.status in FINAL:
            raise BatchTransitionError(f"Cannot cancel a batch with status '{self.status}'.")
        return self.moved("cancelling", now_s)

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's batch object (the tenant is not in it)."""
        out: dict[str, Any] = {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "errors": {"object": "list", "data": list(self.errors)} if self.errors else None,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "expires_at": self.expires_at,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "metadata": self.metadata,
        }
        for stamp in _STAMP.values():
            out[stamp] = self.stamps.get(stamp)
        return out

    def to_record(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "errors": list(self.errors)}

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> Batch:
        return cls(**{**d, "errors": tuple(d.get("errors") or ())})
