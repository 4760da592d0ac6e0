"""The edge of the HTTP gateway: the typed API error every endpoint answers with (4xx/5xx JSON in OpenAI's error
shape, with a message that says what to change), and the request steps the OpenAI endpoints (`http.py`) and the
jobs API (`jobs_api.py`) share. Both modules import this one, never each other."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from redis.exceptions import NoPermissionError, RedisError

from pipeline.config import RackflowConfig
from pipeline.errors import RackflowError
from pipeline.openai_format import error_body, error_type
from workers.gateway.auth import Authenticator, AuthError, Principal
from workers.stores.ingress import Gateway, RequestRejected


class ApiError(RackflowError):
    """An answer other than success; `code` is machine-readable and also the `reason` label of the rejected count."""

    def __init__(
        self, status: int, message: str, code: str, param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, error_type(self.status), self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _from_rejected(e: RequestRejected) -> ApiError:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else None
    return ApiError(e.status, str(e), e.code, e.param, headers)


def _from_auth(e: AuthError) -> ApiError:
    headers = None
    if e.status == 401:
        challenge = 'Bearer realm="rackflow"'
        if e.code != "missing_token":
            challenge += ', error="invalid_token"'
        headers = {"WWW-Authenticate": challenge}
    return ApiError(e.status, str(e), e.code, None, headers)


def _store_down(e: RedisError, retry_after_s: int = 1) -> ApiError:
    if isinstance(e, NoPermissionError):  # a misconfigured ACL, not an outage: the gateway log names the grant
        return ApiError(503, "the gateway's stream-store user lacks a permission it needs (the gateway log names "
                        "it); retry after an operator fixes the ACL", "store_forbidden",
                        headers={"Retry-After": str(retry_after_s)})
    return ApiError(503, f"the gateway cannot reach its stream store; retry later ({type(e).__name__})",
                    "store_unavailable", headers={"Retry-After": str(retry_after_s)})


class Edge:
    """The steps every endpoint shares, the OpenAI ones and the jobs API alike: who is calling (auth), the body
    within its size limit, the model it may use, and the ingress (`Gateway`) it submits to once started."""

    def __init__(self, config: RackflowConfig, authn: Authenticator) -> None:
        self.config = config
        self.authn = authn
        self._gateway: Gateway | None = None

    @property
    def gateway(self) -> Gateway:
        if self._gateway is None:
            raise RuntimeError("the gateway is not started (lifespan not run)")
        return self._gateway

    def attach(self, gateway: Gateway | None) -> None:
        self._gateway = gateway

    # -- common steps ------------------------------------------------------------------------------------------
    def principal(self, request: Request) -> Principal:
        try:
            return self.authn.verify(request.headers.get("authorization"))
        except AuthError as e:
            raise _from_auth(e) from None

    async def read_body(self, request: Request) -> bytes:
        """The raw body, refused with 413 as soon as more than gateway.max_body_bytes arrived (whatever the
        Content-Length said: chunked bodies have none)."""
        limit = self.config.gateway.max_body_bytes
        too_big = ApiError(413, f"request body is larger than {limit} bytes (gateway.max_body_bytes)",
                           "body_too_large")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def check_content_type(self, request: Request) -> None:
        """Refuse (415) a body sent as anything but JSON: `application/json` or a `+json` type, any parameters
        (charset) aside. A missing or empty Content-Type is read as JSON: OpenAI's SDKs always send
        `application/json`, and clients that send none (Python's `requests` with `data=`, httpx with `content=`,
        http.client) mean JSON too; the body is still validated as JSON either way. A type that says the body is
        something else is never guessed at: `text/plain`, multipart, and `application/x-www-form-urlencoded`, which
        is what `curl -d` sends unless told otherwise (the message says how)."""
        raw = request.headers.get("content-type", "")
        media = raw.split(";", 1)[0].strip().lower()
        if not media or media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
            return
        shown = raw if len(raw) <= 80 else raw[:80] + "..."
        raise ApiError(
            415, f"unsupported Content-Type {shown!r}: the body must be JSON; send `Content-Type: application/json` "
            "(curl: -H 'Content-Type: application/json')", "unsupported_media_type", "Content-Type",
        )

    def check_content_length(self, request: Request) -> None:
        cl = request.headers.get("content-length")
        if cl is None:
            return
        limit = self.config.gateway.max_body_bytes
        try:
            n = int(cl)
        except ValueError:
            raise ApiError(400, "Content-Length is not a number", "invalid_header", "Content-Length") from None
        if n > limit:
            raise ApiError(413, f"request body is larger than {limit} bytes (gateway.max_body_bytes)",
                           "body_too_large")

    def select_model(self, request: Request, body_model: str | None, principal: Principal) -> str:
        model = body_model or request.headers.get("x-model") or principal.default_model
        if not model:
            raise ApiError(
                400, "no model given: set `model` in the body, the X-Model header, or a `model` claim in the token",
                "model_required", "model",
            )
        try:
            principal.require_model(model)
        except AuthError as e:
            raise _from_auth(e) from None
        return model
