"""`rackflow bench soak --minutes N`: a steady load at 80% of capacity while a random role is killed every 30 s and
Valkey and etcd are restarted once each; what the clients saw, whether every accepted request ended exactly once,
and whether Valkey's memory stayed flat.

The run, in order:

1. Valkey (durable: append-only file, `appendfsync always`, `valkey_durable_args`) and etcd are started in a
   temporary directory unless URLs are given. A given URL is a server this run does not own: it is not restarted
   (`valkey_restarts`/`etcd_restarts` are then 0 and `valkey_restart_skipped`/`etcd_restart_skipped` say why).
   The cluster keeps `retention_s` (60 s) of every stream and of each request's own output stream
   (`policies.streams.retention_s`, `output_ttl_s`): that, not the run's length, bounds Valkey's memory.
2. A cluster of real processes: 2 racks x 2 `sim` H100 nodes (real iteration times, `max_running` 2 per engine, so
   that capacity is set by the engines, not by the CPU the kills and restarts also need), a router, a batcher per
   rack, one HTTP gateway (`--no-auth`), and failover (a health agent per node, the monitor, a Celery worker).
3. Capacity: a closed loop of `clients` HTTP clients for `capacity_s` (after a short warm-up), completed requests
   per second. The offered rate is `load` (0.8) x that.
4. The soak: an open loop at that rate for N minutes through the gateway (`max_tokens` 32; every 5th request
   streamed over SSE, the others plain JSON). Every `kill_every_s` (30 s) one role process gets SIGKILL (its whole
   process group: `kill -9`), in random order, each role once per round of six: a GPU worker, the router, a
   batcher, the gateway, the Celery worker (main process and pool) or the monitor. A second later it is started
   again, under the same name, as a supervisor (systemd, Kubernetes) would. Once, halfway between two kills in the
   middle of the run, Valkey gets SIGKILL and is started again on the same port and data dir after 1 s (put off
   while a killed gateway is not back yet: the clients would not see the outage). Once, between the kill a quarter
   into the run and the next, etcd gets SIGKILL and is started again the same way (its WAL holds the registry and
   the leases).
5. While the load runs, a follower reads `rf:ingress` (`rf:admitted` too) and `rf:results` as they grow (one XREAD)
   and checks each final result's output stream when it lands, and Valkey's `used_memory` is sampled every 5 s:
   with a 60 s retention an end-of-run read would find only the last minute. When the open loop has sent
   everything, the run waits (up to `drain_timeout_s`) until every accepted request has its final result.

Definitions (what the report counts):

- `sent`: HTTP requests the load generator sent.
- `accepted`: requests the gateway admitted: the XADD of their RequestEvent to `rf:ingress` (or `rf:admitted`) was
  acknowledged. They are found there by their prompt (`load test request {i}`, unique per request of this run), so
  a request whose client never learned its id (the gateway died before answering) is still accounted for.
- `completed`: accepted requests with a final `ok` result in `rf:results`.
- `lost`: accepted requests without any final result in `rf:results` when the drain wait ends.
- `duplicates`: final results beyond the first for one request id in `rf:results` (sum over requests of
  results - 1); `duplicate_requests`: how many request ids have more than one.
- `shed`: 429 answers (load shedding with Retry-After; not errors).
- `refused`: connection refused (httpx ConnectError / ConnectTimeout) while the gateway was down (from its kill to
  its restarted process answering `/healthz`): the request never reached a gateway, nothing was accepted. Not an
  error: an HTTP client of a single gateway sees this while its gateway restarts.
- `interrupted`: a request in flight on the gateway when it was killed, or sent on a pooled connection to it
  (within the down interval, plus `STALE_CONN_S` for connections the client pool still held): the client got a
  transport error or an SSE stream cut before `[DONE]`. Not an error by itself: `interrupted_accepted` of them had
  been admitted, and each of those must have its final result readable by id (`GET /v1/results/{id}` on the
  restarted gateway: 200, `status` ok, `completion_tokens` = max_tokens) or it counts as a client error
  (`interrupted_unverified`); `interrupted_not_accepted` never entered the pipeline (same as refused).
- `client_errors`: requests (each counted once) with any of: a non-2xx answer other than 429 (`http_<code>`, e.g.
  a 503 while Valkey restarts); a transport error outside a gateway-down interval (`transport`); a 2xx answer with
  the wrong token count, an SSE error event or a stream without `[DONE]` (`answer`); a final result that is not
  `ok`, or whose token stream (`rf:out:{id}`, read as the gateway reads it) does not carry every token index
  0..n-1 once with the result's text and n = max_tokens (`result`); an interrupted accepted request whose result
  cannot be read back by id (`interrupted_unverified`); a 2xx answer whose id is not in `rf:ingress`
  (`not_in_ingress`). `client_error_kinds` counts them by kind, `client_error_samples` shows a few;
  `client_errors_accepted`: how many of them had been admitted (the others, e.g. a 503 with Retry-After while
  Valkey is down, never entered the pipeline).
- `kills`: role processes killed (and started again without error); `valkey_restarts`, `etcd_restarts`: server
  restarts that came back.
- `valkey_used_memory_mb`: `after_first_minute` (the first sample 60 s or more into the load), `end` (the last one
  of the load), `peak`, `after_drain`; `valkey_memory_series` all samples; `valkey_keys_end` the keys at the end by
  pattern (count, MB). `follower_max_lag_s`: the oldest entry the follower read (under `retention_s`: none trimmed
  unread).
- `events`: one entry per kill and server restart: `{role, name, t_s, p99_before_ms,
  p99_after_ms, n_before, n_after, restart_s, overlaps}`: the p99 end-to-end latency (send -> whole answer, or ->
  `[DONE]`) of the requests sent in the `window_s` (30 s) before the kill and in the `window_s` after it
  (completed ones, as the client saw them); `restart_s`: kill -> the new process spawned (gateway: -> `/healthz`
  answers; valkey: -> PING answers); `overlaps`: the other events inside the two windows.
- `unexpected_exits`: role processes that died without being killed (must be empty).
- `sent_rps`, `send_lag_p99_s`, `send_lag_max_s` (`send_lag_max_at_s`: when): the rate actually sent and how
  late requests left against the open loop's schedule (a load generator starved of CPU sends late, then in
  bursts); `transport_errors`: the status-0 outcomes by httpx exception (refused and interrupted ones included).
- Kills and the Valkey restart fire on their own schedule (a slow restart does not delay the next event).

The plot (`soak.png` in `out_dir`, default `report/`) shows every completed request's latency over time with the
rolling p99, the kills and the server restarts marked, per 5 s the shed, refused, interrupted and failed requests,
and Valkey's memory; `soak.json` beside it holds the report. RACKFLOW_BENCH_KEEP_LOGS=DIR keeps the processes'
logs there. Progress goes to stderr (tqdm). The load generator, the cluster and the kills share this machine's
cores, so the latencies include CPU contention.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from redis.exceptions import RedisError
from tqdm import tqdm

from pipeline.config import RackflowConfig
from pipeline.events import RequestEvent, ResultEvent, TokenEvent
from pipeline.stats import percentile
from streams import codec, keys
from streams.runner import connect
from workers.bench.gateway import MODEL, Outcome, _client, closed_loop, one_request, wait_http_ready
from workers.local.launcher import ClusterProcesses, RoleProcess, config_overlay_file, wait_cluster_ready
from workers.shell.runtime import run_async

ROLES = ("worker", "router", "batcher", "gateway", "celery", "monitor")
"""The roles a kill picks from (health agents are not killed: they stand in for the GPU's own telemetry)."""

MAX_TOKENS = 32
STREAM_EVERY = 5
STALE_CONN_S = 2.5
"""After a restarted gateway answers, a request may still go out on a connection the client pool opened to the
killed one (the pool drops idle connections after 2 s: workers/bench/gateway.py `_client`)."""
PROMPT = re.compile(r"load test request (\d+)\Z")

SOAK_CLUSTER: dict[str, Any] = {
    "cluster": {"racks": [
        {"name": "r0", "node_count": 2, "node": {"gpu": "h100-80gb", "tp": 1, "models": [MODEL]}},
        {"name": "r1", "node_count": 2, "node": {"gpu": "h100-80gb", "tp": 1, "models": [MODEL]}},
    ]},
    "policies": {
        "worker": {"max_running": 2, "token_flush_ms": 50},
        # a restarted router or batcher claims what its dead predecessor left pending after 2 s, not 10 s
        "streams": {"claim_idle_ms": 2000},
    },
}


@dataclass
class Sent:
    k: int
    """Index in this run (the prompt carries base + k)."""
    outcome: Outcome


@dataclass
class Chaos:
    role: str
    name: str
    t: float
    """time.monotonic() of the kill."""
    ready: float | None = None
    """time.monotonic() when the replacement was spawned (gateway: answered /healthz; valkey: PING)."""
    error: str | None = None


@dataclass
class _State:
    sent: list[Sent] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    send_lag_s: list[float] = field(default_factory=list)
    """Per request, how late the open loop sent it against its schedule (a starved load generator catches up
    in bursts)."""
    events: list[Chaos] = field(default_factory=list)
    gateway_down: list[tuple[float, float]] = field(default_factory=list)
    """(kill, ready) of each gateway outage, time.monotonic()."""
    cut: list[int] = field(default_factory=list)
    """Requests whose client got a transport error or a stream without [DONE] (to read back by id)."""


async def _respawn(server: Any, timeout_s: float = 30.0) -> None:
    """Start a killed server again on its ports and data dir: spawned from the main thread (so that it dies with
    this process), waited for in a thread."""
    server.spawn()
    await asyncio.to_thread(server.wait_healthy, timeout_s)


def _kill_group(p: RoleProcess) -> None:
    """kill -9 of the role's process group (a Celery worker's pool dies with it), then reap."""
    try:
        os.killpg(p.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.proc.wait()


class _Soak:
    def __init__(self, config: RackflowConfig, procs: ClusterProcesses, url: str, gateway_port: int,
                 valkey: Any, etcd: Any, rng: random.Random) -> None:
        self.config = config
        self.procs = procs
        self.url = url
        self.gateway_port = gateway_port
        self.valkey = valkey
        self.etcd = etcd
        self.rng = rng
        self.state = _State()
        self.follower: _Follower | None = None
        self.readback: dict[str, str | None] = {}
        """{request_id: None (read back whole and ok) or what was wrong} for requests whose client saw a transport
        error or a cut stream, read by id (`GET /v1/results/{id}`) once their result is in: before their output
        stream expires (`output_ttl_s`)."""
        self._round: list[str] = []
        self._gateway_down = 0
        """Gateway kills whose replacement does not answer yet."""

    # -- load --------------------------------------------------------------------------------------------------
    async def drive(self, rate: float, duration_s: float, base: int, t0: float) -> None:
        """Open loop: request k goes out at t0 + k / rate whatever the answers (an `open_loop` of
        workers/bench/gateway.py that keeps each request's index, which maps it to its `rf:ingress` entry)."""
        st = self.state
        tasks: set[asyncio.Task[None]] = set()
        async with _client(4000, 120.0) as client:

            async def send(k: int) -> None:
                st.in_flight += 1
                st.max_in_flight = max(st.max_in_flight, st.in_flight)
                try:
                    o = await one_request(client, self.url, base + k, MAX_TOKENS, k % STREAM_EVERY == 0)
                finally:
                    st.in_flight -= 1
                st.sent.append(Sent(k, o))
                if o.status == 0 or (200 <= o.status < 300 and o.error == "stream ended without [DONE]"):
                    st.cut.append(k)

            for k in range(int(rate * duration_s)):
                due = t0 + k / rate
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                st.send_lag_s.append(time.monotonic() - due)
                task = asyncio.create_task(send(k))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)

    # -- chaos -------------------------------------------------------------------------------------------------
    def _next_role(self) -> str:
        if not self._round:
            self._round = list(ROLES)
            self.rng.shuffle(self._round)
        return self._round.pop()

    async def kill_one(self, restart_delay_s: float) -> None:
        role = self._next_role()
        live = [p for p in self.procs.procs if p.role == role and p.proc.poll() is None]
        if not live:
            self.state.events.append(Chaos(role, "-", time.monotonic(), error=f"no live {role} process"))
            return
        victim = self.rng.choice(live)
        ev = Chaos(role, victim.name, time.monotonic())
        self.state.events.append(ev)
        gateway = role == "gateway"
        self._gateway_down += 1 if gateway else 0
        try:
            await self._kill_and_restart(ev, victim, restart_delay_s)
        finally:
            self._gateway_down -= 1 if gateway else 0

    async def _kill_and_restart(self, ev: Chaos, victim: RoleProcess, restart_delay_s: float) -> None:
        role = victim.role
        await asyncio.to_thread(_kill_group, victim)
        self.procs.procs.remove(victim)
        await asyncio.sleep(restart_delay_s)
        try:
            # spawned from the main thread: a child dies with this process only when the thread that forked it is
            # the main one (PR_SET_PDEATHSIG; workers/shell/runtime.py die_with_parent), so a soak that is killed
            # leaves no restarted role behind
            self._restart(victim)
            if role == "gateway":
                await wait_http_ready(self.url, 120)
        except Exception as e:  # reported, the run goes on (the next kills, the drain and the checks)
            ev.error = f"restart failed: {type(e).__name__}: {e}"
        ev.ready = time.monotonic()
        if role == "gateway":
            self.state.gateway_down.append((ev.t, ev.ready))

    def _restart(self, victim: RoleProcess) -> None:
        name, p = victim.name, self.procs
        if victim.role == "worker":
            p.start_worker(name.removeprefix("worker-"))
        elif victim.role == "batcher":
            rack = next(rk for rk in self.config.rack_names() if name == f"batcher-{rk}" or
                        name.startswith(f"batcher-{rk}-"))
            p._spawn("batcher", name, ["--rack", rack])
        elif victim.role == "router":
            p._spawn("router", name, [])
        elif victim.role == "gateway":
            p.start_gateway(name, self.gateway_port)
        elif victim.role == "celery":
            p.start_celery_worker(name)
        elif victim.role == "monitor":
            p.start_monitor(name)
        else:  # pragma: no cover - ROLES is closed
            raise ValueError(victim.role)

    async def verify(self, done: asyncio.Event) -> None:
        """Read back by id, as the client would once its gateway answers again, every accepted request whose
        client was cut off (transport error or a stream without [DONE]) and whose final result is in."""
        st, fol = self.state, self.follower
        assert fol is not None
        async with httpx.AsyncClient(timeout=30) as c:
            while True:
                last_pass = done.is_set()
                for k in list(st.cut):
                    rid = fol.accepted.get(k)
                    if rid is None or rid in self.readback or rid not in fol.first or self._gateway_down:
                        continue
                    try:
                        resp = await c.get(f"{self.url}/v1/results/{rid}")
                    except httpx.HTTPError:
                        continue  # the gateway is not back yet: the next pass
                    if resp.status_code != 200:
                        self.readback[rid] = f"GET /v1/results: {resp.status_code}"
                        continue
                    body = resp.json()
                    ok = body.get("status") == "ok" and body["usage"]["completion_tokens"] == MAX_TOKENS
                    self.readback[rid] = None if ok else (
                        f"GET /v1/results: status {body.get('status')}, {body['usage']['completion_tokens']} tokens")
                if last_pass:
                    return
                try:
                    await asyncio.wait_for(done.wait(), 1.0)
                except TimeoutError:
                    pass

    async def restart_etcd(self, down_s: float) -> None:
        """SIGKILL of etcd, and a start on the same ports and data dir `down_s` later (its WAL holds the registry,
        the leases and the sequence records)."""
        ev = Chaos("etcd", "etcd", time.monotonic())
        self.state.events.append(ev)
        try:
            await asyncio.to_thread(self.etcd.kill)
            await asyncio.sleep(down_s)
            await _respawn(self.etcd)  # the same ports and data dir: the roles' URL is unchanged
        except Exception as e:
            ev.error = f"{type(e).__name__}: {e}"
        ev.ready = time.monotonic()

    async def restart_valkey(self, down_s: float) -> None:
        # while the gateway is down, no client would see the outage: wait for it (up to a minute)
        deadline = time.monotonic() + 60
        while self._gateway_down and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        ev = Chaos("valkey", "valkey", time.monotonic())
        self.state.events.append(ev)
        try:
            await asyncio.to_thread(self.valkey.kill)  # SIGKILL: no shutdown, no final fsync
            await asyncio.sleep(down_s)
            await _respawn(self.valkey)  # same port and data dir: reloads the append-only file
        except Exception as e:
            ev.error = f"{type(e).__name__}: {e}"
        ev.ready = time.monotonic()

    async def chaos(self, t0: float, schedule: list[tuple[float, str]], restart_delay_s: float,
                    valkey_down_s: float, etcd_down_s: float) -> None:
        """Each event on its own schedule: a slow restart (a gateway answering late) does not delay the next."""
        tasks = []
        for at, what in schedule:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            tasks.append(asyncio.create_task(
                self.restart_valkey(valkey_down_s) if what == "valkey" else
                self.restart_etcd(etcd_down_s) if what == "etcd" else self.kill_one(restart_delay_s)))
        await asyncio.gather(*tasks)


def _schedule(duration_s: float, kill_every_s: float, with_valkey: bool,
              with_etcd: bool = False) -> list[tuple[float, str]]:
    """Kills at kill_every_s, 2 x kill_every_s, ... up to half a period before the end; the Valkey restart halfway
    between the middle kill and the next one; the etcd restart halfway between the kill a quarter into the run and
    the next one (after the last kill in a run of three kills or fewer)."""
    kills = []
    t = kill_every_s
    while t <= duration_s - kill_every_s / 2:
        kills.append(t)
        t += kill_every_s
    out = [(t, "role") for t in kills]
    if with_valkey and kills:
        mid = kills[(len(kills) - 1) // 2] if len(kills) > 1 else 0.0
        out.append((mid + kill_every_s / 2, "valkey"))
    if with_etcd and kills:
        at = kills[-1] if len(kills) <= 3 else kills[len(kills) // 4]
        out.append((at + kill_every_s / 2, "etcd"))
    return sorted(out)


# -- what the streams hold ---------------------------------------------------------------------------------------
def _stream_problem(evs: list[Any], res: ResultEvent) -> str | None:
    """What an HTTP client would have been streamed, checked as workers/bench/failover.py does: the gateway's
    reader (tokens deduplicated by index, up to the first result) gives every index 0..n-1 once, with the result's
    text, and n = max_tokens."""
    got: list[int] = []
    text: list[str] = []
    nxt = 0
    final: ResultEvent | None = None
    for ev in evs:
        if isinstance(ev, ResultEvent):
            final = ev
            break
        if not isinstance(ev, TokenEvent):
            continue
        ids, texts, index = list(ev.token_ids), list(ev.texts), ev.index
        if index + len(ids) <= nxt:
            continue
        if index < nxt:
            ids, texts, index = ids[nxt - index:], texts[nxt - index:], nxt
        got += [index + j for j in range(len(ids))]
        text.append("".join(texts))
        nxt = index + len(ids)
    if final is None:
        return "no result in its output stream"
    if final.status != "ok":
        return f"result {final.status}: {final.error}"
    if res.out_tokens != MAX_TOKENS:
        return f"{res.out_tokens} tokens, asked {MAX_TOKENS}"
    if got != list(range(res.out_tokens)):
        return f"token indices {got[:8]}... are not 0..{res.out_tokens - 1} once"
    if "".join(text) != res.text:
        return "streamed text differs from the result's"
    return None


class _Follower:
    """Tails `rf:ingress`, `rf:admitted` (the requests a gateway routed itself) and `rf:results` while the soak runs
    (one XREAD of all three, blocking 1 s), so that the run's accounting does not depend on the streams' retention:
    the soak trims them at `retention_s` (60 s), which is what keeps Valkey's memory flat, and an end-of-run read
    would find only the last minute. Each final result's own output stream (`rf:out:{id}`, which expires
    `output_ttl_s` after its last write) is checked when the result arrives. A Valkey restart is ridden out (the
    read resumes from the last entry seen: the append-only file kept it)."""

    def __init__(self, redis_url: str, since_ms: int, base: int, n: int) -> None:
        self.redis_url = redis_url
        self.last = {keys.INGRESS: f"{since_ms}-0", keys.ADMITTED: f"{since_ms}-0", keys.RESULTS: f"{since_ms}-0"}
        self.base, self.n = base, n
        self.accepted: dict[int, str] = {}
        self.admitted_twice = 0
        self.first: dict[str, ResultEvent] = {}
        self.counts: Counter[str] = Counter()
        self.problems: dict[str, str] = {}
        """{request_id: what its output stream lacks}; a result not yet found there is retried for STREAM_WAIT_S."""
        self._unchecked: dict[str, float] = {}
        self.max_lag_s = 0.0
        """The oldest entry read, by its id's time: past the retention, entries could have been trimmed unread."""
        self.read_errors = 0
        self.stop = False

    def _take(self, stream: str, entries: list[Any]) -> None:
        now_ms = time.time() * 1000
        for eid, fields in entries:
            eid = eid.decode() if isinstance(eid, bytes) else str(eid)
            self.last[stream] = eid
            self.max_lag_s = max(self.max_lag_s, (now_ms - int(eid.split("-", 1)[0])) / 1000)
            try:
                ev = codec.decode(fields)
            except Exception:  # not an event of ours
                continue
            if stream in (keys.INGRESS, keys.ADMITTED) and isinstance(ev, RequestEvent):
                m = PROMPT.match(ev.prompt)
                if m is None or not self.base <= int(m.group(1)) < self.base + self.n:
                    continue
                k = int(m.group(1)) - self.base
                if k in self.accepted and self.accepted[k] != ev.request_id:
                    self.admitted_twice += 1
                self.accepted.setdefault(k, ev.request_id)
            elif stream == keys.RESULTS and isinstance(ev, ResultEvent):
                self.counts[ev.request_id] += 1
                if ev.request_id not in self.first:
                    self.first[ev.request_id] = ev
                    self._unchecked[ev.request_id] = time.monotonic()

    async def _check(self, r: Any) -> None:
        ids = list(self._unchecked)
        for i in range(0, len(ids), 200):
            chunk = ids[i:i + 200]
            pipe = r.pipeline(transaction=False)
            for rid in chunk:
                pipe.xrange(keys.request_out(rid))
            for rid, entries in zip(chunk, await pipe.execute(), strict=True):
                evs = []
                for _eid, fields in entries:
                    try:
                        evs.append(codec.decode(fields))
                    except Exception:
                        continue
                problem = _stream_problem(evs, self.first[rid])
                if problem == "no result in its output stream" and \
                        time.monotonic() - self._unchecked[rid] < STREAM_WAIT_S:
                    continue  # rf:results may be read before the result reaches rf:out: look again
                self._unchecked.pop(rid)
                if problem is not None:
                    self.problems[rid] = problem

    async def run(self) -> None:
        r = connect(self.redis_url)
        try:
            while True:
                stopping = self.stop
                try:
                    got: Any = await r.xread(dict(self.last), count=2000, block=1000)  # type: ignore[arg-type]
                    for stream, entries in got or []:
                        self._take(stream.decode() if isinstance(stream, bytes) else str(stream), entries)
                    await self._check(r)
                except (RedisError, OSError):
                    self.read_errors += 1
                    await asyncio.sleep(0.5)
                    continue
                if stopping and not got and not self._unchecked:
                    return
        finally:
            await r.aclose()


STREAM_WAIT_S = 10.0


async def _sample_memory(redis_url: str, t0: float, every_s: float, out: list[tuple[float, float]],
                         done: asyncio.Event) -> None:
    """Valkey's `used_memory` (MB) every `every_s` until `done`; a sample that fails (Valkey restarting) is skipped."""
    r = connect(redis_url)
    try:
        while not done.is_set():
            try:
                info = await r.info("memory")
                out.append((time.monotonic() - t0, int(info["used_memory"]) / 1e6))
            except (RedisError, OSError, KeyError):
                pass
            try:
                await asyncio.wait_for(done.wait(), every_s)
            except TimeoutError:
                pass
    finally:
        await r.aclose()


_HASH_TAG = re.compile(r"\{(?!rf:)[^}]*\}")
_ID_PART = re.compile(r"[0-9a-f]{8,}(-[0-9a-f]{4,})*|\d{3,}")


async def _census(redis_url: str, sample: int = 20) -> dict[str, dict[str, float]]:
    """Valkey's keys grouped by pattern (hash tags of a request, node or user, ids and numbers as `*`): how many, and
    their memory (MB; MEMORY USAGE of up to `sample` keys per group, scaled to the group)."""
    r = connect(redis_url)
    groups: dict[str, list[bytes]] = {}
    try:
        async for key in r.scan_iter(count=1000):
            name = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
            groups.setdefault(_ID_PART.sub("*", _HASH_TAG.sub("{*}", name)), []).append(key)
        out: dict[str, dict[str, float]] = {}
        for pattern, ks in groups.items():
            picked = ks[:sample]
            sizes = [await r.memory_usage(k) or 0 for k in picked]
            out[pattern] = {"keys": len(ks), "mb": round(sum(sizes) / max(1, len(picked)) * len(ks) / 1e6, 3)}
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["mb"]))
    finally:
        await r.aclose()


# -- the report --------------------------------------------------------------------------------------------------
def _is_connect_error(o: Outcome) -> bool:
    return o.status == 0 and (o.error or "").startswith(("ConnectError", "ConnectTimeout"))


def _classify(st: _State, accepted: dict[int, str]) -> dict[int, str]:
    """Per request index, what the client saw: ok, shed, refused, interrupted, or an error kind."""

    def down(o: Outcome, slack: float) -> bool:
        a, b = o.start, o.start + o.latency_s
        return any(a <= up + slack and b >= kill for kill, up in st.gateway_down)

    ids = set(accepted.values())
    kinds: dict[int, str] = {}
    for s in st.sent:
        o = s.outcome
        if o.ok:
            kinds[s.k] = "ok" if o.request_id in ids else "not_in_ingress"
        elif o.shed:
            kinds[s.k] = "shed"
        elif _is_connect_error(o):
            kinds[s.k] = "refused" if down(o, 0.5) else "transport"
        elif o.status == 0 or (200 <= o.status < 300 and o.error == "stream ended without [DONE]"):
            kinds[s.k] = "interrupted" if down(o, STALE_CONN_S) else ("transport" if o.status == 0 else "answer")
        elif 200 <= o.status < 300:
            kinds[s.k] = "answer"
        else:
            kinds[s.k] = f"http_{o.status}"
    return kinds


def _p99(st: _State, a: float, b: float) -> tuple[float | None, int]:
    lat = [s.outcome.latency_s * 1000 for s in st.sent if s.outcome.ok and a <= s.outcome.start < b]
    return (round(percentile(lat, 99), 1) if lat else None), len(lat)


def _plot(st: _State, t0: float, path: Path, kinds: dict[int, str], title: str,
          memory: list[tuple[float, float]] | None = None) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = sorted((s.outcome.start - t0, s.outcome.latency_s * 1000) for s in st.sent if s.outcome.ok)
    end = max((s.outcome.start - t0 for s in st.sent), default=0.0)
    rows = 3 if memory else 2
    fig, axes = plt.subplots(rows, 1, figsize=(13, 9 if memory else 7), sharex=True,
                             gridspec_kw={"height_ratios": [3, 1, 1][:rows]})
    ax1, ax2 = axes[0], axes[1]
    if ok:
        ax1.scatter([x for x, _ in ok], [y for _, y in ok], s=2, alpha=0.25, color="tab:blue", label="request")
        bins = 5.0
        xs, ys = [], []
        b = 0.0
        while b <= end:
            vals = [y for x, y in ok if b <= x < b + bins]
            if vals:
                xs.append(b + bins / 2)
                ys.append(percentile(vals, 99))
            b += bins
        ax1.plot(xs, ys, color="black", lw=1.2, label="p99 per 5 s")
    for kill, up in st.gateway_down:
        ax1.axvspan(kill - t0, up - t0, color="tab:orange", alpha=0.15)
    for ev in st.events:
        color = "tab:red" if ev.role in ("valkey", "etcd") else "tab:gray"
        ax1.axvline(ev.t - t0, color=color, ls="--", lw=1)
        ax1.annotate(ev.name, (ev.t - t0, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                     va="top", ha="right", color=color)
    ax1.set_yscale("log")
    ax1.set_ylabel("end-to-end latency (ms)")
    ax1.set_title(title)
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(loc="upper left", fontsize=8)
    by_bin: dict[str, Counter[int]] = {}
    for s in st.sent:
        kind = kinds.get(s.k, "ok")
        if kind != "ok":
            by_bin.setdefault(kind if kind in ("shed", "refused", "interrupted") else "error", Counter())[
                int((s.outcome.start - t0) // 5)] += 1
    for kind, counts in sorted(by_bin.items()):
        ax2.bar([5 * b + 2.5 for b in counts], list(counts.values()), width=4.5, alpha=0.6, label=kind)
    for ev in st.events:
        ax2.axvline(ev.t - t0, color="tab:red" if ev.role in ("valkey", "etcd") else "tab:gray", ls="--", lw=1)
    ax2.set_ylabel("requests per 5 s")
    if by_bin:
        ax2.legend(loc="upper left", fontsize=8)
    if memory:
        ax3 = axes[2]
        ax3.plot([t for t, _ in memory], [mb for _, mb in memory], color="tab:purple", lw=1.2)
        for ev in st.events:
            ax3.axvline(ev.t - t0, color="tab:red" if ev.role in ("valkey", "etcd") else "tab:gray", ls="--", lw=1)
        ax3.set_ylabel("Valkey used_memory (MB)")
        ax3.set_ylim(bottom=0)
        ax3.grid(True, alpha=0.3)
    axes[-1].set_xlabel("time since the soak started (s), by request send time")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def bench_soak(redis_url: str | None, etcd_url: str | None, minutes: float, progress: bool = True, *,
               out_dir: str | Path = "report", load: float = 0.8, kill_every_s: float = 30.0,
               window_s: float = 30.0, clients: int = 16, capacity_s: float = 10.0, restart_delay_s: float = 1.0,
               valkey_down_s: float = 1.0, etcd_down_s: float = 1.0, drain_timeout_s: float = 240.0,
               retention_s: int = 60, memory_every_s: float = 5.0, seed: int | None = None) -> dict[str, Any]:
    """The soak described in this module's docstring; returns the report (JSON-ready) and writes soak.png and
    soak.json under `out_dir`. `redis_url` None: a durable Valkey of its own (restarted once mid-run); given: that
    server, not restarted. `etcd_url` None: an etcd of its own (restarted once); given: not restarted.
    `retention_s`: the cluster's stream retention and output-stream TTL (`policies.streams.retention_s`,
    `output_ttl_s`), which bound Valkey's memory."""
    from workers.local.etcd import EtcdProcess
    from workers.local.supervise import free_port
    from workers.local.valkey import ValkeyProcess, valkey_durable_args

    duration_s = minutes * 60.0
    rng = random.Random(seed)
    base = rng.randrange(10**9, 10**12)  # prompts unique to this run, whatever else the streams hold
    wall_offset = time.time() - time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rackflow-soak-") as tmp:
        tmpd = Path(tmp)
        valkey = etcd = None
        procs = None
        try:
            if redis_url is None:
                valkey = ValkeyProcess(tmpd / "valkey", port=free_port(), extra_args=valkey_durable_args("always"))
                valkey.start()
                redis_url = valkey.url
            if etcd_url is None:
                etcd = EtcdProcess(tmpd / "etcd")
                etcd.start()
                etcd_url = etcd.url
            over = json.loads(json.dumps(SOAK_CLUSTER))
            over["policies"]["kv"] = {"l1_dir": str(tmpd / "l1")}
            over["policies"]["streams"].update(retention_s=retention_s, output_ttl_s=retention_s)
            path = tmpd / "soak.yaml"
            config = config_overlay_file(path, over)
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            procs = ClusterProcesses(config, redis_url, etcd_url, tmpd / "logs", ["--config", str(path)],
                                     log_level="INFO", with_gateway=True, gateway_no_auth=True, gateway_port=port,
                                     with_failover=True)
            procs.start()
            asyncio.run(wait_cluster_ready(config, redis_url, etcd_url, 180))
            asyncio.run(wait_http_ready(url, 120))
            report = _run(config, procs, url, port, valkey, etcd, redis_url, rng, base, wall_offset, duration_s,
                          progress=progress, load=load, kill_every_s=kill_every_s, window_s=window_s,
                          clients=clients, capacity_s=capacity_s, restart_delay_s=restart_delay_s,
                          valkey_down_s=valkey_down_s, etcd_down_s=etcd_down_s, drain_timeout_s=drain_timeout_s,
                          memory_every_s=memory_every_s, out_dir=Path(out_dir))
            report["retention_s"] = retention_s
        finally:
            if procs is not None:
                procs.stop()
            keep = os.environ.get("RACKFLOW_BENCH_KEEP_LOGS")
            if keep and (tmpd / "logs").exists():
                import shutil

                shutil.copytree(tmpd / "logs", keep, dirs_exist_ok=True)
            if etcd is not None:
                etcd.stop()
            if valkey is not None:
                valkey.stop()
    if valkey is None:
        report["valkey_restart_skipped"] = "an external Redis URL was given: this run does not own that server"
    if etcd is None:
        report["etcd_restart_skipped"] = "an external etcd URL was given: this run does not own that server"
    return report


def _memory_summary(samples: list[tuple[float, float]], load_end_s: float) -> dict[str, float | None]:
    """Valkey's used_memory: the first sample a minute or more into the soak, the last one of the load, the
    largest, and the last one (after the drain)."""
    during = [mb for t, mb in samples if t <= load_end_s + 1]
    first = next((mb for t, mb in samples if t >= 60.0), None)
    return {
        "after_first_minute": round(first, 2) if first is not None else None,
        "end": round(during[-1], 2) if during else None,
        "peak": round(max(during), 2) if during else None,
        "after_drain": round(samples[-1][1], 2) if samples else None,
    }


def _run(config: RackflowConfig, procs: ClusterProcesses, url: str, port: int, valkey: Any, etcd: Any,
         redis_url: str, rng: random.Random, base: int, wall_offset: float, duration_s: float, *, progress: bool,
         load: float, kill_every_s: float, window_s: float, clients: int, capacity_s: float, restart_delay_s: float,
         valkey_down_s: float, etcd_down_s: float, drain_timeout_s: float, memory_every_s: float,
         out_dir: Path) -> dict[str, Any]:
    # capacity: a closed loop that keeps every engine slot busy (after a warm-up: connections, imports, caches)
    if progress:
        print(f"soak: measuring capacity ({clients} clients, closed loop, {capacity_s:g} s after a 3 s warm-up)",
              file=sys.stderr)
    warm = run_async(closed_loop(url, clients, 3.0, MAX_TOKENS, STREAM_EVERY, timeout_s=30.0))
    if not any(o.ok for o in warm):
        raise RuntimeError(
            "the cluster served no request in the warm-up (answers: "
            f"{dict(Counter(o.status for o in warm))}, e.g. {next((o.error for o in warm if o.error), None)}); "
            "RACKFLOW_BENCH_KEEP_LOGS=DIR keeps the role processes' logs")
    c0 = time.monotonic()
    cap = run_async(closed_loop(url, clients, capacity_s, MAX_TOKENS, STREAM_EVERY))
    window = max(capacity_s, max((o.start + o.latency_s for o in cap), default=c0) - c0)
    capacity = sum(1 for o in cap if o.ok) / window
    if capacity <= 0:
        raise RuntimeError(f"capacity 0: no request completed in {capacity_s:g} s ({Counter(o.status for o in cap)})")
    rate = load * capacity
    n = int(rate * duration_s)
    soak = _Soak(config, procs, url, port, valkey, etcd, rng)
    schedule = _schedule(duration_s, kill_every_s, valkey is not None, etcd is not None)
    since_ms = int(time.time() * 1000) - 1000
    fol = soak.follower = _Follower(redis_url, since_ms, base, n)
    memory: list[tuple[float, float]] = []
    load_end_s = duration_s

    async def main() -> float:
        nonlocal load_end_s
        t0 = time.monotonic()
        done = asyncio.Event()
        following = asyncio.create_task(fol.run())
        sampling = asyncio.create_task(_sample_memory(redis_url, t0, memory_every_s, memory, done))
        verifying = asyncio.create_task(soak.verify(done))
        bar = tqdm(total=round(duration_s), desc="soak", unit="s", disable=not progress, file=sys.stderr)
        drive = asyncio.create_task(soak.drive(rate, duration_s, base, t0))
        chaos = asyncio.create_task(soak.chaos(t0, schedule, restart_delay_s, valkey_down_s, etcd_down_s))
        shown = 0
        st = soak.state
        while not drive.done():
            await asyncio.sleep(1.0)
            el = min(round(duration_s), int(time.monotonic() - t0))
            if el > shown:
                bar.update(el - shown)
                shown = el
            last = st.events[-1].name if st.events else "-"
            ok = sum(1 for s in st.sent if s.outcome.ok)
            mb = f", valkey {memory[-1][1]:.0f} MB" if memory else ""
            bar.set_postfix_str(f"{rate:.1f} req/s, done {ok}, in flight {st.in_flight}, kills {len(st.events)} "
                                f"(last {last}){mb}")
        bar.update(round(duration_s) - shown)
        bar.close()
        await drive
        await chaos
        load_end_s = time.monotonic() - t0
        # the drain: every accepted request's final result (the follower reads them as they land)
        deadline = time.monotonic() + drain_timeout_s
        want = set(fol.accepted.values())
        dbar = tqdm(total=len(want), desc="soak: final results", unit="req", disable=not progress, file=sys.stderr)
        while True:
            dbar.n = len(want & fol.first.keys())
            dbar.refresh()
            if want <= fol.first.keys() or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        dbar.close()
        done.set()
        fol.stop = True
        await asyncio.gather(following, sampling, verifying)
        return t0

    t0 = run_async(main())
    census = run_async(_census(redis_url))
    st = soak.state
    accepted, admitted_twice = fol.accepted, fol.admitted_twice
    ids = set(accepted.values())
    got, counts = {rid: ev for rid, ev in fol.first.items() if rid in ids}, fol.counts
    kinds = _classify(st, accepted)
    problems = {rid: p for rid, p in fol.problems.items() if rid in ids}
    interrupted_ids = [accepted[k] for k, kind in kinds.items() if kind == "interrupted" and k in accepted]
    unreadable = {rid: soak.readback.get(rid) or "not read back before its output stream expired"
                  for rid in interrupted_ids if rid in got and soak.readback.get(rid, "missing") is not None}
    # client errors, one per request: what the client saw, then what the streams hold
    by_rid = {rid: k for k, rid in accepted.items()}
    errors: dict[int, str] = {k: kind for k, kind in kinds.items()
                              if kind not in ("ok", "shed", "refused", "interrupted")}
    samples: list[str] = []
    for s in st.sent:
        if s.k in errors and len(samples) < 8:
            ra = f" retry-after {s.outcome.retry_after}" if s.outcome.retry_after else ""
            samples.append(f"{errors[s.k]}: status {s.outcome.status}{ra} {s.outcome.error or ''}".strip())
    for rid, problem in problems.items():
        k = by_rid[rid]
        if k not in errors:
            errors[k] = "result"
            if len(samples) < 12:
                samples.append(f"result {rid}: {problem}")
    for rid, problem in unreadable.items():
        k = by_rid[rid]
        if k not in errors:
            errors[k] = "interrupted_unverified"
            if len(samples) < 12:
                samples.append(f"interrupted {rid}: {problem}")
    for rid in ids - set(got):  # lost: counted as lost; an interrupted one without result is not also an error
        errors.pop(by_rid[rid], None)
    events = []
    st.events.sort(key=lambda e: e.t)
    for ev in st.events:
        t = ev.t - t0
        before, nb = _p99(st, ev.t - window_s, ev.t)
        after, na = _p99(st, ev.t, ev.t + window_s)
        events.append({
            "role": ev.role, "name": ev.name, "t_s": round(t, 1), "p99_before_ms": before, "p99_after_ms": after,
            "n_before": nb, "n_after": na,
            "restart_s": round(ev.ready - ev.t, 2) if ev.ready is not None else None,
            "overlaps": [o.name for o in st.events if o is not ev and abs(o.t - ev.t) < window_s],
            **({"error": ev.error} if ev.error else {}),
        })
    kind_counts = Counter(kinds.values())
    ok_lat = [s.outcome.latency_s * 1000 for s in st.sent if s.outcome.ok]
    ttft = [s.outcome.ttft_s * 1000 for s in st.sent if s.outcome.ok and s.outcome.ttft_s is not None]

    def restarts(role: str) -> tuple[int, dict[str, Any] | None]:
        evs = [e for e in st.events if e.role == role]
        ok = sum(1 for e in evs if e.error is None)
        first = None if not evs else {
            "t_s": round(evs[0].t - t0, 1), "down_s": round((evs[0].ready or evs[0].t) - evs[0].t, 2),
            **({"error": evs[0].error} if evs[0].error else {})}
        return ok, first

    valkey_restarts, valkey_first = restarts("valkey")
    etcd_restarts, etcd_first = restarts("etcd")
    dead = [p.name for p in procs.dead()]
    report: dict[str, Any] = {
        "minutes": round(duration_s / 60, 2),
        "capacity_rps": round(capacity, 2),
        "capacity_clients": clients,
        "capacity_errors": sum(1 for o in cap if not o.ok and not o.shed),
        "offered_rps": round(rate, 2),
        "load": load,
        "requests": len(st.sent),
        "sent": len(st.sent),
        "accepted": len(ids),
        "completed": sum(1 for rid in ids if rid in got and got[rid].status == "ok"),
        "lost": len(ids - set(got)),
        "duplicates": sum(c - 1 for rid, c in counts.items() if rid in ids and c > 1),
        "duplicate_requests": sum(1 for rid, c in counts.items() if rid in ids and c > 1),
        "admitted_twice": admitted_twice,
        "client_errors": len(errors),
        "client_error_kinds": dict(Counter(errors.values())),
        "client_error_samples": samples,
        "client_errors_accepted": sum(1 for k in errors if k in accepted),
        "shed": kind_counts.get("shed", 0),
        "refused": kind_counts.get("refused", 0),
        "interrupted": kind_counts.get("interrupted", 0),
        "interrupted_accepted": len(interrupted_ids),
        "interrupted_verified": sum(1 for rid in interrupted_ids if rid in got and rid not in unreadable),
        "interrupted_not_accepted": kind_counts.get("interrupted", 0) - len(interrupted_ids),
        "streamed_ok": sum(1 for s in st.sent if s.outcome.ok and s.outcome.stream),
        "p50_ms": round(percentile(ok_lat, 50), 1) if ok_lat else None,
        "p99_ms": round(percentile(ok_lat, 99), 1) if ok_lat else None,
        "ttft_p99_ms": round(percentile(ttft, 99), 1) if ttft else None,
        "max_in_flight": st.max_in_flight,
        "sent_rps": round(len(st.sent) / duration_s, 2),
        "send_lag_p99_s": round(percentile(st.send_lag_s, 99), 3) if st.send_lag_s else None,
        "send_lag_max_s": round(max(st.send_lag_s), 3) if st.send_lag_s else None,
        "send_lag_max_at_s": round(max(range(len(st.send_lag_s)), key=st.send_lag_s.__getitem__) / rate, 1)
        if st.send_lag_s else None,
        "transport_errors": dict(Counter((s.outcome.error or "").split(":", 1)[0] for s in st.sent
                                         if s.outcome.status == 0)),
        "kills": sum(1 for e in st.events if e.role not in ("valkey", "etcd") and e.error is None),
        "events": events,
        "valkey_restarts": valkey_restarts,
        "valkey_restart": valkey_first,
        "etcd_restarts": etcd_restarts,
        "etcd_restart": etcd_first,
        "valkey_used_memory_mb": _memory_summary(memory, load_end_s),
        "valkey_memory_series": [[round(t, 1), round(mb, 2)] for t, mb in memory],
        "valkey_keys_end": census,
        "follower_max_lag_s": round(fol.max_lag_s, 2),
        "follower_read_errors": fol.read_errors,
        "gateway_down_s": [round(b - a, 2) for a, b in st.gateway_down],
        "unexpected_exits": dead,
        "wall_offset_s": round(wall_offset, 3),
        "cluster": "2 racks x 2 sim H100 nodes (real iteration times, max_running 2); router, batcher per rack, "
                   "1 gateway, 4 health agents, monitor, Celery worker; durable Valkey (appendfsync always)",
        "max_tokens": MAX_TOKENS,
        "stream_share": round(1 / STREAM_EVERY, 3),
        "kill_every_s": kill_every_s,
        "window_s": window_s,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    title = (f"soak: {report['minutes']:g} min at {rate:.1f} req/s ({load:.0%} of {capacity:.1f}); "
             f"lost {report['lost']}, duplicates {report['duplicates']}, client errors {report['client_errors']}")
    plot = _plot(st, t0, out_dir / "soak.png", kinds, title, memory)
    report["plot"] = plot
    if plot is None:
        report["plot_skipped"] = "matplotlib is not installed"
    (out_dir / "soak.json").write_text(json.dumps(report, sort_keys=True, indent=2) + "\n")
    return report


def main_json(res: dict[str, Any]) -> str:
    return json.dumps(res, sort_keys=True)

