"""A measured engine step cost (`LinearStepCost`): what `python -m workers.engines.vllm_profile` fits to an engine's
iterations, the simulator's engine cost in `rackflow sim validate` and the decision tier, and the control plane's
price of a node whose GPU entry names a step profile (`GpuSpec.step_profile`: an engine the committed calibration
does not cover, such as vLLM's CPU build)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class LinearStepCost:
    """One iteration of an engine measured as a whole: a fixed cost, plus a cost per prefilled token, per decoding
    sequence and per KV token those sequences read, a fixed extra for an iteration that prefills (the intake of
    its new requests), and the prefill's attention: per new token and context token it attends to
    (`per_prefill_attn_ms` x sum over the chunks of new x (cached + new / 2), cached being the chunk's tokens
    already in the KV cache: a cached prefix or earlier chunks). The simulator's `StepCost` (O(1) decode spans)."""

    base_ms: float
    per_prefill_token_ms: float
    per_decode_seq_ms: float
    per_kv_token_ms: float
    prefill_base_ms: float = 0.0
    per_prefill_attn_ms: float = 0.0
    """0 in a profile fitted before the term (2026-12-07): the prefill is then linear in its new tokens alone."""

    def step_ms(self, prefill_tokens: Sequence[int], decode_seqs: int, decode_kv_tokens: int,
                prefill_cached: Sequence[int] | None = None) -> float:
        p = sum(prefill_tokens)
        if p == 0 and decode_seqs == 0:
            return 0.0
        pre = 0.0
        if p:
            pre = self.prefill_base_ms + self.per_prefill_token_ms * p
            if self.per_prefill_attn_ms:
                pre += self.per_prefill_attn_ms * prefill_attn(prefill_tokens, prefill_cached)
        return (self.base_ms + pre + self.per_decode_seq_ms * decode_seqs
                + self.per_kv_token_ms * decode_kv_tokens)

    def decode_span_ms(self, n: int, kv0: int, steps: int) -> float:
        """Sum over k in [0, steps) of step_ms([], n, kv0 + k n): an arithmetic series."""
        if steps <= 0 or n <= 0:
            return 0.0
        a = self.base_ms + self.per_decode_seq_ms * n + self.per_kv_token_ms * kv0
        return steps * a + self.per_kv_token_ms * n * steps * (steps - 1) / 2.0

    def decode_steps_within(self, n: int, kv0: int, budget_ms: float) -> int:
        """The largest `steps` with decode_span_ms(n, kv0, steps) <= budget_ms (the quadratic's root, then exact)."""
        if n < 1:
            raise ValueError(f"decode_steps_within needs n >= 1 sequences, got {n}")
        if not math.isfinite(budget_ms):
            raise ValueError(f"budget_ms must be finite, got {budget_ms}")
        if budget_ms <= 0:
            return 0
        a = self.base_ms + self.per_decode_seq_ms * n + self.per_kv_token_ms * kv0
        c = self.per_kv_token_ms * n / 2.0
        if a <= 0 and c <= 0:
            raise ValueError("a step cost of 0 ms: no finite number of steps fills a budget")
        if c <= 0:
            k = int(budget_ms / a)
        else:  # c k^2 + (a - c) k - budget = 0
            b = a - c
            k = int((-b + math.sqrt(b * b + 4 * c * budget_ms)) / (2 * c))
        while k > 0 and self.decode_span_ms(n, kv0, k) > budget_ms:
            k -= 1
        while self.decode_span_ms(n, kv0, k + 1) <= budget_ms:
            k += 1
        return k

    @classmethod
    def from_profile(cls, path: str | Path) -> LinearStepCost:
        """The fit of a step profile JSON (`vllm_profile -o PATH`: its `fit`)."""
        try:
            fit = json.loads(Path(path).read_text())["fit"]
            return cls(**{k: float(v) for k, v in fit.items()})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"step profile {path}: {type(e).__name__}: {e} (write one with "
                             "`python -m workers.engines.vllm_profile -o PATH`)") from None


def prefill_attn(prefill_tokens: Sequence[int], prefill_cached: Sequence[int] | None = None) -> float:
    """The prefill's attention work in (new token x context token) pairs: each chunk's new tokens attend to the
    tokens already cached and, causally, to half of their own."""
    cached = prefill_cached if prefill_cached is not None else [0] * len(prefill_tokens)
    return float(sum(c * (k + c / 2.0) for c, k in zip(prefill_tokens, cached, strict=True)))

