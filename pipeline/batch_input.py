"""The OpenAI Batch API's input file, checked line by line before anything runs (pure: bytes in, requests or errors
out).

A batch input file is JSONL: one request per line, `{"custom_id", "method": "POST", "url", "body"}`, where `url` is
the batch's endpoint (`/v1/chat/completions` or `/v1/completions`) and `body` is that endpoint's request body.
OpenAI checks the whole file when a batch is created and, when any line is wrong, fails the batch with one error
object per wrong line (`errors.data`: `code`, `message`, `param`, `line`) and runs nothing. The codes and messages
here are the ones OpenAI's API returns, as recorded by Llama Stack's compatibility tests against it
(tests/integration/batches/test_batches_errors.py in meta-llama/llama-stack):

| what is wrong | code | param |
|---|---|---|
| the line is not JSON | `invalid_json_line` | |
| `custom_id`, `method`, `url` or `body` is missing | `missing_required_parameter` | the field |
| `url` is not the batch's endpoint | `invalid_url` | `url` |
| `body.stream` is true | `streaming_unsupported` | `body.stream` |
| `body.model` is missing | `invalid_request` | `body.model` |
| `body.model` is not served | `model_not_found` | `body.model` |
| `body.messages` (chat) or `body.prompt` (completions) is missing | `invalid_request` | the field |

Beyond those (no recorded OpenAI wording): a `custom_id` seen on an earlier line is `duplicate_custom_id`; a field of
the wrong JSON type is `invalid_type`, a `method` other than POST `invalid_value` (OpenAI's codes for those in its
other endpoints); more than `MAX_REQUESTS` lines is one error without a line. `check_body` lets the caller add the
endpoint's own checks (the gateway's: context length, unsupported parameters), each an error on its line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
"""The endpoints a batch may target here (OpenAI's list also has embeddings and responses, which this cluster does
not serve)."""
COMPLETION_WINDOWS = ("24h",)
"""OpenAI accepts only 24 h."""
MAX_REQUESTS = 50_000
"""Requests in one batch (OpenAI's limit)."""
MAX_ERRORS = 1000
"""Error objects kept for one file: a file wrong on every line is reported by its first thousand."""

_ENDPOINT_NAME = {"/v1/chat/completions": "Chat Completions", "/v1/completions": "Completions"}
_REQUIRED = ("custom_id", "method", "url", "body")


@dataclass(frozen=True, slots=True)
class BatchError:
    """One of a batch's `errors.data` (OpenAI's BatchError)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None

    def to_openai(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(frozen=True, slots=True)
class BatchLine:
    """A line that passed: its 1-based line number, its `custom_id` and its request body."""

    line: int
    custom_id: str
    body: dict[str, Any]


BodyCheck = Callable[[str, dict[str, Any]], "BatchError | None"]
"""(endpoint, body) -> the body's error (its `line` is filled in by the parser), or None."""


def _json_type(x: Any) -> str:
    if isinstance(x, bool):
        return "a boolean"
    if isinstance(x, (int, float)):
        return "a number"
    if isinstance(x, str):
        return "a string"
    if isinstance(x, list):
        return "an array"
    if x is None:
        return "null"
    return "an object"


def check_line(obj: Any, endpoint: str, served: Callable[[str], bool],
               check_body: BodyCheck | None) -> BatchError | None:
    """The first thing wrong with one parsed line, in the order OpenAI reports them, or None."""
    if not isinstance(obj, dict):
        return BatchError("invalid_json_line", f"This line is not a JSON object (it is {_json_type(obj)}): a request "
                          "line is an object with custom_id, method, url and body.")
    for f in _REQUIRED:
        if f not in obj:
            return BatchError("missing_required_parameter", f"Missing required parameter: '{f}'.", f)
    for f, want in (("custom_id", str), ("method", str), ("url", str), ("body", dict)):
        if not isinstance(obj[f], want):
            wanted = "a string" if want is str else "an object"
            return BatchError("invalid_type", f"Invalid type for '{f}': expected {wanted}, but got "
                              f"{_json_type(obj[f])} instead.", f)
    if obj["method"] != "POST":
        return BatchError("invalid_value", f"Invalid value: '{obj['method']}'. Supported values are: 'POST'.",
                          "method")
    if obj["url"] != endpoint:
        return BatchError("invalid_url", "The URL provided for this request does not match the batch endpoint.",
                          "url")
    body: dict[str, Any] = obj["body"]
    if body.get("stream"):
        return BatchError("streaming_unsupported",
                          f"{_ENDPOINT_NAME.get(endpoint, endpoint)}: Streaming is not supported in the Batch API.",
                          "body.stream")
    model = body.get("model")
    if model is None:
        return BatchError("invalid_request", "Model parameter is required.", "body.model")
    if not isinstance(model, str) or not served(model):
        return BatchError("model_not_found", f"The provided model '{model}' is not supported by the Batch API.",
                          "body.model")
    need = "messages" if endpoint == "/v1/chat/completions" else "prompt"
    if need not in body:
        return BatchError("invalid_request", f"{need.capitalize()} parameter is required.", f"body.{need}")
    return check_body(endpoint, body) if check_body is not None else None


def parse_batch_input(data: bytes, endpoint: str, served: Callable[[str], bool],
                      check_body: BodyCheck | None = None,
                      max_requests: int = MAX_REQUESTS) -> tuple[list[BatchLine], list[BatchError]]:
    """Every line of a batch input file checked: the requests, in file order, and the errors (at most MAX_ERRORS,
    in line order). The batch runs only when there is no error. Blank lines are skipped (a trailing newline is
    not a request); line numbers count every line, as an editor does."""
    if endpoint not in BATCH_ENDPOINTS:
        raise ValueError(f"unsupported batch endpoint {endpoint!r}; supported: {', '.join(BATCH_ENDPOINTS)}")
    lines: list[BatchLine] = []
    errors: list[BatchError] = []
    seen: set[str] = set()
    count = 0
    for n, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        count += 1
        if len(errors) >= MAX_ERRORS:
            continue
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            errors.append(BatchError("invalid_json_line", "This line is not parseable as valid JSON.", None, n))
            continue
        err = check_line(obj, endpoint, served, check_body)
        if err is None and obj["custom_id"] in seen:
            err = BatchError("duplicate_custom_id", "The custom_id for this request is a duplicate of another "
                             "request. The custom_id parameter must be unique for each request in a batch.",
                             "custom_id")
        if err is not None:
            errors.append(BatchError(err.code, err.message, err.param, n))
            continue
        seen.add(obj["custom_id"])
        lines.append(BatchLine(n, obj["custom_id"], obj["body"]))
    if count == 0:
        errors.append(BatchError("empty_file", "The batch input file is empty: it needs at least one request line."))
    elif count > max_requests:
        errors.append(BatchError("too_many_requests", f"The batch input file has {count} requests; a batch holds at "
                                 f"most {max_requests}: split it into several batches."))
    return lines, errors
