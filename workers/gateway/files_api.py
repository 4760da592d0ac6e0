"""The OpenAI Files API for batch work: `POST /v1/files` (multipart `file` + `purpose=batch`), `GET /v1/files`,
`GET /v1/files/{id}`, `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`.

Files live in the gateway's file store (workers/stores/files.py: a local directory by default,
`gateway.files_dir`), under the caller's tenant: any other tenant's file id is answered as an unknown one (404). An
upload with purpose `batch` must be JSONL, every non-blank line a JSON value, as OpenAI requires at upload; the lines'
request structure is checked when a batch is created from the file (pipeline/batch_input.py). The store's disk calls
run in a thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from pipeline.config import RackflowConfig
from workers.gateway.edge import ApiError, Edge
from workers.stores.files import FileStore, LocalFileStore

log = logging.getLogger(__name__)

UPLOAD_PURPOSES = ("batch",)
"""What a client may upload here (OpenAI's other purposes are for services this cluster does not run)."""


def _not_found(file_id: str) -> ApiError:
    return ApiError(404, f"No such File object: {file_id}", "file_not_found", "id")


def jsonl_problem(data: bytes) -> str | None:
    """Why `data` is not JSONL (the first bad line), or None."""
    seen = False
    for n, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        seen = True
        try:
            json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return f"line {n} is not valid JSON"
    return None if seen else "the file has no lines"


class FilesApi:
    def __init__(self, config: RackflowConfig, api: Edge, store: FileStore | None = None) -> None:
        self.config = config
        self.api = api
        self.store: FileStore = store if store is not None else LocalFileStore(Path(config.gateway.files_dir))

    async def start(self) -> None:
        if isinstance(self.store, LocalFileStore):
            swept = await asyncio.to_thread(self.store.sweep)
            if swept:
                log.info("file store %s: %d half-written entries from a crash removed", self.store.root, swept)

    async def upload(self, request: Request) -> JSONResponse:
        principal = self.api.principal(request)
        limit = self.config.gateway.max_file_bytes
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > limit + 64 * 1024:
            raise ApiError(413, f"the file is larger than {limit} bytes (gateway.max_file_bytes)", "file_too_large")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ApiError(400, "upload a file as multipart/form-data with the fields `file` and `purpose`",
                           "invalid_content_type")
        try:
            form = await request.form(max_files=1, max_fields=4, max_part_size=limit)
        except Exception as e:  # python-multipart's limits and parse errors
            raise ApiError(400, f"the multipart body could not be read: {e}", "invalid_multipart") from None
        try:
            purpose = form.get("purpose")
            if purpose is None:
                raise ApiError(400, "Missing required parameter: 'purpose'.", "missing_required_parameter", "purpose")
            if purpose not in UPLOAD_PURPOSES:
                raise ApiError(400, f"Invalid value: '{purpose}'. Supported values are: "
                                    f"{', '.join(repr(p) for p in UPLOAD_PURPOSES)}.", "invalid_value", "purpose")
            f = form.get("file")
            if not isinstance(f, UploadFile):
                raise ApiError(400, "Missing required parameter: 'file'.", "missing_required_parameter", "file")
            data = await f.read(limit + 1)
            if len(data) > limit:
                raise ApiError(413, f"the file is larger than {limit} bytes (gateway.max_file_bytes)",
                               "file_too_large")
            why = jsonl_problem(data)
            if why is not None:
                raise ApiError(400, f"Invalid file format for Batch API. Must be .jsonl: {why}.",
                               "invalid_file_format", "file")
            meta = await asyncio.to_thread(self.store.put, principal.tenant, f.filename or "upload.jsonl",
                                           str(purpose), data)
        finally:
            await form.close()
        log.info("file %s uploaded: tenant %s, %d bytes, purpose %s", meta.id, principal.tenant, meta.bytes,
                 meta.purpose)
        return JSONResponse(meta.to_openai())

    async def list(self, request: Request) -> JSONResponse:
        principal = self.api.principal(request)
        purpose = request.query_params.get("purpose")
        files = await asyncio.to_thread(self.store.list, principal.tenant, purpose)
        return JSONResponse({"object": "list", "data": [m.to_openai() for m in files], "has_more": False,
                             "first_id": files[0].id if files else None,
                             "last_id": files[-1].id if files else None})

    async def get(self, request: Request, file_id: str) -> JSONResponse:
        principal = self.api.principal(request)
        meta = await asyncio.to_thread(self.store.meta, principal.tenant, file_id)
        if meta is None:
            raise _not_found(file_id)
        return JSONResponse(meta.to_openai())

    async def content(self, request: Request, file_id: str) -> Response:
        principal = self.api.principal(request)
        data = await asyncio.to_thread(self.store.read, principal.tenant, file_id)
        if data is None:
            raise _not_found(file_id)
        return Response(data, media_type="application/octet-stream")

    async def delete(self, request: Request, file_id: str) -> JSONResponse:
        principal = self.api.principal(request)
        if not await asyncio.to_thread(self.store.delete, principal.tenant, file_id):
            raise _not_found(file_id)
        log.info("file %s deleted: tenant %s", file_id, principal.tenant)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    def register(self, app: FastAPI) -> None:
        @app.post("/v1/files")
        async def upload_file(request: Request) -> Response:
            return await self.upload(request)

        @app.get("/v1/files")
        async def list_files(request: Request) -> Response:
            return await self.list(request)

        @app.get("/v1/files/{file_id}")
        async def get_file(request: Request, file_id: str) -> Response:
            return await self.get(request, file_id)

        @app.get("/v1/files/{file_id}/content")
        async def file_content(request: Request, file_id: str) -> Response:
            return await self.content(request, file_id)

        @app.delete("/v1/files/{file_id}")
        async def delete_file(request: Request, file_id: str) -> Response:
            return await self.delete(request, file_id)
