"""Engine model of one node (one engine instance) for the simulator: vLLM-like continuous batching.

- Admission FCFS from the waiting queue while KV blocks (block_size tokens each) and `max_num_seqs` allow; a
  request's prompt is allocated at admission; prompts are prefilled in chunks under a token budget per iteration
  (`max_num_batched_tokens`, decode tokens count against it: chunked prefill).
- Prefix cache (`pipeline.kv.prefix_cache`): an LRU of prefix-block hashes in GPU memory, and optionally a host-memory
  tier under it; the cached part of a prompt is not prefilled (it still holds KV), a part found only in host memory
  is loaded back over the host link (its transfer time is added to the iteration).
- Decode: between composition changes the node runs a "stretch" of identical decode steps whose total time comes
  from the cost model in closed form (`decode_span_ms`), so a request costs a few events, not one per token. A
  stretch ends at the first finishing sequence or when KV memory would run out; an arrival shortens the stretch to
  the step in progress, and new work joins at that step boundary, as in an iteration-level scheduler.
- Out of KV memory: the most recently admitted sequence is preempted (recompute: its blocks are freed and it goes
  back to the front of the queue with prompt + generated tokens to prefill again).
Generated-token counts are kept implicitly (a global decode-step counter and per-sequence offsets) so advancing a
stretch is O(1) whatever the batch size.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.kv.prefix_cache import BlockListener, PrefixCache
from pipeline.sim.control_plane import Station
from pipeline.sim.world import NodeWorld


class StepCost(Protocol):
    def step_ms(
        self, prefill_tokens: Sequence[int], decode_seqs: int, decode_kv_tokens: int,
        prefill_cached: Sequence[int] | None = None,
    ) -> float: ...

    def decode_span_ms(self, n: int, kv0: int, steps: int) -> float: ...

    def decode_steps_within(self, n: int, kv0: int, budget_ms: float) -> int: ...


@dataclass(slots=True)
class SimSeq:
    rid: int
    """Index of the request in the simulation's request table."""
    prompt: int
    """Tokens to prefill on this node (prompt, plus tokens generated elsewhere after a migration/preemption)."""
    remaining: int
    """Tokens still to generate."""
    mem_est_kb: float
    prefix: tuple[int, ...] = ()
    cached: int = 0
    prefilled: int = 0
    finish_step: int = 0
    """Value of the node's decode-step counter at which this sequence has generated all `remaining` tokens."""
    started_step: int = 0
    admitted_ms: float = 0.0
    host_tokens: int = 0
    """Of `cached`, the tokens loaded back from the host-memory tier (charged to its first prefill chunk)."""
    resident: bool = False
    """Its KV is already here (moved in with it): admission prefills only the token that continues it."""
    priority: int = 0
    """Its class (pipeline/priority.py): 0 interactive, 1 batch. Interactive sequences are admitted and prefilled
    first; one that finds no free slot or no KV room preempts a batch sequence when `preempt_batch` is on."""

    def __init__(self, rid: int, prompt: int, remaining: int, mem_est_kb: float, prefix: tuple[int, ...] = (),
                 cached: int = 0, prefilled: int = 0, finish_step: int = 0, started_step: int = 0,
                 admitted_ms: float = 0.0, host_tokens: int = 0, resident: bool = False, priority: int = 0) -> None:
        # written out: see pipeline.routing.views.RackView.__init__
        self.rid = rid
        self.prompt = prompt
        self.remaining = remaining
        self.mem_est_kb = mem_est_kb
        self.prefix = prefix
        self.cached = cached
        self.prefilled = prefilled
        self.finish_step = finish_step
        self.started_step = started_step
        self.admitted_ms = admitted_ms
        self.host_tokens = host_tokens
        self.resident = resident
        self.priority = priority


@dataclass(slots=True)
class FinishedSeq:
    rid: int
    finish_ms: float

    def __init__(self, rid: int, finish_ms: float) -> None:
        self.rid = rid
        self.finish_ms = finish_ms


@dataclass(slots=True)
class StepResult:
    first_tokens: list[tuple[int, float]] = field(default_factory=list)
    finished: list[FinishedSeq] = field(default_factory=list)
    freed: bool = False
    """KV memory or a running slot was released (the batcher may have room now)."""

    def __init__(self, first_tokens: list[tuple[int, float]] | None = None, finished: list[FinishedSeq] | None = None,
                 freed: bool = False) -> None:
        # written out: see pipeline.routing.views.RackView.__init__ (None: a new empty list, as the factories)
        self.first_tokens = [] if first_tokens is None else first_tokens
        self.finished = [] if finished is None else finished
        self.freed = freed


class SimNode:
    def __init__(
        self,
        name: str,
        rack: str,
        cost: StepCost,
        *,
        kv_capacity_tokens: int,
        block_size: int,
        max_num_seqs: int,
        max_batched_tokens: int,
        mem_cap_kb: float,
        vram_total_gb: float,
        weights_gb: float,
        kv_bytes_per_token: int,
        prefix_block_tokens: int,
        prefix_cache: bool = True,
        host_cache_blocks: int = 0,
        host_link_gbps: float = 64.0,
        block_listener: BlockListener | None = None,
        util_bin_ms: float = 10_000.0,
        preempted: set[int] | None = None,
        max_stretch_steps: int = 0,
        world: NodeWorld | None = None,
        prefix_shares_kv: bool = False,
        preempt_batch: bool = True,
        batch_reserve: int = 0,
    ) -> None:
        self.name = name
        self.rack = rack
        self.cost = cost
        self.block_size = block_size
        self.capacity_tokens = kv_capacity_tokens
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.max_stretch_steps = max_stretch_steps
        """Most decode steps one phase may run (0: as many as nothing changes in; the live `sim` engine runs 1, so
        that each step hands out its tokens)."""
        self.mem_cap_kb = mem_cap_kb
        self.vram_total_gb = vram_total_gb
        self.weights_gb = weights_gb
        self.kv_bytes_per_token = kv_bytes_per_token
        self.prefix_block_tokens = prefix_block_tokens
        self.prefix_enabled = prefix_cache
        self.prefix = PrefixCache(max(1, kv_capacity_tokens // prefix_block_tokens), host_cache_blocks,
                                  block_listener)
        self.prefix_shares_kv = prefix_shares_kv
        """The cached blocks live in the KV pool that the running sequences use, as in vLLM (a block is cached while
        it is free and not yet reused): the GPU tier holds what the sequences leave free, plus their own prefix
        blocks. Off: the GPU tier holds the node's whole KV capacity in cached blocks besides the sequences."""
        self.host_ms_per_token = kv_bytes_per_token / (host_link_gbps * 1e6) if host_link_gbps > 0 else 0.0
        """Time to load one token's KV back from host memory (bytes / link bandwidth), ms."""
        self.host_link: Station | None = None
        """With the fabric modelled (`--control-plane`): the node's inbound link as a station that host-tier loads
        share with the KV of sequences migrating to this node (the GPU's PCIe, which its NIC hangs off too): a load
        waits behind a migration's transfer, and the other way round. None: the load takes its own time alone."""
        self.prefill_backlog = 0
        """Prompt tokens queued here and not prefilled yet (NodeView.prefill_tokens)."""
        self.slowdown = 1.0
        """EWMA of (iteration time / the cost model's time for it): what the live worker measures."""
        self.waiting: deque[SimSeq] = deque()
        """Interactive sequences first, then batch ones (each in arrival order)."""
        self.batch_seqs = 0
        """Batch-class sequences on the node, waiting or running (NodeView.batch_seqs)."""
        self.batch_mem_kb = 0.0
        """Their memory estimates (NodeView.batch_kv_kb)."""
        self.preempt_batch = preempt_batch
        """An interactive sequence that finds no free slot or KV room preempts the newest batch sequence (vLLM's
        priority scheduling); off: it waits for one to end (batch work is only held back upstream)."""
        self.priority_preemptions = 0
        self.batch_reserve = batch_reserve
        """Slots a batch sequence leaves free when it is admitted (a preempted one waiting to come back, too):
        interactive arrivals find them free, and preemption serves only the bursts beyond them."""
        self.prefilling: list[SimSeq] = []
        self.decoding: dict[int, SimSeq] = {}
        self._finish_heap: list[tuple[int, int]] = []
        self.steps = 0
        self.kv_tokens = 0
        """KV tokens held by admitted sequences (prefilling ones count their whole prompt)."""
        self.kv_decoding = 0
        """KV tokens of the decoding sequences (what a decode step reads)."""
        self.mem_est_used = 0.0
        """Sum of mem_est_kb of every sequence on the node (the batcher's accounting)."""
        self.alive = True
        """False once the node died: it schedules nothing more."""
        self.accepting = True
        """False while drained (health below threshold) or dead: the batcher sends it nothing new."""
        self.slow_factor = 1.0
        self.world = world
        """The node's hidden truth (oracle-free runs): its iterations take the cost model's time times its factor per
        operator class, noise and stalls; None: exactly the cost model's (times `slow_factor`)."""
        self.last_report: tuple[float, float, float] | None = None
        """With a world: the phase that just ended as its worker reports it: (observed ms, the cost model's ms of its
        prefill part, of its decode part), for the control plane's speed belief."""
        self.epoch = 0
        # the phase in progress: None, ("prefill", end_ms, chunks, t0, model_prefill_ms, model_decode_ms) or
        # ("decode", t0, n, kv0, steps, end_ms, mult): mult is the phase's time over the cost model's
        self.phase: tuple[object, ...] | None = None
        self.avg_step_ms = 0.0
        self.busy_ms = 0.0
        self.mem_integral = 0.0
        """Integral over time of (weights + KV bytes) / total memory, for the mean memory utilisation."""
        self.kv_integral = 0.0
        """Integral of KV used / KV capacity (the memory the engine can give to sequences)."""
        self.seq_integral = 0.0
        """Integral of running sequences (mean concurrency)."""
        self._last_mem_t = 0.0
        self._origin: float | None = None
        self.preemptions = 0
        self.preempted = preempted if preempted is not None else set()
        """Requests preempted at least once (shared by the nodes of a simulation)."""
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.host_hit_tokens = 0
        self.iterations = 0
        self.util_bin_ms = util_bin_ms
        self.kv_bins: list[float] = []
        """Per `util_bin_ms` of simulated time: the integral of KV used / KV capacity (ms) within it."""

    # -- views ---------------------------------------------------------------------------------------------------
    @property
    def outstanding(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def idle(self) -> bool:
        return self.phase is None and not self.waiting and not self.prefilling and not self.decoding

    def kv_bytes(self) -> float:
        return float(self.kv_tokens) * self.kv_bytes_per_token

    def free_vram_gb(self) -> float:
        return max(0.0, self.vram_total_gb - self.weights_gb - self.kv_bytes() / 1e9)

    def _mem_frac(self) -> float:
        return min(1.0, (self.weights_gb + self.kv_bytes() / 1e9) / self.vram_total_gb)

    def _account_mem(self, now: float) -> None:
        if self._origin is None:  # the first event: integrals and bins start here (the live engine's clock is epoch ms)
            self._origin = self._last_mem_t = now
            return
        if now > self._last_mem_t:
            t0 = self._last_mem_t
            dt = now - t0
            kv = min(1.0, self.kv_tokens / self.capacity_tokens)
            self.mem_integral += self._mem_frac() * dt
            self.kv_integral += kv * dt
            self.seq_integral += self.running * dt
            self._last_mem_t = now
            if kv > 0:
                w = self.util_bin_ms
                bins = self.kv_bins
                t0 -= self._origin
                now -= self._origin
                k = int(t0 // w)
                while t0 < now:
                    end = min(now, (k + 1) * w)
                    while len(bins) <= k:
                        bins.append(0.0)
                    bins[k] += kv * (end - t0)
                    t0 = end
                    k += 1

    # -- intake --------------------------------------------------------------------------------------------------
    def submit(self, seq: SimSeq) -> None:
        if seq.priority:
            self.batch_seqs += 1
            self.batch_mem_kb += seq.mem_est_kb
            self.waiting.append(seq)
        else:
            self._wait_interactive(seq)
        self.mem_est_used += seq.mem_est_kb
        self.prefill_backlog += seq.prompt

    def batch_prefill(self) -> int:
        """Of `prefill_backlog`, the batch sequences' (waiting whole, prefilling the rest): 0 without batch work."""
        if not self.batch_seqs:
            return 0
        return (sum(s.prompt for s in self.waiting if s.priority)
                + sum(s.prompt - s.prefilled for s in self.prefilling if s.priority))

    def _unbatch(self, s: SimSeq) -> None:
        if s.priority:
            self.batch_seqs -= 1
            self.batch_mem_kb = self.batch_mem_kb - s.mem_est_kb if self.batch_seqs else 0.0

    def _wait_interactive(self, seq: SimSeq) -> None:
        """Queue an interactive sequence behind the interactive ones waiting, ahead of every batch one."""
        if self.batch_seqs and self.waiting and self.waiting[-1].priority:
            for k, w in enumerate(self.waiting):
                if w.priority:
                    self.waiting.insert(k, seq)
                    return
        self.waiting.append(seq)

    @property
    def kv_usage(self) -> float:
        return min(1.0, self.kv_tokens / self.capacity_tokens) if self.capacity_tokens else 0.0

    def drain_all(self, now: float) -> list[SimSeq]:
        """Remove every sequence (the node died): returns them with `prompt`/`remaining` set for a re-prefill
        elsewhere (prompt + tokens generated so far)."""
        if self.phase is not None and self.phase[0] == "decode":
            _, t0, n, kv0, steps, _end, mult = self.phase
            assert isinstance(t0, float) and isinstance(n, int) and isinstance(kv0, int) and isinstance(steps, int)
            assert isinstance(mult, float)
            self.steps += min(steps, self.cost.decode_steps_within(n, kv0, (now - t0) / mult))
        self._account_mem(now)
        out: list[SimSeq] = []
        for s in list(self.waiting) + self.prefilling:
            out.append(s)
        for s in self.decoding.values():
            done = self.steps - s.started_step
            out.append(SimSeq(s.rid, s.prompt + done, s.remaining - done, s.mem_est_kb, s.prefix,
                              priority=s.priority))
        self.waiting.clear()
        self.prefilling.clear()
        self.decoding.clear()
        self._finish_heap.clear()
        self.kv_tokens = self.kv_decoding = 0
        self.mem_est_used = 0.0
        self.prefill_backlog = 0
        self.batch_seqs = 0
        self.batch_mem_kb = 0.0
        self.phase = None
        self.epoch += 1
        self.alive = self.accepting = False
        self.prefix.clear()  # a dead node's GPU and host memory are gone
        return [SimSeq(s.rid, s.prompt, s.remaining, s.mem_est_kb, s.prefix, priority=s.priority) for s in out]

    def abort(self, rid: int) -> SimSeq | None:
        """Take one sequence out (a cancel, a release for migration) with its accounting; None if it is not here.
        Not while a phase is in progress (the live engine applies aborts between phases)."""
        assert self.phase is None, "abort between phases only"
        for s in self.waiting:
            if s.rid == rid:
                self.waiting.remove(s)
                self.prefill_backlog -= s.prompt
                self.mem_est_used -= s.mem_est_kb
                self._unbatch(s)
                return s
        for s in self.prefilling:
            if s.rid == rid:
                self.prefilling.remove(s)
                self.prefill_backlog -= s.prompt - s.prefilled
                self.kv_tokens -= s.prompt
                self.mem_est_used -= s.mem_est_kb
                self._unbatch(s)
                return s
        if rid not in self.decoding:
            return None
        s = self.decoding.pop(rid)
        self._unbatch(s)
        tokens = s.prompt + (self.steps - s.started_step)
        self.kv_tokens -= tokens
        self.kv_decoding -= tokens
        self.mem_est_used -= s.mem_est_kb
        self._finish_heap = [(f, r) for f, r in self._finish_heap if r != rid]
        heapq.heapify(self._finish_heap)
        return s

    def generated(self, rid: int) -> int | None:
        """Decode steps a decoding sequence has had on this node since its first token (None: not decoding)."""
        s = self.decoding.get(rid)
        return None if s is None else self.steps - s.started_step

    # -- prefix cache --------------------------------------------------------------------------------------------
    def _prefix_hit(self, seq: SimSeq) -> tuple[int, int]:
        """(cached tokens, of which loaded from host memory) of a sequence being admitted."""
        if not self.prefix_enabled or not seq.prefix:
            return 0, 0
        if self.prefix_shares_kv:
            self._fit_prefix()
        hit = self.prefix.lookup(seq.prefix)
        if not hit.blocks:
            return 0, 0
        cached = min(seq.prompt - 1, hit.blocks * self.prefix_block_tokens)
        # host blocks are the later ones of the run only if GPU ones precede them; count them at block size,
        # capped by what is cached
        return cached, min(cached, hit.host_blocks * self.prefix_block_tokens)

    def _prefix_insert(self, seq: SimSeq) -> None:
        if not self.prefix_enabled or not seq.prefix:
            return
        if self.prefix_shares_kv:
            self._fit_prefix(seq)
        self.prefix.insert(seq.prefix)

    def _fit_prefix(self, inserting: SimSeq | None = None) -> None:
        """Room for cached blocks in a shared pool: the KV the running sequences leave free, plus the prefix
        blocks they hold themselves (cached and in use at once), `inserting`'s included (its prefill just ended:
        it is in neither list for that moment, and its KV is still counted)."""
        pb = self.prefix_block_tokens
        held = sum(min(len(s.prefix) * pb, s.prompt) for s in self.prefilling)
        if inserting is not None:
            held += min(len(inserting.prefix) * pb, inserting.prompt)
        held += sum(min(len(s.prefix) * pb, s.prompt) for s in self.decoding.values())
        self.prefix.resize((self.capacity_tokens - self.kv_tokens + held) // pb)

    # -- scheduling ----------------------------------------------------------------------------------------------
    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _free_tokens(self) -> int:
        # allocation is in blocks: every sequence wastes up to a block; count that against the capacity
        return self.capacity_tokens - self.kv_tokens - self.block_size * (len(self.prefilling) + len(self.decoding))

    def _admit(self, now: float) -> None:
        # vLLM v1's scheduler: a waiting request is scheduled only with what the iteration's token budget has left
        # after the running ones (decode tokens and prefill chunks in progress); the rest stay waiting, holding no
        # KV blocks, and count in the engine's queue (num_requests_waiting). With batch-class sequences here, an
        # interactive one is admitted first, and (preempt_batch) takes a batch one's slot or KV room
        budget = self.max_batched_tokens - len(self.decoding)
        queued = sum(x.prompt - x.prefilled for x in self.prefilling)
        while self.waiting:
            s = self.waiting[0]
            urgent = not s.priority and self.batch_seqs > 0
            if urgent:
                # batch prefills run after interactive ones: only the interactive queue counts against this one
                q = sum(x.prompt - x.prefilled for x in self.prefilling if not x.priority)
                if self.preempt_batch:
                    while self.running >= self.max_num_seqs and self._preempt_batch():
                        pass
            else:
                q = queued
            if s.priority and self.running >= self.max_num_seqs - self.batch_reserve:
                return
            if not (self.running < self.max_num_seqs and (q < budget or not self.running)):
                return
            # its prompt, its first token, and one more token for each decoding sequence in this iteration
            need = self._blocks(s.prompt + 1) * self.block_size + len(self.decoding)
            if urgent and self.preempt_batch:
                while need > self._free_tokens() and self._preempt_batch():
                    need = self._blocks(s.prompt + 1) * self.block_size + len(self.decoding)
            if need > self._free_tokens() and self.running:
                return
            self.waiting.popleft()
            s.cached, s.host_tokens = (s.prompt - 1, 0) if s.resident else self._prefix_hit(s)
            s.prefilled = s.cached
            s.admitted_ms = now
            self.prompt_tokens += s.prompt
            self.cached_tokens += s.cached
            self.host_hit_tokens += s.host_tokens
            self.prefill_backlog -= s.cached
            self.kv_tokens += s.prompt
            if urgent:  # ahead of the batch prefills: its chunks are cut first
                k = next((k for k, x in enumerate(self.prefilling) if x.priority), len(self.prefilling))
                self.prefilling.insert(k, s)
            else:
                self.prefilling.append(s)
            queued += s.prompt - s.prefilled

    def _requeue_batch(self, seq: SimSeq) -> None:
        """A preempted batch sequence waits first among the batch ones (behind every interactive one)."""
        k = next((k for k, w in enumerate(self.waiting) if w.priority), len(self.waiting))
        self.waiting.insert(k, seq)

    def _preempt_batch(self) -> bool:
        """Preempt the newest batch sequence (decoding, else prefilling) for an interactive one: recompute, as
        vLLM's priority policy does. False when none runs."""
        victims = [r for r, x in self.decoding.items() if x.priority]
        if victims:
            self._preempt_decoding(max(victims, key=lambda r: (self.decoding[r].admitted_ms, r)))
        else:
            pre = [x for x in self.prefilling if x.priority]
            if not pre:
                return False
            s = max(pre, key=lambda x: (x.admitted_ms, x.rid))
            self.prefilling.remove(s)
            self.kv_tokens -= s.prompt
            self.prefill_backlog += s.prefilled
            self.prompt_tokens -= s.prompt
            self.cached_tokens -= s.cached
            s.prefilled = s.cached = s.host_tokens = 0
            self._requeue_batch(s)
            self.preemptions += 1
            self.preempted.add(s.rid)
        self.priority_preemptions += 1
        return True

    def _preempt_one(self) -> bool:
        """Recompute preemption of the most recently admitted decoding sequence (a batch one first)."""
        if not self.decoding:
            return False
        pool = [r for r, x in self.decoding.items() if x.priority] if self.batch_seqs else []
        rid = max(pool or self.decoding, key=lambda r: (self.decoding[r].admitted_ms, r))
        self._preempt_decoding(rid)
        return True

    def _preempt_decoding(self, rid: int) -> None:
        s = self.decoding.pop(rid)
        done = self.steps - s.started_step
        tokens = s.prompt + done
        self.kv_tokens -= tokens
        self.kv_decoding -= tokens
        self._finish_heap = [(f, r) for f, r in self._finish_heap if r != rid]
        heapq.heapify(self._finish_heap)
        back = SimSeq(s.rid, tokens, s.remaining - done, s.mem_est_kb, s.prefix, priority=s.priority)
        if s.priority:
            self._requeue_batch(back)
        else:
            self.waiting.appendleft(back)
        self.prefill_backlog += tokens
        self.preemptions += 1
        self.preempted.add(s.rid)

    def schedule(self, now: float) -> float | None:
        """Start the next iteration or decode stretch if idle; returns when it ends (None: nothing to do)."""
        if self.phase is not None or not self.alive:
            return None
        self._account_mem(now)
        self._admit(now)
        while self.prefilling and self.decoding and self._free_tokens() < len(self.decoding):
            if not self._preempt_one():  # no room for this iteration's decode tokens
                break
        if self.prefilling:
            budget = max(1, self.max_batched_tokens - len(self.decoding))
            chunks: list[tuple[SimSeq, int]] = []
            load_ms = 0.0
            for s in self.prefilling:
                if budget <= 0:
                    break
                c = min(s.prompt - s.prefilled, budget)
                if c > 0:
                    chunks.append((s, c))
                    budget -= c
                    if s.host_tokens:  # its host-tier blocks come back over the link before its first chunk runs
                        ms = s.host_tokens * self.host_ms_per_token
                        link = self.host_link
                        load_ms += ms if link is None else link.serve(now, ms) - now
                        s.host_tokens = 0
            model_ms = self.cost.step_ms(
                [c for _, c in chunks], len(self.decoding), self.kv_decoding, [s.prefilled for s, _ in chunks]
            )
            w = self.world
            if w is None:
                dt = (model_ms + load_ms) * self.slow_factor
                self.phase = ("prefill", now + dt, chunks, now, 0.0, 0.0)
                return now + dt
            # the world: the prefill part and the decode part at their own hidden factors, noise, stalls
            dec_ms = self.cost.step_ms([], len(self.decoding), self.kv_decoding) if self.decoding else 0.0
            pre_ms = max(0.0, model_ms - dec_ms)
            dt = ((w.prefill * pre_ms + w.decode * dec_ms) * w.noise(1) + w.stalls_ms(1) + load_ms) * self.slow_factor
            self.phase = ("prefill", now + dt, chunks, now, pre_ms + load_ms, dec_ms)
            return now + dt
        if self.decoding:
            n = len(self.decoding)
            while True:
                free = self._free_tokens()
                steps_oom = free // n
                if steps_oom >= 1 or n == 1 or not self._preempt_one():
                    break
                n = len(self.decoding)
                if n == 0:
                    return self.schedule(now)
            r_min = self._finish_heap[0][0] - self.steps
            steps = max(1, min(r_min, max(1, steps_oom)))
            if self.max_stretch_steps:
                steps = min(steps, self.max_stretch_steps)
            model_ms = self.cost.decode_span_ms(n, self.kv_decoding, steps)
            w = self.world
            if w is None:
                mult = self.slow_factor
            else:
                mult = (w.decode * w.noise(steps) + w.stalls_ms(steps) / max(1e-9, model_ms)) * self.slow_factor
            end = now + model_ms * mult
            self.phase = ("decode", now, n, self.kv_decoding, steps, end, mult)
            return end
        return None

    def advance_to(self, now: float) -> bool:
        """Shorten a decode stretch in progress so it ends with the step running at `now` (new work joins at that
        step boundary). True when the end moved: the caller reschedules the node's end event (epoch changed)."""
        if self.phase is None or self.phase[0] != "decode":
            return False
        _, t0, n, kv0, steps, _end, mult = self.phase
        assert isinstance(t0, float) and isinstance(n, int) and isinstance(kv0, int) and isinstance(steps, int)
        assert isinstance(mult, float)
        done = self.cost.decode_steps_within(n, kv0, (now - t0) / mult)
        k = min(steps, done + 1)
        if k >= steps:
            return False
        new_end = t0 + self.cost.decode_span_ms(n, kv0, k) * mult
        self.phase = ("decode", t0, n, kv0, k, new_end, mult)
        self.epoch += 1
        return True

    def phase_end(self) -> float | None:
        if self.phase is None:
            return None
        return float(self.phase[1] if self.phase[0] == "prefill" else self.phase[5])  # type: ignore[arg-type]

    def finish_phase(self, now: float) -> StepResult:
        """Apply the iteration or stretch that ends at `now`."""
        res = StepResult()
        ph = self.phase
        assert ph is not None
        self.phase = None
        self._account_mem(now)
        if ph[0] == "prefill":
            _, _end, chunks, t0, pre_ms, dec_ms = ph
            assert isinstance(chunks, list) and isinstance(t0, float)
            self.iterations += 1
            dt = now - t0
            if self.world is not None:
                assert isinstance(pre_ms, float) and isinstance(dec_ms, float)
                self.last_report = (dt, pre_ms, dec_ms)
            self.busy_ms += dt
            self.avg_step_ms = 0.8 * self.avg_step_ms + 0.2 * dt if self.avg_step_ms else dt
            self.slowdown = 0.8 * self.slowdown + 0.2 * self.slow_factor
            if self.decoding:  # decoding sequences got one token in this iteration too
                self.steps += 1
                self.kv_tokens += len(self.decoding)
                self.kv_decoding += len(self.decoding)
            for s, c in chunks:
                s.prefilled += c
                self.prefill_backlog -= c
                if s.prefilled >= s.prompt:
                    self.prefilling.remove(s)
                    self._prefix_insert(s)
                    res.first_tokens.append((s.rid, now))
                    # the prefill produced the first token
                    s.remaining -= 1
                    s.started_step = self.steps
                    self.kv_tokens += 1
                    if s.remaining <= 0:
                        self._release(s, res, now)
                        continue
                    s.prompt += 1
                    s.finish_step = self.steps + s.remaining
                    self.decoding[s.rid] = s
                    self.kv_decoding += s.prompt
                    heapq.heappush(self._finish_heap, (s.finish_step, s.rid))
        else:
            _, t0, n, kv0, steps, _end, _mult = ph
            assert isinstance(t0, float) and isinstance(n, int) and isinstance(steps, int)
            if self.world is not None and steps:
                assert isinstance(kv0, int)
                self.last_report = (now - t0, 0.0, self.cost.decode_span_ms(n, kv0, steps))
            self.iterations += steps
            self.busy_ms += now - t0
            per = (now - t0) / steps if steps else 0.0
            self.avg_step_ms = 0.8 * self.avg_step_ms + 0.2 * per if self.avg_step_ms else per
            self.slowdown = 0.8 * self.slowdown + 0.2 * self.slow_factor
            self.steps += steps
            self.kv_tokens += n * steps
            self.kv_decoding += n * steps
        while self._finish_heap and self._finish_heap[0][0] <= self.steps:
            _, rid = heapq.heappop(self._finish_heap)
            s = self.decoding.pop(rid)
            tokens = s.prompt + (self.steps - s.started_step)
            self.kv_tokens -= tokens
            self.kv_decoding -= tokens
            self._release(s, res, now, kv_done=True)
        return res

    def _release(self, s: SimSeq, res: StepResult, now: float, kv_done: bool = False) -> None:
        if not kv_done:
            self.kv_tokens -= s.prompt + 1
        self._unbatch(s)
        self.mem_est_used -= s.mem_est_kb
        res.finished.append(FinishedSeq(s.rid, now))
        res.freed = True
