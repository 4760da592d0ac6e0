"""A batch's life cycle (pipeline/batch_state.py): only OpenAI's transitions, final statuses stay final, a cancel
behaves as OpenAI's (again allowed, after completion a conflict), and the record round-trips to OpenAI's object."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.batch_state import FINAL, STATUSES, TRANSITIONS, Batch, BatchTransitionError


def fresh() -> Batch:
    return Batch("batch_abc", "t1", "/v1/chat/completions", "file-0123456789abcdef01234567", "24h", 1000,
                 metadata={"job": "nightly"})


def test_the_happy_path_stamps_each_status_and_counts_requests() -> None:
    b = fresh().moved("in_progress", 1001, total=3).moved("finalizing", 1005, completed=2, failed=1)
    b = b.moved("completed", 1006, output_file_id="file-out", error_file_id="file-err")
    o = b.to_openai()
    assert o["object"] == "batch" and o["status"] == "completed"
    assert (o["in_progress_at"], o["finalizing_at"], o["completed_at"], o["failed_at"]) == (1001, 1005, 1006, None)
    assert o["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert o["expires_at"] == 1000 + 86_400 and o["errors"] is None and o["metadata"] == {"job": "nightly"}
    assert "tenant" not in o
    assert Batch.from_record(b.to_record()) == b


def test_a_failed_validation_carries_its_errors_and_a_cancel_is_openais() -> None:
    errs = ({"code": "invalid_json_line", "message": "This line is not parseable as valid JSON.", "param": None,
             "line": 2},)
    failed = fresh().moved("failed", 1002, errors=errs)
    assert failed.to_openai()["errors"] == {"object": "list", "data": list(errs)}
    with pytest.raises(BatchTransitionError, match="Cannot cancel a batch with status 'failed'"):
        failed.cancel(1003)
    running = fresh().moved("in_progress", 1001)
    c = running.cancel(1004)
    assert c.status == "cancelling" and c.cancel(1005) == c  # cancelling again is allowed and changes nothing
    done = c.moved("cancelled", 1006)
    assert done.cancel(1007) == done and done.to_openai()["cancelled_at"] == 1006
    with pytest.raises(BatchTransitionError):
        done.moved("in_progress", 1008)


@given(st.lists(st.sampled_from(STATUSES), max_size=12))
def test_only_the_life_cycle_moves_and_final_stays_final(asked: list[str]) -> None:
    b = fresh()
    for i, status in enumerate(asked):
        before = b
        try:
            b = b.moved(status, 2000 + i)
        except BatchTransitionError:
            assert status not in TRANSITIONS[before.status]
            continue
        assert status in TRANSITIONS[before.status] and before.status not in FINAL
    assert b.status in STATUSES
