"""The OpenAI Batch API: `POST /v1/batches`, `GET /v1/batches` (`limit`, `after`), `GET /v1/batches/{id}`,
`POST /v1/batches/{id}/cancel`.

A batch is created from an input file the caller uploaded to `/v1/files` (purpose `batch`) and runs on Celery
(workers/control/batches.py, the task `rackflow.batches.run` on queue `jobs`): this module records it in Valkey
(workers/stores/batches.py, status `validating`), queues its first run, and answers with OpenAI's batch object at
once; the input file is checked by the run, as OpenAI checks it after the create call. `GET` reads the record with
its line counts as they move. A cancel moves the batch to `cancelling` (a compare-and-set against the runner's own
moves: pipeline/batch_state.py's one transition table); the runner stops admitting lines and aborts those in flight.

The tenant is the authenticated identity's, as for `/v1/files`: a batch of another tenant, like an input file of
another tenant, is answered as an unknown one (404). The lines run as the creator's user, within the models its
token allows. Every error is OpenAI's error shape with a message that says what to change.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from pipeline.batch_input import BATCH_ENDPOINTS, COMPLETION_WINDOWS
from pipeline.batch_state import Batch, BatchTransitionError
from pipeline.config import RackflowConfig
from workers.control import batches
from workers.gateway.edge import ApiError, Edge, _store_down
from workers.gateway.jobs_api import _broker_error
from workers.stores.batches import BATCH_ID, BatchNotFound, BatchOwner, BatchStore, new_batch_id
from workers.stores.files import FileStore

log = logging.getLogger(__name__)

METADATA_KEYS = 16
"""OpenAI's limits on `metadata`: at most 16 pairs, keys of at most 64 characters, values of at most 512."""
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512
LIST_LIMIT = (1, 100, 20)
"""`GET /v1/batches?limit=`: least, most and default (OpenAI's)."""


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param)


def _not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"No batch found with id '{batch_id}'.", "batch_not_found", "batch_id")


def check_metadata(value: Any) -> dict[str, str] | None:
    """`metadata` as OpenAI takes it (null, or up to 16 string pairs), else a 400 naming what to change."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("metadata must be an object of string keys and string values (or null)", "metadata")
    if len(value) > METADATA_KEYS:
        raise _bad(f"metadata has {len(value)} keys; at most {METADATA_KEYS} are allowed", "metadata")
    for k, v in value.items():
        if len(k) > METADATA_KEY_CHARS:
            raise _bad(f"metadata key {k[:20]!r}... is {len(k)} characters long; at most {METADATA_KEY_CHARS}",
                       "metadata")
        if not isinstance(v, str):
            raise _bad(f"metadata[{k!r}] must be a string", f"metadata.{k}")
        if len(v) > METADATA_VALUE_CHARS:
            raise _bad(f"metadata[{k!r}] is {len(v)} characters long; at most {METADATA_VALUE_CHARS}",
                       f"metadata.{k}")
    return dict(value)


class BatchesApi:
    def __init__(self, config: RackflowConfig, api: Edge, files: FileStore, redis_url: str,
                 etcd_url: str | None) -> None:
        self.config = config
        self.api = api
        self.files = files
        self.redis_url = redis_url
        self.etcd_url = etcd_url
        self._store: BatchStore | None = None

    @property
    def store(self) -> BatchStore:
        if self._store is None:
            raise RuntimeError("the gateway is not started (lifespan not run)")
        return self._store

    async def start(self, r: aioredis.Redis) -> None:
        from workers.control.app import configure

        configure(self.config, self.redis_url, self.etcd_url or "")  # the broker the runs are queued on
        self._store = BatchStore(r, self.config.batches.retention_s)

    def close(self) -> None:
        self._store = None

    # -- endpoints -------------------------------------------------------------------------------------------------
    async def _body(self, request: Request) -> dict[str, Any]:
        self.api.check_content_length(request)
        self.api.check_content_type(request)
        raw = await self.api.read_body(request)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise _bad("request body is not valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise _bad("request body must be a JSON object with input_file_id, endpoint and completion_window")
        return body

    async def create(self, request: Request) -> JSONResponse:
        principal = self.api.principal(request)
        body = await self._body(request)
        for f in ("input_file_id", "endpoint", "completion_window"):
            if f not in body:
                raise _bad(f"Missing required parameter: '{f}'.", f, "missing_required_parameter")
            if not isinstance(body[f], str):
                raise _bad(f"Invalid type for '{f}': expected a string.", f, "invalid_type")
        endpoint, window, file_id = body["endpoint"], body["completion_window"], body["input_file_id"]
        if endpoint not in BATCH_ENDPOINTS:
            raise _bad(f"Invalid value: '{endpoint}'. This cluster runs batches for {', '.join(BATCH_ENDPOINTS)} "
                       "only (OpenAI's /v1/embeddings and /v1/responses are not served here).", "endpoint")
        if window not in COMPLETION_WINDOWS:
            raise _bad(f"Invalid value: '{window}'. Supported values are: "
                       f"{', '.join(repr(w) for w in COMPLETION_WINDOWS)}.", "completion_window")
        metadata = check_metadata(body.get("metadata"))
        meta = await asyncio.to_thread(self.files.meta, principal.tenant, file_id)
        if meta is None:
            raise ApiError(404, f"No such File object: {file_id}", "file_not_found", "input_file_id")
        if meta.purpose != "batch":
            raise _bad(f"File {file_id} has purpose '{meta.purpose}': a batch's input file is one uploaded with "
                       "purpose 'batch'.", "input_file_id")
        now = time.time()
        batch = Batch(new_batch_id(), principal.tenant, endpoint, file_id, window, int(now), metadata=metadata)
        owner = BatchOwner(principal.tenant, principal.sub, principal.models, trust_user=not self.api.authn.enabled)
        token = batches.new_token()
        try:
            await self.store.create(batch, owner, token, now * 1000.0)
        except RedisError as e:
            raise _store_down(e) from None
        try:
            await asyncio.to_thread(batches.submit, batch.id, token)
        except Exception as e:
            if not _broker_error(e):
                raise
            await self.store.remove(batch)
            raise ApiError(503, f"the gateway cannot reach the job queue; retry later ({type(e).__name__})",
                           "store_unavailable", headers={"Retry-After": str(self.config.gateway.retry_after_s)}) \
                from None
        log.info("batch %s created: tenant %s, endpoint %s, input %s", batch.id, principal.tenant, endpoint, file_id)
        return JSONResponse(batch.to_openai())

    async def _own(self, request: Request, batch_id: str) -> tuple[str, Batch]:
        principal = self.api.principal(request)
        if not BATCH_ID.match(batch_id):
            raise _not_found(batch_id)
        try:
            b = await self.store.get(batch_id)
        except RedisError as e:
            raise _store_down(e) from None
        if b is None or b.tenant != principal.tenant:
            raise _not_found(batch_id)
        return principal.tenant, b

    async def get(self, request: Request, batch_id: str) -> JSONResponse:
        _tenant, b = await self._own(request, batch_id)
        return JSONResponse(b.to_openai())

    async def list(self, request: Request) -> JSONResponse:
        principal = self.api.principal(request)
        least, most, default = LIST_LIMIT
        raw = request.query_params.get("limit")
        try:
            limit = default if raw is None else int(raw)
        except ValueError:
            raise _bad(f"limit must be an integer from {least} to {most}, got {raw!r}", "limit") from None
        if not least <= limit <= most:
            raise _bad(f"limit must be from {least} to {most}, got {limit}", "limit")
        after = request.query_params.get("after")
        try:
            page = await self.store.list(principal.tenant, limit, after or None)
        except RedisError as e:
            raise _store_down(e) from None
        if page is None:
            raise _bad(f"after: no batch '{after}' among yours; pass the last_id of the page before", "after")
        found, more = page
        return JSONResponse({"object": "list", "data": [b.to_openai() for b in found],
                             "first_id": found[0].id if found else None, "last_id": found[-1].id if found else None,
                             "has_more": more})

    async def cancel(self, request: Request, batch_id: str) -> JSONResponse:
        _tenant, b = await self._own(request, batch_id)
        now = int(time.time())
        try:
            b = await self.store.update(batch_id, lambda cur: cur.cancel(now))
        except BatchTransitionError as e:
            raise ApiError(409, f"{e} Only a batch that is validating or in progress can be cancelled.",
                           "batch_not_cancellable", "batch_id") from None
        except BatchNotFound:
            raise _not_found(batch_id) from None
        except RedisError as e:
            raise _store_down(e) from None
        log.info("batch %s: cancel asked (status %s)", batch_id, b.status)
        return JSONResponse(b.to_openai())

    def register(self, app: FastAPI) -> None:
        @app.post("/v1/batches")
        async def create_batch(request: Request) -> Response:
            return await self.create(request)

        @app.get("/v1/batches")
        async def list_batches(request: Request) -> Response:
            return await self.list(request)

        @app.get("/v1/batches/{batch_id}")
        async def get_batch(request: Request, batch_id: str) -> Response:
            return await self.get(request, batch_id)

        @app.post("/v1/batches/{batch_id}/cancel")
        async def cancel_batch(request: Request, batch_id: str) -> Response:
            return await self.cancel(request, batch_id)
