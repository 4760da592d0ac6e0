"""The simulator's fast paths compute exactly what the general code does (they exist for speed at 10 k GPUs only)."""

from __future__ import annotations

import dataclasses
import random

from pipeline.config import load_config
from pipeline.costmodel import CalibratedCostModel
from pipeline.routing.views import NodeView
from pipeline.sim.traces import TraceRequest, superpose


def test_with_placed_is_replace_of_its_three_fields_and_copies_every_other_field() -> None:
    v = NodeView("n", True, 640.0, 100.5, 12.0, 31.0, 5e7, 2e7, 3, 2, prefill_tokens=900, decode_seqs=3,
                 decode_tokens=4000, kv_usage=0.4, slowdown=1.3, max_seqs=64, prefill_slowdown=0.9)
    got = v.with_placed(3e6, 512)
    want = dataclasses.replace(v, kv_free_kb=2e7 - 3e6, waiting=3, prefill_tokens=1412)
    assert got == want
    b = dataclasses.replace(v, batch_seqs=2, batch_kv_kb=1e6)
    assert b.with_placed(3e6, 512, batch=True) == dataclasses.replace(
        b, kv_free_kb=2e7 - 3e6, waiting=3, prefill_tokens=1412, batch_seqs=3, batch_kv_kb=4e6,
        batch_prefill_tokens=512)
    assert b.with_placed(3e6, 512) == dataclasses.replace(b, kv_free_kb=2e7 - 3e6, waiting=3, prefill_tokens=1412)
    # a field added to NodeView must be added to with_placed: it builds the view positionally
    assert b.with_placed(3e6, 512, batch=True).batch_prefill_tokens == 512
    assert ([f.name for f in dataclasses.fields(NodeView)][-1] == "batch_prefill_tokens"
            and len(dataclasses.fields(NodeView)) == 20)
    assert v.with_placed(3e7, 1).kv_free_kb == 0.0


def test_superpose_copies_every_field_of_a_request() -> None:
    reqs = [TraceRequest(10.0 * i, 100 + i, 5 + i, f"u{i}", (i, i + 1), "m", 64 * i or None, f"t{i % 2}", i % 2)
            for i in range(5)]
    out = superpose(reqs, 3, random.Random(1))
    assert len(out) == 15
    for r in out:
        base = reqs[r.in_tokens - 100]
        assert (r.out_tokens, r.prefix_hashes, r.model, r.max_tokens, r.tenant, r.priority) == (
            base.out_tokens, base.prefix_hashes, base.model, base.max_tokens, base.tenant, base.priority)
        assert r.user_id.split("#")[0] == base.user_id
    assert [f.name for f in dataclasses.fields(TraceRequest)] == [
        "arrival_ms", "in_tokens", "out_tokens", "user_id", "prefix_hashes", "model", "max_tokens", "tenant",
        "priority"]


def test_one_chunk_step_time_is_the_general_loops_to_the_last_bit() -> None:
    cfg = load_config()
    for gpu in ("h100-80gb", "a100-80gb"):
        for tp in (1, 8):
            m = CalibratedCostModel.for_node(cfg, (gpu, "qwen2-72b" if tp == 8 else "qwen2-7b", tp))
            rng = random.Random(tp)
            for _ in range(300):
                t, c, d, k = rng.randint(1, 8192), rng.choice([0, rng.randint(0, 4000)]), rng.randint(0, 64), 0
                k = rng.randint(d, 200_000) if d else 0
                # the general path: two chunks where one is empty (it is skipped) runs the loop
                assert m.step_ms([t], d, k, [c]) == m.step_ms([t, 0], d, k, [c, 0])
                assert m.step_ms([t], d, k) == m.step_ms([0, t], d, k)


def test_a_route_given_the_summary_of_its_views_decides_as_one_that_computes_it() -> None:
    from pipeline.routing.rack_affinity import RackAffinityRouter
    from pipeline.routing.views import RackView

    racks = [f"r{i}" for i in range(40)]
    rng = random.Random(5)
    for prefix_aware in (False, True):
        router = RackAffinityRouter({"m": racks}, 16, 1.25, prefix_aware=prefix_aware)
        for _ in range(200):
            views = {r: RackView(r, rng.random() > 0.1, float(rng.randint(0, 50)), float(rng.randint(0, 90_000)),
                                 rng.choice([0, 8, 7])) for r in racks}
            summary = router.summarize("m", views)
            for k in range(5):
                user = f"u{rng.randint(0, 10_000)}"
                cached = {rng.choice(racks): float(rng.randint(0, 4000))} if k % 2 else None
                assert router.route(user, "m", views, cached, summary=summary) == router.route(user, "m", views, cached)
    assert router.summarize("m", {}).healthy == ()


def test_cached_node_views_are_never_stale_through_faults_and_recoveries() -> None:
    # check_invariants compares every cached view with one built afresh from the node (AssertionError if stale)
    from pipeline.sim.simulator import Fault, SimParams, Simulator
    from tests.unit.test_control_plane_costs import _cfg, _cost, _reqs

    cfg = _cfg()
    reqs = _reqs(1200, 25.0)
    # each fault lands just after an arrival, whose close has just read (and cached) every view of its rack
    at = [reqs[k].arrival_ms + 1e-6 for k in (200, 300, 400, 500, 700)]
    faults = [Fault(at[0], "r0-n1", "xid", 3_000.0), Fault(at[1], "r1-n2", "xid", 3_000.0),
              Fault(at[2], "r0-n2", "death"), Fault(at[3], "r1-n0", "slow", 8_000.0, 2.0),
              Fault(at[4], "r1-n3", "death")]
    res = Simulator(cfg, reqs, _cost(cfg), params=SimParams(check_invariants=True), faults=faults).run()
    assert res.migrations > 0
    assert sum(1 for f in res.finish if f >= 0) + sum(res.dropped) == 1200
