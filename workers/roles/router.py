"""Router process (`rackflow router`): consumer group "router" on `rf:ingress`.

For each request: pick the rack with the rack-affinity policy over the live rack views, append the routed request
to `rf:rack:{R}:req` and the decision to `rf:decisions` in one pipelined round trip, then acknowledge. When no rack
serving the model is healthy it waits (the request stays pending) up to `no_rack_wait_s`, then answers the client
with an error result instead of dropping the request.
"""

from __future__ import annotations

import asyncio
import json
import logging

from pipeline.config import RackflowConfig
from pipeline.events import RequestEvent, ResultEvent
from pipeline.routing.rack_affinity import RackAffinityRouter
from pipeline.routing.registry import build_router
from pipeline.routing.views import RackView
from streams import codec, keys
from streams.runner import Delivery, StreamConsumer, StreamProducer, connect
from workers.shell import metrics, tracing
from workers.shell.runtime import WALL, consumer_name, log_context
from workers.stores.cluster_view import ClusterView, PacedRefresh
from workers.stores.etcd import NodeRegistry
from workers.stores.prefix_feed import PrefixFeed
from workers.stores.rack_routing import RackRouting
from workers.stores.results import ResultWriter, error_result

log = logging.getLogger(__name__)


STOP_WAIT_S = 2.0
"""On stop, how long the batch in hand may take to finish before it is left pending for another router."""


class Router:
    def __init__(self, config: RackflowConfig, redis_url: str, etcd_url: str, no_rack_wait_s: float = 30.0) -> None:
        self.config = config
        pol = config.policies
        self.policy: RackAffinityRouter = build_router(config)  # a clear error for an unknown router policy
        self.r = connect(redis_url)
        self.registry = NodeRegistry(etcd_url)
        self.view = ClusterView(config, self.r, self.registry, stale_ms=pol.node_selection.stale_ms,
                                decode_weight_tokens=pol.router.decode_weight_tokens)
        self.feed = PrefixFeed(self.r, config.rack_names())
        """Where every node's prefix blocks are cached (their block events): the rack choice weighs it."""
        self.routing = RackRouting(config, self.policy, self.feed)
        retention_ms = pol.streams.retention_s * 1000
        self.producer = StreamProducer(self.r, WALL.now_ms, retention_ms)
        self.results = ResultWriter(self.r, WALL.now_ms, retention_ms, out_ttl_s=pol.streams.output_ttl_s)
        self.no_rack_wait_s = no_rack_wait_s
        self.consumer = StreamConsumer(
            self.r, keys.INGRESS, keys.GROUP_ROUTER, consumer_name("router"), self._on_requests,
            now_ms=WALL.now_ms, count=pol.streams.read_count, block_ms=pol.streams.block_ms,
            claim_idle_ms=pol.streams.claim_idle_ms, max_deliveries=pol.streams.max_deliveries,
            retention_ms=retention_ms, accepts=(RequestEvent,),
        )
        self.routed = 0
        self.serving = {m: config.racks_serving(m) for m in config.models}
        self.paced = PacedRefresh(self._refresh, config.policies.node_selection.refresh_ms / 1000.0)
        """The view refresh, paced by traffic (backs off while no request comes)."""

    async def _racks(self) -> dict[str, RackView]:
        return self.view.rack_views(WALL.now_ms())

    async def _on_requests(self, deliveries: list[Delivery]) -> None:
        await self.paced.on_request()  # after an idle spell the view backed off: a route needs a fresh one
        now = WALL.now_ms()
        racks = await self._racks()
        views = dict(racks)
        seen = dict(racks)  # what the policy saw before the first request of this batch (for the decision)
        out: list[tuple[str, dict[bytes, bytes]]] = []
        errors: list[ResultEvent] = []
        ids: list[str] = []
        choices: list[str] = []
        walked: dict[str, float] = {}
        waited = 0.0
        rt = self.routing
        cached_seen: dict[str, float] = {}
        for d in deliveries:
            req = d.event
            if not isinstance(req, RequestEvent):
                raise TypeError(f"expected a request on {d.stream}, got {type(req).__name__}")
            if not self.serving.get(req.model):
                errors.append(error_result(req, f"model {req.model!r} is not served by any rack; served: "
                                                f"{', '.join(self.policy.models())}"))
                continue
            cached = rt.cached(req)
            if cached:
                for rk, t in cached.items():
                    cached_seen[f"cached:{req.request_id}:{rk}"] = t
            while True:
                decision = rt.route(req, views, cached)
                if decision.rack is not None or waited >= self.no_rack_wait_s:
                    break
                await asyncio.sleep(0.2)  # no healthy rack yet (cluster starting, or every rack down)
                waited += 0.2
                await self.view.refresh(with_backlog=True)
                views = dict(await self._racks())
                seen = dict(views)
            if decision.rack is None:
                errors.append(error_result(req, f"no healthy rack serves model {req.model!r}; retry later"))
                with log_context(request_id=req.request_id):
                    log.warning("request %s: no healthy rack serves model %s after %.1fs; answered with an error",
                                req.request_id, req.model, waited)
                if req.trace and tracing.TRACER is not None:
                    tracing.hop("router.route", req, now, error="no healthy rack")
                continue
            # forward the entry as it came, with the router's fields as an overlay: no re-encoding of the request
            fields, kept = rt.forward(d.fields, req, decision, views, now, "router.route")
            out.append((keys.rack_requests(decision.rack), fields))
            ids.append(req.request_id)
            choices.append(decision.rack)
            if not kept:
                walked[f"walked:{req.request_id}"] = 1.0
        if ids:
            out.append((keys.DECISIONS, codec.encode(rt.decision_event(seen, ids, choices, walked, cached_seen, now,
                                                                       self.consumer.consumer))))
        await self.producer.add_many(out)
        for e in errors:
            await self.results.write(e)
        self.routed += len(ids)

    async def _refresh(self) -> bool:
        try:
            await self.view.refresh(with_backlog=True)
            self._export_metrics()
            return True
        except Exception as e:
            log.warning("router: cluster view refresh failed: %s", e)
            return False

    def _export_metrics(self) -> None:
        for rack, v in self.view.rack_views(WALL.now_ms()).items():
            metrics.RACK_LOAD.labels(rack).set(v.load)
            metrics.RACK_HEALTHY.labels(rack).set(1.0 if v.healthy else 0.0)

    async def run(self, stop: asyncio.Event) -> int:
        # the config in force, for `rackflow replay export` (an incident file carries the config it ran under)
        await self.r.set(keys.CONFIG, json.dumps(self.config.model_dump(mode="json")))
        await self.view.refresh(with_backlog=True)
        refresh = asyncio.create_task(self.paced.run(stop))
        feed = asyncio.create_task(self.feed.run(stop))
        consume = asyncio.create_task(self.consumer.run())
        log.info("router ready (policy %s)", self.policy.name)
        await stop.wait()
        self.consumer.stop()
        # a batch waiting for a healthy rack (up to no_rack_wait_s) is left pending for the next router: a stop is
        # not held up by it (its entries were not acknowledged; a successor claims them)
        _done, pending = await asyncio.wait({consume}, timeout=STOP_WAIT_S)
        for t in pending:
            t.cancel()
        await asyncio.gather(consume, refresh, feed, return_exceptions=True)
        await self.consumer.close()
        await self.registry.close(revoke=False)
        await self.r.aclose()
        log.info("router stopped (%d routed)", self.routed)
        return 0
