"""The Batch API's file store (workers/stores/files.py): OpenAI's file objects, tenants kept apart, ids that are
never paths, and writes that a crash leaves whole or invisible."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.stores.files import FILE_ID, LocalFileStore


def test_a_file_round_trips_as_openais_file_object(tmp_path: Path) -> None:
    store = LocalFileStore(tmp_path)
    m = store.put("t1", "in.jsonl", "batch", b'{"a": 1}\n')
    assert FILE_ID.match(m.id)
    assert store.read("t1", m.id) == b'{"a": 1}\n'
    o = m.to_openai()
    assert {k: o[k] for k in ("id", "object", "bytes", "filename", "purpose", "status")} == {
        "id": m.id, "object": "file", "bytes": 9, "filename": "in.jsonl", "purpose": "batch", "status": "processed"}
    assert "tenant" not in o
    # a new store on the same directory (a restarted gateway) sees it
    assert LocalFileStore(tmp_path).meta("t1", m.id) == m


def test_tenants_see_only_their_own_files(tmp_path: Path) -> None:
    store = LocalFileStore(tmp_path)
    a = store.put("t1", "a.jsonl", "batch", b"x")
    b = store.put("t2", "b.jsonl", "batch", b"y")
    assert store.meta("t2", a.id) is None and store.read("t2", a.id) is None
    assert store.delete("t2", a.id) is False and store.read("t1", a.id) == b"x"
    assert [m.id for m in store.list("t1")] == [a.id] and [m.id for m in store.list("t2")] == [b.id]


def test_ids_are_never_paths_and_purposes_are_checked(tmp_path: Path) -> None:
    store = LocalFileStore(tmp_path)
    for bad in ("../x", "file-../../etc/passwd", "", "file-XYZ"):
        assert store.meta("t1", bad) is None and store.read("t1", bad) is None and not store.delete("t1", bad)
    with pytest.raises(ValueError, match="purpose"):
        store.put("t1", "x", "fine-tune", b"")
    with pytest.raises(ValueError, match="not a file id"):
        store.put("t1", "x", "batch", b"", file_id="../../x")


def test_delete_list_order_and_what_a_crash_leaves(tmp_path: Path) -> None:
    store = LocalFileStore(tmp_path)
    first = store.put("t1", "1.jsonl", "batch", b"1")
    out = store.put("t1", "out.jsonl", "batch_output", b"2")
    assert [m.id for m in store.list("t1", purpose="batch_output")] == [out.id]
    assert {m.id for m in store.list("t1")} == {first.id, out.id}
    assert store.delete("t1", first.id) and store.read("t1", first.id) is None and not store.delete("t1", first.id)
    # a crash between the data and the metadata, and a half-written temporary: invisible, then swept
    d = next(p for p in tmp_path.iterdir() if p.is_dir())
    (d / "file-0123456789abcdef01234567.data").write_bytes(b"half")
    (d / ".file-0123456789abcdef01234567.json.abcd.tmp").write_bytes(b"{")
    assert [m.id for m in store.list("t1")] == [out.id]
    assert store.read("t1", "file-0123456789abcdef01234567") is None
    assert store.sweep() == 2 and store.read("t1", out.id) == b"2"
