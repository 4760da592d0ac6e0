"""The oracle-free simulator: what clients send, the hidden world each node runs, and the speed belief that learns
it (pipeline/sim/world.py, pipeline/costmodel/online.py)."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
from dataclasses import replace

from pipeline.config import load_config
from pipeline.costmodel.online import SpeedBelief
from pipeline.events import RequestEvent
from pipeline.sim.report import summarize
from pipeline.sim.simulator import SimParams, Simulator
from pipeline.sim.world import ClientModel, WorldSpec
from tests.unit.test_sim import azure, cfg, costs


def test_a_client_cap_is_never_below_the_true_length_and_some_clients_send_none() -> None:
    rng = random.Random(5)
    client = ClientModel()
    trues = [max(1, int(rng.lognormvariate(5.0, 1.2))) for _ in range(20_000)]
    sent = [client.draw(t, rng) for t in trues]
    unset = sum(1 for s in sent if s is None) / len(sent)
    assert abs(unset - client.unset_frac) < 0.02
    assert all(s >= t for s, t in zip(sent, trues, strict=True) if s is not None)
    # round numbers, as clients send them
    assert all(s in client.caps or s % 1024 == 0 for s in sent if s is not None)
    # reproducible
    rng2 = random.Random(5)
    trues2 = [max(1, int(rng2.lognormvariate(5.0, 1.2))) for _ in range(20_000)]
    assert [client.draw(t, rng2) for t in trues2] == sent


def test_the_belief_learns_two_hidden_factors_through_noise_and_stalls() -> None:
    rng = random.Random(11)
    f_pre, f_dec = 1.32, 0.87
    belief = SpeedBelief()
    for k in range(400):
        noise = math.exp(rng.gauss(0.0, 0.05))
        stall = 150.0 if rng.random() < 0.01 else 0.0
        if k % 3 == 0:  # an iteration that prefills a chunk next to a decode batch
            pre, dec = rng.uniform(20.0, 200.0), rng.uniform(5.0, 15.0)
        else:
            pre, dec = 0.0, rng.uniform(5.0, 40.0)
        belief.observe((f_pre * pre + f_dec * dec) * noise + stall, pre, dec)
    assert abs(belief.prefill / f_pre - 1.0) < 0.05
    assert abs(belief.decode / f_dec - 1.0) < 0.05
    assert belief.error(f_pre, f_dec) < 0.05
    # one stall of 2 s moves a warm belief by a bounded step, not by its size
    before = belief.decode
    belief.observe(2000.0 + 10.0 * f_dec, 0.0, 10.0)
    assert belief.decode / before < math.exp(belief.p.clip_log * belief.p.alpha) + 1e-9


def test_world_factors_are_seeded_per_node_and_some_nodes_are_slow_with_no_signal() -> None:
    spec = WorldSpec()
    names = [f"r{r}-n{n}" for r in range(2) for n in range(4)]
    assert spec.slow_nodes(names, 7) == spec.slow_nodes(names, 7)
    assert len(spec.slow_nodes(names, 7)) == 1
    a, b = spec.node("r0-n1", 7, False), spec.node("r0-n1", 7, False)
    assert (a.prefill, a.decode) == (b.prefill, b.decode)
    c = spec.node("r0-n1", 8, False)
    assert (a.prefill, a.decode) != (c.prefill, c.decode)
    slow = spec.node("r0-n1", 7, True)
    assert math.isclose(slow.prefill, a.prefill * spec.slow_node_factor)


def test_the_control_plane_never_sees_the_true_output_length() -> None:
    # the same arrivals, one run with every true length doubled: what the control plane expected of each request's
    # first appearance per user (before any of that user's results) must not move
    config = cfg(policy="work_aware", estimator="shape")
    reqs = azure(600, rate=2.0)
    longer = [replace(r, out_tokens=2 * r.out_tokens) for r in reqs]
    a = Simulator(config, reqs, costs(config)).run()
    b = Simulator(config, longer, costs(config)).run()
    assert not a.oracle and not b.oracle
    assert a.max_tokens == b.max_tokens or all(  # the client model's caps scale with the true length, or are unset
        (x is None) == (y is None) for x, y in zip(a.max_tokens, b.max_tokens, strict=True))
    seen: set[str] = set()
    firsts = []
    for i, r in enumerate(reqs):
        if r.user_id not in seen and a.max_tokens[i] is None:
            firsts.append(i)
        seen.add(r.user_id)
    assert firsts, "some users' first request goes without max_tokens"
    model_default = config.models["qwen2-7b"].default_out_tokens
    for i in firsts:
        assert a.expected_out[i] == b.expected_out[i] == model_default
    # with the oracle, the control plane is handed the truth
    o = Simulator(config, reqs, costs(config), params=SimParams(oracle=True)).run()
    assert o.oracle and o.expected_out == [r.out_tokens for r in reqs]
    # the engine ran every request to its true length in both worlds
    assert summarize(a)["completed"] == summarize(o)["completed"] == len(reqs)


def test_the_learned_belief_is_within_10_percent_of_the_world_by_a_tenth_of_the_run() -> None:
    config = cfg(policy="work_aware", estimator="shape")
    res = Simulator(config, azure(3000, rate=3.0), costs(config)).run()
    s = summarize(res)
    assert s["belief_error_median"] is not None and s["belief_error_median"] < 0.10
    assert s["belief_error_median_end"] < 0.10
    # the world differs from the control plane's model: the belief started 1.0 and had something to learn
    worlds = [max(abs(n.world.prefill - 1), abs(n.world.decode - 1)) for n in Simulator(
        config, azure(10), costs(config)).nodes if n.world is not None]
    assert statistics.median(worlds) > 0.03


def test_the_live_sim_engine_stops_at_the_true_length_with_stop_and_learns_its_speed() -> None:
    from workers.engines import build_engine

    config = load_config()
    node = config.nodes()[0].name
    clock = [0.0]
    eng = build_engine(config, node, "sim", now_ms=lambda: clock[0])

    async def sleep(s: float) -> None:
        clock[0] += s * 1000.0

    eng._sleep = sleep  # type: ignore[attr-defined]  # simulated time: the engine's own sleep advances the clock
    assert eng.node.world is not None  # type: ignore[attr-defined]
    eng.submit(RequestEvent("a", 1, "t", "u", "qwen2-7b", 300, 256, 4096, 1.0, 0.0, sim_out_tokens=37))
    eng.submit(RequestEvent("b", 1, "t", "u", "qwen2-7b", 300, 20, 20, 1.0, 0.0, sim_out_tokens=0))
    done = {}
    for _ in range(200):
        out = asyncio.run(eng.step())
        for f in out.finished:
            done[f.request_id] = (f.out_tokens, f.reason)
        if len(done) == 2:
            break
    assert done == {"a": (37, "stop"), "b": (20, "length")}
    st = eng.stats()
    assert st.slowdown != 1.0 and st.prefill_slowdown > 0  # learned from its own iterations, not handed over


def test_written_out_gauss_is_the_same_stream_as_randoms() -> None:
    """`pipeline.sim.world.gauss` draws what `random.Random.gauss` draws, to the last bit, and leaves the generator
    in the same state, interleaved with the generator's other draws and its own gauss (the spare value shared)."""
    import random

    from pipeline.sim.world import gauss

    a, b = random.Random(12345), random.Random(12345)
    for i in range(5000):
        mu, sigma = (i % 7) * 0.1 - 0.3, 0.05 + (i % 5) * 0.2
        if i % 11 == 0:
            assert a.random() == b.random()
        if i % 13 == 0:
            assert a.gauss(mu, sigma) == b.gauss(mu, sigma)
        assert gauss(a, mu, sigma) == b.gauss(mu, sigma)
    assert a.getstate() == b.getstate()
