"""A move reads every token the client has from its stream (`workers/control/failover.py: _tokens_of`) with a fast
path that skips the validating decode for plain token chunks: it must give exactly what the gateway's reader gives
(every index once, in order, up to the result), for any mix of repeats, overlaps and entries it does not know."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from pipeline.events import RequestEvent, ResultEvent, TokenEvent
from streams import codec
from streams.errors import DecodeError
from workers.control.failover import _token_chunk, _tokens_of


def _reference(rows: list[tuple[bytes, dict[bytes, bytes]]]) -> tuple[list[int], list[str], float, bool]:
    """The validating decode, index by index (what the gateway's reader streams)."""
    ids: list[int] = []
    texts: list[str] = []
    first = 0.0
    for _eid, fields in rows:
        try:
            ev = codec.decode(fields)
        except DecodeError:
            continue
        if isinstance(ev, ResultEvent):
            return ids, texts, first, True
        if isinstance(ev, TokenEvent):
            first = first or ev.ts_ms
            for k, (tid, text) in enumerate(zip(ev.token_ids, ev.texts, strict=True)):
                if ev.index + k == len(ids):
                    ids.append(tid)
                    texts.append(text)
    return ids, texts, first, False


def _result() -> ResultEvent:
    req = RequestEvent(request_id="q", version=1, tenant="t", user_id="u", model="m", in_tokens=1, out_tokens=1,
                       max_tokens=1, mem_est_kb=1.0, arrival_ms=1.0)
    return ResultEvent.of(req, "ok", "n", "r", 2.0)


chunk = st.tuples(st.integers(0, 40), st.lists(st.tuples(st.integers(0, 2**31), st.text(max_size=4)), min_size=1,
                                               max_size=5))
entry = st.one_of(
    chunk.map(lambda c: ("tok", c)),
    st.just(("result", None)),
    st.just(("garbage", None)),
    st.just(("overlay", None)),
)


def _rows(spec: list[tuple[str, Any]]) -> list[tuple[bytes, dict[bytes, bytes]]]:
    rows = []
    for n, (kind, c) in enumerate(spec):
        if kind == "tok":
            index, toks = c
            fields = codec.encode(TokenEvent("q", 1, index, tuple(t for t, _ in toks), tuple(x for _, x in toks),
                                             1000.0 + n, "n"))
        elif kind == "result":
            fields = codec.encode(_result())
        elif kind == "garbage":
            fields = {b"v": b"1", b"t": b"tokens", b"d": b"\xc1not msgpack"}
        else:  # a forwarding hop's overlay: only the validating decode applies it
            fields = dict(codec.encode(TokenEvent("q", 1, 0, (5,), ("x",), 999.0, "n")))
            fields[b"o"] = b"\x80"
        rows.append((f"{n}-0".encode(), fields))
    return rows


@given(st.lists(entry, max_size=40))
def test_fast_read_equals_the_validating_decode(spec: list[tuple[str, Any]]) -> None:
    rows = _rows(spec)
    assert _tokens_of(rows) == _reference(rows)


def test_in_order_chunks_with_a_repeat_and_an_overlap() -> None:
    rows = _rows([("tok", (0, [(1, "a"), (2, "b")])), ("tok", (0, [(1, "a")])), ("tok", (1, [(2, "b"), (3, "c")])),
                  ("tok", (3, [(4, "d")]))])
    assert _tokens_of(rows) == ([1, 2, 3, 4], ["a", "b", "c", "d"], 1000.0, False)


def test_only_plain_token_chunks_take_the_fast_path() -> None:
    plain = codec.encode(TokenEvent("q", 1, 3, (7, 8), ("x", "y"), 5.0, "n"))
    assert _token_chunk(plain) == (3, [7, 8], ["x", "y"], 5.0)
    assert _token_chunk(codec.encode(_result())) is None
    assert _token_chunk({**plain, b"v": b"2"}) is None
    assert _token_chunk({**plain, b"o": b"\x80"}) is None
    assert _token_chunk({**plain, b"d": b"\xc1"}) is None
