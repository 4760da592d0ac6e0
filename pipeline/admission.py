"""Admission: whether the gateway lets a new request in, and when a shed one should retry.

One decision, used by the live gateway and by the simulator, so that both shed the same requests above capacity:
a request is shed (HTTP 429 with Retry-After) when the rack the router would send it to has queued
- at least `max_rack_queue` requests, or
- more than `max_queue_s` seconds of work: its queued requests over the rack's recent completion rate (Little's
  law; the queue a new request would wait behind, whatever the mix of prompt lengths). This bound applies only once
  the rack has had a queue for a whole rate window (`RATE_WINDOW_S`): only then is the completion rate the rate at
  which a saturated rack drains it; a burst after a quiet spell meets a rate measured while idle, which would shed
  requests the rack is about to serve.
A rack's queue is what waits for a node: its batcher's backlog (stream lag + pending entries) plus the requests
waiting in its nodes' engines. Priority classes (pipeline/priority.py): an interactive request is judged against the
interactive queue alone (the queue less the batch requests in it: they yield to it), so admission never sheds an
interactive request to keep a batch one; a batch request is judged against the whole queue. Between tenants
(`batcher.fair_share`): an interactive request that would be shed is let in while its tenant holds less than an
equal share of the bound (its queued requests x the tenants queued < `max_rack_queue`), so that a heavy tenant's
flood, shed at the same rate as everyone's, cannot starve a lighter one of its share (the window then serves the
tenants in virtual-token-counter order). The queue stays bounded: each tenant adds at most its share of the bound
beyond it. Batch requests get no such exemption (their tenants share through the batchers' batch queue).
Pure: the caller passes what it read and the rate it measured.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from pipeline.config import GatewayConfig
from pipeline.priority import BATCH

RATE_WINDOW_S = 3.0
"""The completion rate is measured over this many seconds (gateway and simulator alike)."""


class ShedReason(enum.Enum):
    ADMITTED = "admitted"
    RACK_QUEUE = "rack queue over max_rack_queue"
    QUEUE_TIME = "rack queue over max_queue_s of work"
    UNDER_SHARE = "over the bound, but its tenant holds less than an equal share of it"


@dataclass(slots=True, unsafe_hash=True)
class Verdict:
    admit: bool
    reason: ShedReason
    retry_after_s: int | None = None
    """Seconds until the queue ahead drains at the recent completion rate (for a shed request)."""
    wait_s: float | None = None
    """The predicted wait of the queue ahead (None: no completion rate measured yet)."""

    def __init__(self, admit: bool, reason: ShedReason, retry_after_s: int | None = None,
                 wait_s: float | None = None) -> None:
        # written out, and not frozen: compiled, a dataclass's generated __init__ stays interpreted (see
        # pipeline.routing.views.RackView.__init__)
        self.admit = admit
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.wait_s = wait_s


class Admission:
    def __init__(self, gw: GatewayConfig) -> None:
        self.max_queue = gw.max_rack_queue
        self.max_queue_s = gw.max_queue_s
        self.retry_min = gw.retry_after_s
        self.retry_max = gw.max_retry_after_s

    def retry_after(self, queued: float, rate_rps: float | None) -> int:
        """Seconds until `queued` requests drain at `rate_rps`, within [retry_after_s, max_retry_after_s]."""
        if rate_rps is None or rate_rps <= 0:
            return self.retry_max
        return max(self.retry_min, min(self.retry_max, math.ceil(queued / rate_rps)))

    def decide(self, queued: float, rate_rps: float | None, queued_for_s: float = math.inf,
               batch_queued: float = 0.0, priority: int = 0, tenant_queued: float | None = None,
               tenants: int = 1) -> Verdict:
        """`queued`: requests waiting in the rack the request would go to; `rate_rps`: that rack's completions per
        second over the last `RATE_WINDOW_S` (None before two samples); `queued_for_s`: how long that rack has had a
        queue without a break; `batch_queued`: of `queued`, the batch-class requests; `priority`: the request's
        class; `tenant_queued`: of the queue, its tenant's requests, and `tenants` how many tenants have some (None:
        not known; no share is kept)."""
        if priority < BATCH:
            queued = max(0.0, queued - batch_queued)
        verdict = self._decide(queued, rate_rps, queued_for_s)
        if (not verdict.admit and priority < BATCH and tenant_queued is not None and tenants > 1
                and tenant_queued * tenants < self.max_queue):
            return Verdict(True, ShedReason.UNDER_SHARE, None, verdict.wait_s)
        return verdict

    def _decide(self, queued: float, rate_rps: float | None, queued_for_s: float) -> Verdict:
        wait = queued / rate_rps if rate_rps is not None and rate_rps > 0 else None
        if queued >= self.max_queue:
            return Verdict(False, ShedReason.RACK_QUEUE, self.retry_after(queued, rate_rps), wait)
        if (wait is not None and self.max_queue_s > 0 and wait > self.max_queue_s
                and queued_for_s >= RATE_WINDOW_S):
            return Verdict(False, ShedReason.QUEUE_TIME, self.retry_after(queued, rate_rps), wait)
        return Verdict(True, ShedReason.ADMITTED, None, wait)
