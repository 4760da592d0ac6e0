"""Control-plane costs in the simulator: stations saturate at servers / service, the sizing arithmetic, the committed
calibration file and its provenance, and costs off = the simulator exactly as before."""

from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path

import pytest

from pipeline.config import DEFAULT_CONFIG_DIR, NodeSpec, RackflowConfig, parse_config, raw_config
from pipeline.costmodel import CalibratedCostModel
from pipeline.sim.control_plane import ControlPlaneCosts, Station, size_for, valkey_ms_per_request
from pipeline.sim.simulator import Fault, SimParams, Simulator
from pipeline.sim.traces import TraceRequest, assign_users, parse_azure, scale_rate

REPO = Path(__file__).resolve().parents[2]
AZURE = REPO / "data" / "traces" / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"
CALIBRATION = REPO / "data" / "calibration" / "control-plane.json"


def _waits(interval_ms: float, service_ms: float, n: int = 2000, servers: int = 1) -> list[float]:
    s = Station(servers)
    out = []
    for i in range(n):
        t = i * interval_ms
        out.append(s.serve(t, service_ms) - t - service_ms)
    return out


def test_station_below_capacity_never_waits() -> None:
    assert max(_waits(1.0, 0.9)) < 1e-9  # 1,111 req/s capacity, 1,000 offered


def test_station_above_capacity_wait_grows_linearly() -> None:
    w = _waits(1.0, 1.25)  # capacity 800 req/s, 1,000 offered: each request waits 0.25 ms more than the last
    assert w[-1] == pytest.approx(0.25 * (len(w) - 1))
    assert w[len(w) // 2] < w[-1]


def test_k_servers_saturate_at_k_over_service() -> None:
    assert max(_waits(1.0, 3.9, servers=4)) < 1e-9  # 4 / 3.9 ms > 1 per ms
    w = _waits(1.0, 4.4, servers=4)  # 4 / 4.4 ms < 1 per ms: the queue grows by 0.1 ms per request
    assert w[-1] == pytest.approx(0.1 * (len(w) - 1))


def test_station_report_utilisation() -> None:
    s = Station(2)
    for i in range(100):
        s.serve(float(i), 1.0)
    assert s.report(100.0)["utilisation"] == pytest.approx(0.5)


def _costs(**kw: float) -> ControlPlaneCosts:
    base = {"router_ms": 0.1, "batcher_ms": 0.2, "xadd_ms": 0.003, "read_ms": 0.002, "etcd_txn_ms": 18.0,
            "etcd_concurrency": 32, "node_link_gbps": 25.0}
    base.update(kw)
    return ControlPlaneCosts(**base)  # type: ignore[arg-type]


def test_sizing_math() -> None:
    c = _costs()
    # 7,000 req/s x 0.1 ms = 0.7 of a router: one router at the 70% cap, two just above it
    assert size_for(c, 7000.0, 16, decode_ms=0.0, batch_size=1).routers == 1
    assert size_for(c, 7001.0, 16, decode_ms=0.0, batch_size=1).routers == 2
    # batchers per rack: 16 racks x 3,500 req/s x 0.2 ms = 0.7 per rack
    assert size_for(c, 16 * 3500.0, 16, decode_ms=0.0, batch_size=1).batchers_per_rack == 1
    assert size_for(c, 16 * 3600.0, 16, decode_ms=0.0, batch_size=1).batchers_per_rack == 2
    glob, spread = valkey_ms_per_request(c, decode_ms=5000.0, batch_size=10.0)
    assert glob == pytest.approx(3 * 0.003 + 2 * 0.002)
    assert spread == pytest.approx((0.005) * 1.1 + (1 + 100) * 0.003)
    s = size_for(c, 1000.0, 16, decode_ms=5000.0, batch_size=10.0)
    assert s.valkey_shards == math.ceil(1000.0 * spread / 1000.0 / 0.7)
    with pytest.raises(ValueError):
        size_for(c, 1.0, 1, 0.0, 1.0, cap=0.0)


def test_calibration_file_loads_with_provenance() -> None:
    cal = json.loads(CALIBRATION.read_text())
    prov = cal["provenance"]
    assert prov["command"].startswith("rackflow sim calibrate-control-plane")
    assert prov["date_utc"] and prov["machine"]["cpus"] >= 1 and prov["git_head"]
    assert {"streams", "route", "pipeline", "etcd", "network"} <= set(cal["raw"])
    assert cal["raw"]["etcd"]["url_members"] == 3
    c = ControlPlaneCosts.from_calibration(cal)
    for v in (c.router_ms, c.batcher_ms, c.xadd_ms, c.read_ms, c.etcd_txn_ms, c.node_link_gbps):
        assert 0 < v < 1e4
    # derived figures are the raw medians, not typed in
    d = cal["derived"]
    assert d["router_ms_per_decision"] == cal["raw"]["pipeline"]["cpu_ms_per_request"]["router"]
    assert d["batcher_ms_per_request"] == cal["raw"]["pipeline"]["cpu_ms_per_request"]["batcher"]
    assert d["valkey_xadd_ms"] == pytest.approx(cal["raw"]["streams"]["valkey_cpu_us_per_xadd"] / 1000, rel=1e-3)


def _cfg() -> RackflowConfig:
    raw = raw_config(DEFAULT_CONFIG_DIR)
    raw["cluster"] = {"racks": [{"name": f"r{i}", "node_count": 4,
                                 "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}} for i in range(2)]}
    return parse_config(raw)


def _reqs(n: int, rate: float) -> list[TraceRequest]:
    with open(AZURE, newline="") as fh:
        reqs = list(parse_azure(fh, n))
    return assign_users(list(scale_rate(reqs, rate)), 300, 1.1, random.Random(3))


def _cost(cfg: RackflowConfig):  # type: ignore[no-untyped-def]
    cache: dict[str, CalibratedCostModel] = {}

    def make(spec: NodeSpec) -> CalibratedCostModel:
        if spec.gpu not in cache:
            cache[spec.gpu] = CalibratedCostModel.for_node(cfg, spec)
        return cache[spec.gpu]

    return make


# the same run on the code before the control-plane costs (commit 5fd0238), hashed: costs off changes nothing (with the
# oracle, as the simulator ran then: the true output lengths known, the engines timed exactly by the cost model)
BEFORE = "613f1534422b80c2095c3183bca28abbe9dc37dbadb83ddc0aaefb848a178e14"


def test_costs_off_is_the_simulator_as_before() -> None:
    # the rack share guard (router.share_bound), the in-flight batches in the node views (inflight_views), the
    # late-binding hold, work_aware's e2e weight of 0.1 and its KV-pressure term off came later and change decisions on
    # purpose: as then here
    raw = raw_config(DEFAULT_CONFIG_DIR)
    raw["cluster"] = _cfg().model_dump(mode="json")["cluster"]
    raw["policies"]["router"]["share_bound"] = 0.0
    raw["policies"].setdefault("batcher", {}).update(late_binding="none", max_queued_prefill_tokens=16384)
    wa = raw["policies"].setdefault("node_selection", {}).setdefault("work_aware", {})
    wa.update(e2e_weight=0.3, kv_weight_ms=2000.0)
    cfg = parse_config(raw)
    res = Simulator(cfg, _reqs(1500, 20.0), _cost(cfg), params=SimParams(oracle=True, inflight_views=False),
                    faults=[Fault(20_000.0, "r0-n1", "death")]).run()
    h = hashlib.sha256(repr((res.first_token, res.finish, res.node_of, res.dropped, res.migrations,
                             res.events)).encode()).hexdigest()
    assert h == BEFORE
    assert res.control_plane == {}


def _ttft_p50(res) -> float:  # type: ignore[no-untyped-def]
    t = sorted(res.first_token[i] - res.arrival[i] for i in range(len(res.arrival)) if res.first_token[i] >= 0)
    return t[len(t) // 2]


def test_router_station_saturates_in_the_simulator() -> None:
    cfg = _cfg()
    reqs = _reqs(600, 20.0)
    rate = len(reqs) / ((reqs[-1].arrival_ms - reqs[0].arrival_ms) / 1000.0)
    off = Simulator(cfg, reqs, _cost(cfg), params=SimParams(admission=False)).run()
    # a router at 0.8x and at 2x of the offered rate's capacity
    fast = _costs(router_ms=0.8 * 1000.0 / rate)
    slow = _costs(router_ms=2.0 * 1000.0 / rate)
    r_fast = Simulator(cfg, reqs, _cost(cfg), params=SimParams(admission=False, control_plane=fast)).run()
    r_slow = Simulator(cfg, reqs, _cost(cfg), params=SimParams(admission=False, control_plane=slow)).run()
    for r in (off, r_fast, r_slow):
        assert sum(1 for f in r.finish if f >= 0) == len(reqs)  # every request served
    assert r_fast.control_plane["router"]["utilisation"] < 1.0
    assert r_slow.control_plane["router"]["max_wait_ms"] > 0.4 * (reqs[-1].arrival_ms - reqs[0].arrival_ms)
    assert _ttft_p50(r_slow) > _ttft_p50(r_fast) + 1000.0
    # three routers carry what one cannot
    two = _costs(router_ms=slow.router_ms, routers=3)  # type: ignore[arg-type]
    r_two = Simulator(cfg, reqs, _cost(cfg), params=SimParams(admission=False, control_plane=two)).run()
    assert r_two.control_plane["router"]["max_wait_ms"] < r_slow.control_plane["router"]["max_wait_ms"] / 10


def test_migration_pays_etcd_and_the_kv_transfer() -> None:
    cfg = _cfg()
    reqs = _reqs(800, 60.0)
    death = [Fault(reqs[len(reqs) // 2].arrival_ms, "r0-n1", "death")]
    off = Simulator(cfg, reqs, _cost(cfg), params=SimParams(), faults=death).run()
    # the records off: the etcd station serves the moves alone
    cp = _costs(etcd_txn_ms=500.0, etcd_concurrency=1, node_link_gbps=0.01, record_flush_ms=0.0)
    res = Simulator(cfg, reqs, _cost(cfg), params=SimParams(control_plane=cp), faults=death).run()
    assert res.migrations > 0
    et = res.control_plane["etcd"]
    assert et["jobs"] == res.migrations
    assert et["busy_ms"] == pytest.approx(500.0 * res.migrations)
    # one etcd server at 500 ms a move, then KV at 10 MB/s: the moved sequences finish much later than without
    moved = [i for i in range(len(reqs)) if off.node_of[i] != res.node_of[i] and res.finish[i] >= 0]
    assert moved
    assert max(res.finish[i] for i in moved) > max(off.finish) + 400.0


def test_token_flushes_are_charged_while_decoding() -> None:
    cfg = _cfg()
    reqs = _reqs(300, 10.0)
    cp = _costs(xadd_ms=1.0, read_ms=0.0, valkey_shards=1000)  # type: ignore[arg-type]  # nobody waits on it
    res = Simulator(cfg, reqs, _cost(cfg), params=SimParams(control_plane=cp)).run()
    done = [i for i in range(len(reqs)) if res.finish[i] >= 0 and res.first_token[i] >= 0]
    # one XADD per decoding sequence per 50 ms flush interval (+ first token, rack request, batch)
    expected = sum((res.finish[i] - res.first_token[i]) / cp.token_flush_ms for i in done)
    fixed = 2.0 * len(done) + len(res.batch_sizes)
    busy = res.control_plane["valkey_spread_shards"]["busy_ms"]
    assert 0.9 * expected < busy - fixed < 1.1 * expected


def test_sequence_records_share_etcd_and_lag_when_it_saturates() -> None:
    cfg = _cfg()
    reqs = _reqs(600, 40.0)
    fast = Simulator(cfg, reqs, _cost(cfg), params=SimParams(control_plane=_costs(etcd_txn_ms=2.0))).run()
    rec = fast.control_plane["etcd_records"]
    # a claim and a release per request, coalesced per node into transactions
    assert rec["changes"] == 2 * len(reqs)
    assert 0 < rec["transactions"] < rec["changes"]
    assert fast.control_plane["etcd"]["jobs"] == rec["transactions"]  # no migration: the records alone
    # a change waits at most for the one in flight (2 ms), the 20 ms coalescing and its own 2 ms: nothing queues
    assert 2.0 <= rec["mean_lag_ms"] <= rec["max_lag_ms"] <= 24.0 + 1e-9
    # one etcd server at 200 ms a transaction cannot keep up with 8 nodes' records: the lag grows through the run
    slow = Simulator(cfg, reqs, _cost(cfg),
                     params=SimParams(control_plane=_costs(etcd_txn_ms=200.0, etcd_concurrency=1))).run()
    srec = slow.control_plane["etcd_records"]
    assert slow.control_plane["etcd"]["utilisation"] > 0.9
    assert srec["max_lag_ms"] > 20 * rec["max_lag_ms"]
    assert srec["transactions"] < rec["transactions"]  # more coalesced while one is in flight
    # asynchronous: the requests' timings do not change
    assert slow.finish == fast.finish


def test_cross_rack_migration_crosses_the_rack_uplinks() -> None:
    cfg = _cfg()
    reqs = _reqs(800, 60.0)
    # r0's other nodes drain first (for longer than the run), so the dead node's sequences must go to rack r1
    at = reqs[len(reqs) // 2].arrival_ms
    drains = [Fault(at - 1.0, f"r0-n{k}", "xid", 60_000.0) for k in (0, 2, 3)]
    base = Simulator(cfg, reqs, _cost(cfg), params=SimParams(), faults=drains).run()
    on_it = [i for i in range(len(reqs)) if base.node_of[i] == 1 and reqs[i].arrival_ms < at < base.finish[i]]
    assert on_it
    runs = {}
    for over in (1.0, 64.0):
        cp = _costs(node_link_gbps=1.0, spine_oversubscription=over, record_flush_ms=0.0)
        runs[over] = Simulator(cfg, reqs, _cost(cfg), params=SimParams(control_plane=cp),
                               faults=[*drains, Fault(at, "r0-n1", "death")]).run()
    slow = runs[64.0]
    assert slow.control_plane["fabric"]["cross_rack_transfers"] > 0
    # 64:1 on a 4-node rack: the uplink carries 1/16 of one node link, so it, not the node links, is the bottleneck
    up = slow.control_plane["rack_uplink_busiest"]
    assert up["busy_ms"] > 10 * slow.control_plane["node_link_out_busiest"]["busy_ms"]
    moved = [i for i in on_it if slow.node_of[i] >= 4 and slow.finish[i] >= 0 and runs[1.0].finish[i] >= 0]
    assert moved
    assert sum(slow.finish[i] for i in moved) > sum(runs[1.0].finish[i] for i in moved)
    # without a spine the transfers cross the node links alone
    flat = Simulator(cfg, reqs, _cost(cfg), params=SimParams(control_plane=_costs(
        node_link_gbps=1.0, spine_oversubscription=0.0, record_flush_ms=0.0)),
        faults=[*drains, Fault(at, "r0-n1", "death")]).run()
    assert "rack_uplink_busiest" not in flat.control_plane
