"""The Batch API's input file check (pipeline/batch_input.py): OpenAI's error codes, messages and params, one error
per wrong line with its line number, nothing lost and nothing invented on a valid file."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.batch_input import MAX_ERRORS, BatchError, parse_batch_input

CHAT = "/v1/chat/completions"
SERVED = {"qwen2-7b"}


def served(m: str) -> bool:
    return m in SERVED


def line(custom_id: str = "a", **over: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"custom_id": custom_id, "method": "POST", "url": CHAT,
                           "body": {"model": "qwen2-7b", "messages": [{"role": "user", "content": "hi"}]}}
    obj.update(over)
    return obj


def jsonl(*objs: Any) -> bytes:
    return b"\n".join(o if isinstance(o, bytes) else json.dumps(o).encode() for o in objs) + b"\n"


def only_error(data: bytes, endpoint: str = CHAT) -> BatchError:
    _lines, errors = parse_batch_input(data, endpoint, served)
    assert len(errors) == 1, errors
    return errors[0]


def test_a_valid_file_gives_every_request_in_order_with_its_line() -> None:
    data = jsonl(line("x"), line("y")) + b"\n" + jsonl(line("z"))
    lines, errors = parse_batch_input(data, CHAT, served)
    assert errors == []
    assert [(x.line, x.custom_id) for x in lines] == [(1, "x"), (2, "y"), (4, "z")]  # line 3 is blank
    assert lines[0].body["messages"][0]["content"] == "hi"


@pytest.mark.parametrize(("obj", "code", "param", "words"), [
    (b"{invalid json here", "invalid_json_line", None, "not parseable as valid json"),
    ([1, 2], "invalid_json_line", None, "not a json object"),
    ({k: v for k, v in line().items() if k != "custom_id"}, "missing_required_parameter", "custom_id",
     "missing required parameter: 'custom_id'"),
    ({k: v for k, v in line().items() if k != "method"}, "missing_required_parameter", "method", "'method'"),
    ({k: v for k, v in line().items() if k != "url"}, "missing_required_parameter", "url", "'url'"),
    ({k: v for k, v in line().items() if k != "body"}, "missing_required_parameter", "body", "'body'"),
    (line(custom_id=7), "invalid_type", "custom_id", "expected a string"),
    (line(body=[1]), "invalid_type", "body", "expected an object, but got an array"),
    (line(method="GET"), "invalid_value", "method", "supported values are: 'post'"),
    (line(url="/v1/embeddings"), "invalid_url", "url", "does not match the batch endpoint"),
    (line(body={"model": "qwen2-7b", "messages": [], "stream": True}), "streaming_unsupported", "body.stream",
     "chat completions: streaming is not supported"),
    (line(body={"messages": []}), "invalid_request", "body.model", "model parameter is required"),
    (line(body={"model": "nonexistent-model-xyz", "messages": []}), "model_not_found", "body.model",
     "'nonexistent-model-xyz' is not supported by the batch api"),
    (line(body={"model": "qwen2-7b"}), "invalid_request", "body.messages", "messages parameter is required"),
])
def test_each_kind_of_wrong_line_gets_openais_error(obj: Any, code: str, param: str | None, words: str) -> None:
    err = only_error(jsonl(line("ok"), obj))
    assert (err.code, err.param, err.line) == (code, param, 2), err
    assert words in err.message.lower(), err.message
    assert err.to_openai() == {"code": code, "message": err.message, "param": param, "line": 2}


def test_completions_need_a_prompt_and_a_duplicate_custom_id_is_named() -> None:
    url = "/v1/completions"
    err = only_error(jsonl({"custom_id": "a", "method": "POST", "url": url, "body": {"model": "qwen2-7b"}}), url)
    assert (err.code, err.param, err.line) == ("invalid_request", "body.prompt", 1)
    err = only_error(jsonl(line("same"), line("other"), line("same")))
    assert (err.code, err.param, err.line) == ("duplicate_custom_id", "custom_id", 3)


def test_the_file_as_a_whole_empty_too_large_and_the_callers_own_checks() -> None:
    assert only_error(b"\n\n").code == "empty_file"
    err = parse_batch_input(jsonl(*(line(str(i)) for i in range(4))), CHAT, served, max_requests=3)[1]
    assert [e.code for e in err] == ["too_many_requests"] and "4 requests" in err[0].message
    too_long = BatchError("context_length_exceeded", "too long", "body.messages")
    lines, errors = parse_batch_input(jsonl(line("a"), line("b")), CHAT, served,
                                      check_body=lambda _e, b: too_long if b.get("max_tokens") is None else None)
    assert lines == [] and [(e.code, e.line) for e in errors] == [("context_length_exceeded", 1),
                                                                   ("context_length_exceeded", 2)]
    with pytest.raises(ValueError, match="unsupported batch endpoint"):
        parse_batch_input(b"", "/v1/embeddings", served)
    many = parse_batch_input(b"{\n" * (MAX_ERRORS + 5), CHAT, served)[1]
    assert len(many) == MAX_ERRORS  # bounded, the first ones kept


@given(st.lists(st.one_of(
    st.builds(lambda i: line(f"id-{i}"), st.integers(0, 30)),
    st.just(b"{broken"),
    st.builds(lambda m: line("m", method=m), st.sampled_from(["GET", "PUT"])),
    st.just(b""),
), max_size=40))
def test_every_request_line_is_either_a_request_or_one_error(items: list[Any]) -> None:
    data = jsonl(*items) if items else b""
    lines, errors = parse_batch_input(data, CHAT, served)
    request_lines = [n for n, raw in enumerate(data.split(b"\n"), start=1) if raw.strip()]
    if not request_lines:
        assert [e.code for e in errors] == ["empty_file"] and lines == []
        return
    got = sorted([x.line for x in lines] + [e.line for e in errors if e.line is not None])
    assert got == request_lines  # each line exactly once
    assert len({x.custom_id for x in lines}) == len(lines)  # ids unique among the accepted
