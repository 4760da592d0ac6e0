"""`rackflow bench ...`: benchmarks that report medians of repeated runs, measured side by side in one process.

- `streams`: the cost of the stream layer on this machine: msgpack codec encode/decode of a RequestEvent, pipelined
  XADD, and the consumer-group runner (XREADGROUP + decode + XACK) end to end, against a real Valkey (embedded,
  unless URLs are given).
- `profile`: the gateway's profiling step (Gateway.profile: validation, token estimate, memory estimate, prefix
  block hashes) on an 8,000-token prompt, in-process; prose, CJK and code prompts; p50/p99 in microseconds.
- `route`: routing decisions (rack by affinity hash + node by policy) for 64 nodes in 8 racks, in-process.
- `gateway`: the HTTP gateway under concurrent clients through the live pipeline (`workers/bench/gateway.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from pipeline.events import RequestEvent
from pipeline.stats import percentile
from streams import codec
from streams.runner import Delivery, StreamConsumer, StreamProducer, connect
from workers.shell.runtime import WALL


def _req(i: int) -> RequestEvent:
    return RequestEvent(
        request_id=str(uuid.uuid4()), version=1, tenant="bench", user_id=f"u{i % 100}", model="qwen2-7b",
        in_tokens=1000, out_tokens=200, max_tokens=200, mem_est_kb=500_000.0, arrival_ms=WALL.now_ms(),
        rack="r0",
    )


async def _bench_streams(redis_url: str, n: int, repeats: int = 3) -> dict[str, Any]:
    from workers.bench.gateway import valkey_cpu_s

    events = [_req(i) for i in range(n)]
    enc, dec, xadd, consume = [], [], [], []
    server_xadd_us, server_read_us = [], []  # Valkey's own CPU per entry: the shard's service time
    r = connect(redis_url)
    try:
        for rep in range(repeats):
            t = time.perf_counter()
            encoded = [codec.encode(e) for e in events]
            enc.append(n / (time.perf_counter() - t))
            t = time.perf_counter()
            for f in encoded:
                codec.decode(f)
            dec.append(n / (time.perf_counter() - t))
            stream = f"rf:bench:{uuid.uuid4().hex}"
            producer = StreamProducer(r, WALL.now_ms, 3_600_000)
            cpu0 = await valkey_cpu_s(redis_url)
            t = time.perf_counter()
            for i in range(0, n, 500):
                await producer.add_many((stream, e) for e in events[i : i + 500])
            xadd.append(n / (time.perf_counter() - t))
            cpu1 = await valkey_cpu_s(redis_url)
            if cpu0 is not None and cpu1 is not None:
                server_xadd_us.append((cpu1 - cpu0) * 1e6 / n)
            seen = [0]
            finished = asyncio.Event()

            async def handle(ds: list[Delivery], seen: list[int] = seen, finished: asyncio.Event = finished) -> None:
                seen[0] += len(ds)
                if seen[0] >= n:
                    finished.set()

            consumer = StreamConsumer(r, stream, "bench", f"c{rep}", handle, now_ms=WALL.now_ms, count=500,
                                      block_ms=50)
            t = time.perf_counter()
            task = asyncio.create_task(consumer.run())
            await asyncio.wait_for(finished.wait(), timeout=120)
            consume.append(n / (time.perf_counter() - t))
            consumer.stop()
            await task
            cpu2 = await valkey_cpu_s(redis_url)
            if cpu1 is not None and cpu2 is not None:
                server_read_us.append((cpu2 - cpu1) * 1e6 / n)
            await consumer.close()
            await r.delete(stream)
    finally:
        await r.aclose()
    return {
        "entries": n,
        "repeats": repeats,
        "codec_encode_per_s": round(statistics.median(enc)),
        "codec_decode_per_s": round(statistics.median(dec)),
        "xadd_pipelined_per_s": round(statistics.median(xadd)),
        "consume_ack_per_s": round(statistics.median(consume)),
        # Valkey's own CPU (INFO cpu) per entry appended / read and acknowledged: one shard's main thread saturates
        # at 1e6 / these entries per second (the client rates above are one Python client's)
        "valkey_cpu_us_per_xadd": round(statistics.median(server_xadd_us), 3) if server_xadd_us else None,
        "valkey_cpu_us_per_read_ack": round(statistics.median(server_read_us), 3) if server_read_us else None,
    }


_PROSE = (
    "the cluster routes each request to a rack and a node while the batcher packs a window of requests into the "
    "memory budget of the chosen node so that small requests are not starved and large ones still run "
).split()
_CJK = "请求进入网关后会被估算输入长度模型版本和显存需求然后路由到机柜与节点滑动窗口按显存预算合并批次"
_CODE = "def route(req, nodes):\n    w = {n.name: (n.free / n.total) * (1 - n.pcie / 100) for n in nodes}\n"


def _text_of_tokens(kind: str, tokens: int, rates: Any) -> str:
    from pipeline.tokens import estimate_tokens

    unit = {"prose": " ".join(_PROSE) + " ", "cjk": _CJK, "code": _CODE}[kind]
    text = unit * (tokens * 8 // max(1, estimate_tokens(unit, rates)) + 2)
    lo, hi = 0, len(text)
    while lo < hi:  # shortest prefix whose estimate reaches `tokens`
        mid = (lo + hi) // 2
        if estimate_tokens(text[:mid], rates) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return text[:lo]


def _percentiles_us(samples: list[float]) -> tuple[float, float]:
    return round(percentile(samples, 50) * 1e6, 1), round(percentile(samples, 99) * 1e6, 1)


def bench_profile(config_dir: Path, overrides: list[Path], tokens: int = 8000, iterations: int = 3000,
                  tokenizer: str | None = None) -> dict[str, Any]:
    import gc

    from pipeline.config import load_config
    from pipeline.profiling import ProfileInput
    from workers.stores.ingress import Gateway

    config = load_config(config_dir, overrides)
    model = "qwen2-7b"
    if tokenizer:
        raw = config.model_dump()
        raw["models"][model]["tokenizer"] = tokenizer
        from pipeline.config import parse_config

        config = parse_config(raw)
    gw = Gateway(config, None)  # type: ignore[arg-type]  # profile() does no I/O
    rates = config.token_rates(model)
    out: dict[str, Any] = {"tokens": tokens, "iterations": iterations, "exact_tokenizer": bool(tokenizer)}
    per_kind = {}
    for kind in ("prose", "cjk", "code"):
        text = _text_of_tokens(kind, tokens, rates)
        samples = []
        gc.collect()
        for i in range(iterations + 200):
            inp = ProfileInput(f"bench-{i}", "t", "u", model, 0.0, prompt=text, max_tokens=256)
            t = time.perf_counter()
            req = gw.profile(inp)
            dt = time.perf_counter() - t
            if i >= 200:  # warm-up excluded
                samples.append(dt)
        p50, p99 = _percentiles_us(samples)
        per_kind[kind] = {"p50_us": p50, "p99_us": p99, "in_tokens": req.in_tokens, "chars": len(text),
                          "prefix_blocks": len(req.prefix_hashes)}
    out["by_kind"] = per_kind
    out["p50_us"] = max(v["p50_us"] for v in per_kind.values())
    out["p99_us"] = max(v["p99_us"] for v in per_kind.values())
    return out


def bench_route(iterations: int = 20000, racks: int = 8, nodes_per_rack: int = 8) -> dict[str, Any]:
    import random

    from pipeline.config import NodeSelectionPolicy, PrefixCacheRule, RouterPolicy, load_config
    from pipeline.costmodel import CalibratedCostModel
    from pipeline.events import RequestEvent
    from pipeline.routing.prefix_index import BlockIndex
    from pipeline.routing.rack_affinity import RackAffinityRouter, keeps_prefix_cache, rack_cached_tokens
    from pipeline.routing.registry import NODE_POLICIES, NodePolicySet, PolicyContext
    from pipeline.routing.views import NodeView, RackView

    rng = random.Random(7)
    rack_names = [f"r{i}" for i in range(racks)]
    rp = RouterPolicy()
    router = RackAffinityRouter.from_config({"m": rack_names}, rp)
    rule = PrefixCacheRule()
    views = {r: RackView(r, True, float(rng.randint(0, 50)), float(rng.randint(0, 400_000)), nodes_per_rack)
             for r in rack_names}
    nodes = {
        r: [
            NodeView(f"{r}-n{j}", True, 80.0, rng.uniform(5, 60), rng.uniform(0, 60), rng.uniform(5, 40),
                     72e6, rng.uniform(1e6, 70e6), rng.randint(0, 64), rng.randint(0, 8),
                     prefill_tokens=rng.randint(0, 20_000), decode_seqs=rng.randint(0, 64),
                     decode_tokens=rng.randint(0, 400_000), kv_usage=rng.uniform(0, 0.9), max_seqs=256)
            for j in range(nodes_per_rack)
        ]
        for r in rack_names
    }
    cfg = load_config()
    cost = CalibratedCostModel.for_node(cfg, cfg.nodes()[0])  # every node: an H100 serving Qwen2-7B
    blocks = BlockIndex()  # what the nodes' block events would have reported: a pool of shared prefixes
    pool = [tuple(rng.randrange(1 << 40) for _ in range(8)) for _ in range(200)]
    node_rack = {n.name: r for r in rack_names for n in nodes[r]}
    for prefix in pool:
        for n in rng.sample(sorted(node_rack), 2):
            blocks.stored(n, prefix[: rng.randint(1, 8)])
    reqs = [
        RequestEvent(f"q{i}", 1, "t", f"user-{rng.randrange(5000)}", "m", rng.randint(10, 4000), 200, 200, 1.0, 0.0,
                     prefix_hashes=rng.choice(pool)[: rng.randint(0, 8)])
        for i in range(2000)
    ]
    out: dict[str, Any] = {"racks": racks, "nodes": racks * nodes_per_rack, "iterations": iterations}
    per_policy = {}
    for name in sorted(NODE_POLICIES):
        params = NodeSelectionPolicy(policy=name)  # type: ignore[arg-type]
        sets = {r: NodePolicySet(params, 1, r, {n.name: "h100-80gb" for n in nodes[r]}, 512,
                                 context=PolicyContext(node_gpus={n.name: "h100-80gb" for n in nodes[r]},
                                                       block_tokens=512, cost_of=lambda _n: cost, blocks=blocks,
                                                       node_blocks=2000))
                for r in rack_names}
        samples = []
        rack_samples: list[float] = []  # the router's part: prefix lookup, rack choice, prefix-cache rule
        t_all = time.perf_counter()
        for i in range(iterations):
            q = reqs[i % len(reqs)]
            t = time.perf_counter()
            cached = rack_cached_tokens(blocks.matches(q.prefix_hashes), node_rack, 512, q.in_tokens)
            d = router.route(q.user_id, q.model, views, cached)
            keeps_prefix_cache(rule.enabled, rule.min_tokens, q.in_tokens, d, True)
            rack_samples.append(time.perf_counter() - t)
            pol = sets[d.rack or rack_names[0]].get(name)
            ch = pol.choose(nodes[d.rack or rack_names[0]], q)
            if ch.node is not None:
                pol.observe(ch.node, q)
            samples.append(time.perf_counter() - t)
        total = time.perf_counter() - t_all
        p50, p99 = _percentiles_us(samples)
        r50, r99 = _percentiles_us(rack_samples)
        per_policy[name] = {"decisions_per_s": round(iterations / total), "p50_us": p50, "p99_us": p99,
                            "rack_p50_us": r50, "rack_p99_us": r99}
    out["by_policy"] = per_policy
    default = NodeSelectionPolicy().policy
    out["policy"] = default
    out["decisions_per_s"] = per_policy[default]["decisions_per_s"]
    out["p99_us"] = per_policy[default]["p99_us"]
    out["p50_us"] = per_policy[default]["p50_us"]
    out["router_rack_p50_us"] = per_policy[default]["rack_p50_us"]
    out["router_rack_p99_us"] = per_policy[default]["rack_p99_us"]
    return out


def run_bench(args: argparse.Namespace, endpoints: tuple[str, str] | None) -> int:
    from workers.local.services import EmbeddedServices

    if args.what in ("pipeline", "batching", "kv", "failover", "gateway", "streams-capacity"):
        services = None
        tmp = None
        failed: list[str] = []
        if endpoints is None:
            tmp = tempfile.TemporaryDirectory(prefix="rackflow-bench-")
            services = EmbeddedServices(Path(tmp.name))
            ep = services.start()
            endpoints = (ep.redis_url, ep.etcd_url)
        try:
            if args.what == "pipeline":
                from workers.bench.pipeline import bench_pipeline

                res = bench_pipeline(endpoints[0], endpoints[1], requests=args.requests,
                                     progress=not args.no_progress)
            elif args.what == "batching":
                from workers.bench.pipeline import bench_batching

                res = bench_batching(endpoints[0], endpoints[1], requests=args.requests_batching,
                                     progress=not args.no_progress)
            elif args.what == "gateway":
                from workers.bench.gateway import bench_gateway

                res = bench_gateway(endpoints[0], endpoints[1], clients=getattr(args, "clients", 32),
                                    duration_s=getattr(args, "duration_s", 12.0), repeats=args.repeats,
                                    progress=not args.no_progress, window_hold=getattr(args, "window_hold", False),
                                    http_parser=getattr(args, "http_parser", None),
                                    routing=getattr(args, "routing", None))
                if getattr(args, "peer", None):
                    failed = _bench_peers(res, args.peer, progress=not args.no_progress)
            elif args.what == "streams-capacity":
                from workers.bench.streams_capacity import bench_streams_capacity

                res = bench_streams_capacity(endpoints[0], endpoints[1], streams=args.streams,
                                             max_tokens=args.stream_tokens, progress=not args.no_progress)
            elif args.what == "failover":
                from workers.bench.failover import bench_failover

                res = bench_failover(endpoints[0], endpoints[1], progress=not args.no_progress)
            else:
                from workers.bench.kv import bench_kv

                res = bench_kv(endpoints[0])
        finally:
            if services is not None:
                services.stop()
            if tmp is not None:
                tmp.cleanup()
        _print(res, args.json)
        return 1 if failed else 0
    if args.what in ("profile", "route"):
        if args.what == "profile":
            res = bench_profile(Path(args.config_dir), [Path(p) for p in args.config],
                                tokenizer=getattr(args, "tokenizer", None))
        else:
            res = bench_route()
        _print(res, args.json)
        return 0
    services = None
    tmp = None
    if endpoints is None:
        tmp = tempfile.TemporaryDirectory(prefix="rackflow-bench-")
        services = EmbeddedServices(Path(tmp.name))
        ep = services.start()
        endpoints = (ep.redis_url, ep.etcd_url)
    try:
        if args.what == "streams":
            res = asyncio.run(_bench_streams(endpoints[0], args.entries))
        else:  # argparse restricts the choices
            raise ValueError(args.what)
    finally:
        if services is not None:
            services.stop()
        if tmp is not None:
            tmp.cleanup()
    _print(res, args.json)
    return 0


def _bench_peers(res: dict[str, Any], peers: list[str], progress: bool) -> list[str]:
    """Each peer of `--peer` beside rackflow's figures in `res`, then the bare HTTP endpoint, with the same load
    generator, clients, durations and repeats, one after the other in this run. `res["peers"]` gets one entry per
    peer; `res["peer"]` is the first one measured (the key the earlier single `--peer smg` wrote). A peer that
    cannot be installed or started gets a one-line error on stderr and an `unavailable` entry, and the others (and
    rackflow's figures, measured first) are still reported. Returns the names of the peers that failed."""
    from workers.bench.peer import PeerUnavailable, bench_bare, bench_peer
    from workers.local.supervise import ServiceError

    same = {"clients": res["clients"], "duration_s": res["duration_s"], "repeats": res["repeats"],
            "max_tokens": res["max_tokens"], "progress": progress,
            "http": res["http_parser"]}  # the shims parse HTTP as the gateway does
    res["peers"] = {}
    failed = []
    for name in peers:
        try:
            got = bench_peer(**same, peer=name)
        except (PeerUnavailable, ServiceError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"rackflow bench gateway: peer {name} unavailable: {first}", file=sys.stderr, flush=True)
            res["peers"][name] = {"name": name, "unavailable": str(e)}
            failed.append(name)
            continue
        res["peers"][name] = got
        res.setdefault("peer", got)
    res["bare"] = bench_bare(**same)
    return failed


def _print(res: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(res, sort_keys=True))
        return
    for k, v in res.items():
        if isinstance(v, dict):
            print(f"{k}:")
            for k2, v2 in v.items():
                print(f"  {k2:<22} {v2}")
        else:
            print(f"{k:<24} {v}")
