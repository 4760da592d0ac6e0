"""Gateway core: profile a request (ARCHITECTURE §2), admit it into `rf:ingress` (or, with `gateway.routing:
inline`, route it and write it to its rack's stream: workers/stores/rack_routing.py), and read its outputs back.

Every front end shares this: the HTTP gateway, the demo's trace replay and Celery jobs. It validates what the
profile needs and never lets a request it cannot serve into the streams; it sheds load (RequestRejected with status
429 and a Retry-After) when the router's backlog is over its bound or when the rack the router would choose for the
request is saturated (rack queue over `gateway.max_rack_queue`, read at most every `saturation_refresh_ms`); it reads a
request's token stream `rf:out:{id}` until the final result. The exact token count comes from the model's
`tokenizer.json` when the file exists locally.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any, TypeVar

import redis.asyncio as aioredis
from prometheus_client import Counter
from redis.exceptions import NoPermissionError

from pipeline.admission import Admission, ShedReason
from pipeline.config import RackflowConfig
from pipeline.errors import RackflowError
from pipeline.events import RequestEvent, ResultEvent, TokenEvent
from pipeline.priority import BATCH
from pipeline.profiling import ProfileInput, profile_request
from pipeline.routing.rack_affinity import RackAffinityRouter
from pipeline.routing.registry import build_router
from pipeline.routing.views import RackView
from streams import codec, keys
from streams.errors import DecodeError
from streams.runner import StreamProducer
from workers.shell import tracing
from workers.shell.runtime import WALL
from workers.stores.cluster_view import ClusterView
from workers.stores.etcd import NodeRegistry
from workers.stores.prefix_feed import PrefixFeed
from workers.stores.rack_routing import InlineRoute
from workers.stores.rate_limit import TokenRateLimiter
from workers.stores.replies import ReplyMux

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def _no_stream_yet(exc: aioredis.ResponseError, key: str, command: str) -> None:
    """An XINFO on a stream that does not exist yet is an error reply we take as "empty"; an ACL denial is not:
    without its queue figures the gateway could not shed load, so it fails loudly (the request gets a 503)."""
    if isinstance(exc, NoPermissionError):
        log.error("the gateway's Redis user may not run %s on %s (%s): give it `+%s` and `%%R~%s` "
                  "(deploy/valkey/users.acl.example, user rf-gateway)", command, key, exc, command,
                  key.split("{", 1)[0] + "*")
        raise exc


def served_models(config: RackflowConfig, allows: Callable[[str], bool] | None = None) -> list[str]:
    """The models some rack of the cluster serves, in config order, that `allows` lets through (a token's models):
    what `GET /v1/models` lists, and what an unknown or unserved model's 404 offers instead."""
    return [m for m in config.models if config.racks_serving(m) and (allows is None or allows(m))]


class RequestRejected(RackflowError, ValueError):
    """The request cannot be admitted; `status` is the HTTP status to answer with, the message says what to change."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        retry_after_s: int | None = None,
        code: str = "invalid_value",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.retry_after_s = retry_after_s
        self.code = code
        """Machine-readable reason (OpenAI-style error code)."""


HISTORY_CACHE_MAX = 100_000
"""Users whose output-length history one gateway keeps between reads."""


class Gateway:
    def __init__(self, config: RackflowConfig, r: aioredis.Redis, registry: NodeRegistry | None = None,
                 replies: ReplyMux | None = None) -> None:
        """`registry`: etcd's node registry, for the racks' health as the router sees it (drained or dead nodes
        do not count); without it a node with a fresh status counts as active. `replies`: the process's reply
        stream reader (the HTTP gateway's); without it each request's outputs are read from its own stream."""
        self.config = config
        self.r = r
        self.replies = replies
        pol = config.policies
        self.view = ClusterView(config, r, registry, stale_ms=pol.node_selection.stale_ms,
                                decode_weight_tokens=pol.router.decode_weight_tokens, raise_on_denied=True)
        self.producer = StreamProducer(r, WALL.now_ms, config.policies.streams.retention_s * 1000)
        self._tokenizers: dict[str, Any] = {}
        self._backlog = (-math.inf, 0)  # (monotonic time read, value)
        self._backlog_lock = asyncio.Lock()
        self._queues: dict[str, int] = {}
        self._batch_queues: dict[str, float] = {}
        """Per rack, of its queue, the batch-class requests (in its batchers, and waiting in its engines)."""
        self._views: dict[str, RackView] = {}
        self._rack_policy: RackAffinityRouter = build_router(config, prefix_aware=False)
        """The router's rack policy, without the prefix index (the router's own input): the gateway predicts the
        rack a request will go to by its user's hash and the same bounded-load walk over the racks' load (running
        + waiting of fresh nodes + the rack's backlog). The simulator predicts it the same way."""
        self.admission = Admission(config.gateway)
        self._queued_since: dict[str, float] = {}
        """Per rack, since when (monotonic s) its queue has been non-empty at every read."""
        self._queues_t = -math.inf
        self._queues_lock = asyncio.Lock()
        self._done: collections.deque[tuple[float, int]] = collections.deque()
        """(monotonic time, rf:results entries-added) samples of the last few seconds: the completion rate."""
        self._history: dict[str, tuple[float, float | None]] = {}
        """Users' output-length EWMAs as last read (monotonic s, value), by key (`user_avg_out`)."""
        self._limiter: TokenRateLimiter | None = None
        self.inline: InlineRoute | None = None
        """The gateway's own route (`gateway.routing: inline`), once `start_routing` ran."""
        self._feed_task: asyncio.Task[None] | None = None
        self._feed_stop = asyncio.Event()

    # -- the gateway's own route -----------------------------------------------------------------------------------
    async def start_routing(self, routed: Counter | None = None) -> None:
        """With `gateway.routing: inline`, route admitted requests here (rack_routing.InlineRoute): the router's
        policy, fed with the nodes' prefix blocks when it weighs them. `routed`: the counter of routed requests by
        rack and affinity (default: the roles' `rackflow_routed_total`)."""
        if self.config.gateway.routing != "inline" or self.inline is not None:
            return
        policy = build_router(self.config)
        feed = None
        if policy.prefix_aware:
            feed = PrefixFeed(self.r, self.config.rack_names(), actor="gateway",
                              retention_ms=self.config.policies.streams.retention_s * 1000)
            self._feed_task = asyncio.create_task(feed.run(self._feed_stop))
        self.inline = InlineRoute(self.config, self.producer, policy, feed, routed)
        log.info("gateway routes requests itself (policy %s%s)", policy.name,
                 ", with the prefix feed" if feed is not None else "")

    async def stop_routing(self) -> None:
        self._feed_stop.set()
        if self._feed_task is not None:
            await asyncio.gather(self._feed_task, return_exceptions=True)
            self._feed_task = None

    # -- tokenizers ----------------------------------------------------------------------------------------------
    def tokenizer(self, model: str) -> Any | None:
        """The model's `tokenizers.Tokenizer` when its tokenizer.json exists locally, else None (estimate)."""
        if model in self._tokenizers:
            return self._tokenizers[model]
        tok = None
        path = self.config.models[model].tokenizer
        if path and Path(path).exists():
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(path)
            log.info("model %s: exact token counts from %s", model, path)
        elif path:
            log.warning("model %s: tokenizer %s not found; estimating token counts", model, path)
        self._tokenizers[model] = tok
        return tok

    # -- admission -----------------------------------------------------------------------------------------------
    def profile(self, inp: ProfileInput, allows: Callable[[str], bool] | None = None) -> RequestEvent:
        """The RequestEvent of a request this cluster can serve, else RequestRejected saying what to change.
        `allows` (the caller's token's models) narrows the models an unknown model's 404 offers to those the caller
        may use: the same list as its `GET /v1/models`."""
        model = self.config.models.get(inp.model)
        if model is None or not self.config.racks_serving(inp.model):
            why = "does not exist" if model is None else "is not served by any rack of this cluster"
            available = ", ".join(served_models(self.config, allows)) or "none"
            raise RequestRejected(f"model {inp.model!r} {why}; available: {available}", 404, "model",
                                  code="model_not_found")
        if inp.max_tokens is not None and inp.max_tokens < 1:
            raise RequestRejected(f"max_tokens must be >= 1, got {inp.max_tokens}", 400, "max_tokens")
        if inp.route_policy and not self._policy_allowed(inp.route_policy):
            ns = self.config.policies.node_selection
            allowed = ", ".join(ns.allowed_overrides) if ns.allow_request_override else "none (disabled)"
            raise RequestRejected(
                f"route policy {inp.route_policy!r} is not allowed; allowed: {allowed}", 400, "X-Route-Policy",
                code="invalid_route_policy",
            )
        if inp.token_ids is None and inp.prompt_tokens is None and inp.prompt:
            tok = self.tokenizer(inp.model)
            if tok is not None:
                inp = _with_ids(inp, tok.encode(inp.prompt, add_special_tokens=False).ids)
        req = profile_request(inp, model, self.config.policies.profiling, self.config.token_rates(inp.model))
        if req.in_tokens + req.max_tokens > model.context:
            given = inp.max_tokens is not None
            room = model.context - req.in_tokens
            if given and req.max_tokens >= model.context:
                # max_tokens alone leaves no room for a prompt: no shorter prompt helps
                param, change = "max_tokens", f"max_tokens alone fills it: lower max_tokens below {model.context}"
            else:
                # the prompt is what does not fit (the HTTP gateway names `messages` for a chat request)
                param = "prompt"
                change = ("shorten the prompt (it alone fills the context)" if room < 1 else
                          f"shorten the prompt or {'lower' if given else 'set'} max_tokens to at most {room}")
            raise RequestRejected(
                f"prompt ({req.in_tokens} tokens) + max_tokens ({req.max_tokens}{'' if given else ', the default'}) "
                f"exceeds the context of {inp.model} ({model.context} tokens); {change}",
                400, param, code="context_length_exceeded",
            )
        return req

    def _policy_allowed(self, name: str) -> bool:
        ns = self.config.policies.node_selection
        return ns.allow_request_override and name in ns.allowed_overrides

    async def user_avg_out(self, tenant: str, user_id: str) -> float | None:
        """The user's output-length EWMA, read at most every `gateway.user_history_cache_s` per user."""
        ttl = self.config.gateway.user_history_cache_s
        key = keys.user_out_ewma(tenant, user_id)
        now = time.monotonic()
        if ttl > 0:
            hit = self._history.get(key)
            if hit is not None and now - hit[0] < ttl:
                return hit[1]
        v = await self.r.get(key)
        avg = float(v) if v is not None else None
        if ttl > 0:
            if len(self._history) >= HISTORY_CACHE_MAX:
                self._history.clear()  # many users, each seen once: forget them all, read again
            self._history[key] = (now, avg)
        return avg

    async def backlog(self, max_age_s: float = 0.1) -> int:
        """Requests waiting for the router: rf:ingress lag + pending of the router group (cached briefly; the
        requests admitted while it is read share one read, not one each)."""
        t, v = self._backlog
        if time.monotonic() - t < max_age_s:
            return v
        async with self._backlog_lock:
            t, v = self._backlog
            if time.monotonic() - t < max_age_s:
                return v
            return await self._read_backlog()

    async def _read_backlog(self) -> int:
        now = time.monotonic()
        try:
            groups = await self.r.xinfo_groups(keys.INGRESS)
        except aioredis.ResponseError as e:
            _no_stream_yet(e, keys.INGRESS, "xinfo|groups")
            groups = []
        value = 0
        found = False
        for g in groups:
            name = g.get("name")
            if name in (keys.GROUP_ROUTER, keys.GROUP_ROUTER.encode()):
                lag = g.get("lag")
                value = int(g.get("pending") or 0) + (int(lag) if lag is not None else 0)
                found = True
        if not found:
            value = int(await self.r.xlen(keys.INGRESS))
        self._backlog = (now, value)
        return value

    async def rack_queues(self) -> tuple[dict[str, int], dict[str, RackView]]:
        """Requests queued per rack: its batcher group's lag + pending on `rf:rack:{R}:req` (waiting for a window or
        for memory) plus the requests waiting in the engines of its nodes (from their fresh status); and the rack
        views the router balances on. Read at most every `gateway.saturation_refresh_ms`; concurrent callers share
        one read. RedisError when the store is down."""
        refresh_s = self.config.gateway.saturation_refresh_ms / 1000.0
        if time.monotonic() - self._queues_t < refresh_s:
            return self._queues, self._views
        async with self._queues_lock:
            if time.monotonic() - self._queues_t < refresh_s:
                return self._queues, self._views
            self._queues, self._views = await self._read_queues()
            self._queues_t = time.monotonic()
        return self._queues, self._views

    async def _read_queues(self) -> tuple[dict[str, int], dict[str, RackView]]:
        """The racks as the router sees them (ClusterView: ONE definition of a healthy rack, an active node),
        and per rack the requests queued: its batchers' backlog plus what waits in its active nodes' engines."""
        try:
            await self.view.refresh(with_backlog=True)
        except NoPermissionError as e:
            _no_stream_yet(e, keys.rack_requests("*"), "xinfo|groups")
            raise
        now_ms = WALL.now_ms()
        views = self.view.rack_views(now_ms)
        queues: dict[str, int] = {}
        for rk in self.config.rack_names():
            active = [n for n in self.view.node_views(now_ms, rk) if n.active]
            queues[rk] = self.view.rack_backlog.get(rk, 0) + sum(n.waiting for n in active)
            # batch sequences waiting in an engine are at most its batch sequences (some of them run)
            self._batch_queues[rk] = (self.view.rack_batch_backlog.get(rk, 0.0)
                                      + sum(min(n.waiting, n.batch_seqs) for n in active))
        try:
            info = await self.r.xinfo_stream(keys.RESULTS)
            added = info.get("entries-added")
        except aioredis.ResponseError as e:
            _no_stream_yet(e, keys.RESULTS, "xinfo|stream")
            added = 0
        if added is not None:
            t = time.monotonic()
            self._done.append((t, int(added)))
            while len(self._done) > 2 and t - self._done[0][0] > 3.0:
                self._done.popleft()
        t = time.monotonic()
        for rk, q in queues.items():
            if q <= 0:
                self._queued_since.pop(rk, None)
            else:
                self._queued_since.setdefault(rk, t)
        return queues, views

    def completion_rate(self) -> float | None:
        """Final results per second over the last ~3 s (None before two reads)."""
        if len(self._done) < 2:
            return None
        (t0, a0), (t1, a1) = self._done[0], self._done[-1]
        return (a1 - a0) / (t1 - t0) if t1 > t0 else None

    def rack_rate(self, racks: int = 1) -> float | None:
        """The recent completion rate of `racks` of the cluster's racks (their share of the cluster's rate)."""
        rate = self.completion_rate()
        return None if rate is None else rate * racks / max(1, len(self.config.rack_names()))

    def retry_after(self, queued: int, racks: int) -> int:
        """Seconds until the queue ahead (`queued` requests in `racks` of the cluster's racks) drains at the recent
        completion rate (the cluster's rate, this share of racks), within [retry_after_s, max_retry_after_s]."""
        return self.admission.retry_after(queued, self.rack_rate(racks))

    async def admit(self, inp: ProfileInput, allows: Callable[[str], bool] | None = None,
                    tpm_limit: int | None = None) -> RequestEvent:
        """Profile, check the backlog bound, append to rf:ingress; RequestRejected (4xx) on bad input or overload
        (`allows`: as for `profile`; `tpm_limit`: the tenant's tokens per minute for an interactive request,
        workers/stores/rate_limit.py). With tracing on, the admission is the root span of the request's trace
        (`gateway.admit`)."""
        if tracing.TRACER is None:
            return await self._admit(inp, None, allows, tpm_limit)
        with tracing.root_span("gateway.admit") as span:
            return await self._admit(inp, span, allows, tpm_limit)

    async def _charge_tokens(self, req: RequestEvent, limit: int) -> None:
        """Charge an interactive request to its tenant's tokens-per-minute limit, or refuse it (429 until the
        minute ends; 400 when it alone is over the limit)."""
        tokens = req.in_tokens + req.out_tokens
        if tokens > limit:
            raise RequestRejected(
                f"this request needs about {tokens} tokens (prompt {req.in_tokens} + expected output "
                f"{req.out_tokens}), more than tenant {req.tenant!r}'s limit of {limit} tokens per minute; lower "
                "max_tokens or shorten the prompt", 400, "max_tokens", code="request_too_large")
        if self._limiter is None:
            self._limiter = TokenRateLimiter(self.r)
        ok, used, left = await self._limiter.charge(req.tenant, tokens, limit, time.time())
        if not ok:
            raise RequestRejected(
                f"tenant {req.tenant!r} is over its rate limit: {used} of {limit} tokens per minute used, this "
                f"request needs {tokens}; retry in {left} s", 429, None, left, code="rate_limit_exceeded")

    async def _admit(self, inp: ProfileInput, span: Any, allows: Callable[[str], bool] | None,
                     tpm_limit: int | None = None) -> RequestEvent:
        if inp.user_avg_out is None:  # a max_tokens is only a cap: the user's history is the better guess under it
            avg = await self.user_avg_out(inp.tenant, inp.user_id)
            if avg is not None:
                inp = _replace(inp, user_avg_out=avg)
        req = self.profile(inp, allows)
        if span is not None:
            req = tracing.stamp(span, req)
        bound = self.config.gateway.max_ingress_backlog
        if await self.backlog() >= bound:
            raise RequestRejected(
                f"the cluster is overloaded ({bound} requests already waiting for routing); retry later",
                429, None, self.config.gateway.retry_after_s, code="overloaded",
            )
        queues, views = await self.rack_queues()
        rack = self._rack_policy.route(req.user_id, req.model, views).rack if views else None
        if rack is not None:
            since = self._queued_since.get(rack)
            per = self.view.rack_tenants.get(rack) if self.config.policies.batcher.fair_share else None
            verdict = self.admission.decide(queues.get(rack, 0), self.rack_rate(1),
                                            time.monotonic() - since if since is not None else 0.0,
                                            self._batch_queues.get(rack, 0.0), req.priority,
                                            per.get(req.tenant, 0) if per is not None else None,
                                            len(per) + (req.tenant not in per) if per is not None else 1)
            if not verdict.admit:
                # the router would queue it behind a full rack (its bounded-load walk found no rack with room)
                gw = self.config.gateway
                why = (f"{queues[rack]} requests queued, bound {gw.max_rack_queue}"
                       if verdict.reason is ShedReason.RACK_QUEUE else
                       f"{queues[rack]} requests queued, about {verdict.wait_s or 0:.0f} s of work, bound "
                       f"{gw.max_queue_s:g} s")
                raise RequestRejected(f"rack {rack} is saturated ({why}); retry later", 429, None,
                                      verdict.retry_after_s, code="overloaded")
        if tpm_limit and req.priority < BATCH:
            await self._charge_tokens(req, tpm_limit)
        if self.replies is None or not self.replies.ready:
            await self._enter(req, views)
            return req
        # open it on the reply stream first: nothing written for it can arrive before its reader exists
        req = _replace(req, reply_to=self.replies.key)
        self.replies.subscribe(req.request_id)
        try:
            await self._enter(req, views)
        except BaseException:
            self.replies.unsubscribe(req.request_id)
            raise
        return req

    async def _enter(self, req: RequestEvent, views: dict[str, RackView]) -> None:
        """Into the streams: straight to its rack when this gateway routes and a rack is healthy, else rf:ingress."""
        if self.inline is not None and await self.inline.submit(req, views):
            return
        await self.producer.add(keys.INGRESS, req)

    async def submit(self, inp: ProfileInput) -> RequestEvent:
        req = self.profile(inp)
        if tracing.TRACER is not None:
            with tracing.root_span("gateway.admit") as span:
                req = tracing.stamp(span, req)
        await self.producer.add(keys.INGRESS, req)
        return req

    async def submit_many(self, inputs: Sequence[ProfileInput]) -> list[RequestEvent]:
        reqs = [self.profile(i) for i in inputs]
        if tracing.TRACER is not None:
            for k, req in enumerate(reqs):
                with tracing.root_span("gateway.admit") as span:
                    reqs[k] = tracing.stamp(span, req)
        await self.producer.add_many((keys.INGRESS, r) for r in reqs)
        return reqs

    # -- outputs -------------------------------------------------------------------------------------------------
    async def outputs(
        self, request_id: str, timeout_s: float | None = None, block_ms: int = 1000
    ) -> AsyncGenerator[TokenEvent | ResultEvent, None]:
        """Token chunks of a request as they are generated, then its final ResultEvent. Raises TimeoutError when
        nothing final arrives within `timeout_s` (default: gateway.request_timeout_s). A request admitted here
        with a reply stream is read from it (no connection held); any other from its own stream (one blocking
        XREAD at a time)."""
        if self.replies is not None and self.replies.subscribed(request_id):
            limit = timeout_s if timeout_s is not None else self.config.gateway.request_timeout_s
            async with aclosing(self.replies.outputs(request_id, limit)) as events:
                async for ev in events:
                    yield ev
            return
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.config.gateway.request_timeout_s)
        stream = keys.request_out(request_id)
        last = "0-0"
        next_index = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no final result for request {request_id} in time")
            resp = await self.r.xread({stream: last}, count=256, block=int(min(block_ms, remaining * 1000) or 1))
            for _s, entries in resp or []:
                for eid, fields in entries:
                    last = eid.decode() if isinstance(eid, bytes) else eid
                    try:
                        ev = codec.decode(fields)
                    except DecodeError as e:
                        log.warning("request %s: undecodable output entry %s: %s", request_id, last, e)
                        continue
                    if isinstance(ev, ResultEvent):
                        yield ev
                        return
                    if isinstance(ev, TokenEvent):
                        # a retried sequence may resend tokens the client already has: skip them
                        if ev.index + len(ev.token_ids) <= next_index:
                            continue
                        if ev.index < next_index:
                            cut = next_index - ev.index
                            ev = TokenEvent(ev.request_id, ev.version, next_index, ev.token_ids[cut:],
                                            ev.texts[cut:], ev.ts_ms, ev.node)
                        next_index = ev.index + len(ev.token_ids)
                        yield ev

    async def result(self, request_id: str) -> ResultEvent | None:
        """The final result of a request if its output stream still holds it (within the output TTL)."""
        entries = await self.r.xrevrange(keys.request_out(request_id), count=8)
        for _eid, fields in entries:
            try:
                ev = codec.decode(fields)
            except DecodeError:
                continue
            if isinstance(ev, ResultEvent):
                return ev
        return None


def _replace(obj: _T, **kw: Any) -> _T:
    return dataclasses.replace(obj, **kw)  # type: ignore[type-var]


def _with_ids(inp: ProfileInput, ids: Sequence[int]) -> ProfileInput:
    return _replace(inp, token_ids=list(ids))
