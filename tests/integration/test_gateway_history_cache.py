"""The gateway reads a user's output-length history (the EWMA the workers update on completion) at most once per
`gateway.user_history_cache_s`, not once per request: one round trip less on every admission."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.config import load_config
from streams import keys
from streams.runner import connect
from workers.local.services import ServiceEndpoints
from workers.stores.ingress import Gateway

pytestmark = pytest.mark.integration


def test_user_history_is_read_once_per_interval_and_then_again(clean_services: ServiceEndpoints) -> None:
    base = load_config()

    def with_cache(s: float):  # type: ignore[no-untyped-def]
        return base.model_copy(update={"gateway": base.gateway.model_copy(update={"user_history_cache_s": s})})

    async def run() -> None:
        r = connect(clean_services.redis_url)
        try:
            gw = Gateway(with_cache(60.0), r)  # long enough that no stall of a busy machine expires it
            key = keys.user_out_ewma("t", "alice")
            await r.set(key, "40")
            await r.config_resetstat()
            assert [await gw.user_avg_out("t", "alice") for _ in range(20)] == [40.0] * 20
            assert await gw.user_avg_out("t", "bob") is None  # no history: cached as none too
            assert await gw.user_avg_out("t", "bob") is None
            assert (await r.info("commandstats"))["cmdstat_get"]["calls"] == 2  # alice once, bob once
            await r.set(key, "55")
            assert await gw.user_avg_out("t", "alice") == 40.0  # within the interval: the value read
            short = Gateway(with_cache(0.2), r)
            await r.set(key, "40")
            assert await short.user_avg_out("t", "alice") == 40.0
            await r.set(key, "55")
            await asyncio.sleep(0.3)  # at least the interval, however busy the machine: read again
            assert await short.user_avg_out("t", "alice") == 55.0

            gw = Gateway(with_cache(0), r)  # off: every request reads it
            await r.config_resetstat()
            for _ in range(3):
                await gw.user_avg_out("t", "alice")
            assert (await r.info("commandstats"))["cmdstat_get"]["calls"] == 3
        finally:
            await r.aclose()

    asyncio.run(run())
