"""Replay re-decides recorded windows and routes with the live policy code: exact with the recorded policy (random
policies get their recorded draws back), different under a what-if; the recording file round-trips and a damaged
one is refused with a clear error."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import yaml

from pipeline.config import DEFAULT_CONFIG_DIR, RackflowConfig, load_config
from pipeline.events import BlockEvent, DecisionEvent, RequestEvent
from pipeline.replay import DrawLog, Replayer, rack_batcher, rack_router, window_record
from pipeline.routing.prefix_index import BlockIndex, apply_block_event
from pipeline.routing.views import NodeView, RackView
from streams import codec
from streams.replay_file import Header, RecordingError, RecordingWriter, read_header, read_records


def _config(tmp_path: Path, policy: str) -> RackflowConfig:
    p = tmp_path / f"o-{policy}.yaml"
    p.write_text(yaml.safe_dump({
        "cluster": {"racks": [
            {"name": "r0", "node_count": 4, "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}},
            {"name": "r1", "node_count": 3, "node": {"gpu": "a100-80gb", "tp": 1, "models": ["qwen2-7b"]}},
        ]},
        "policies": {"node_selection": {"policy": policy}},
    }))
    return load_config(DEFAULT_CONFIG_DIR, [p])


POOL = [(1 << 62) + 7919 * k for k in range(40)]
"""Prefix-block hashes the recorded requests share (63-bit: the record must carry them exactly)."""


def _request(rng: random.Random, i: int, t: float, rack: str | None) -> RequestEvent:
    start = rng.randrange(0, 30)
    return RequestEvent(
        request_id=f"req-{i}", version=0, tenant="t", user_id=f"user-{rng.randrange(40)}", model="qwen2-7b",
        in_tokens=rng.randint(10, 3000), out_tokens=100, max_tokens=200,
        mem_est_kb=rng.choice([2e5, 5e5, 1e6, 4e6, 1.2e7, 3e7]), arrival_ms=t, rack=rack,
        prefix_hashes=tuple(POOL[start:start + rng.randrange(1, 8)]),
    )


def _block_events(rng: random.Random, nodes: list[str], t: float) -> list[BlockEvent]:
    """What the rack's engines reported since the last close: blocks stored, evicted, a node restarted."""
    out = []
    for _ in range(rng.randrange(0, 4)):
        n = rng.choice(nodes)
        k = rng.randrange(0, 30)
        out.append(BlockEvent(n, "r0", t, stored=tuple(POOL[k:k + rng.randrange(1, 8)]),
                              removed=tuple(rng.sample(POOL, rng.randrange(0, 3))), cleared=rng.random() < 0.05))
    return out


def _views(rng: random.Random, nodes: list[str], t: int) -> list[NodeView]:
    out = []
    for n in nodes:
        free = rng.uniform(0, 60e6) if (t // 6) % 3 != 2 else 0.0  # stretches with no memory anywhere
        out.append(NodeView(n, active=not (t > 60 and n.endswith("n1")), vram_total_gb=80, free_vram_gb=free / 1e6,
                            pcie_util_pct=rng.uniform(0, 60), avg_latency_ms=rng.uniform(5, 80),
                            kv_capacity_kb=60e6, kv_free_kb=free, running=rng.randrange(20),
                            waiting=rng.randrange(5)))
    return out


IDLE_SEEN = [0]


def record_run(
    config: RackflowConfig, seed: int = 7, closes: int = 150
) -> tuple[list[RequestEvent], list[DecisionEvent]]:
    """What a batcher and a router record over a synthetic run (the batcher part through the same objects and
    record builders as workers.roles.batcher), passed through the wire codec."""
    rng = random.Random(seed)
    log = DrawLog()
    blocks = BlockIndex()
    window, policies = rack_batcher(config, "r0", log.factory, blocks=blocks)
    seen_blocks: list[BlockEvent] = []
    nodes = [n.name for n in config.cluster.racks[0].expanded()]
    router = rack_router(config)
    reqs: list[RequestEvent] = []
    decisions: list[DecisionEvent] = []
    i = 0
    t = 1_000_000.0
    from pipeline.batching.window import PendingRequest

    offered: list[tuple[str, int, float]] = []  # offered since the last close, as the batcher keeps them
    idle, last_idle = 0, 0.0
    for step in range(closes):
        batch = []
        # no arrivals while memory is short: those closes are idle (they only age the waiting requests)
        for _ in range(rng.randrange(0, 12) if (step // 6) % 3 != 2 else 0):
            req = _request(rng, i, t, "r0")
            i += 1
            batch.append(req)
            reqs.append(req)
            window.offer(PendingRequest(req, f"{i}-0", t))
            offered.append((req.request_id, 0, t))
            t += rng.uniform(0, 3)
        # the router's decision for the same requests (rack views with load and health)
        if batch:
            seen = {r: RackView(r, step < 80 or r != "r1", rng.uniform(0, 50)) for r in ("r0", "r1")}
            views = dict(seen)
            choices = []
            for req in batch:
                d = router.route(req.user_id, req.model, views)
                assert d.rack is not None
                views[d.rack] = dataclasses.replace(views[d.rack], load=views[d.rack].load + 1)
                choices.append(d.rack)
            scores = {f"load:{k}": v.load for k, v in seen.items()}
            scores.update({f"healthy:{k}": float(v.healthy) for k, v in seen.items()})
            decisions.append(DecisionEvent("route", "rack_affinity", choices[0], tuple(r.request_id for r in batch),
                                           t, scores, choices=tuple(choices)))
        t += rng.uniform(5, 120)
        for ev in _block_events(rng, nodes, t):  # the batcher's prefix feed, between closes
            apply_block_event(blocks, ev)
            seen_blocks.append(ev)
        views_now = _views(rng, nodes, step)
        if window.close_reason(t, views_now).value in ("empty", "not yet") and step % 3 and (step // 6) % 3 != 2:
            continue
        log.take()
        outcome = window.close(t, views_now)
        draws = log.take()
        if not outcome.plans and not outcome.rejections and not offered:
            idle += 1  # as the batcher does: folded into the next record
            last_idle = t
            continue
        for plan in outcome.plans:
            for c in plan.choices:
                decisions.append(DecisionEvent("dispatch", c.policy, c.node, c.request_ids, t, dict(c.scores),
                                               c.draw, batch_id=f"b{step}", rack="r0", actor="batcher-a"))
        decisions.append(window_record(actor="batcher-a", rack="r0", policy=policies.default, reason="window elapsed",
                                       now_ms=t, nodes=views_now, offered=offered, draws=draws,
                                       pending_after=outcome.waiting, idle_closes=idle, last_idle_ms=last_idle,
                                       blocks=seen_blocks))
        seen_blocks = []
        offered = []
        idle = 0
        IDLE_SEEN[0] += 1 if decisions[-1].inputs.get("idle_closes") else 0
    # through the wire, as replay reads them
    return ([codec.decode(codec.encode(r)) for r in reqs],  # type: ignore[misc]
            [codec.decode(codec.encode(d)) for d in decisions])  # type: ignore[misc]


@pytest.mark.parametrize("policy", ["weighted", "power_of_two", "random", "round_robin", "kv_aware",
                                    "least_outstanding", "static_weight", "work_aware", "llm_d", "dynamo", "sglang",
                                    "lmetric"])
def test_replay_with_the_recorded_policy_matches_every_decision(tmp_path: Path, policy: str) -> None:
    config = _config(tmp_path, policy)
    reqs, decisions = record_run(config)
    rp = Replayer(config)
    for r in reqs:
        rp.add_request(r)
    for d in decisions:
        rp.decision(d)
    st = rp.finish()
    assert st.dispatch_decisions > 50 and st.route_decisions > 200
    assert st.match_rate == 1.0, rp.differences[:5]
    assert not rp.differences
    assert st.requests_same_node == st.requests_dispatched_recorded > 0
    assert IDLE_SEEN[0] > 0, "the run should fold some idle closes into records"


def test_replay_of_a_recording_that_starts_mid_run_still_matches_random_policies(tmp_path: Path) -> None:
    """The recorded draws, not the seed's stream position, drive a random policy: dropping the first half of the
    decisions (and their requests) still replays the rest exactly, once the waiting requests of the cut are gone."""
    config = _config(tmp_path, "weighted")
    reqs, decisions = record_run(config, closes=120)
    windows = [d for d in decisions if d.kind == "window"]
    cut = windows[len(windows) // 2].ts_ms
    rp = Replayer(config, count_from_ms=cut)
    later = [d for d in decisions if d.ts_ms >= cut - 5_000]  # a lead-in, as `replay export --lead-in-s` takes
    for r in reqs:
        rp.add_request(r)
    for d in later:
        rp.decision(d)
    st = rp.finish()
    assert st.dispatch_decisions > 10
    # requests offered before the lead-in and still waiting cannot be known: allow those, nothing else
    assert st.match_rate >= 0.9, (st, rp.differences[:5])


def test_what_if_with_another_policy_reports_the_differences(tmp_path: Path) -> None:
    config = _config(tmp_path, "weighted")
    reqs, decisions = record_run(config)
    rp = Replayer(config, policy="least_outstanding")
    for r in reqs:
        rp.add_request(r)
    for d in decisions:
        rp.decision(d)
    st = rp.finish()
    assert rp.what_if
    assert st.dispatch_matched < st.dispatch_decisions
    assert any(d.kind == "dispatch" for d in rp.differences)
    assert st.route_matched == st.route_decisions  # the router policy did not change
    with pytest.raises(ValueError, match="valid"):
        Replayer(config, policy="no-such-policy")


def test_recording_file_round_trips_and_refuses_damage(tmp_path: Path) -> None:
    path = tmp_path / "x.rfr"
    w = RecordingWriter(path, Header(since_ms=1.0, until_ms=2.0, lead_in_ms=0.0, config={"a": 1}))
    entries = [("rf:ingress", f"{i}-0", {b"v": b"1", b"t": b"request", b"d": bytes([i % 256]) * 10})
               for i in range(5000)]
    for e in entries:
        w.add(*e)
    h = w.close()
    assert h.counts == {"rf:ingress": 5000}
    assert read_header(path).config == {"a": 1} and read_header(path).total == 5000
    assert list(read_records(path)) == entries
    bad = tmp_path / "bad.rfr"
    bad.write_bytes(b"NOPE" + path.read_bytes()[4:])
    with pytest.raises(RecordingError, match="not a rackflow recording"):
        read_header(bad)
    cut = tmp_path / "cut.rfr"
    cut.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(RecordingError, match="truncated or damaged"):
        list(read_records(cut))


def _two_routers_recording(config: RackflowConfig, actors: tuple[str, str]) -> tuple[list[RequestEvent],
                                                                                     list[DecisionEvent]]:
    """Route decisions of two routing processes (a router and a gateway that routes itself), interleaved batch by
    batch, each with its own policy object, made by the code both run (RackRouting): the share guard counts what
    its own process sent."""
    from workers.stores.rack_routing import RackRouting

    rng = random.Random(11)
    live = {a: RackRouting(config, rack_router(config), None) for a in actors}
    reqs: list[RequestEvent] = []
    decisions: list[DecisionEvent] = []
    for b in range(60):
        actor = actors[0] if b % 3 else actors[1]  # unequal traffic: the guard's counts differ between the two
        rt = live[actor]
        views = {rk: RackView(rk, True, float(rng.randrange(0, 4)), float(rng.randrange(0, 9000)),
                              4 if rk == "r0" else 3)
                 for rk in ("r0", "r1")}
        seen = dict(views)
        ids, choices = [], []
        for _ in range(rng.randrange(1, 6)):
            req = _request(rng, len(reqs), 1000.0 + b, None)
            req = dataclasses.replace(req, user_id=f"user-{rng.randrange(3)}")  # few users: the guard walks them
            d = rt.route(req, views, None)
            assert d.rack is not None
            rt.forward(codec.encode(req), req, d, views, 1000.0 + b, "test")  # charges the rack in `views`
            reqs.append(dataclasses.replace(req, rack=d.rack))
            ids.append(req.request_id)
            choices.append(d.rack)
        decisions.append(rt.decision_event(seen, ids, choices, {}, {}, 1000.0 + b, actor))
    return reqs, decisions


def _replayed(config: RackflowConfig, reqs: list[RequestEvent], decisions: list[DecisionEvent]) -> Replayer:
    rp = Replayer(config)
    for q in reqs:
        rp.add_request(q)
    for d in decisions:
        rp.decision(d)
    rp.finish()
    return rp


def test_route_decisions_of_several_routing_processes_replay_each_with_its_own_policy(tmp_path: Path) -> None:
    config = _config(tmp_path, "work_aware")
    assert config.policies.router.share_bound > 0  # the guard is on: a process's decisions depend on its history
    reqs, decisions = _two_routers_recording(config, ("router-1", "gateway-ab12"))
    rp = _replayed(config, reqs, decisions)
    assert rp.stats.route_decisions == len(reqs) and rp.stats.route_matched == len(reqs), rp.differences[:3]
    # the test can fail: one policy object for both processes (the old replay) re-decides some differently
    merged = _replayed(config, reqs, [dataclasses.replace(d, actor="") for d in decisions])
    assert merged.stats.route_matched < len(reqs)


def test_a_window_record_keeps_each_node_view_whole_the_learned_prefill_speed_included() -> None:
    """Every NodeView field a node policy reads is in the record: `work_aware` prices prefill with the node's learned
    prefill slowdown, and a replay without it placed 138 of 858 requests elsewhere (the parity tier's multiturn)."""
    import dataclasses as dc

    from pipeline.replay import VIEW_FIELDS, view_from_inputs, view_inputs

    v = NodeView("r0-n1", True, 80.0, 40.0, 0.0, 12.0, 1e7, 4e6, running=3, waiting=2, prefill_tokens=900,
                 decode_seqs=3, decode_tokens=4000, kv_usage=0.4, slowdown=1.3, max_seqs=64, prefill_slowdown=1.8)
    assert {f.name for f in dc.fields(NodeView)} - {"name"} == set(VIEW_FIELDS)
    assert view_from_inputs(v.name, view_inputs(v)) == v
    unlearned = dc.replace(v, prefill_slowdown=None)
    assert view_from_inputs(v.name, view_inputs(unlearned)) == unlearned
    # a record written before the field existed: the view as it was then (prefill priced at `slowdown`)
    cut = VIEW_FIELDS.index("prefill_slowdown")
    assert view_from_inputs(v.name, view_inputs(v)[:cut]) == unlearned
    # the batch-class fields: kept, and 0 in a record written before them
    busy = dc.replace(v, batch_seqs=2, batch_kv_kb=1.5e6)
    assert view_from_inputs(v.name, view_inputs(busy)) == busy
    assert view_from_inputs(v.name, view_inputs(busy)[:cut + 1]) == v
