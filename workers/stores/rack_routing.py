"""The rack choice as the streams see it: shared by the router role and the gateway's own route.

`RackRouting` is what both do for each request once the rack policy (pipeline/routing/rack_affinity.py) has a view
of the racks: weigh where the request's prefix is cached, charge the chosen rack in the view so that the next
request of the same batch sees it, forward the entry to `rf:rack:{R}:req` with the routing fields as an overlay (no
re-encoding of the prompt), and record the batch's choices as one `DecisionEvent` on `rf:decisions`.

`InlineRoute` is the gateway's route (`gateway.routing: inline`, ARCHITECTURE §2). The gateway already holds the
racks' views for its admission check; with them and the router's prefix feed it chooses the rack itself and writes,
in one pipelined round trip:
- the routed request to the rack's stream, where the rack's batchers read it;
- the request as admitted to `rf:admitted`, the record that `rackflow replay` reads (no consumer group reads it);
- the decision to `rf:decisions`.
That removes a hop (rf:ingress, the router's read, decode, write and XACK) from every request. Requests admitted
while a write is in flight wait for it and go together in the next one, so under load a round trip carries many
requests and one decision. A request for which no rack is healthy is handed back to the caller, which queues it on
`rf:ingress`: the router waits for a rack (`no_rack_wait_s`) and answers an error if none comes, as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Mapping

from prometheus_client import Counter

from pipeline.config import RackflowConfig
from pipeline.events import DecisionEvent, RequestEvent
from pipeline.routing.rack_affinity import RackAffinityRouter, RouteDecision, keeps_prefix_cache, rack_cached_tokens
from pipeline.routing.views import RackView
from streams import codec, keys
from streams.runner import StreamProducer
from workers.shell import metrics, tracing
from workers.shell.runtime import WALL
from workers.stores.prefix_feed import PrefixFeed

log = logging.getLogger(__name__)


class RackRouting:
    """One batch's rack choices: `route` each request in turn over `views` (charged as it goes), then
    `decision_event` for the batch."""

    def __init__(self, config: RackflowConfig, policy: RackAffinityRouter, feed: PrefixFeed | None,
                 routed: Counter | None = None) -> None:
        self.config = config
        self.routed = routed if routed is not None else metrics.ROUTED
        """Requests routed, by rack and affinity (`rackflow_routed_total` of the process that routes)."""
        self.policy = policy
        self.feed = feed
        rp = config.policies.router
        self.rule = rp.prefix_cache_rule
        self.decode_weight_tokens = rp.decode_weight_tokens
        self.block_tokens = config.policies.profiling.prefix_block_tokens
        self.node_rack = {n.name: config.rack_of(n.name) for n in config.nodes()}
        self.serving = {m: bool(config.racks_serving(m)) for m in config.models}

    def cached(self, req: RequestEvent) -> dict[str, float] | None:
        """Per rack, the prompt tokens its nodes hold cached (the prefix index), when the policy weighs it."""
        if self.feed is None or not (self.policy.prefix_aware and req.prefix_hashes and req.prefix_cache):
            return None
        return rack_cached_tokens(self.feed.index.matches(req.prefix_hashes), self.node_rack, self.block_tokens,
                                  req.in_tokens)

    def route(self, req: RequestEvent, views: Mapping[str, RackView],
              cached: dict[str, float] | None) -> RouteDecision:
        return self.policy.route(req.user_id, req.model, views, cached)

    def forward(self, fields: Mapping[bytes, bytes], req: RequestEvent, decision: RouteDecision,
                views: dict[str, RackView], now_ms: float, hop: str) -> tuple[dict[bytes, bytes], bool]:
        """The entry for the rack's stream (the request's fields with the routing overlay) and whether the request
        kept its primary rack; charges the rack in `views` with the request's load and work."""
        rack = decision.rack
        assert rack is not None
        v = views[rack]
        views[rack] = dataclasses.replace(v, load=v.load + 1.0,
                                          work=v.work + req.in_tokens + self.decode_weight_tokens)
        kept = rack == decision.primary
        self.routed.labels(rack, "kept" if kept else "walked").inc()
        prefix_cache = keeps_prefix_cache(self.rule.enabled, self.rule.min_tokens, req.in_tokens, decision,
                                          req.prefix_cache)
        changes: dict[str, object] = {"rack": rack, "routed_ms": now_ms}
        if prefix_cache != req.prefix_cache:
            changes["prefix_cache"] = prefix_cache
        if req.trace and tracing.TRACER is not None:  # the next hop's parent is this hop's span
            changes["trace"] = tracing.hop(hop, req, now_ms, rack=rack, affinity="kept" if kept else "walked")
        return codec.with_overlay(fields, **changes), kept

    def decision_event(self, seen: Mapping[str, RackView], ids: list[str], choices: list[str],
                       walked: Mapping[str, float], cached_seen: Mapping[str, float], now_ms: float,
                       actor: str) -> DecisionEvent:
        """The batch's choices, with the views the policy saw before its first request (what replay checks)."""
        scores = {f"load:{k}": v.load for k, v in seen.items()}
        scores.update({f"healthy:{k}": float(v.healthy) for k, v in seen.items()})
        scores.update({f"work:{k}": v.work for k, v in seen.items()})
        scores.update({f"nodes:{k}": float(v.nodes) for k, v in seen.items()})
        scores.update(walked)
        scores.update(cached_seen)
        return DecisionEvent(kind="route", policy=self.policy.name, choice=choices[0], request_ids=tuple(ids),
                             ts_ms=now_ms, scores=scores, draw=-1.0, choices=tuple(choices), actor=actor)


@dataclasses.dataclass
class _Pending:
    req: RequestEvent
    views: Mapping[str, RackView]
    done: asyncio.Future[bool]


class InlineRoute:
    """The gateway's own rack choice and write (module docstring). `submit` returns True once the request is on its
    rack's stream, False when no healthy rack serves its model (the caller queues it for the router); a failed
    write raises."""

    def __init__(self, config: RackflowConfig, producer: StreamProducer, policy: RackAffinityRouter,
                 feed: PrefixFeed | None, routed: Counter | None = None) -> None:
        self.routing = RackRouting(config, policy, feed, routed)
        self.producer = producer
        self._pending: list[_Pending] = []
        self._writer: asyncio.Task[None] | None = None
        self._base: Mapping[str, RackView] | None = None
        self._views: dict[str, RackView] = {}
        """The views last handed in, charged with every request routed on them since (until fresher ones come)."""
        self.actor = f"gateway-{uuid.uuid4().hex[:12]}"
        """This gateway's name on its route decisions (replay keeps each routing process's policy apart)."""
        self.routed = 0
        self.round_trips = 0

    async def submit(self, req: RequestEvent, views: Mapping[str, RackView]) -> bool:
        """`views`: the racks as the caller last read them (the same object until it reads them again)."""
        if not views or not self.routing.serving.get(req.model):
            return False
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(req, views, done))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_all())
        return await done

    async def _write_all(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                await self._write(batch)
            except BaseException as e:  # the futures carry it to their callers; the writer goes on with the next
                for p in batch:
                    if not p.done.done():
                        p.done.set_exception(e if isinstance(e, Exception) else RuntimeError(str(e)))
                if not isinstance(e, Exception):
                    raise

    async def _write(self, batch: list[_Pending]) -> None:
        rt = self.routing
        now = WALL.now_ms()
        views = batch[-1].views
        if views is not self._base:  # a fresh read already counts what was routed before it
            self._base = views
            self._views = dict(views)
        seen = dict(self._views)
        out: list[tuple[str, dict[bytes, bytes]]] = []
        sent: list[_Pending] = []
        ids: list[str] = []
        choices: list[str] = []
        walked: dict[str, float] = {}
        cached_seen: dict[str, float] = {}
        for p in batch:
            req = p.req
            cached = rt.cached(req)
            decision = rt.route(req, self._views, cached)
            if decision.rack is None:
                p.done.set_result(False)
                continue
            if cached:
                for rk, t in cached.items():
                    cached_seen[f"cached:{req.request_id}:{rk}"] = t
            fields, kept = rt.forward(codec.encode(req), req, decision, self._views, now, "gateway.route")
            out.append((keys.rack_requests(decision.rack), fields))
            out.append((keys.ADMITTED, fields))
            sent.append(p)
            ids.append(req.request_id)
            choices.append(decision.rack)
            if not kept:
                walked[f"walked:{req.request_id}"] = 1.0
        if not sent:
            return
        out.append((keys.DECISIONS, codec.encode(rt.decision_event(seen, ids, choices, walked, cached_seen, now,
                                                                   self.actor))))
        replies = await self.producer.add_each(out)
        self.round_trips += 1
        for k, p in enumerate(sent):
            err = replies[2 * k]
            if isinstance(err, Exception):  # not on its rack's stream: the caller answers an error
                p.done.set_exception(err)
                continue
            if isinstance(replies[2 * k + 1], Exception):
                log.warning("request %s: routed to rack %s but its record on %s failed: %s", p.req.request_id,
                            choices[k], keys.ADMITTED, replies[2 * k + 1])
            p.done.set_result(True)
            self.routed += 1
        if isinstance(replies[-1], Exception):
            log.warning("route decision of %d requests not recorded on %s: %s", len(ids), keys.DECISIONS, replies[-1])
