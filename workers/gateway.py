"""Gateway function: profile a request (ARCHITECTURE §2) and append it to `rf:ingress`.

This is the ingress step every front end shares (the demo's trace replay now; the HTTP gateway and Celery jobs
build on it). It validates what the profile needs and never lets a request it cannot serve into the streams.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis.asyncio as aioredis

from pipeline.config import RackflowConfig
from pipeline.events import RequestEvent
from pipeline.profiling import ProfileInput, profile_request
from streams import keys
from streams.runner import StreamProducer
from workers.runtime import WALL

log = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """The client's request cannot be served as given; the message says what to change."""


class Gateway:
    def __init__(self, config: RackflowConfig, r: aioredis.Redis) -> None:
        self.config = config
        self.r = r
        self.producer = StreamProducer(r, WALL.now_ms, config.policies.streams.retention_s * 1000)

    def profile(self, inp: ProfileInput) -> RequestEvent:
        model = self.config.models.get(inp.model)
        if model is None:
            raise RequestRejected(f"unknown model {inp.model!r}; available: {', '.join(sorted(self.config.models))}")
        if inp.max_tokens is not None and inp.max_tokens < 1:
            raise RequestRejected(f"max_tokens must be >= 1, got {inp.max_tokens}")
        req = profile_request(inp, model, self.config.policies.profiling)
        if req.in_tokens + req.max_tokens > model.context:
            raise RequestRejected(
                f"prompt ({req.in_tokens} tokens) + max_tokens ({req.max_tokens}) exceeds the context of "
                f"{inp.model} ({model.context} tokens); shorten the prompt or lower max_tokens"
            )
        return req

    async def submit(self, inp: ProfileInput) -> RequestEvent:
        req = self.profile(inp)
        await self.producer.add(keys.INGRESS, req)
        return req

    async def submit_many(self, inputs: Sequence[ProfileInput]) -> list[RequestEvent]:
        reqs = [self.profile(i) for i in inputs]
        await self.producer.add_many((keys.INGRESS, r) for r in reqs)
        return reqs
