"""The simulator's engine model and admission as the live engines and gateway behave, the traces the decision matrix
runs, and the default policy's edge over round robin on a prefix-heavy trace."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from pipeline.config import DEFAULT_CONFIG_DIR, load_config
from pipeline.costmodel import CalibratedCostModel
from pipeline.sim.node import SimNode, SimSeq
from pipeline.sim.report import summarize
from pipeline.sim.simulator import SimParams, Simulator
from pipeline.sim.traces import MultiTurnSpec, TraceRequest, multiturn, parse_mooncake, scale_rate, to_jsonl
from pipeline.tokens import prefix_hashes_from_ids
from tests.unit.test_sim import cfg, costs

REPO = Path(__file__).resolve().parents[2]
MOONCAKE = REPO / "data" / "traces" / "mooncake-fast25" / "synthetic_trace.jsonl"
CONFIG = load_config(DEFAULT_CONFIG_DIR)
H100 = CalibratedCostModel.for_node(CONFIG, CONFIG.nodes()[0])


def node(**kw: object) -> SimNode:
    args: dict[str, object] = dict(kv_capacity_tokens=1_000_000, block_size=16, max_num_seqs=256,
                                   max_batched_tokens=8192, mem_cap_kb=1e9, vram_total_gb=80.0, weights_gb=15.0,
                                   kv_bytes_per_token=57344, prefix_block_tokens=512)
    args.update(kw)
    return SimNode("n", "r", H100, **args)  # type: ignore[arg-type]


def test_admission_takes_waiting_prompts_only_with_what_the_iteration_budget_has_left() -> None:
    n = node()
    for i in range(10):
        n.submit(SimSeq(i, 6000, 10, 1.0))
    n.schedule(0.0)
    # 6,000 + 6,000 >= 8,192: the second fills the budget, the other eight wait holding no KV (vLLM v1)
    assert len(n.prefilling) == 2 and len(n.waiting) == 8
    assert n.kv_tokens == 12_000 and n.prefill_backlog == 60_000


def test_a_prefix_in_host_memory_is_a_hit_loaded_over_the_host_link() -> None:
    gpu_only = node(kv_capacity_tokens=1024, host_cache_blocks=0)
    tiered = node(kv_capacity_tokens=1024, host_cache_blocks=64, host_link_gbps=32.0)
    for n in (gpu_only, tiered):  # prompt A (4 blocks) then B push A's blocks out of the 2-block GPU cache
        for rid, hashes in ((0, (1, 2, 3, 4)), (1, (9, 8, 7, 6))):
            n.submit(SimSeq(rid, 2048, 1, 1.0, hashes))
            t = 0.0
            while n.waiting or n.prefilling or n.decoding:
                end = n.schedule(t)
                assert end is not None
                n.finish_phase(end)
                t = end
    for n in (gpu_only, tiered):
        n.submit(SimSeq(2, 2048, 1, 1.0, (1, 2, 3, 4)))
        n.schedule(100_000.0)
    assert gpu_only.prefilling[0].cached == 0
    s = tiered.prefilling[0]
    assert s.cached == 2047 and tiered.host_hit_tokens == 2047
    # the load time (2047 tokens x 57,344 B over 32 GB/s) is in the iteration: more than a 1-token prefill alone
    assert tiered.phase is not None and tiered.phase[1] - 100_000.0 > 2047 * 57344 / 32e6


def test_above_capacity_the_gateway_sheds_and_the_cluster_keeps_serving_at_capacity() -> None:
    config = cfg(racks=1, nodes=2, policy="work_aware", estimator="shape")
    rng = random.Random(5)
    # about twice what two nodes serve, for two minutes
    flood = [TraceRequest(i * 20.0, rng.randint(1500, 4000), rng.randint(50, 300), f"u{i % 50}")
             for i in range(6000)]
    shed = summarize(Simulator(config, flood, costs(config), params=SimParams()).run())
    queued = summarize(Simulator(config, flood, costs(config), params=SimParams(admission=False)).run())
    assert shed["completed"] + shed["dropped"] == 6000 and shed["shed"] > 0
    assert shed["drop_reasons"] == {"shed (429)": shed["shed"]}
    # what is admitted waits about max_queue_s at most; without admission the queue, and the wait, keeps growing
    assert shed["ttft_p99_ms"] < 0.5 * queued["ttft_p99_ms"]
    assert shed["steady_throughput_rps"] > 0.9 * queued["steady_throughput_rps"]


def test_the_multiturn_trace_grows_each_users_prompt_and_hashes_it_as_the_gateway_does(tmp_path: Path) -> None:
    spec = MultiTurnSpec(conversations=40, block_tokens=64, system_tokens_mean=300, message_tokens_mean=80,
                         answer_tokens_mean=60)
    reqs = multiturn(spec, random.Random(3), prefix_hashes_from_ids)
    by_user: dict[str, list[TraceRequest]] = {}
    for r in reqs:
        by_user.setdefault(r.user_id, []).append(r)
    assert any(len(v) > 1 for v in by_user.values())
    for turns in by_user.values():
        for a, b in itertools.pairwise(turns):
            assert b.arrival_ms > a.arrival_ms and b.in_tokens > a.in_tokens + a.out_tokens
            assert b.prefix_hashes[: len(a.prefix_hashes)] == a.prefix_hashes  # the earlier turn is its prefix
    path = tmp_path / "mt.jsonl"
    path.write_text("".join(to_jsonl(r) + "\n" for r in reqs))
    back = list(parse_mooncake(path.read_text().splitlines()))
    assert [(r.in_tokens, r.out_tokens, r.user_id, r.prefix_hashes) for r in back] == [
        (r.in_tokens, r.out_tokens, r.user_id, r.prefix_hashes) for r in reqs]


def test_work_aware_beats_round_robin_on_the_mooncake_trace() -> None:
    with open(MOONCAKE) as fh:
        reqs = list(parse_mooncake(fh, 1200))
    from pipeline.sim.traces import assign_users

    reqs = assign_users(list(scale_rate(reqs, 3.0)), 500, 1.1, random.Random(2))
    out = {}
    for pol in ("round_robin", "work_aware"):
        config = cfg(policy=pol, estimator="shape")
        out[pol] = summarize(Simulator(config, reqs, costs(config)).run())
    rr, wa = out["round_robin"], out["work_aware"]
    assert wa["prefix_hit_rate"] > 1.5 * rr["prefix_hit_rate"]
    assert wa["ttft_p99_ms"] < 0.5 * rr["ttft_p99_ms"] and wa["p99_ms"] < rr["p99_ms"]


def test_a_shared_kv_pool_leaves_cached_prefixes_only_the_room_the_running_sequences_leave() -> None:
    """vLLM keeps cached blocks in the pool its running sequences use: a running sequence's own KV beyond its prefix
    blocks crowds out a finished prompt's blocks, which a cache of the node's whole capacity besides the sequences
    would have kept."""
    def cached(shares: bool) -> int:
        n = node(kv_capacity_tokens=4096, block_size=16, prefix_shares_kv=shares)
        n.submit(SimSeq(0, 1024, 1, 1.0, (1, 2)))  # 2 blocks, finished at once: cached
        # 3,200 tokens, 2,560 of them in 5 prefix blocks: 896 tokens of the pool stay free, room for 1 more block
        n.submit(SimSeq(1, 3200, 400, 1.0, (7, 8, 9, 10, 11)))
        t, again = 0.0, False
        while n.waiting or n.prefilling or n.decoding:
            if n.decoding and not again:  # the first prompt again, while the long one decodes
                n.submit(SimSeq(2, 1024, 1, 1.0, (1, 2)))
                again = True
            end = n.schedule(t)
            assert end is not None
            n.finish_phase(end)
            t = end
        return n.cached_tokens

    assert cached(False) == 1023  # the whole prompt but its last token
    assert cached(True) == 512  # its least recently used block (inserted first: the tail) was reused
