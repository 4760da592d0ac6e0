"""The OpenAI Batch API's runner on Celery (task `rackflow.batches.run`, queue `jobs`): one batch, line by line,
through the same request path as HTTP traffic, in the `batch` priority class (pipeline/priority.py: it runs in the
capacity interactive work leaves idle).

A run of the task works on its batch for at most `batches.slice_s`, then queues the next run and hands the batch to
it (workers/stores/batches.py: `claim`, `hand_over`). A slice, not one task for the whole batch, because the Redis
broker delivers a message again once it has been held unacknowledged for its visibility timeout (60 s,
workers/control/app.py): a task that ran for minutes would run twice at once. With `acks_late` a message is
acknowledged when its run ends, so a worker killed mid-slice (kill -9) leaves it to be delivered again, and that
run resumes where the batch is; the lease and the `next` token make a second delivery of a message already handed on
a no-op, and make a second delivery that races its own live run wait for it.

What a run does, by status (pipeline/batch_state.py's life cycle, every move through `Batch.moved`):
- `validating`: the input file is checked line by line (pipeline/batch_input.py, plus what the gateway would refuse
  outright: a body that does not validate, a parameter the engines do not honour, n > 1, logprobs, a prompt that
  does not fit the context). Any error: `failed` with OpenAI's `errors` (the first thousand lines), nothing runs.
  Else `in_progress` with `request_counts.total`.
- `in_progress`: line i is admitted through the gateway core (`Gateway.admit`: profiling, the overload bound, then
  router, batcher and worker) as request uuid5(batch, i), at most `batches.max_in_flight` lines admitted and not
  ended at a time. A 429 (overload, a tenant's rate) puts the line back: it is offered again after its Retry-After,
  never failed for it. Another refusal ends the line with the status and error body the live endpoint would have
  answered. The runner reads its lines' final-result markers every `poll_ms` (one MGET), reads each ended line's
  result from its stream (`rf:out:{id}`) and records its output- or error-file line at once (a hash field per line,
  written once; the counts move with it). When every line has ended: `finalizing`, the files, `completed`.
- `cancelling` (the API's cancel): no line is admitted any more; the lines in flight are aborted
  (`jobs.abort_requests`: their results come back `cancelled`, or `ok` if they finished first); once every admitted
  line has ended, the files hold what ended and the batch is `cancelled`. Lines never admitted never ran and are in
  neither file.
- past `expires_at` (created + 24 h): the lines in flight are aborted, every line not ended goes to the error file
  with `batch_expired`, and the batch is `expired`.
A resumed run skips the lines with a recorded result, waits for the admitted ones (their result may already be in
their stream) and admits the rest. The files are written under ids derived from the batch's, so a run that died
while writing them writes the same files again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.batch_input import BatchError, BatchLine, parse_batch_input
from pipeline.batch_state import FINAL, Batch, BatchTransitionError
from pipeline.errors import RackflowError
from pipeline.events import RequestEvent, ResultEvent
from pipeline.openai_format import (
    ENDPOINT_KIND,
    FinalChoice,
    RequestFormatError,
    error_body,
    error_type,
    final_body,
    finish_reason,
    generation_fields,
    parse_request,
    rejected_param,
    result_error,
)
from pipeline.priority import BATCH
from pipeline.profiling import ProfileInput
from pipeline.sampling import SamplingRefused, check_engine
from pipeline.sampling import encode as encode_sampling
from streams import keys
from workers.control.app import _state as _app_state
from workers.control.app import app
from workers.control.jobs import _context, _TaskContext, abort_requests
from workers.shell.runtime import WALL
from workers.stores.batches import Admitted, BatchOwner, BatchStore, line_request_id
from workers.stores.etcd import NodeRegistry, SequenceRegistry
from workers.stores.files import LocalFileStore
from workers.stores.ingress import Gateway, RequestRejected, served_models

log = logging.getLogger(__name__)

TASK_NAME = "rackflow.batches.run"
SLOW_SWEEP_S = 10.0
"""How often the runner also reads the streams of lines whose marker it has not seen (a marker lives a minute or
more, a request's stream `streams.output_ttl_s`: a run resumed after a long stop finds results there)."""
RESULT_READS = 32
"""Result streams read at once (each one round trip, on connections of the runner's pool)."""
EXPIRED = {"code": "batch_expired", "message": "This request could not be executed before the completion window "
           "expired."}
"""OpenAI's error of a line that did not run within the completion window."""


def new_token() -> str:
    return uuid.uuid4().hex


def file_id_of(batch_id: str, which: str) -> str:
    """The id of a batch's output or error file: derived from the batch's, so a run that writes them again (its
    predecessor died while writing) replaces them instead of leaving orphans."""
    return "file-" + hashlib.sha256(f"{batch_id}:{which}".encode()).hexdigest()[:24]


def batch_req_id(request_id: str) -> str:
    return "batch_req_" + request_id.replace("-", "")


# -- validation ------------------------------------------------------------------------------------------------------
def check_line_body(gateway: Gateway, owner: BatchOwner, engine: str, endpoint: str,
                    body: dict[str, Any]) -> BatchError | None:
    """What the gateway would refuse outright in one line's body (its `line` is filled in by the parser)."""
    try:
        req = parse_request(ENDPOINT_KIND[endpoint], json.dumps(body))
    except RequestFormatError as e:
        return BatchError("invalid_request", str(e), f"body.{e.param}" if e.param else "body")
    if (req.n or 1) != 1:
        return BatchError("invalid_value", "n: a batch line runs one completion here; send n=1 or leave it out "
                          "(one line per completion)", "body.n")
    fields = generation_fields(req)
    if fields.sampling.logprobs is not None:
        return BatchError("unsupported_parameter", "logprobs are not returned in batch output files here; leave "
                          "logprobs out (or send the request to the endpoint itself)", "body.logprobs")
    try:
        check_engine(fields.sampling, engine)
    except SamplingRefused as e:
        return BatchError("unsupported_parameter", str(e), f"body.{e.param}")
    try:
        gateway.profile(ProfileInput("check", owner.tenant, owner.user, str(req.model), 0.0, fields.prompt,
                                     max_tokens=fields.max_tokens, priority=BATCH), owner.allows)
    except RequestRejected as e:
        param, message = rejected_param(req, e.param, str(e))
        return BatchError(e.code, message, f"body.{param}" if param else "body")
    return None


_parsed: OrderedDict[tuple[str, str, int], list[BatchLine]] = OrderedDict()
_parsed_lock = threading.Lock()
PARSED_KEEP = 8
"""Parsed input files kept per process (a batch's next run, usually in the same worker, does not parse it again)."""


def _remember(key: tuple[str, str, int], lines: list[BatchLine] | None = None) -> list[BatchLine] | None:
    with _parsed_lock:
        if lines is None:
            return _parsed.get(key)
        _parsed[key] = lines
        while len(_parsed) > PARSED_KEEP:
            _parsed.popitem(last=False)
        return lines


# -- the task --------------------------------------------------------------------------------------------------------
@dataclass
class _Stores:
    store: BatchStore
    files: LocalFileStore
    seqs: SequenceRegistry | None


_local = threading.local()


async def _stores(ctx: _TaskContext) -> _Stores:
    """This thread's batch store, file store and sequence registry (the last opened on this thread's loop)."""
    st: _Stores | None = getattr(_local, "stores", None)
    if st is None or st.store.r is not ctx.r:
        etcd_url = _app_state.get("etcd_url") or ""
        seqs = SequenceRegistry(NodeRegistry(etcd_url).client) if etcd_url else None
        st = _Stores(BatchStore(ctx.r, ctx.config.batches.retention_s),
                     LocalFileStore(Path(ctx.config.gateway.files_dir)), seqs)
        _local.stores = st
    return st


def submit(batch_id: str, token: str) -> None:
    """Queue a run of the batch (blocking: Celery's client is synchronous)."""
    run.apply_async((batch_id, token))


@app.task(name=TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True,  # type: ignore[untyped-decorator]
          ignore_result=True, autoretry_for=(Exception,), retry_backoff=0.5, retry_backoff_max=30, retry_jitter=True,
          max_retries=120)
def run(self: Any, batch_id: str, token: str) -> dict[str, Any]:
    """One slice of a batch's run (module docstring). Returns what it did: `stale` (another run has the batch),
    `gone` (no such batch), `final` (the batch is in a final status) or `continued` (the next run is queued).

    A run that fails (Valkey or etcd unreachable, anything else) is retried with backoff under the same token: its
    lease was dropped, so the retry claims the batch at once. A message that a failed task left would be acknowledged
    and gone, leaving the batch with no run."""
    ctx = _context()
    holder = new_token()
    while True:
        outcome, status = ctx.loop.run_until_complete(_slice(ctx, batch_id, token, holder))
        if outcome != "continue":
            return {"batch": batch_id, "outcome": outcome, "status": status}
        nxt = new_token()
        try:
            # queued before the hand-over: a run killed between the two leaves its own message to be delivered
            # again, and the one queued here finds its token stale
            run.apply_async((batch_id, nxt))
        except Exception as e:  # the broker is away: keep the lease and work another slice
            log.warning("batch %s: next run not queued (%r); this run goes on", batch_id, e)
            continue
        ctx.loop.run_until_complete(_hand_over(ctx, batch_id, holder, nxt))
        return {"batch": batch_id, "outcome": "continued", "status": status}


async def _hand_over(ctx: _TaskContext, batch_id: str, holder: str, nxt: str) -> None:
    st = await _stores(ctx)
    if not await st.store.hand_over(batch_id, holder, nxt):
        log.warning("batch %s: lost its lease before handing it over; the run that holds it goes on", batch_id)


async def _slice(ctx: _TaskContext, batch_id: str, token: str, holder: str) -> tuple[str, str]:
    st = await _stores(ctx)
    cfg = ctx.config.batches
    lease_ms = int(cfg.lease_s * 1000)
    while True:
        claim = await st.store.claim(batch_id, token, holder, lease_ms)
        if claim != "busy":
            break
        # a second delivery of a message whose run still works (or died: its lease runs out): wait, then look again
        await asyncio.sleep(min(1.0, cfg.lease_s / 4))
    if claim != "ok":
        log.info("batch %s: run %s is %s; nothing to do", batch_id, token[:8], claim)
        return claim, ""
    runner = BatchRunner(ctx, st, batch_id, holder)
    try:
        more = await runner.run(time.monotonic() + cfg.slice_s)
    except BaseException:
        try:  # drop the lease: a retry claims the batch at once
            await asyncio.shield(st.store.hand_over(batch_id, holder, ""))
        except Exception as e:
            log.warning("batch %s: lease not dropped (%r); it runs out in %g s", batch_id, e, cfg.lease_s)
        raise
    finally:
        await runner.close()
    if not more:
        await st.store.hand_over(batch_id, holder, "")
        return "final", runner.status
    return "continue", runner.status


class LeaseLost(RackflowError):
    """The run's lease ran out while it stalled (another run has the batch now), or the batch is gone."""


class BatchRunner:
    """One slice of one batch's run (module docstring): holds the batch's lease while it works."""

    def __init__(self, ctx: _TaskContext, stores: _Stores, batch_id: str, holder: str) -> None:
        self.ctx = ctx
        self.cfg = ctx.config.batches
        self.store = stores.store
        self.files = stores.files
        self.seqs = stores.seqs
        self.batch_id = batch_id
        self.holder = holder
        self.status = ""
        self._lost = False
        self._keeper: asyncio.Task[None] | None = None
        self.lines: list[BatchLine] = []
        self.kind = "chat"
        self.owner = BatchOwner("", "")
        self.in_flight: dict[int, Admitted] = {}
        self.pending: deque[int] = deque()
        self.aborted: set[int] = set()
        self.backoff_until = 0.0
        self.swept = 0.0

    # -- lease -----------------------------------------------------------------------------------------------------
    async def _keep_lease(self) -> None:
        lease_ms = int(self.cfg.lease_s * 1000)
        while True:
            await asyncio.sleep(self.cfg.lease_s / 4)
            try:
                if not await self.store.renew(self.batch_id, self.holder, lease_ms):
                    self._lost = True
                    return
            except (RedisConnectionError, RedisTimeoutError) as e:  # the main loop meets the outage too
                log.warning("batch %s: lease not renewed (%s)", self.batch_id, e)

    def _check_lease(self) -> None:
        if self._lost:
            raise LeaseLost(self.batch_id)

    async def close(self) -> None:
        """Stop renewing the lease (the caller hands it over or drops it next)."""
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
            self._keeper = None

    # -- the slice -------------------------------------------------------------------------------------------------
    async def run(self, deadline: float) -> bool:
        """Work until `deadline` (monotonic); True when the batch needs another run."""
        self._keeper = asyncio.create_task(self._keep_lease())
        try:
            return await self._run(deadline)
        except LeaseLost:
            log.warning("batch %s: the lease ran out while this run stalled; another run has the batch", self.batch_id)
            return False

    async def _batch(self) -> Batch:
        b = await self.store.get(self.batch_id)
        if b is None:
            raise LeaseLost(self.batch_id)  # expired or deleted under us: nothing left to run
        self.status = b.status
        return b

    async def _move(self, status: str, **changes: Any) -> Batch | None:
        """Move the batch to `status`; None when its current status does not allow it (a cancel came first)."""
        now = int(WALL.now_ms() / 1000)
        try:
            b = await self.store.update(self.batch_id, lambda b: b.moved(status, now, **changes))
        except BatchTransitionError as e:
            log.info("batch %s: not moved to %s: %s", self.batch_id, status, e)
            return None
        self.status = b.status
        log.info("batch %s: %s", self.batch_id, status)
        return b

    async def _run(self, deadline: float) -> bool:
        b = await self._batch()
        if b.status in FINAL:
            return False
        self.owner = await self.store.owner(self.batch_id)
        self.kind = ENDPOINT_KIND[b.endpoint]
        if b.status == "validating" and WALL.now_ms() / 1000 >= b.expires_at:
            if await self._move("expired") is not None:
                return False
            b = await self._batch()  # a cancel came first
        if b.status == "validating":
            lines, errors = await self._validate(b)
            if errors:
                if await self._move("failed", errors=tuple(e.to_openai() for e in errors)) is not None:
                    return False
                lines = []  # a cancel came first: nothing ran, the batch ends `cancelled` below
            elif await self._move("in_progress", total=len(lines)) is None:
                b = await self._batch()  # a cancel came first: no line is admitted, it ends `cancelled` below
            self.lines = lines
        else:
            self.lines = await self._parsed(b)
        if self.status in FINAL:
            return False
        if self.status == "finalizing":
            await self._finish(await self._batch(), "completed")
            return False
        ended = await self.store.ended(self.batch_id)
        admitted = await self.store.admitted(self.batch_id)
        self.in_flight = {i: a for i, a in admitted.items() if i not in ended}
        self.pending = deque(i for i in range(len(self.lines)) if i not in ended and i not in admitted)
        log.info("batch %s: run with %d lines ended, %d in flight, %d to admit", self.batch_id, len(ended),
                 len(self.in_flight), len(self.pending))
        while True:
            self._check_lease()
            b = await self._batch()
            if b.status in FINAL:
                return False
            if b.status == "in_progress" and WALL.now_ms() / 1000 >= b.expires_at and await self._expire(b):
                return False
            if b.status == "cancelling":
                self.pending.clear()  # never admitted: never run, in neither file
                await self._abort([i for i in self.in_flight if i not in self.aborted], "batch cancelled")
            await self._collect(b)
            await self._time_out(b)
            if b.status == "in_progress" and self.pending:
                await self._admit(b)
            if not self.in_flight and not self.pending:
                if b.status == "in_progress":
                    moved = await self._move("finalizing")
                    if moved is None:
                        continue  # a cancel came first: finish as cancelled
                    await self._finish(moved, "completed")
                    return False
                if b.status == "cancelling":
                    await self._finish(b, "cancelled")
                    return False
            if time.monotonic() >= deadline:
                return True
            await asyncio.sleep(self.cfg.poll_ms / 1000)

    # -- input -----------------------------------------------------------------------------------------------------
    async def _read_input(self, b: Batch) -> bytes | None:
        return await asyncio.to_thread(self.files.read, b.tenant, b.input_file_id)

    async def _validate(self, b: Batch) -> tuple[list[BatchLine], list[BatchError]]:
        data = await self._read_input(b)
        if data is None:
            return [], [BatchError("invalid_request", f"The input file {b.input_file_id} no longer exists (it was "
                                   "deleted before the batch ran): upload it again and create a new batch.",
                                   "input_file_id")]
        gw, owner, engine = self.ctx.gateway, self.owner, self.ctx.config.policies.worker.engine
        served = set(served_models(self.ctx.config, owner.allows))

        def check() -> tuple[list[BatchLine], list[BatchError]]:
            return parse_batch_input(data, b.endpoint, served.__contains__,
                                     lambda ep, body: check_line_body(gw, owner, engine, ep, body),
                                     self.cfg.max_requests)

        lines, errors = await asyncio.to_thread(check)
        if not errors:
            _remember((b.id, b.input_file_id, len(data)), lines)
        log.info("batch %s: input checked, %d requests, %d errors", b.id, len(lines), len(errors))
        return lines, errors

    async def _parsed(self, b: Batch) -> list[BatchLine]:
        data = await self._read_input(b)
        if data is None:
            raise RuntimeError(f"batch {b.id}: its input file {b.input_file_id} was deleted while it ran")
        key = (b.id, b.input_file_id, len(data))
        hit = _remember(key)
        if hit is not None:
            return hit
        lines, _ = await asyncio.to_thread(parse_batch_input, data, b.endpoint, lambda _m: True, None,
                                           self.cfg.max_requests)
        return _remember(key, lines) or lines

    # -- admission -------------------------------------------------------------------------------------------------
    def _input(self, i: int) -> tuple[ProfileInput, Any]:
        line = self.lines[i]
        body = parse_request(self.kind, json.dumps(line.body))
        fields = generation_fields(body)
        user = (body.user or self.owner.user) if self.owner.trust_user else self.owner.user
        return ProfileInput(request_id=line_request_id(self.batch_id, i), tenant=self.owner.tenant, user_id=user,
                            model=str(body.model), arrival_ms=WALL.now_ms(), prompt=fields.prompt,
                            max_tokens=fields.max_tokens, priority=BATCH,
                            sampling=encode_sampling(fields.sampling)), body

    async def _admit(self, b: Batch) -> None:
        """Admit lines, `admit_concurrency` at a time, until `max_in_flight` are in flight (or a 429 says wait)."""
        while self.pending and time.monotonic() >= self.backoff_until:
            room = self.cfg.max_in_flight - len(self.in_flight)
            take = [self.pending.popleft() for _ in range(min(room, self.cfg.admit_concurrency, len(self.pending)))]
            if not take:
                return
            await self._admit_round(b, take)

    async def _admit_round(self, b: Batch, take: list[int]) -> None:
        inputs = [self._input(i) for i in take]
        outs = await asyncio.gather(*(self.ctx.gateway.admit(inp, self.owner.allows) for inp, _ in inputs),
                                    return_exceptions=True)
        admitted: dict[int, Admitted] = {}
        refused: list[tuple[int, bool, dict[str, Any]]] = []
        retry: list[int] = []
        error: BaseException | None = None
        for i, (inp, body), out in zip(take, inputs, outs, strict=True):
            if isinstance(out, RequestEvent):
                admitted[i] = Admitted(inp.arrival_ms, out.max_tokens)
            elif isinstance(out, RequestRejected) and out.status == 429:
                retry.append(i)
                wait = (out.retry_after_s or 1) * (1 + random.random() / 4)
                self.backoff_until = max(self.backoff_until, time.monotonic() + wait)
            elif isinstance(out, RequestRejected):
                param, message = rejected_param(body, out.param, str(out))
                refused.append((i, False, self._error_line(i, out.status, message, out.code, param)))
            else:
                retry.append(i)
                error = error or out
        self.pending.extendleft(reversed(retry))  # offered again first, in file order
        await self.store.mark_admitted(b, admitted)
        self.in_flight.update(admitted)
        if refused:
            await self.store.record_lines(b, refused)
        if retry and error is None:
            log.info("batch %s: %d lines refused with 429; offered again in %.1f s", self.batch_id, len(retry),
                     self.backoff_until - time.monotonic())
        if error is not None:
            raise error

    # -- results ---------------------------------------------------------------------------------------------------
    def _error_line(self, i: int, status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
        rid = line_request_id(self.batch_id, i)
        return {"id": batch_req_id(rid), "custom_id": self.lines[i].custom_id,
                "response": {"status_code": status, "request_id": rid,
                             "body": error_body(message, error_type(status), param, code)},
                "error": None}

    def _result_line(self, i: int, res: ResultEvent, max_tokens: int) -> tuple[bool, dict[str, Any]]:
        """Line i's output-file line (ok) or error-file line, as the live endpoint would have answered."""
        rid = line_request_id(self.batch_id, i)
        if res.status != "ok":
            status, message, code = result_error(res)
            return False, self._error_line(i, status, message, code)
        body = parse_request(self.kind, json.dumps(self.lines[i].body))
        sampling = generation_fields(body).sampling if self.kind == "chat" else None
        answer = final_body(self.kind, rid, res.model, int(res.finish_ms / 1000),
                            [FinalChoice(rid, res.text, finish_reason(res, max_tokens))], sampling, res.in_tokens,
                            res.out_tokens)
        return True, {"id": batch_req_id(rid), "custom_id": self.lines[i].custom_id,
                      "response": {"status_code": 200, "request_id": rid, "body": answer}, "error": None}

    async def _results(self, ids: list[int]) -> dict[int, ResultEvent]:
        """The final results of these lines that their streams hold (`Gateway.result`, RESULT_READS at once)."""
        out: dict[int, ResultEvent] = {}
        for k in range(0, len(ids), RESULT_READS):
            chunk = ids[k:k + RESULT_READS]
            got = await asyncio.gather(*(self.ctx.gateway.result(line_request_id(self.batch_id, i)) for i in chunk))
            out.update({i: res for i, res in zip(chunk, got, strict=True) if res is not None})
        return out

    async def _collect(self, b: Batch) -> None:
        """Record every line in flight whose final result is in."""
        if not self.in_flight:
            return
        ids = list(self.in_flight)
        now = time.monotonic()
        if now - self.swept >= SLOW_SWEEP_S:
            self.swept = now
            look = ids
        else:
            marks = await self.ctx.r.mget([keys.result_done(line_request_id(self.batch_id, i)) for i in ids])
            look = [i for i, m in zip(ids, marks, strict=True) if m is not None]
        if not look:
            return
        found = await self._results(look)
        if not found:
            return
        lines = [(i, *self._result_line(i, res, self.in_flight[i].max_tokens)) for i, res in found.items()]
        await self.store.record_lines(b, lines)
        for i in found:
            self.in_flight.pop(i, None)

    async def _abort(self, ids: list[int], reason: str) -> None:
        if not ids:
            return
        rids = [line_request_id(self.batch_id, i) for i in ids]
        report = await abort_requests(self.ctx.r, self.seqs, rids, reason,
                                      self.ctx.config.policies.streams.retention_s * 1000)
        self.aborted.update(ids)
        log.info("batch %s: %s: %d lines in flight aborted (%s)", self.batch_id, reason, len(ids), report)

    async def _time_out(self, b: Batch) -> None:
        limit_ms = self.cfg.line_timeout_s * 1000
        now = WALL.now_ms()
        late = [i for i, a in self.in_flight.items() if now - a.at_ms > limit_ms]
        if not late:
            return
        await self._abort(late, "batch line timed out")
        await self.store.record_lines(b, [(i, False, self._error_line(
            i, 504, f"no result for this request within {self.cfg.line_timeout_s:g} s (batches.line_timeout_s); "
            "it was cancelled", "timeout")) for i in late])
        for i in late:
            self.in_flight.pop(i, None)

    async def _expire(self, b: Batch) -> bool:
        """The completion window ended: what is in flight is aborted, what ended keeps its line, the rest ends with
        `batch_expired`; then the files, then `expired`. False when a cancel came first (the batch then ends
        `cancelled`, with the same lines)."""
        await self._abort(list(self.in_flight), "batch expired")
        self.swept = 0.0
        await self._collect(b)
        rest = sorted([*self.in_flight, *self.pending])
        await self.store.record_lines(b, [(i, False, {
            "id": batch_req_id(line_request_id(self.batch_id, i)), "custom_id": self.lines[i].custom_id,
            "response": None, "error": EXPIRED}) for i in rest])
        self.in_flight.clear()
        self.pending.clear()
        return await self._finish(b, "expired")

    # -- files -----------------------------------------------------------------------------------------------------
    async def _finish(self, b: Batch, status: str) -> bool:
        """Write the output and error files (each only when it has a line, lines in input order) and move the batch
        to `status` with their ids; False when its status does not allow that move any more."""
        ended = await self.store.lines(self.batch_id)
        out = [ended[i][1] for i in sorted(ended) if ended[i][0]]
        err = [ended[i][1] for i in sorted(ended) if not ended[i][0]]
        ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        for field, which, rows in (("output_file_id", "output", out), ("error_file_id", "error", err)):
            if rows:
                fid = file_id_of(self.batch_id, which)
                await asyncio.to_thread(self.files.put, b.tenant, f"{self.batch_id}_{which}.jsonl", "batch_output",
                                        b"\n".join(rows) + b"\n", fid)
                ids[field] = fid
        if await self._move(status, **ids) is None:
            return False
        log.info("batch %s: %s, %d lines in the output file, %d in the error file", self.batch_id, status, len(out),
                 len(err))
        return True
