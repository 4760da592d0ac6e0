"""`/v1/batches` through the official `openai` client against the gateway app, in process, on real Valkey and etcd
(no Celery worker: a created batch stays `validating`, its first run queued): what the create call refuses, with
OpenAI's error shape and a message that says what to change; a tenant sees, lists and cancels only its own batches
and creates them only from its own files; the list pages; a cancel is idempotent and a final batch cannot be
cancelled; the status moves through one compare-and-set, so a cancel and the runner's own move never both win."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from pipeline.batch_state import Batch, BatchTransitionError
from streams.runner import connect
from tests.integration.test_files_api import LINE, SECRET, client_for, files_config
from workers.local.services import ServiceEndpoints
from workers.stores.batches import BatchOwner, BatchStore

pytestmark = [pytest.mark.integration, pytest.mark.batch_api]


def _upload(c: openai.OpenAI, n: int = 2) -> str:
    data = "".join(json.dumps({**LINE, "custom_id": f"r{i}"}) + "\n" for i in range(n)).encode()
    return c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def _code(e: openai.APIStatusError) -> tuple[int, str, str | None]:
    body = e.body if isinstance(e.body, dict) else {}
    return e.status_code, str(body.get("code")), body.get("param")


@pytest.mark.timeout(120)
def test_batches_api_per_tenant_and_its_refusals(clean_services: ServiceEndpoints, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.gateway.http import create_app

    monkeypatch.setenv("RACKFLOW_JWT_SECRET", SECRET)
    config = files_config(tmp_path)
    app = create_app(config, clean_services.redis_url, clean_services.etcd_url, no_auth=False)
    with TestClient(app) as http:
        c1, c2 = client_for(config, http, "t1"), client_for(config, http, "t2")
        f1 = _upload(c1)
        made = [c1.batches.create(input_file_id=f1, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"n": str(i)}) for i in range(3)]
        b = made[0]
        assert (b.object, b.status, b.input_file_id, b.completion_window) == ("batch", "validating", f1, "24h")
        assert b.id.startswith("batch_") and b.expires_at == b.created_at + 86_400
        assert b.request_counts.total == 0 and b.errors is None and b.output_file_id is None
        assert c1.batches.retrieve(b.id).metadata == {"n": "0"}

        # the list: newest first, in pages of `limit`, `after` the last id of a page
        page = c1.batches.list(limit=2)
        assert [x.id for x in page.data] == [made[2].id, made[1].id] and page.has_more
        assert page.first_id == made[2].id and page.last_id == made[1].id  # type: ignore[attr-defined]
        last = c1.batches.list(limit=2, after=made[1].id)
        assert [x.id for x in last.data] == [made[0].id] and not last.has_more
        assert [x.id for x in c1.batches.list()] == [m.id for m in reversed(made)]

        # another tenant: nothing to see, list, cancel, or create from t1's file
        assert list(c2.batches.list()) == []
        for call in (lambda: c2.batches.retrieve(b.id), lambda: c2.batches.cancel(b.id)):
            with pytest.raises(openai.NotFoundError) as nf:
                call()
            assert _code(nf.value)[:2] == (404, "batch_not_found") and b.id in str(nf.value)
        with pytest.raises(openai.NotFoundError) as nf:
            c2.batches.create(input_file_id=f1, endpoint="/v1/chat/completions", completion_window="24h")
        assert _code(nf.value) == (404, "file_not_found", "input_file_id")
        assert c1.batches.retrieve(b.id).status == "validating"

        # what the create call refuses, each a 400 naming the field and what to change
        def refused(**kw: object) -> tuple[int, str, str | None, str]:
            args = {"input_file_id": f1, "endpoint": "/v1/chat/completions", "completion_window": "24h", **kw}
            with pytest.raises(openai.APIStatusError) as e:
                c1.batches.create(**args)  # type: ignore[arg-type]
            return (*_code(e.value), str(e.value))

        status, code, param, msg = refused(endpoint="/v1/embeddings")
        assert (status, code, param) == (400, "invalid_value", "endpoint")
        assert "/v1/chat/completions" in msg and "/v1/completions" in msg
        status, code, param, msg = refused(completion_window="48h")
        assert (status, code, param) == (400, "invalid_value", "completion_window") and "'24h'" in msg
        status, code, param, msg = refused(metadata={f"k{i}": "v" for i in range(17)})
        assert (status, code, param) == (400, "invalid_value", "metadata") and "at most 16" in msg
        assert refused(metadata={"k": "v" * 513})[:3] == (400, "invalid_value", "metadata.k")
        assert refused(input_file_id="file-000000000000000000000000")[:3] == (404, "file_not_found",
                                                                               "input_file_id")
        with pytest.raises(openai.BadRequestError) as bad:
            c1.post("/batches", cast_to=object, body={"endpoint": "/v1/completions", "completion_window": "24h"})
        assert _code(bad.value) == (400, "missing_required_parameter", "input_file_id")
        with pytest.raises(openai.BadRequestError) as bad:
            c1.batches.list(limit=101)
        assert _code(bad.value)[::2] == (400, "limit")
        with pytest.raises(openai.BadRequestError) as bad:
            c1.batches.list(after="batch_" + "0" * 32)
        assert _code(bad.value)[::2] == (400, "after")
        with pytest.raises(openai.NotFoundError):
            c1.batches.retrieve("not-a-batch-id")

        # cancel: a batch not yet final goes to `cancelling` (again: the same); a final one cannot be cancelled
        x = c1.batches.cancel(made[1].id)
        assert x.status == "cancelling" and x.cancelling_at
        assert c1.batches.cancel(made[1].id).status == "cancelling"
        assert c1.batches.retrieve(made[1].id).status == "cancelling"

        async def finish(batch_id: str) -> None:
            r = connect(clean_services.redis_url)
            try:
                store = BatchStore(r, 3600)
                await store.update(batch_id, lambda b: b.moved("failed", b.created_at + 1))
            finally:
                await r.aclose()

        asyncio.run(finish(made[2].id))
        with pytest.raises(openai.ConflictError) as conflict:
            c1.batches.cancel(made[2].id)
        assert _code(conflict.value)[:2] == (409, "batch_not_cancellable") and "'failed'" in str(conflict.value)


@pytest.mark.timeout(60)
def test_a_status_move_is_one_compare_and_set(clean_services: ServiceEndpoints) -> None:
    """Many cancels and the runner's `in_progress -> finalizing` at once: exactly one of the two kinds wins, and
    the loser sees the winner's status (never a batch moved backwards or out of a final status)."""

    async def run() -> list[str]:
        r = connect(clean_services.redis_url)
        try:
            store = BatchStore(r, 3600)
            b = Batch("batch_" + "a" * 32, "t", "/v1/chat/completions", "file-" + "0" * 24, "24h", 1_000)
            await store.create(b, BatchOwner("t", "u"), "tok")
            await store.update(b.id, lambda x: x.moved("in_progress", 1_001, total=3))

            async def cancel() -> str:
                try:
                    return (await store.update(b.id, lambda x: x.cancel(1_002))).status
                except BatchTransitionError:
                    return "refused"

            async def finalize() -> str:
                try:
                    return (await store.update(b.id, lambda x: x.moved("finalizing", 1_002))).status
                except BatchTransitionError:
                    return "refused"

            outs = await asyncio.gather(*(cancel() for _ in range(10)), finalize(), *(cancel() for _ in range(10)))
            final = await store.get(b.id)
            assert final is not None
            return [*outs, final.status]
        finally:
            await r.aclose()

    *outs, final = asyncio.run(run())
    if final == "cancelling":
        assert outs[10] == "refused" and all(o == "cancelling" for i, o in enumerate(outs) if i != 10)
    else:
        assert final == "finalizing" and outs[10] == "finalizing"
        assert all(o == "refused" for i, o in enumerate(outs) if i != 10)
