"""`rackflow jobs submit|status|cancel`: async jobs (Celery tasks `rackflow.jobs.generate`) from the command line.

`submit --file prompts.jsonl` checks every line first (JSON, fields, model, context) and submits nothing when one is
bad; then it submits a Celery group, saves it in the result backend, records the job (tenant, task ids) and prints
its id; with `--wait` it shows a progress bar until every task is done and prints the results. `status ID` takes a
job id (a group, or a single task id) and prints state counts and, when done, the results. `cancel ID` revokes the
tasks and aborts their requests in the pipeline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.config import RackflowConfig
from pipeline.events import REQUEST_ID


def add_parser(sub: Any) -> None:
    s = sub.add_parser("jobs", help="async jobs on Celery: submit a JSONL file of prompts, status, cancel")
    jsub = s.add_subparsers(dest="action", required=True)
    p = jsub.add_parser("submit", help="submit a JSONL file of requests as one job (a Celery group)")
    p.add_argument("--file", required=True, help="JSONL: one object a line with `prompt` and optional `model`, "
                                                 "`max_tokens`, `user`")
    p.add_argument("--model", default=None, help="model of the lines that name none (default: the cluster's only "
                                                 "served model)")
    p.add_argument("--max-tokens", type=int, default=None, help="max_tokens of the lines that give none")
    p.add_argument("--user", default=None, help="user id of the lines that give none (default: jobs)")
    p.add_argument("--tenant", default=None, help="tenant the job belongs to (default: gateway.auth.default_tenant)")
    p.add_argument("--wait", action="store_true", help="wait for every result, with a progress bar")
    p.add_argument("--timeout", type=float, default=None, help="--wait: give up after this many seconds (exit 1)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(fn=cmd_jobs_cli)
    p = jsub.add_parser("status", help="state counts of a job (group or task id) and, when done, its results")
    p.add_argument("id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_jobs_cli)
    p = jsub.add_parser("cancel", help="revoke a job's tasks and abort their requests on their engines")
    p.add_argument("id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_jobs_cli)


def cmd_jobs_cli(args: argparse.Namespace) -> int:
    from workers.cli.common import config_of, endpoints
    from workers.shell.runtime import setup_logging

    config = config_of(args)
    redis_url, etcd_url = endpoints(args)
    setup_logging("WARNING" if args.log_level.upper() == "INFO" else args.log_level, "jobs")
    return cmd_jobs(args, config, redis_url, etcd_url)


def cmd_jobs(args: argparse.Namespace, config: RackflowConfig, redis_url: str, etcd_url: str) -> int:
    from kombu.exceptions import OperationalError
    from redis.exceptions import RedisError

    from workers.control.app import configure
    from workers.stores.etcd import EtcdStoreError

    configure(config, redis_url, etcd_url)
    try:
        if args.action == "submit":
            return _submit(args, config, redis_url)
        if args.action == "status":
            return _status(args, redis_url)
        return _cancel(args, config, redis_url, etcd_url)
    except (RedisError, OperationalError) as e:
        print(f"rackflow jobs: Redis/Valkey at {redis_url} failed: {e}", file=sys.stderr)
        return 1
    except EtcdStoreError as e:
        print(f"rackflow jobs: etcd at {etcd_url} failed: {e}", file=sys.stderr)
        return 1


def _redis(redis_url: str) -> Any:
    from streams.runner import connect

    return connect(redis_url)


def _submit(args: argparse.Namespace, config: RackflowConfig, redis_url: str) -> int:
    from workers.control import jobs

    tenant = args.tenant or config.gateway.auth.default_tenant
    if args.max_tokens is not None and args.max_tokens < 1:
        print(f"rackflow jobs submit: --max-tokens must be >= 1, got {args.max_tokens}", file=sys.stderr)
        return 2
    path = Path(args.file)
    try:
        specs = jobs.read_jsonl(path)
        where = [f"{path}:{n}" for n in _line_numbers(path)]
        specs = [jobs.JobSpec(s.prompt, s.model or args.model, s.max_tokens or args.max_tokens, s.user or args.user)
                 for s in specs]
        specs = jobs.check_specs(config, specs, tenant, where)
    except jobs.JobSpecError as e:
        print(f"rackflow jobs submit: {e}; nothing was submitted", file=sys.stderr)
        return 2
    job = jobs.submit(specs, tenant, as_group=True)

    async def record() -> None:
        r = _redis(redis_url)
        try:
            await jobs.save_job(r, job)
        finally:
            await r.aclose()

    asyncio.run(record())
    if not args.wait:
        if args.json:
            print(json.dumps({"id": job.id, "kind": job.kind, "tasks": len(job.task_ids), "status": "queued"}))
        else:
            print(f"job {job.id}: {len(job.task_ids)} requests submitted\n"
                  f"  rackflow jobs status {job.id}\n  rackflow jobs cancel {job.id}")
        return 0
    print(f"job {job.id}: {len(job.task_ids)} requests submitted; waiting", file=sys.stderr)
    finished = _wait(job, args.timeout, progress=not args.no_progress)
    state = jobs.job_state(job)
    _print_state(state, args.json)
    if not finished:
        print(f"rackflow jobs submit: not done after {args.timeout:g}s; the job goes on "
              f"(rackflow jobs status {job.id})", file=sys.stderr)
        return 1
    return 0 if state["status"] == "succeeded" else 1


def _line_numbers(path: Path) -> list[int]:
    """The numbers of the non-blank lines (the ones read_jsonl turned into requests, in order)."""
    return [n for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1) if line.strip()]


def _wait(job: Any, timeout_s: float | None, progress: bool) -> bool:
    from tqdm import tqdm

    from workers.control import jobs

    total = len(job.task_ids)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    bar = tqdm(total=total, desc="requests", unit="req", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    done = 0
    try:
        while True:
            n = jobs.done_count(job)
            if n > done:
                bar.update(n - done)
                done = n
            if done >= total:
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.25)
    finally:
        bar.close()


def _print_state(state: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(state, sort_keys=True, default=str))
        return
    counts = ", ".join(f"{k.lower()} {v}" for k, v in state["counts"].items())
    p = state["progress"]
    print(f"job {state['id']} ({state['kind']}): {state['status']}; {p['done']}/{p['total']} done; {counts}")
    if p["done"] < p["total"]:
        return
    for row in state.get("results", []):
        res = row.get("result")
        if isinstance(res, dict):
            t = res.get("timings") or {}
            text = str(res.get("text", "")).replace("\n", " ")
            print(f"  {row['id']}  {row['state']:<8} {res.get('tokens')} tokens  e2e {t.get('e2e_ms')} ms  "
                  f"{text[:60]}{'…' if len(text) > 60 else ''}")
        else:
            print(f"  {row['id']}  {row['state']:<8} {row.get('error', '')}")


def _status(args: argparse.Namespace, redis_url: str) -> int:
    from workers.control import jobs

    async def load() -> Any:
        r = _redis(redis_url)
        try:
            return await jobs.load_job(r, args.id)
        finally:
            await r.aclose()

    job = asyncio.run(load()) or jobs.find_job(args.id)
    if job is None:
        print(f"rackflow jobs status: no job or task {args.id!r} (unknown, expired, or still queued and not "
              "recorded)", file=sys.stderr)
        return 1
    _print_state(jobs.job_state(job), args.json)
    return 0


def _cancel(args: argparse.Namespace, config: RackflowConfig, redis_url: str, etcd_url: str) -> int:
    from workers.control import jobs
    from workers.stores.etcd import NodeRegistry, SequenceRegistry

    async def go() -> dict[str, Any] | None:
        r = _redis(redis_url)
        registry = NodeRegistry(etcd_url)
        try:
            job = await jobs.load_job(r, args.id) or await asyncio.to_thread(jobs.find_job, args.id)
            if job is None:
                if not REQUEST_ID.match(args.id):
                    return None
                # a task submitted without a record (`generate.delay`) that is still queued: revoke it by its id
                job = jobs.Job(args.id, "task", [args.id])
            return await jobs.cancel(r, SequenceRegistry(registry.client), job,
                                     config.policies.streams.retention_s * 1000)
        finally:
            await registry.close(revoke=False)
            await r.aclose()

    report = asyncio.run(go())
    if report is None:
        print(f"rackflow jobs cancel: no job or task {args.id!r} (unknown or expired)", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        print(f"job {report['id']}: {report['revoked']} tasks revoked; {report['signalled']} running requests "
              f"aborted on their nodes, {report['finished']} already finished, the rest stopped before they start")
    return 0
