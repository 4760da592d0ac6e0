"""The control plane's belief of each node's speed, corrected online from what its worker reports.

A node's cost model (`pipeline.costmodel.CalibratedCostModel`) is the control plane's prior: what the node's GPU
type, model and TP degree should take per iteration. Real nodes differ from it (the model errs per operator class on
held-out shapes, a node runs hot or throttled, a neighbour shares its host), and nothing tells the control plane by
how much except the iterations the node itself runs. `SpeedBelief` learns two factors per node from those reports,
one per operator class, because they err independently (prefill is compute-bound GEMMs, decode streams weights and
the KV cache):

    decode-only iteration:       observed = f_dec x predicted_decode
    iteration with prefill:      observed = f_pre x predicted_prefill_part + f_dec x predicted_decode_part

Each update moves the factor's logarithm toward the observed ratio's by a step `alpha` (1/n for the first few, so
the first reports count fully), with the residual clipped to +-`clip_log`: a stall (a GC pause, a collective that
waits on a neighbour) is one sample far off, and a clipped step keeps it from throwing the belief off (a Huber-style
M-estimator of the log ratio, robust to rare outliers, as an EWMA of the raw ratio is not).

The same class serves the live worker (which knows the shape of each iteration it ran and how long it took) and the
simulator (whose engine model runs a hidden "world" cost model and reports the same two things). Pure: no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["BeliefParams", "SpeedBelief"]


@dataclass(frozen=True, slots=True)
class BeliefParams:
    alpha: float = 0.1
    """Step of the log-factor toward each new observation once warm (an EWMA over ~1/alpha iterations)."""
    warmup: int = 8
    """The first `warmup` observations of a class average with weight 1/n (a fast, unbiased start)."""
    clip_log: float = 0.35
    """Largest step of the log residual per observation (|log 1.42|): a stall moves the belief by at most this x
    alpha."""
    min_factor: float = 0.2
    max_factor: float = 20.0
    min_prefill_share: float = 0.15
    """An iteration whose predicted prefill part is under this share of its predicted time says little about the
    prefill factor: only the decode factor learns from it."""


class SpeedBelief:
    """Two learned factors (observed over predicted time) of one node: `prefill` and `decode`."""

    __slots__ = ("log_dec", "log_pre", "n_dec", "n_pre", "p")

    def __init__(self, params: BeliefParams | None = None) -> None:
        self.p = params or BeliefParams()
        self.log_pre = 0.0
        self.log_dec = 0.0
        self.n_pre = 0
        self.n_dec = 0

    @property
    def prefill(self) -> float:
        return math.exp(self.log_pre)

    @property
    def decode(self) -> float:
        return math.exp(self.log_dec)

    def _step(self, log_f: float, n: int, ratio: float) -> float:
        p = self.p
        r = math.log(max(1e-9, ratio)) - log_f
        if n > 1:  # the very first observation is taken whole (the prior is only the GPU type's nominal speed)
            r = max(-p.clip_log, min(p.clip_log, r))
        a = 1.0 / n if n <= p.warmup else p.alpha
        lo, hi = math.log(p.min_factor), math.log(p.max_factor)
        return max(lo, min(hi, log_f + a * r))

    def observe(self, observed_ms: float, predicted_prefill_ms: float, predicted_decode_ms: float) -> None:
        """One iteration (or a stretch of identical decode iterations, summed): its measured time and the prior
        model's prediction of it split into the prefill part and the decode part (the time of the same iteration
        without its prefill chunks)."""
        if observed_ms <= 0 or predicted_prefill_ms + predicted_decode_ms <= 0:
            return
        pre, dec = max(0.0, predicted_prefill_ms), max(0.0, predicted_decode_ms)
        total = pre + dec
        if pre < self.p.min_prefill_share * total:
            self.n_dec += 1
            self.log_dec = self._step(self.log_dec, self.n_dec, observed_ms / total)
            return
        # the decode part at its learned factor; the rest is the prefill's
        rest = observed_ms - self.decode * dec
        if rest <= 0.0:
            rest = 0.05 * pre  # faster than the decode part alone predicts: a clipped step down
        self.n_pre += 1
        self.log_pre = self._step(self.log_pre, self.n_pre, rest / pre)

    def error(self, world_prefill: float, world_decode: float) -> float:
        """The larger relative error of the two factors against the true ones (a class never observed counts with
        its prior)."""
        return max(abs(self.prefill / world_prefill - 1.0), abs(self.decode / world_decode - 1.0))
