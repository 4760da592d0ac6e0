"""The gateway's async-job endpoints: `POST /v1/jobs`, `GET /v1/jobs/{id}`, `DELETE /v1/jobs/{id}` (also
`POST /v1/jobs/{id}/cancel`), on the Celery tasks of `workers.control.jobs`.

A job is one request (`{"prompt", "model"?, "max_tokens"?, "user"?}`: one task) or many (`{"requests": [...]}`: a
Celery group). Every request is checked as the completions endpoints check theirs (the token allows the model, the
model is served, the prompt fits the context) before anything is submitted; a bad one is a 4xx naming it. The job is
recorded with the caller's tenant, and only that tenant may read or cancel it: any other caller gets the same 404 as
for an unknown id. Celery's client is synchronous: its calls run in worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from pipeline.config import RackflowConfig
from pipeline.events import REQUEST_ID
from pipeline.profiling import ProfileInput
from workers.control import jobs
from workers.gateway.edge import ApiError, Edge
from workers.shell.runtime import WALL
from workers.stores.ingress import RequestRejected

if TYPE_CHECKING:
    from workers.stores.etcd import NodeRegistry, SequenceRegistry

log = logging.getLogger(__name__)

class JobsApi:
    def __init__(self, config: RackflowConfig, api: Edge, redis_url: str, etcd_url: str | None) -> None:
        self.config = config
        self.api = api
        self.redis_url = redis_url
        self.etcd_url = etcd_url
        self._r: aioredis.Redis | None = None
        self._registry: NodeRegistry | None = None
        self.seqs: SequenceRegistry | None = None

    @property
    def r(self) -> aioredis.Redis:
        if self._r is None:
            raise RuntimeError("the gateway is not started (lifespan not run)")
        return self._r

    async def start(self, r: aioredis.Redis) -> None:
        from workers.control.app import configure

        configure(self.config, self.redis_url, self.etcd_url or "")
        self._r = r
        if self.etcd_url:
            from workers.stores.etcd import NodeRegistry, SequenceRegistry

            self._registry = NodeRegistry(self.etcd_url)
            self.seqs = SequenceRegistry(self._registry.client)

    async def close(self) -> None:
        if self._registry is not None:
            await self._registry.close(revoke=False)
        self._registry = self.seqs = None
        self._r = None

    # -- helpers ---------------------------------------------------------------------------------------------------
    def _error(self, status: int, message: str, code: str, param: str | None = None) -> Exception:

        return ApiError(status, message, code, param)

    def _down(self, e: Exception) -> Exception:
        return self._error(503, f"the gateway cannot reach the job queue or its store; retry later "
                                f"({type(e).__name__})", "store_unavailable")

    def _not_found(self, job_id: str) -> Exception:
        return self._error(404, f"no job {job_id!r} (unknown, expired, or not yours)", "job_not_found", "id")

    async def _specs(self, request: Request) -> tuple[list[jobs.JobSpec], bool]:
        self.api.check_content_length(request)
        self.api.check_content_type(request)
        raw = await self.api.read_body(request)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested deeper than the parser goes
            raise self._error(400, "request body is not valid JSON", "invalid_json") from None
        try:
            if isinstance(body, dict) and "requests" in body:
                extra = sorted(set(body) - {"requests"})
                if extra:
                    raise _Bad(f"body: unknown field {extra[0]!r} next to `requests`", extra[0])
                items = body["requests"]
                if not isinstance(items, list) or not items:
                    raise _Bad("requests: expected a non-empty list of request objects", "requests")
                if len(items) > jobs.MAX_JOB_REQUESTS:
                    raise _Bad(f"requests: {len(items)} items; at most {jobs.MAX_JOB_REQUESTS}", "requests")
                specs = []
                for i, it in enumerate(items):
                    try:
                        specs.append(jobs.parse_spec(it, f"requests[{i}]"))
                    except jobs.JobSpecError as e:
                        raise _Bad(str(e), f"requests[{i}].{e.field}" if e.field else f"requests[{i}]") from None
                return specs, True
            return [jobs.parse_spec(body, "body")], False
        except jobs.JobSpecError as e:
            raise self._error(400, str(e), "invalid_value", e.field) from None

    # -- endpoints -------------------------------------------------------------------------------------------------
    async def submit(self, request: Request) -> JSONResponse:
        principal = self.api.principal(request)
        specs, batch = await self._specs(request)
        checked = []
        gw = self.api.gateway
        for i, spec in enumerate(specs):
            where = f"requests[{i}]" if batch else "body"
            model = spec.model or request.headers.get("x-model") or principal.default_model or \
                jobs.default_model(self.config)
            if not model:
                raise self._error(400, f"{where}: no model given: set `model`, the X-Model header, or a `model` "
                                       "claim in the token", "model_required", f"{where}.model")
            self.api.select_model(request, model, principal)  # 403 when the token does not allow it
            user = principal.sub if self.api.authn.enabled else (spec.user or principal.sub)
            try:
                gw.profile(ProfileInput(request_id="check", tenant=principal.tenant, user_id=user, model=model,
                                        arrival_ms=WALL.now_ms(), prompt=spec.prompt, max_tokens=spec.max_tokens),
                           principal.allows)
            except RequestRejected as e:
                raise self._error(e.status, f"{where}: {e}", e.code, f"{where}.{e.param}" if e.param else where) \
                    from None
            checked.append(jobs.JobSpec(spec.prompt, model, spec.max_tokens, user))
        try:
            job = await asyncio.to_thread(jobs.submit, checked, principal.tenant, batch)
            job.extra["user"] = principal.sub
            await jobs.save_job(self.r, job)
        except RedisError as e:
            raise self._down(e) from None
        except Exception as e:
            if _broker_error(e):
                raise self._down(e) from None
            raise
        log.info("job %s submitted: tenant %s, %d requests", job.id, principal.tenant, len(job.task_ids))
        return JSONResponse({"id": job.id, "object": "rackflow.job", "status": "queued", "tasks": len(job.task_ids)},
                            status_code=202)

    async def _own_job(self, request: Request, job_id: str) -> jobs.Job:
        principal = self.api.principal(request)
        if not REQUEST_ID.match(job_id):
            raise self._not_found(job_id)
        try:
            job = await jobs.load_job(self.r, job_id)
        except RedisError as e:
            raise self._down(e) from None
        if job is None or job.tenant != principal.tenant:
            raise self._not_found(job_id)
        return job

    async def get(self, request: Request, job_id: str) -> JSONResponse:
        job = await self._own_job(request, job_id)
        try:
            state = await asyncio.to_thread(jobs.job_state, job)
        except RedisError as e:
            raise self._down(e) from None
        return JSONResponse({"object": "rackflow.job", **state})

    async def cancel(self, request: Request, job_id: str) -> JSONResponse:
        job = await self._own_job(request, job_id)
        try:
            report = await jobs.cancel(self.r, self.seqs, job, self.config.policies.streams.retention_s * 1000)
            state = await asyncio.to_thread(jobs.job_state, job, False)
        except RedisError as e:
            raise self._down(e) from None
        log.info("job %s cancelled: %s", job.id, report)
        return JSONResponse({"object": "rackflow.job", **state, "cancel": report})

    def register(self, app: FastAPI) -> None:
        @app.post("/v1/jobs")
        async def submit_job(request: Request) -> Response:
            return await self.submit(request)

        @app.get("/v1/jobs/{job_id}")
        async def get_job(request: Request, job_id: str) -> Response:
            return await self.get(request, job_id)

        @app.delete("/v1/jobs/{job_id}")
        async def delete_job(request: Request, job_id: str) -> Response:
            return await self.cancel(request, job_id)

        @app.post("/v1/jobs/{job_id}/cancel")
        async def cancel_job(request: Request, job_id: str) -> Response:
            return await self.cancel(request, job_id)


class _Bad(jobs.JobSpecError):
    """A bad job body; `field` is the full parameter path (`requests[2].prompt`)."""


def _broker_error(e: Exception) -> bool:
    from kombu.exceptions import OperationalError

    return isinstance(e, OperationalError | ConnectionError | OSError)
