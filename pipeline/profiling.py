"""Request profiling at the gateway (ARCHITECTURE §2): token estimate, output estimate, memory estimate.

Owns the arithmetic that turns a client request into a RequestEvent within the gateway's budget (< 5 ms). It never
talks to Redis: the caller passes in what it looked up (the user's output-length EWMA, the arrival time).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import ModelSpec, ProfilingPolicy
from pipeline.events import RequestEvent


def _is_cjk(ch: str) -> bool:
    o = ord(ch)
    return (
        0x4E00 <= o <= 0x9FFF  # CJK unified ideographs
        or 0x3400 <= o <= 0x4DBF  # extension A
        or 0x3040 <= o <= 0x30FF  # hiragana, katakana
        or 0xAC00 <= o <= 0xD7AF  # hangul syllables
        or 0xF900 <= o <= 0xFAFF
        or 0xFF00 <= o <= 0xFFEF  # full-width forms
    )


def estimate_tokens(text: str, policy: ProfilingPolicy) -> int:
    """Fast token estimate: CJK characters and other characters at separate rates (a BPE vocabulary packs about
    1.5 CJK characters or 4 Latin characters per token). Exact counts need the model's tokenizer (gateway)."""
    if not text:
        return 0
    cjk = sum(1 for ch in text if _is_cjk(ch))
    other = len(text) - cjk
    est = cjk / policy.cjk_chars_per_token + other / policy.latin_chars_per_token
    return max(1, round(est))


def estimate_mem_kb(model: ModelSpec, in_tokens: int, out_tokens: int, estimator: str) -> float:
    """Estimated KV memory of one request, KB (10^3 bytes).

    `seed`: the field report's formula, mem_est_kb = in * 200 + out * 1500 (coefficients per model in config).
    `shape`: KV bytes per token from the model's shape, 2 * layers * kv_heads * head_dim * dtype_bytes.
    """
    if in_tokens < 0 or out_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got in={in_tokens} out={out_tokens}")
    if estimator == "seed":
        return in_tokens * model.mem_in_kb_per_token + out_tokens * model.mem_out_kb_per_token
    if estimator == "shape":
        return (in_tokens + out_tokens) * model.kv_bytes_per_token / 1000.0
    raise ValueError(f"unknown memory estimator {estimator!r}; allowed: seed, shape")


def expected_out_tokens(model: ModelSpec, max_tokens: int | None, user_avg_out: float | None) -> int:
    """Output length used for the memory estimate: the request's max_tokens, else the user's EWMA, else the
    model default."""
    if max_tokens is not None:
        return max_tokens
    if user_avg_out is not None and user_avg_out > 0:
        return max(1, round(user_avg_out))
    return model.default_out_tokens


@dataclass(frozen=True, slots=True)
class ProfileInput:
    request_id: str
    tenant: str
    user_id: str
    model: str
    arrival_ms: float
    prompt: str = ""
    prompt_tokens: int | None = None
    """Exact prompt length when known (a tokenizer ran, or a trace gives it); else estimated from `prompt`."""
    max_tokens: int | None = None
    user_avg_out: float | None = None
    priority: int = 0
    prefix_cache: bool = True


def profile_request(inp: ProfileInput, model: ModelSpec, policy: ProfilingPolicy) -> RequestEvent:
    """Build the RequestEvent (version 1) for a new request."""
    in_tokens = inp.prompt_tokens if inp.prompt_tokens is not None else estimate_tokens(inp.prompt, policy)
    out_tokens = expected_out_tokens(model, inp.max_tokens, inp.user_avg_out)
    max_tokens = inp.max_tokens if inp.max_tokens is not None else out_tokens
    return RequestEvent(
        request_id=inp.request_id,
        version=1,
        tenant=inp.tenant,
        user_id=inp.user_id,
        model=inp.model,
        in_tokens=in_tokens,
        out_tokens=out_tokens,
        max_tokens=max_tokens,
        mem_est_kb=estimate_mem_kb(model, in_tokens, out_tokens, policy.estimator),
        arrival_ms=inp.arrival_ms,
        prompt=inp.prompt,
        priority=inp.priority,
        prefix_cache=inp.prefix_cache,
    )
