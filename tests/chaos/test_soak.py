"""A short soak (workers/bench/soak.py, `rackflow bench soak`): 1.5 minutes at 80% of the measured capacity through
the HTTP gateway, a random role (worker, router, batcher, gateway, Celery worker, monitor) killed with SIGKILL every
30 s and started again, Valkey (durable, its own) and etcd each restarted once between two kills. Every accepted request
ends with exactly one final result and no client sees an error (429, connections refused by a dead gateway and
requests cut by its death, whose results are read back by id, are not errors: see the module's definitions).

`long`: `make test` leaves it out (about 4 minutes with the cluster's start, the capacity run and the drain);
`make test-all` runs it. Alone, with the report printed:
    .venv/bin/python -m pytest -q -s tests/chaos/test_soak.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.bench.soak import bench_soak

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(900)]


def test_soak_with_kills_every_30s_and_a_valkey_restart_loses_nothing(tmp_path: Path) -> None:
    res = bench_soak(None, None, 1.5, False, out_dir=tmp_path, seed=11)
    print("\nsoak:", json.dumps({k: v for k, v in res.items() if k not in ("events", "valkey_memory_series")},
                                sort_keys=True))
    for k in res["events"]:
        print("  ", json.dumps(k, sort_keys=True))
    assert res["accepted"] > 0 and res["completed"] == res["accepted"] - res["lost"], res
    assert res["lost"] == 0, res
    assert res["duplicates"] == 0, res
    assert res["client_errors"] == 0, (res["client_error_kinds"], res["client_error_samples"])
    assert res["kills"] >= 2, res["events"]
    assert res["valkey_restarts"] == 1 and res["etcd_restarts"] == 1, res["events"]
    assert not any("error" in k for k in res["events"]), res["events"]
    # the accounting read every entry before the 60 s retention could trim it
    assert res["follower_max_lag_s"] < res["retention_s"], res["follower_max_lag_s"]
    assert res["unexpected_exits"] == [], res["unexpected_exits"]
    assert res["interrupted_verified"] == res["interrupted_accepted"], res
    assert (tmp_path / "soak.json").exists()
    assert res["plot"] is None or Path(res["plot"]).exists()
