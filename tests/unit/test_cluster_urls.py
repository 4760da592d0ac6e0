"""Cluster URLs: `redis+cluster://` selects the cluster client; Celery refuses a cluster broker with a clear error."""

from __future__ import annotations

import pytest

from streams.runner import connect, is_cluster_url, plain_url
from workers.control.app import BROKER_ENV, broker_url


def test_cluster_url_scheme() -> None:
    assert is_cluster_url("redis+cluster://10.0.0.1:6379/0") and is_cluster_url("rediss+cluster://h:1")
    assert not is_cluster_url("redis://h:1/0")
    assert plain_url("rediss+cluster://u:p@h:1/0") == "rediss://u:p@h:1/0"
    from redis.asyncio.cluster import RedisCluster

    assert isinstance(connect("redis+cluster://127.0.0.1:1/0"), RedisCluster)  # no connection until first use
    assert not isinstance(connect("redis://127.0.0.1:1/0"), RedisCluster)


def test_celery_broker_must_not_be_a_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BROKER_ENV, raising=False)
    assert broker_url("redis://h:1/0") == "redis://h:1/0"
    with pytest.raises(ValueError, match=BROKER_ENV):
        broker_url("redis+cluster://h:1/0")
    monkeypatch.setenv(BROKER_ENV, "redis://broker:6379/1")
    assert broker_url("redis+cluster://h:1/0") == "redis://broker:6379/1"
