"""The OpenAI-compatible HTTP gateway: FastAPI app + uvicorn in front of the gateway core (`workers.stores.ingress`).

One concern in one file (over 500 lines on purpose): the endpoints of the OpenAI API and their answers. The steps
they share with the jobs API (auth, body, model, the typed error) are `edge.py`; the ingress is `stores/ingress.py`.

Owns the HTTP edge of the request path (ARCHITECTURE §1): bearer-token auth and per-model authorization, body
limits and validation, model selection (body `model`, else `X-Model`, else the token's `model` claim), the per-request
node policy (`X-Route-Policy`), admission through `Gateway.admit`, and the answers: JSON, or Server-Sent Events
relayed from the request's own token stream as the chunks arrive. Also `/v1/models`, `/v1/results/{id}`, `/healthz`
and `/metrics` (Prometheus, one registry per app).

Rules it keeps:
- every error is an OpenAI-style JSON body `{"error": {message, type, param, code}}` with the right status, never a
  traceback; a rejected request never reaches `rf:ingress`;
- a request that got a 2xx always ends with its final result or an error (SSE error event, or 502/503/504 JSON);
- a tenant only ever reads its own requests: the token stream of the request it sent in the same HTTP call, and
  `/v1/results/{id}` only when the result's tenant is the caller's tenant (404 otherwise, never the content).
It must never decide routing or batching, never read another request's stream, and never log prompts or tokens.
`/healthz` and `/metrics` answer without a token: expose them on the private network only.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import socket
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.config import RackflowConfig
from pipeline.events import REQUEST_ID, RequestEvent, ResultEvent, TokenEvent
from pipeline.openai_format import (
    ChatCompletionRequest,
    CompletionRequest,
    FinalChoice,
    RequestFormatError,
    chat_chunk,
    chat_logprobs,
    completion_chunk,
    completion_logprobs,
    final_body,
    generation_fields,
    parse_request,
    parse_tool_calls,
    rejected_param,
    result_error,
    tool_finish,
    usage,
)
from pipeline.openai_format import finish_reason as final_finish_reason
from pipeline.priority import BATCH, HEADER, INTERACTIVE, PriorityError, class_of, parse_class
from pipeline.profiling import ProfileInput
from pipeline.sampling import LogprobEntry, SamplingRefused, check_engine, decode_logprobs, tool_mode
from pipeline.sampling import decode as decode_sampling
from pipeline.sampling import encode as encode_sampling
from streams.runner import connect, is_cluster_url, retrying_connection_kwargs
from workers.gateway.auth import Authenticator, Principal
from workers.gateway.edge import ApiError, Edge, _from_rejected, _store_down
from workers.shell.runtime import WALL, bind_log_context
from workers.stores.etcd import NodeRegistry
from workers.stores.ingress import Gateway, RequestRejected, served_models
from workers.stores.replies import ReplyMux

log = logging.getLogger(__name__)

TIER_CLASS = {"flex": BATCH, "priority": INTERACTIVE}
"""OpenAI's `service_tier` as a priority class (`auto`, `default`: none of its own)."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# An open request holds no connection (one reader serves them all: workers/stores/replies.py); admissions and reads
# take one from the pool (gateway.redis_max_connections) for a round trip, and wait for one (then fail with 503)
# instead of opening connections without limit.
REDIS_POOL_WAIT_S = 5.0
HEALTH_TIMEOUT_S = 2.0

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _from_result(result: ResultEvent) -> ApiError:
    return ApiError(*result_error(result))


def _wants_logprobs(req: RequestEvent) -> bool:
    """Whether the client asked for log probabilities (the engine was checked for them at admission)."""
    return bool(req.sampling) and decode_sampling(req.sampling).logprobs is not None


def _timeout(request_id: str, timeout_s: float) -> ApiError:
    return ApiError(
        504,
        f"no result for request {request_id} within {timeout_s:g}s; it may still finish: GET /v1/results/{request_id}",
        "timeout",
    )


# -- metrics -----------------------------------------------------------------------------------------------------------
class GatewayMetrics:
    """The gateway's Prometheus series, in a registry of their own (one per app, so tests and apps never share)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("rackflow_gateway_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "code"], registry=r)
        self.latency = Histogram(
            "rackflow_gateway_request_seconds", "Time from request to the end of the response (streams included)",
            ["endpoint"], registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.ttft = Histogram(
            "rackflow_gateway_time_to_first_token_seconds", "Time from admission to the first generated token",
            ["model"], registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.tokens = Counter("rackflow_gateway_tokens_streamed", "Generated tokens relayed to clients", ["model"],
                              registry=r)
        self.in_flight = Gauge("rackflow_gateway_in_flight_requests",
                               "Admitted requests still waiting for their final result", registry=r)
        self.results = Counter("rackflow_gateway_results", "Final outcome of admitted requests, by model and status "
                               "(ok, error, cancelled, timeout)", ["model", "status"], registry=r)
        self.completion = Histogram(
            "rackflow_gateway_completion_seconds", "Admission to the final result of a completion, by model",
            ["model"], registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600),
        )
        self.rejected = Counter("rackflow_gateway_rejected", "Requests answered with an error, by reason",
                                ["reason"], registry=r)
        self.routed = Counter("rackflow_routed_total", "Requests this gateway routed itself (gateway.routing: "
                              "inline), by rack and whether they kept their affinity rack", ["rack", "affinity"],
                              registry=r)

    def watch_replies(self, mux: ReplyMux) -> None:
        """The reply stream reader's state, read at each scrape: open requests, events buffered for them (memory per
        open request is bounded by `gateway.reply_queue_events`), and the fallbacks taken."""
        r = self.registry
        stats = mux.stats
        for name, doc, fn in (
            ("open_requests", "Requests open on this gateway's reply stream", lambda: mux.open_requests),
            ("queued_events", "Events buffered in the gateway for open requests (bounded per request)",
             mux.queued_events),
            ("queue_max_events", "Largest per-request buffer seen", lambda: stats.queue_max),
            ("dropped_events", "Events not buffered because a slow client's buffer was full (it caught up from its "
             "request stream)", lambda: stats.dropped),
            ("catch_ups", "Reads of a request's own stream to fill a gap or find a missed result",
             lambda: stats.catch_ups),
            ("read_errors", "Failed reads of the reply stream (retried)", lambda: stats.read_errors),
        ):
            Gauge(f"rackflow_gateway_reply_{name}", doc, registry=r).set_function(fn)


class _MetricsMiddleware:
    """Counts every HTTP answer by route template and status, times it to its last byte, and turns an unexpected
    exception into a logged 500 JSON answer (never a traceback to the client)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status = int(message["status"])
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            log.exception("unexpected error answering %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # the client sees a cut response, which is the truth
            self.metrics.rejected.labels("internal_error").inc()
            resp = ApiError(500, "internal error in the gateway; it has been logged", "internal_error").response()
            await resp(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)


@dataclass(frozen=True)
class _HotRoute:
    path: str
    """The route template the metrics label an answer with (as FastAPI's route object carries it)."""


class _HotPath:
    """The two generation endpoints, answered straight from the ASGI call: `POST /v1/completions` and `POST
    /v1/chat/completions` go to their handler without FastAPI's application, middleware (server errors, telemetry,
    body limit: the gateway bounds bodies itself, `gateway.max_body_bytes`), router, exception and exit-stack
    layers; everything else goes to the FastAPI app. The handler reads and validates its body itself, so the answers
    are the same: an `ApiError` becomes its 4xx/5xx JSON here, as the app's handler makes it, and anything else
    reaches `_MetricsMiddleware` outside (a logged 500). Measured with a zero-time shim (docs/GUIDE.md, Benchmarks): a
    bare ASGI callable costs 177 µs of server CPU per request on uvicorn, FastAPI 286 µs."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], api: _Api,
                 metrics: GatewayMetrics) -> None:
        self.app = app
        self.api = api
        self.metrics = metrics
        self.kinds = {"/v1/completions": ("completion", _HotRoute("/v1/completions")),
                      "/v1/chat/completions": ("chat", _HotRoute("/v1/chat/completions"))}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hot = self.kinds.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if hot is None:
            await self.app(scope, receive, send)
            return
        kind, route = hot
        scope["route"] = route
        scope["app"] = self.app  # as FastAPI would set it (Request.app)
        try:
            response = await self.api.generate(Request(scope, receive), kind)
        except ApiError as exc:
            self.metrics.rejected.labels(exc.code).inc()
            response = exc.response()
        await response(scope, receive, send)


class _EventStreamResponse(StreamingResponse):
    """SSE response that always watches for the client going away and then cancels the stream at once (the body
    iterator's cleanup runs), whatever ASGI spec version the server reports."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(self._wait_for_disconnect(receive))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, watcher):
                if not t.done():
                    t.cancel()
            await asyncio.gather(task, watcher, return_exceptions=True)
            # cancelled while sending, the body generator sits at a `yield`: close it now, not when collected
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
        exc = None if task.cancelled() else task.exception()
        if exc is not None and not isinstance(exc, OSError):  # a write to a closed connection is a disconnect
            raise exc

    @staticmethod
    async def _wait_for_disconnect(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


@dataclass
class _Admitted:
    req: RequestEvent
    principal: Principal
    created: int
    t0: float
    stream: bool
    include_usage: bool
    choices: tuple[RequestEvent, ...] = ()
    """The n sequences of the request (`n`), `req` the first."""


# -- the app -----------------------------------------------------------------------------------------------------------
class _Api(Edge):
    """The endpoints' logic, bound to one config, authenticator, metrics registry and (after start-up) Redis."""

    def __init__(self, config: RackflowConfig, authn: Authenticator, metrics: GatewayMetrics, engine: str) -> None:
        super().__init__(config, authn)
        self.metrics = metrics
        self.engine = engine
        """The workers' engine: which sampling parameters are honoured (pipeline.sampling.ENGINE_PARAMS)."""
        self.started_s = int(time.time())

    async def admit(self, request: Request, kind: str) -> _Admitted:
        self.check_content_length(request)
        principal = self.principal(request)
        self.check_content_type(request)
        raw = await self.read_body(request)
        body: CompletionRequest | ChatCompletionRequest
        try:
            body = parse_request(kind, raw)
        except RequestFormatError as e:
            raise ApiError(400, str(e), e.code, e.param) from None
        max_n = self.config.gateway.max_n
        n = body.n or 1
        if n > max_n:
            raise ApiError(400, f"n={n} is not supported: at most {max_n} completions per request "
                           "(gateway.max_n)", "invalid_value", "n")
        model = self.select_model(request, body.model, principal)
        fields = generation_fields(body)
        sampling, prompt, max_tokens = fields.sampling, fields.prompt, fields.max_tokens
        try:
            check_engine(sampling, self.engine)
        except SamplingRefused as e:
            raise ApiError(400, str(e), "unsupported_parameter", e.param) from None
        user_id = principal.sub if self.authn.enabled else (body.user or principal.sub)
        route_policy = request.headers.get("x-route-policy", "").strip()
        priority, tpm = self.class_and_limit(request, principal, TIER_CLASS.get(body.service_tier or ""))
        t0 = time.perf_counter()
        reqs: list[RequestEvent] = []
        for i in range(n):
            # n choices are n sequences, each routed and batched as its own request (the later ones find the
            # prompt's prefix cached); with a seed, choice i draws with seed + i, so the choices differ
            own = sampling if i == 0 or sampling.seed is None else replace(sampling, seed=sampling.seed + i)
            inp = ProfileInput(
                request_id=str(uuid.uuid4()),
                tenant=principal.tenant,
                user_id=user_id,
                model=model,
                arrival_ms=WALL.now_ms(),
                prompt=prompt,
                max_tokens=max_tokens,
                route_policy=route_policy,
                sampling=encode_sampling(own),
                priority=priority,
            )
            if i == 0:
                bind_log_context(request_id=inp.request_id)  # this request's task: every line it logs carries the id
            try:
                reqs.append(await self.gateway.admit(inp, principal.allows, tpm))
            except RequestRejected as e:
                e.param, message = rejected_param(body, e.param, str(e))
                e.args = (message,)
                if reqs:
                    log.warning("request %s: choice %d of %d refused (%s); the %d admitted run to their end",
                                reqs[0].request_id, i, n, e, len(reqs))
                raise _from_rejected(e) from None
            except RedisError as e:
                log.warning("request %s: cannot admit, stream store error: %s", inp.request_id, e)
                raise _store_down(e, self.config.gateway.retry_after_s) from None
        req = reqs[0]
        log.debug("request %s admitted: tenant %s model %s in %d max %d n %d", req.request_id, req.tenant, req.model,
                  req.in_tokens, req.max_tokens, n)
        return _Admitted(req, principal, int(time.time()), t0, body.streaming, body.include_usage, tuple(reqs))

    def class_and_limit(self, request: Request, principal: Principal,
                        tier: int | None = None) -> tuple[int, int | None]:
        """The request's priority class (pipeline/priority.py: the `X-Priority` header, else its `service_tier`
        (`tier`), else the tenant's configured class, else interactive; a token's `priority` claim is a ceiling)
        and its tenant's tokens-per-minute limit (the token's `tpm` claim, else `gateway.tenants.{tenant}.tpm`)."""
        header = request.headers.get(HEADER.lower(), "").strip()
        try:
            requested = parse_class(header, HEADER) if header else tier
        except PriorityError as e:
            raise ApiError(400, str(e), "invalid_value", HEADER) from None
        tenant = self.config.gateway.tenants.get(principal.tenant)
        default = parse_class(tenant.priority) if tenant is not None and tenant.priority else None
        tpm = principal.tpm or (tenant.tpm if tenant is not None else None)
        return class_of(requested, default, principal.priority), tpm

    def outputs(self, request_id: str) -> AsyncGenerator[TokenEvent | ResultEvent, None]:
        """The request's own output stream (Gateway.outputs is an async generator: closed when we stop early)."""
        return self.gateway.outputs(request_id)

    async def _merged(self, adm: _Admitted) -> AsyncGenerator[tuple[int, TokenEvent | ResultEvent], None]:
        """(choice index, event) of every choice's output stream as they arrive; one choice: its stream alone."""
        if len(adm.choices) == 1:
            async with aclosing(self.outputs(adm.req.request_id)) as events:
                async for ev in events:
                    yield 0, ev
            return
        queue: asyncio.Queue[tuple[int, TokenEvent | ResultEvent | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, rid: str) -> None:
            try:
                async with aclosing(self.outputs(rid)) as events:
                    async for ev in events:
                        queue.put_nowait((i, ev))
            except Exception as e:  # handed to the reader, which raises it
                queue.put_nowait((i, e))
                return
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, r.request_id)) for i, r in enumerate(adm.choices)]
        try:
            left = len(tasks)
            while left:
                i, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def finish_reason(self, req: RequestEvent, result: ResultEvent) -> str:
        """OpenAI's finish_reason of one choice (`pipeline.openai_format.finish_reason`)."""
        return final_finish_reason(result, req.max_tokens)

    # -- generation --------------------------------------------------------------------------------------------
    async def generate(self, request: Request, kind: str) -> Response:
        adm = await self.admit(request, kind)
        if adm.stream:
            return _EventStreamResponse(self.sse(adm, kind), headers=_SSE_HEADERS)
        return await self.collect(adm, kind)

    def _finished(self, adm: _Admitted, status: str) -> None:
        self.metrics.results.labels(adm.req.model, status).inc()
        if status == "ok":
            self.metrics.completion.labels(adm.req.model).observe(time.perf_counter() - adm.t0)

    def _on_tokens(self, adm: _Admitted, ev: TokenEvent, first: bool) -> None:
        if first:
            self.metrics.ttft.labels(adm.req.model).observe(time.perf_counter() - adm.t0)
        self.metrics.tokens.labels(adm.req.model).inc(len(ev.token_ids))

    async def collect(self, adm: _Admitted, kind: str) -> JSONResponse:
        req = adm.req
        n = len(adm.choices)
        texts: list[list[str]] = [[] for _ in range(n)]
        lps: list[list[LogprobEntry]] | None = [[] for _ in range(n)] if _wants_logprobs(req) else None
        results: list[ResultEvent | None] = [None] * n
        self.metrics.in_flight.inc()
        try:
            async with aclosing(self._merged(adm)) as merged:
                async for i, ev in merged:
                    if isinstance(ev, TokenEvent):
                        self._on_tokens(adm, ev, not any(texts))
                        texts[i].append(ev.text)
                        if lps is not None:
                            lps[i] += decode_logprobs(ev.logprobs)
                        continue
                    results[i] = ev
                    self._finished(adm, ev.status)
                    if ev.status != "ok":
                        log.info("request %s failed: %s", ev.request_id, ev.error)
                        raise _from_result(ev)
        except TimeoutError:
            log.warning("request %s: no final result within %.0fs", req.request_id,
                        self.config.gateway.request_timeout_s)
            self._finished(adm, "timeout")
            raise _timeout(req.request_id, self.config.gateway.request_timeout_s) from None
        except RedisError as e:
            log.warning("request %s: stream store error while waiting: %s", req.request_id, e)
            raise _store_down(e) from None
        finally:
            self.metrics.in_flight.dec()
        done = [r for r in results if r is not None]
        assert len(done) == n  # outputs() ends with the result or raises
        fmt_lp = chat_logprobs if kind == "chat" else completion_logprobs
        sampling = decode_sampling(req.sampling) if kind == "chat" and req.sampling else None
        choices = [FinalChoice(adm.choices[i].request_id, done[i].text or "".join(texts[i]),
                               self.finish_reason(adm.choices[i], done[i]),
                               fmt_lp(lps[i]) if lps is not None else None) for i in range(n)]
        return JSONResponse(final_body(kind, req.request_id, req.model, adm.created, choices, sampling,
                                       done[0].in_tokens, sum(r.out_tokens for r in done)))

    async def sse(self, adm: _Admitted, kind: str) -> AsyncIterator[str]:
        """SSE body: a chunk per TokenEvent as it arrives (each with its choice's index), a finish chunk per choice,
        optional usage, `[DONE]`; errors after admission become an error event followed by `[DONE]`, so the client
        always learns how its request ended."""
        req = adm.req
        rid, model, created = req.request_id, req.model, adm.created
        n = len(adm.choices)

        want_lp = _wants_logprobs(req)
        sampling = decode_sampling(req.sampling) if kind == "chat" and req.sampling else None
        tooling = sampling is not None and tool_mode(sampling) != "none"
        # with tools, each choice's text is held to its end: whether it is a tool call is known from the whole
        held: list[list[str]] = [[] for _ in range(n)]
        # per choice, the text streamed so far (a completion's logprobs.text_offset counts from it)
        offsets = [0] * n
        timed = False  # the first token of the request has been observed (the TTFT histogram)

        def chunk(i: int, content: Any, finish: str | None = None, usage_: dict[str, int] | None = None,
                  with_choice: bool = True, ev: TokenEvent | None = None) -> dict[str, Any]:
            build = chat_chunk if kind == "chat" else completion_chunk
            lp = None
            if ev is not None and want_lp:
                entries = decode_logprobs(ev.logprobs)
                lp = chat_logprobs(entries) if kind == "chat" else completion_logprobs(entries, offsets[i])
                offsets[i] += sum(len(tok) for _lp, tok, _alts in entries)
            out = build(rid, model, created, content, finish, usage_, with_choice, lp)
            if with_choice and i:
                out["choices"][0]["index"] = i
            return out

        def piece(i: int, text: str, finish: str | None = None, ev: TokenEvent | None = None) -> dict[str, Any]:
            if kind == "chat":
                return chunk(i, {"content": text} if text else {}, finish, ev=ev)
            return chunk(i, text, finish, ev=ev)

        self.metrics.in_flight.inc()
        first = [True] * n
        error: ApiError | None = None
        in_tokens = out_tokens = 0
        try:
            # the first chunk of a choice leaves with its first token, never before (vLLM's server does the same):
            # a client times its TTFT at the first chunk, so an early empty one would show a token that is not there
            try:
                async with aclosing(self._merged(adm)) as merged:
                    async for i, ev in merged:
                        if isinstance(ev, TokenEvent):
                            self._on_tokens(adm, ev, not timed)
                            timed = True
                            if tooling:
                                held[i].append(ev.text)
                                continue
                            if first[i] and kind == "chat":
                                yield _sse(chunk(i, {"role": "assistant", "content": ev.text}, ev=ev))
                            elif ev.text or first[i] or (want_lp and ev.logprobs):
                                yield _sse(piece(i, ev.text, ev=ev))
                            first[i] = False
                            continue
                        self._finished(adm, ev.status)
                        if ev.status != "ok":
                            log.info("request %s failed: %s", ev.request_id, ev.error)
                            error = _from_result(ev)
                            break
                        finish = self.finish_reason(adm.choices[i], ev)
                        if tooling and sampling is not None:
                            # the whole answer at once: its text, or its tool calls (streamed as OpenAI's deltas)
                            text, calls = parse_tool_calls(ev.text or "".join(held[i]), sampling,
                                                           adm.choices[i].request_id)
                            finish = tool_finish(sampling, finish, calls)
                            yield _sse(chunk(i, {"role": "assistant", "content": text}))
                            if calls:
                                yield _sse(chunk(i, {"tool_calls": [
                                    {"index": j, **c} for j, c in enumerate(calls)]}))
                            first[i] = False
                        if first[i] and kind == "chat":  # no token at all: the role still comes before the end
                            yield _sse(chunk(i, {"role": "assistant", "content": ""}))
                        first[i] = False
                        yield _sse(piece(i, "", finish))
                        out_tokens += ev.out_tokens
                        in_tokens = ev.in_tokens
                    else:
                        if adm.include_usage:
                            u = usage(in_tokens, out_tokens)
                            yield _sse(chunk(0, {} if kind == "chat" else "", usage_=u, with_choice=False))
            except TimeoutError:
                log.warning("request %s: no final result within %.0fs (stream)", rid,
                            self.config.gateway.request_timeout_s)
                self._finished(adm, "timeout")
                error = _timeout(rid, self.config.gateway.request_timeout_s)
            except RedisError as e:
                log.warning("request %s: stream store error while streaming: %s", rid, e)
                error = _store_down(e)
            except asyncio.CancelledError:
                log.info("request %s: client went away; stream closed", rid)
                raise
            except Exception:
                log.exception("request %s: unexpected error while streaming", rid)
                error = ApiError(500, "internal error in the gateway; it has been logged", "internal_error")
            if error is not None:
                self.metrics.rejected.labels(error.code).inc()
                yield _sse(error.body())
            yield _SSE_DONE
        finally:
            self.metrics.in_flight.dec()

    # -- reads -------------------------------------------------------------------------------------------------
    def models(self, request: Request) -> JSONResponse:
        principal = self.principal(request)
        data = [
            {"id": name, "object": "model", "created": self.started_s, "owned_by": "rackflow"}
            for name in served_models(self.config, principal.allows)
        ]
        return JSONResponse({"object": "list", "data": data})

    def model(self, request: Request, model_id: str) -> JSONResponse:
        """`GET /v1/models/{id}`: one model the caller may use, else OpenAI's 404 (`model_not_found`)."""
        principal = self.principal(request)
        served = served_models(self.config, principal.allows)
        if model_id not in served:
            raise ApiError(404, f"The model {model_id!r} does not exist or you do not have access to it; available: "
                           f"{', '.join(served) or 'none'}", "model_not_found", "model")
        return JSONResponse({"id": model_id, "object": "model", "created": self.started_s, "owned_by": "rackflow"})

    async def result(self, request: Request, request_id: str) -> JSONResponse:
        principal = self.principal(request)
        rid = request_id.removeprefix("chatcmpl-").removeprefix("cmpl-")
        not_found = ApiError(
            404, f"no result for request {request_id!r} (unknown, not finished yet, expired, or not yours)",
            "result_not_found", "request_id",
        )
        if not REQUEST_ID.match(rid):
            raise not_found
        try:
            res = await self.gateway.result(rid)
        except RedisError as e:
            raise _store_down(e) from None
        if res is None or res.tenant != principal.tenant:
            raise not_found
        return JSONResponse(
            {
                "id": res.request_id,
                "object": "rackflow.result",
                "status": res.status,
                "model": res.model,
                "text": res.text,
                "error": res.error or None,
                "usage": usage(res.in_tokens, res.out_tokens),
                "timings": {
                    "arrival_ms": res.arrival_ms,
                    "first_token_ms": res.first_token_ms,
                    "finish_ms": res.finish_ms,
                },
            }
        )

    async def healthz(self) -> JSONResponse:
        try:
            await asyncio.wait_for(self.gateway.r.ping(), HEALTH_TIMEOUT_S)
        except (RedisError, OSError, TimeoutError) as e:
            return JSONResponse({"status": "unavailable", "reason": f"redis: {type(e).__name__}"}, status_code=503,
                                headers={"Retry-After": str(self.config.gateway.retry_after_s)})
        return JSONResponse({"status": "ok"})


def create_app(config: RackflowConfig, redis_url: str, etcd_url: str | None, no_auth: bool,
               engine: str | None = None) -> GatewayApp:
    """The gateway's ASGI app. Raises AuthSetupError (a ConfigError) at once when auth is on but has no key.

    `etcd_url` is the sequence registry a job cancel finds the node of a running request in (without it, workers
    still abort a cancelled request through its cancellation marker, within a status interval).
    """
    from workers.gateway.batches_api import BatchesApi
    from workers.gateway.files_api import FilesApi
    from workers.gateway.jobs_api import JobsApi

    authn = Authenticator(config.gateway.auth, no_auth)
    metrics = GatewayMetrics()
    api = _Api(config, authn, metrics, engine or config.policies.worker.engine)
    jobs_api = JobsApi(config, api, redis_url, etcd_url)
    files_api = FilesApi(config, api)
    batches_api = BatchesApi(config, api, files_api.store, redis_url, etcd_url)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        pool: aioredis.BlockingConnectionPool | None = None
        if is_cluster_url(redis_url):  # a cluster client keeps a pool per node
            r = connect(redis_url, max_connections=config.gateway.redis_max_connections, socket_connect_timeout=5)
        else:
            # the roles' retry policy (streams.runner.connect): a Valkey restart of a second or two, or a pooled
            # connection it closed, is retried with backoff instead of answering 503
            pool = aioredis.BlockingConnectionPool.from_url(
                redis_url, max_connections=config.gateway.redis_max_connections, timeout=REDIS_POOL_WAIT_S,
                socket_connect_timeout=5, client_name="rackflow-gateway", **retrying_connection_kwargs(redis_url),
            )
            r = aioredis.Redis(connection_pool=pool)
        # the racks' health as the router sees it (etcd's registry and the monitor's verdicts): a drained rack is
        # not one the gateway predicts requests to; without etcd, a node with a fresh status counts as active
        registry = NodeRegistry(etcd_url) if etcd_url else None
        gw = config.gateway
        replies = ReplyMux(r, queue_events=gw.reply_queue_events, sweep_ms=gw.reply_sweep_ms, ttl_s=gw.reply_ttl_s,
                           max_open_s=gw.request_timeout_s + 60)
        await replies.start()
        metrics.watch_replies(replies)
        core = Gateway(config, r, registry, replies)
        await core.start_routing(metrics.routed)
        api.attach(core)
        await jobs_api.start(r)
        await files_api.start()
        await batches_api.start(r)
        log.info("gateway started: redis %s, auth %s", redis_url, "on" if authn.enabled else "OFF")
        try:
            yield
        finally:
            await jobs_api.close()
            batches_api.close()
            api.attach(None)
            await core.stop_routing()
            if registry is not None:
                await registry.close(revoke=False)
            await replies.close()
            await r.aclose()
            if pool is not None:
                await pool.disconnect()
            log.info("gateway stopped; redis connections closed")

    app = FastAPI(title="rackflow gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.api = api
    app.state.metrics = metrics
    app.state.etcd_url = etcd_url

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        metrics.rejected.labels(exc.code).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        path = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        err = ApiError(400, f"invalid request: {path}: {first.get('msg', 'invalid value')}", "invalid_value",
                       path or None)
        metrics.rejected.labels(err.code).inc()
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = ApiError(404, f"no such endpoint: {request.method} {request.url.path}", "unknown_endpoint")
        elif exc.status_code == 405:
            err = ApiError(405, f"method {request.method} is not allowed on {request.url.path}",
                           "method_not_allowed")
        else:
            err = ApiError(exc.status_code, str(exc.detail), "http_error")
        metrics.rejected.labels(err.code).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=dict(exc.headers or {}) | err.headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await api.generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await api.generate(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return api.models(request)

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        return api.model(request, model_id)

    @app.get("/v1/results/{request_id}")
    async def results(request: Request, request_id: str) -> Response:
        return await api.result(request, request_id)

    jobs_api.register(app)  # POST /v1/jobs, GET|DELETE /v1/jobs/{id}, POST /v1/jobs/{id}/cancel
    files_api.register(app)  # POST|GET /v1/files, GET|DELETE /v1/files/{id}, GET /v1/files/{id}/content
    batches_api.register(app)  # POST|GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel

    @app.get("/healthz")
    async def healthz() -> Response:
        return await api.healthz()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return GatewayApp(app, api, metrics)


class GatewayApp:
    """The gateway's ASGI app as the server runs it: the metrics layer (`_MetricsMiddleware`: every answer counted
    and timed, an unexpected exception a logged 500), then the hot path (`_HotPath`: the two generation endpoints),
    then the FastAPI app for every other route and the lifespan. Outermost, the hot path skips FastAPI's own
    middleware stack on every request and every SSE chunk (its server-error and metrics send wrappers)."""

    def __init__(self, app: FastAPI, api: _Api, metrics: GatewayMetrics) -> None:
        self.fastapi = app
        self.state = app.state
        self._asgi = _MetricsMiddleware(_HotPath(app, api, metrics), metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._asgi(scope, receive, send)


class _Server(uvicorn.Server):
    """uvicorn, plus the one `gateway listening on` line once the socket is bound, and exit status 0 after a clean
    shutdown on SIGTERM/SIGINT (uvicorn would re-raise the signal after shutting down)."""

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.started:
            return
        host = self.config.host
        port = self.servers[0].sockets[0].getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        log.info("gateway listening on http://%s:%d", shown, port)
        print(f"gateway listening on http://{shown}:{port}", flush=True)

    def capture_signals(self) -> Any:
        import signal
        from contextlib import contextmanager

        @contextmanager
        def handlers() -> Any:
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        return handlers()


def serve(
    config: RackflowConfig, redis_url: str, etcd_url: str | None, host: str | None, port: int | None, no_auth: bool,
    engine: str | None = None,
) -> int:
    """Run the gateway until SIGTERM/SIGINT; host/port default to gateway.host/gateway.port (port 0: any free).
    The socket is bound before anything else starts: a port in use ends the process at once, exit status 2, with a
    message that names the port and the way out (uvicorn would log the error and then hang in its shutdown)."""
    host = host or config.gateway.host
    port = config.gateway.port if port is None else port
    try:
        sock = listen_socket(host, port, config.gateway.backlog)
    except OSError as e:
        msg = (f"gateway: cannot listen on {host}:{port}: {e.strerror or e}; "
               + ("another process holds the port: pass --port (rackflow up: --gateway-port), or stop that process"
                  if e.errno == errno.EADDRINUSE else "check gateway.host and the port"))
        log.error("%s", msg)
        print(msg, file=sys.stderr, flush=True)
        return 2
    app = create_app(config, redis_url, etcd_url, no_auth, engine)
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan="on",
        server_header=False,
        timeout_keep_alive=config.gateway.keep_alive_s,
        http=config.gateway.http_parser,
        backlog=config.gateway.backlog,
        # open streams get this long to finish (their results stay readable at /v1/results/{id})
        timeout_graceful_shutdown=config.gateway.shutdown_grace_s,
    )
    server = _Server(uv_config)
    server.run(sockets=[sock])
    return 0 if server.started else 1


def listen_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv6 when the host is), SO_REUSEADDR as uvicorn sets it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock
