"""`work_aware` (rackflow's default): place each request on the node where it finishes soonest, priced in predicted
milliseconds by the node's own cost model, from the work it adds and the work already there.

For a request r with `in` prompt tokens and `out` tokens to generate, on a node i whose engine reports Q prefill
tokens queued ahead (not yet prefilled), D decoding sequences over K KV tokens, a measured slowdown s (observed
iteration time over the cost model's for the same iterations) and host-link use pcie:

    u     = in - (leading prefix blocks of r cached on i) x block_tokens       prompt tokens r would prefill there
    TTFT  = s x [ prefill(Q + u  in chunks of B - D tokens, each chunk iteration also decoding D sequences) ]
            + slot_weight x (expected wait for a sequence slot where the engine runs its most: slot_wait_ms)
    TPOT  = s x decode_step(D + 1 sequences, K + in KV tokens)
    cost  = (TTFT + e2e_weight x (out - 1) x TPOT + others_weight x D x s x prefill(u)) / (1 - pcie/100)
            + kv_weight_ms x max(0, kv_after - kv_soft_limit) / (1 - kv_soft_limit)     (kv_weight_ms 0 by default)

- The prefill and decode times come from the node's calibrated cost model (`pipeline.costmodel`), so nodes of other
  GPU types in one rack are priced in their own milliseconds, not in request counts.
- The third term is what r costs the sequences already decoding there: its prefill chunks stretch their iterations.
- The seed's W = free/total x (1 - pcie/100) x exp(-0.05 x latency_ms) stays as the hardware-and-health term, with
  each factor made exact: exp(-0.05 x latency) becomes the measured slowdown s (raw step latency also grows with batch
  size and prompt length, which Q, D and K already count: measured in the simulator, the raw term made `weighted` the
  worst policy on P99 TTFT at every load), free/total becomes the KV-pressure term (off by default: the batcher's memory
  budget already keeps a node from overflowing, and priced in fixed milliseconds the term cost more cells of the
  decision matrix than it won: `WorkAwareParams.kv_weight_ms`), and (1 - pcie/100) divides the whole cost.
- Prefix hits come from the precise block index (the engines' own block events, `BlockIndex`) when one is attached,
  else from an approximate index learned from this policy's own dispatches (`PrefixIndex`, as `kv_aware` uses).
- Deterministic (lowest cost, then fewer outstanding sequences, then name) by default; with `temperature_ms > 0` it
  samples a softmax over -cost / temperature_ms instead, for deployments where several batchers place onto the same
  nodes from views up to a refresh apart and would otherwise herd onto the same node.
Every constant lives in `node_selection.work_aware` (`WorkAwareParams`, with its docstrings).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar

from pipeline.config import WorkAwareParams
from pipeline.costmodel.calibrated import CalibratedCostModel
from pipeline.events import RequestEvent
from pipeline.routing.node_policies.base import NodeChoice, StepTime, outstanding
from pipeline.routing.prefix_index import BlockIndex, PrefixIndex
from pipeline.routing.views import NodeView


class WorkAware:
    name: ClassVar[str] = "work_aware"
    per_request: ClassVar[bool] = True
    late_binding: ClassVar[bool] = True
    """The batcher holds its requests whose prefix is cached nowhere (`late_binds`) until a node can start them now,
    smallest first (`batcher.late_binding`, `batcher.late_age_after_windows`)."""

    def __init__(
        self,
        params: WorkAwareParams,
        cost_of: Callable[[str], StepTime],
        block_tokens: int,
        rng: random.Random,
        blocks: BlockIndex | None = None,
        approx: PrefixIndex | None = None,
        max_batched_tokens: int = 8192,
    ) -> None:
        self.p = params
        self.cost_of = cost_of
        self.block_tokens = block_tokens
        self.rng = rng
        self.blocks = blocks
        self.approx = approx if blocks is None else None
        self.chunk = max_batched_tokens
        self._memo_req: RequestEvent | None = None
        self._memo: dict[str, tuple[NodeView, int, float]] = {}
        """The last request's costs per node, with the view and the cached blocks they were priced on: a close asks
        `waits_for` and then `choose` about the same request and the same views."""

    def cached_blocks(self, nodes: Sequence[NodeView], req: RequestEvent) -> Mapping[str, int]:
        if not req.prefix_hashes or not req.prefix_cache:
            return {}
        if self.blocks is not None:
            return self.blocks.matches(req.prefix_hashes)
        if self.approx is not None:
            return {v.name: self.approx.matched_blocks(v.name, req.prefix_hashes) for v in nodes}
        return {}

    def prefill_ms(self, cost: StepTime, tokens: int, decode_seqs: int, decode_kv: int, cached: int) -> float:
        """Time to prefill `tokens` in chunks of the iteration budget, each chunk iteration also decoding the
        node's decode batch."""
        if tokens <= 0:
            return 0.0
        chunk = max(1, self.chunk - decode_seqs)
        full, rest = divmod(tokens, chunk)
        t = 0.0
        if type(cost) is CalibratedCostModel:  # the same figures without a list per call (`chunk_ms`)
            if full:
                t += full * cost.chunk_ms(chunk, 0, decode_seqs, decode_kv)
            if rest:
                t += cost.chunk_ms(rest, cached, decode_seqs, decode_kv)
            return t
        if full:
            t += full * cost.step_ms([chunk], decode_seqs, decode_kv)
        if rest:
            t += cost.step_ms([rest], decode_seqs, decode_kv, [cached])
        return t

    def node_cost(self, v: NodeView, req: RequestEvent, cached_blocks: int) -> float:
        p = self.p
        cost = self.cost_of(v.name)
        hit = min(max(0, req.in_tokens - 1), cached_blocks * self.block_tokens)
        u = req.in_tokens - hit
        if p.use_slowdown:  # the node's learned speed (observed over modelled), per operator class
            s = min(20.0, max(0.2, v.slowdown))
            sp = s if v.prefill_slowdown is None else min(20.0, max(0.2, v.prefill_slowdown))
        else:
            s = sp = 1.0
        d, k = v.decode_seqs, v.decode_tokens
        queued = v.prefill_tokens + u
        prefill = self.prefill_ms(cost, queued, d, k, hit)
        ttft = sp * prefill
        if p.slot_weight:
            ttft += p.slot_weight * self.slot_wait_ms(v, req, s)
        total = ttft
        if p.e2e_weight and req.out_tokens > 1:
            step = (cost.decode_step_ms(d + 1, k + req.in_tokens) if type(cost) is CalibratedCostModel
                    else cost.step_ms([], d + 1, k + req.in_tokens))
            total += p.e2e_weight * (req.out_tokens - 1) * s * step
        behind = d + p.queue_weight * v.waiting
        if p.others_weight and behind and u:
            # the request's own share of that prefill: what its chunks add to the decoders' iterations
            total += p.others_weight * behind * sp * prefill * (u / queued)
        link = max(0.05, 1.0 - v.pcie_util_pct / 100.0)
        total /= link
        if p.kv_weight_ms and v.kv_capacity_kb > 0:
            after = 1.0 - (v.kv_free_kb - req.mem_est_kb) / v.kv_capacity_kb
            if after > p.kv_soft_limit:
                total += p.kv_weight_ms * (after - p.kv_soft_limit) / max(1e-9, 1.0 - p.kv_soft_limit)
        return total

    def costs(self, nodes: Sequence[NodeView], req: RequestEvent) -> dict[str, float]:
        """`node_cost` of the request on each node, by name (a node priced on the same view and the same cached
        blocks for the same request is not priced again)."""
        cached = self.cached_blocks(nodes, req)
        if self._memo_req is not req:
            self._memo_req = req
            self._memo = {}
        memo = self._memo
        out: dict[str, float] = {}
        for v in nodes:
            name = v.name
            blocks = cached.get(name, 0)
            hit = memo.get(name)
            if hit is not None and hit[0] is v and hit[1] == blocks:
                out[name] = hit[2]
                continue
            c = self.node_cost(v, req, blocks)
            memo[name] = (v, blocks, c)
            out[name] = c
        return out

    def choose(self, nodes: Sequence[NodeView], req: RequestEvent | None) -> NodeChoice:
        if not nodes:
            return NodeChoice(None)
        if req is None:  # placed per request; without one, the least work queued
            best = min(nodes, key=lambda v: (v.prefill_tokens, outstanding(v), v.name))
            return NodeChoice(best.name)
        costs = self.costs(nodes, req)
        if self.p.temperature_ms > 0 and len(nodes) > 1:
            low = min(costs.values())
            w = {n: math.exp(-(c - low) / self.p.temperature_ms) for n, c in costs.items()}
            total = sum(w.values())
            draw = self.rng.random()
            acc = 0.0
            for name in sorted(w):
                acc += w[name] / total
                if draw < acc:
                    return NodeChoice(name, draw, costs)
            return NodeChoice(max(w, key=lambda n: (w[n], n)), draw, costs)
        best = min(nodes, key=lambda v: (costs[v.name], outstanding(v), v.name))
        return NodeChoice(best.name, scores=costs)

    def waits_for(self, everyone: Sequence[NodeView], with_room: Sequence[NodeView], req: RequestEvent,
                  waited_ms: float) -> bool:
        """Late binding: True while the request is better off waiting in the batcher for a node that cannot start it
        now: its cheapest node overall is busy and beats every node with room by more than `wait_margin_ms` (a prefix
        cached there, usually), or by more than `idle_margin_ms` when a node with room has nothing to prefill, and it
        has waited less than `max_wait_ms`. A node with nothing to prefill is not idle: it is decoding, and a long
        prompt sent there because it drained first stretches every one of its decoding sequences' iterations; the
        cost already prices that (`others_weight`) and the prefill that the busy node would save."""
        if waited_ms >= self.p.max_wait_ms:
            return False
        costs = self.costs(everyone, req)
        best = min(everyone, key=lambda v: (costs[v.name], v.name)).name
        room = {v.name for v in with_room}
        if best in room or not room:
            return False
        margin = self.p.wait_margin_ms
        if any(v.prefill_tokens == 0 for v in with_room):  # a node with room has nothing to prefill
            margin = max(margin, self.p.idle_margin_ms)
        return min(costs[n] for n in room) - costs[best] > margin

    def late_binds(self, nodes: Sequence[NodeView], req: RequestEvent) -> bool:
        """Whether the batcher holds this request until a node can start it now (late binding): only when no node
        has a block of its prefix cached. A request with a cached prefix goes at once to the node this policy
        prices cheapest, its locality intact: held, it would go to whichever node frees up first, and on the Mooncake
        trace holding every request cut the prefix hit rate from 0.58 to 0.52 and the TPOT goodput with it
        (docs/SIMULATOR.md). A request whose prefix is cached nowhere loses nothing by waiting, and waiting in the
        batcher lets short prompts pass long ones (`batcher.late_binding`)."""
        return not any(self.cached_blocks(nodes, req).values())

    def slot_wait_ms(self, v: NodeView, req: RequestEvent, s: float) -> float:
        """The expected wait for a sequence slot on node `v` before the request can start there, where its engine
        already runs its most sequences (`max_seqs`, vLLM's max_num_seqs) with `ahead` = running + waiting - max_seqs
        + 1 sequences to end first: the D decoding sequences' remaining lengths are unknown; taken as uniform over the
        expected output length (the request's own, from the same users' history and caps), the k-th of them ends
        after k x out / (D + 1) decode steps of D sequences. Without it a node with a cached prefix won however full
        its slots were: on two vLLM engines with 4 slots, a request queued 300 ms behind 4 sequences to save a 70 ms
        prefill on the other node (the worst TTFT of that run)."""
        if v.max_seqs <= 0:
            return 0.0
        ahead = v.running + v.waiting - v.max_seqs + 1
        if ahead <= 0:
            return 0.0
        d = max(1, v.decode_seqs or v.running)
        cost = self.cost_of(v.name)
        step = s * (cost.decode_step_ms(d, v.decode_tokens) if type(cost) is CalibratedCostModel
                    else cost.step_ms([], d, v.decode_tokens))
        return ahead * step * max(1, req.out_tokens) / (d + 1)

    def observe(self, node: str, req: RequestEvent) -> None:
        if self.approx is not None and req.prefix_hashes and req.prefix_cache:
            self.approx.insert(node, req.prefix_hashes)
