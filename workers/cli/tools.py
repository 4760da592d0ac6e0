"""The operator's tools: `rackflow fault` (faults of simulated nodes), `token` (a development JWT), `tokens`
(calibrate the fast token estimator), `model` (the tiny checkpoint, a checkpoint's models entry), `config check`
and `perf` (the calibrated cost model)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

from workers.cli.common import config_of, endpoints
from workers.local.cluster import DEFAULT_VLLM_CHECKPOINT


def _clock(ms: float) -> str:
    """A wall-clock time an operator reads: local date and time to the second, with the zone."""
    import datetime

    return datetime.datetime.fromtimestamp(ms / 1000.0).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def _fault_line(node: str, f: Any, now_ms: float) -> str:
    what = {"slow": f"{f.factor:g}x slower", "nvlink-crc": f"{f.factor * 500:g} NVLink CRC errors a sample"}.get(
        f.kind, "")
    if f.active_at(now_ms):
        state = f"active, {max(0.0, (f.until_ms - now_ms) / 1000):.0f} s left"
    elif now_ms < f.at_ms:
        state = f"starts in {(f.at_ms - now_ms) / 1000:.0f} s"
    else:
        state = f"over {(now_ms - f.until_ms) / 1000:.0f} s ago"
    return (f"{node:<10} {f.kind:<11} {what or '-':<28} {_clock(f.at_ms)} -> {_clock(f.until_ms)}  {state}")


def cmd_fault(args: argparse.Namespace) -> int:
    from streams.runner import connect
    from workers.health import faults
    from workers.shell.runtime import WALL

    config = config_of(args)
    redis_url, _etcd_url = endpoints(args)
    try:
        schedule = faults.load_schedule(Path(args.schedule)) if args.action == "play" else []
        node = getattr(args, "node", None)
        for n in [node] if node else [s.node for s in schedule]:
            config.node(n)
        if args.action == "inject":
            faults.check(args.kind, args.duration, faults.DEFAULT_FACTOR.get(args.kind, 1.0)
                         if args.factor is None else args.factor)
    except KeyError as e:
        known = ", ".join(n.name for n in config.nodes())
        print(f"rackflow fault: {e.args[0]} (this cluster's nodes: {known})", file=sys.stderr)
        return 2
    except faults.FaultError as e:
        print(f"rackflow fault: {e}", file=sys.stderr)
        return 2

    async def go() -> int:
        r = connect(redis_url)
        try:
            now = WALL.now_ms()
            if args.action == "inject":
                f = await faults.inject(r, args.node, args.kind, args.duration, args.factor, now_ms=now)
                if args.json:
                    print(json.dumps({"node": args.node, **f.to_dict()}, sort_keys=True))
                else:
                    print(f"injected {f.kind} on {args.node} (fault {f.id}); the node's health agent acts on it at "
                          "its next sample, and `rackflow fault list` shows it")
                    print(_fault_line(args.node, f, now))
            elif args.action == "clear":
                print(f"cleared {await faults.clear(r, args.node)} faults of {args.node}")
            elif args.action == "list":
                rows = []
                for n in [args.node] if args.node else [x.name for x in config.nodes()]:
                    for f in sorted((await faults.listing(r, n)).values(), key=lambda f: f.at_ms):
                        rows.append((n, f))
                if args.json:
                    for n, f in rows:
                        state = "active" if f.active_at(now) else ("pending" if now < f.at_ms else "expired")
                        print(json.dumps({"node": n, **f.to_dict(), "state": state}, sort_keys=True))
                elif not rows:
                    print("no faults stored (an expired one stays listed until the agent clears it or "
                          "`rackflow fault clear` does)")
                else:
                    print(f"{'node':<10} {'kind':<11} {'effect':<28} {'from -> until':<51}  state")
                    for n, f in rows:
                        print(_fault_line(n, f, now))
                    print("a fault is what was injected; whether the node is in service now is the monitor's call "
                          "(its log, or the node's state in etcd)")
            else:
                stop = asyncio.Event()
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, stop.set)
                n = await faults.play_schedule(r, schedule, stop, WALL.now_ms)
                print(f"injected {n} of {len(schedule)} scheduled faults")
        finally:
            await r.aclose()
        return 0

    from redis.exceptions import RedisError

    try:
        return asyncio.run(go())
    except RedisError as e:
        print(f"rackflow fault: Redis/Valkey at {redis_url} failed: {e}", file=sys.stderr)
        return 1


def cmd_token(args: argparse.Namespace) -> int:
    from workers.gateway.auth import AuthError, mint_token

    config = config_of(args)
    try:
        print(mint_token(config.gateway.auth, tenant=args.tenant, sub=args.sub, models=args.model or None,
                         default_model=args.default_model, ttl_s=args.ttl, priority=args.priority,
                         tpm=args.tpm))
    except AuthError as e:
        print(f"rackflow token: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_tokens(args: argparse.Namespace) -> int:
    """Fit the fast estimator's rates to a real tokenizer over a corpus and print them for models.yaml."""
    from tokenizers import Tokenizer

    from pipeline.config import TokenRates
    from pipeline.tokens import estimate_tokens, fit_rates

    tok = Tokenizer.from_file(args.tokenizer)
    samples: list[tuple[str, int]] = []
    for path in args.corpus:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        for part in (p for p in text.split("\n\n") if p.strip()):
            samples.append((part, len(tok.encode(part, add_special_tokens=False).ids)))
    if len(samples) < 4:
        print("rackflow tokens calibrate: need at least 4 paragraphs (blank-line separated) in the corpus",
              file=sys.stderr)
        return 2
    train, test = samples[::2], samples[1::2]
    before, after = TokenRates(), fit_rates(train)

    def mape(rates: TokenRates) -> float:
        return 100 * sum(abs(estimate_tokens(t, rates) - n) / max(1, n) for t, n in test) / len(test)

    print(f"# {len(samples)} paragraphs; held-out mean abs error: default rates {mape(before):.1f}%, "
          f"fitted {mape(after):.1f}%")
    print(f"token_rates: {{cjk: {after.cjk:.3f}, latin: {after.latin:.3f}, code: {after.code:.3f}}}")
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    from workers.engines.checkpoint import model_spec, served_name, write_tiny_checkpoint

    if args.action == "tiny":
        print(write_tiny_checkpoint(Path(args.out)))
        return 0
    if not args.dir:
        print("rackflow model spec: give the checkpoint directory: rackflow model spec DIR", file=sys.stderr)
        return 2
    try:
        spec = model_spec(Path(args.dir))
    except (FileNotFoundError, KeyError, ValueError) as e:
        print(f"rackflow model spec: {e}", file=sys.stderr)
        return 2
    import yaml

    print(yaml.safe_dump({served_name(Path(args.dir)): spec}, sort_keys=False), end="")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    config = config_of(args)
    nodes = config.nodes()
    print(f"config OK: {len(config.cluster.racks)} racks, {len(nodes)} nodes, models {', '.join(config.models)}")
    for r in config.cluster.racks:
        for n in r.expanded():
            print(f"  {r.name}/{n.name}: {n.gpu} x{n.tp} serving {', '.join(n.models)}; batch budget "
                  f"{config.node_mem_budget_kb(n.name) / 1e6:.1f} GB")
    return 0


def cmd_perf(args: argparse.Namespace) -> int:
    """`rackflow perf ...`: iteration times from the calibrated cost model; `perf calibrate [--check]` refits it."""
    from workers.sim import perf

    config = config_of(args)
    if args.action == "calibrate":
        try:
            doc, profiles, cal = perf.fresh_document(config.gpus)
        except (OSError, ValueError) as e:  # unreadable profiles, CalibrationError
            print(f"rackflow perf calibrate: {e}", file=sys.stderr)
            return 2
        ops, iters = perf.error_tables(profiles, cal)
        print(perf.format_fit(cal), perf.format_operator_errors(ops), perf.format_iteration_errors(iters),
              perf.format_all_reduce_errors(perf.all_reduce_errors(profiles, cal)), sep="\n\n")
        target = Path(args.config_dir) / "calibration.json"
        text = perf.render(doc)
        if args.check:
            current = target.read_text(encoding="utf-8") if target.exists() else ""
            if current != text:
                print(f"rackflow: {target} is out of date with the profiles, configs/gpus.yaml or the fit; "
                      "regenerate it with `rackflow perf calibrate`", file=sys.stderr)
                return 1
            print(f"\n{target} is up to date")
            return 0
        target.write_text(text, encoding="utf-8")
        print(f"\nwrote {target}")
        return 0
    missing = [f"--{n.replace('_', '-')}" for n in ("model", "gpu", "prompt_tokens") if getattr(args, n) is None]
    if missing:
        print(f"rackflow perf: {', '.join(missing)} required (or `rackflow perf calibrate`)", file=sys.stderr)
        return 2
    try:
        cal = perf.load_calibration(perf.calibration_path(Path(args.config_dir)))
        numbers = perf.perf_numbers(config, args.model, args.gpu, args.tp, args.prompt_tokens, args.batch, cal)
    except ValueError as e:  # DoesNotFit, CalibrationError, a bad --tp/--batch/--prompt-tokens
        print(f"rackflow perf: {e}", file=sys.stderr)
        return 2
    print(json.dumps(numbers) if args.json else perf.format_perf(numbers))
    return 0


def add_parser(sub: Any) -> None:
    s = sub.add_parser("fault", help="inject, list or clear faults of a simulated node (the sim agent acts on them)",
                       description="Faults of simulated nodes, read by each node's health agent (`--source sim`).")
    fs = s.add_subparsers(dest="action", required=True, metavar="{inject,list,clear,play}")
    node_help = "the node, as the cluster config names it (e.g. r0-n1)"
    f = fs.add_parser("inject", help="inject a fault into one node", description="Inject a fault into one node: "
                      "its health agent samples it, the monitor scores the node and drains it when it must.")
    f.add_argument("--node", required=True, help=node_help)
    f.add_argument("--kind", required=True, choices=["xid", "overheat", "nvlink-crc", "slow", "kill"],
                   help="xid: a GPU error; overheat; nvlink-crc: link errors; slow: iterations take --factor times "
                        "longer; kill: the worker process dies")
    f.add_argument("--duration", type=float, default=30.0, help="seconds the fault lasts (default 30)")
    f.add_argument("--factor", type=float, default=None, help="slow: times slower (default 3); nvlink-crc: "
                   "x 500 errors per sample (default 1)")
    f.add_argument("--json", action="store_true", help="print the stored fault as JSON (times in epoch ms)")
    f.set_defaults(fn=cmd_fault)
    f = fs.add_parser("list", help="the faults stored, with wall-clock times and whether each is active")
    f.add_argument("--node", default=None, help=node_help + " (default: every node)")
    f.add_argument("--json", action="store_true", help="one JSON object per fault (times in epoch ms)")
    f.set_defaults(fn=cmd_fault)
    f = fs.add_parser("clear", help="remove every fault of one node")
    f.add_argument("--node", required=True, help=node_help)
    f.set_defaults(fn=cmd_fault)
    f = fs.add_parser("play", help="inject a schedule of faults at their times")
    f.add_argument("--schedule", required=True, metavar="FILE",
                   help="YAML list of {at_s, node, kind, duration_s, factor}")
    f.set_defaults(fn=cmd_fault)

    s = sub.add_parser("token", help="mint an HS256 JWT for the gateway (secret from gateway.auth.secret_env)")
    s.add_argument("--tenant", required=True)
    s.add_argument("--sub", required=True, help="user id")
    s.add_argument("--model", action="append", default=[], help="allowed model (repeatable; default: all)")
    s.add_argument("--default-model", default=None)
    s.add_argument("--ttl", type=int, default=3600, help="seconds until exp")
    s.add_argument("--priority", choices=["interactive", "batch"], default=None,
                   help="the highest priority class the token's requests may run in (claim `priority`)")
    s.add_argument("--tpm", type=int, default=None,
                   help="the tenant's tokens-per-minute limit for interactive requests (claim `tpm`)")
    s.set_defaults(fn=cmd_token)

    s = sub.add_parser("tokens", help="calibrate the fast token estimator against a real tokenizer.json")
    s.add_argument("action", choices=["calibrate"])
    s.add_argument("--tokenizer", required=True, help="path of the model's tokenizer.json")
    s.add_argument("--corpus", nargs="+", required=True, help="text files (blank-line separated paragraphs)")
    s.set_defaults(fn=cmd_tokens)

    s = sub.add_parser("model", help="`model tiny --out DIR`: write the tiny random-weight Qwen2 test checkpoint; "
                                     "`model spec DIR`: print a checkpoint's models.yaml entry")
    s.add_argument("action", choices=["tiny", "spec"])
    s.add_argument("dir", nargs="?", default=None, help="spec: the checkpoint directory")
    s.add_argument("--out", default=str(DEFAULT_VLLM_CHECKPOINT), help="tiny: where to write it")
    s.set_defaults(fn=cmd_model)

    s = sub.add_parser("config", help="validate and summarise the configuration")
    s.add_argument("action", choices=["check"])
    s.set_defaults(fn=cmd_config)

    s = sub.add_parser("perf", help="iteration times from the calibrated cost model; `perf calibrate` refits it")
    s.add_argument("action", nargs="?", choices=["calibrate"], help="refit on data/profiles/vidur and write "
                   "configs/calibration.json (with --check: only verify it is up to date)")
    s.add_argument("--check", action="store_true", help="calibrate: exit 1 if configs/calibration.json is stale")
    s.add_argument("--model", default=None, help="model name (configs/models.yaml)")
    s.add_argument("--gpu", default=None, help="GPU type (configs/gpus.yaml)")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    s.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (and decode context)")
    s.add_argument("--batch", type=int, default=1, help="prompts prefilled together / sequences decoding")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_perf)
