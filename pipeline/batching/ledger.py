"""Reservation ledger: memory a batcher dispatched to a node that the node's last status does not show yet.

A node reports the stream id of the last batch entry it admitted (`last_batch_entry`). Stream ids grow
monotonically, so every dispatched batch with a larger id is still in flight and its memory is reserved; without
this, two windows inside one status refresh would both see the same free memory and overfill the node.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pipeline.routing.views import NodeView
from pipeline.stats import stream_id_key


@dataclass
class ReservationLedger:
    _inflight: dict[str, list[tuple[tuple[int, int], float, int, int, int, float, int]]] = field(
        default_factory=dict)

    def record(self, node: str, entry_id: str, mem_kb: float, requests: int, prompt_tokens: int = 0,
               batch_requests: int = 0, batch_kb: float = 0.0, batch_tokens: int = 0) -> None:
        """`batch_requests`, `batch_kb`, `batch_tokens`: of the batch's requests, the batch-class ones, their memory
        and their prompt tokens (an interactive request may take their slots and memory, and its prefill goes
        first: NodeView.batch_seqs, batch_kv_kb, batch_prefill_tokens)."""
        self._inflight.setdefault(node, []).append(
            (stream_id_key(entry_id), mem_kb, requests, prompt_tokens, batch_requests, batch_kb, batch_tokens))

    def reserved_kb(self, node: str) -> float:
        return sum(r[1] for r in self._inflight.get(node, ()))

    def apply(self, view: NodeView, last_admitted: str) -> NodeView:
        """Drop reservations the node has admitted; return the view with what is still in flight added: its memory
        taken from the free KV, its requests waiting, their prompts queued for prefill."""
        seen = stream_id_key(last_admitted)
        pending = [r for r in self._inflight.get(view.name, ()) if r[0] > seen]
        self._inflight[view.name] = pending
        if not pending:
            return view
        mem = sum(r[1] for r in pending)
        n = sum(r[2] for r in pending)
        tokens = sum(r[3] for r in pending)
        nb = sum(r[4] for r in pending)
        if nb:
            return replace(view, kv_free_kb=max(0.0, view.kv_free_kb - mem), waiting=view.waiting + n,
                           prefill_tokens=view.prefill_tokens + tokens, batch_seqs=view.batch_seqs + nb,
                           batch_kv_kb=view.batch_kv_kb + sum(r[5] for r in pending),
                           batch_prefill_tokens=view.batch_prefill_tokens + sum(r[6] for r in pending))
        return replace(view, kv_free_kb=max(0.0, view.kv_free_kb - mem), waiting=view.waiting + n,
                       prefill_tokens=view.prefill_tokens + tokens)
