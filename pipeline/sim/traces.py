"""Request traces for the simulator: Azure LLM inference CSV, Mooncake JSONL, and synthetic arrivals.

Parsers take lines (the caller opens the file) and yield TraceRequest in arrival order. `scale_rate` compresses
time (x2 = twice the request rate); `assign_users` gives requests user ids drawn from a Zipf law (a few heavy users,
a long tail), because rack affinity only matters when users come back.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from pipeline.errors import RackflowError


@dataclass(slots=True, unsafe_hash=True)
class TraceRequest:
    arrival_ms: float
    """Milliseconds since the trace's first request."""
    in_tokens: int
    out_tokens: int
    user_id: str = ""
    prefix_hashes: tuple[int, ...] = ()
    """Ids of the prompt's prefix blocks (Mooncake: 512-token blocks; equal ids share KV)."""
    model: str = ""
    max_tokens: int | None = None
    """What the client sends as `max_tokens` (None: unset). `out_tokens` is the true length, which the engine alone
    learns (it stops there); the control plane sees only this, the user's history and the model default
    (`pipeline.sim.world.ClientModel` draws it; the oracle mode hands the control plane `out_tokens` instead)."""
    tenant: str = ""
    """Whose request it is (fair shares are between tenants); empty: the simulation's one tenant, `sim`."""
    priority: int = 0
    """Its class (pipeline/priority.py): 0 interactive, 1 batch."""

    def __init__(self, arrival_ms: float, in_tokens: int, out_tokens: int, user_id: str = "",
                 prefix_hashes: tuple[int, ...] = (), model: str = "", max_tokens: int | None = None, tenant: str = "",
                 priority: int = 0) -> None:
        # written out: see pipeline.routing.views.RackView.__init__
        self.arrival_ms = arrival_ms
        self.in_tokens = in_tokens
        self.out_tokens = out_tokens
        self.user_id = user_id
        self.prefix_hashes = prefix_hashes
        self.model = model
        self.max_tokens = max_tokens
        self.tenant = tenant
        self.priority = priority


class TraceError(RackflowError, ValueError):
    """A trace line cannot be parsed; the message names the line and the field."""


def _days_from_civil(y: int, m: int, d: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm): no datetime, no clock."""
    y -= m <= 2
    era = (y if y >= 0 else y - 399) // 400
    yoe = y - era * 400
    doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def _azure_ts_ms(ts: str) -> float:
    """`YYYY-MM-DD HH:MM:SS[.fffffff]` (UTC) -> ms since the epoch."""
    date, _, clock = ts.strip().partition(" ")
    y, mo, d = (int(x) for x in date.split("-"))
    hms, _, frac = clock.partition(".")
    h, mi, sec = (int(x) for x in hms.split(":"))
    seconds = _days_from_civil(y, mo, d) * 86400 + h * 3600 + mi * 60 + sec
    return seconds * 1000.0 + (float("0." + frac) * 1000.0 if frac else 0.0)


def parse_azure(lines: Iterable[str], limit: int | None = None) -> Iterator[TraceRequest]:
    """Azure LLM inference trace (Splitwise, 2023): TIMESTAMP, ContextTokens, GeneratedTokens."""
    reader = csv.DictReader(lines)
    need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
    if not reader.fieldnames or not need <= set(reader.fieldnames):
        raise TraceError(f"expected Azure trace columns {sorted(need)}, got {reader.fieldnames}")
    t0: float | None = None
    for i, rec in enumerate(reader):
        if limit is not None and i >= limit:
            return
        try:
            t = _azure_ts_ms(rec["TIMESTAMP"])
            tin, tout = int(rec["ContextTokens"]), int(rec["GeneratedTokens"])
        except (TypeError, ValueError) as e:
            raise TraceError(f"line {i + 2}: {e}") from None
        if t0 is None:
            t0 = t
        yield TraceRequest(t - t0, max(1, tin), max(1, tout))


def parse_mooncake(lines: Iterable[str], limit: int | None = None) -> Iterator[TraceRequest]:
    """Mooncake trace JSONL: {"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}."""
    t0: float | None = None
    n = 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        if limit is not None and n >= limit:
            return
        try:
            rec = json.loads(line)
            t = float(rec["timestamp"])
            tin, tout = int(rec["input_length"]), int(rec["output_length"])
            hashes = tuple(int(h) & ((1 << 63) - 1) for h in rec.get("hash_ids", ()))
            user = str(rec.get("user_id", ""))
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"line {i + 1}: {type(e).__name__}: {e}") from None
        if t0 is None:
            t0 = t
        n += 1
        yield TraceRequest(t - t0, max(1, tin), max(1, tout), user_id=user, prefix_hashes=hashes)


def to_jsonl(r: TraceRequest) -> str:
    """One request in the Mooncake JSONL format (plus `user_id` when it has one)."""
    rec: dict[str, object] = {"timestamp": round(r.arrival_ms, 3), "input_length": r.in_tokens,
                              "output_length": r.out_tokens, "hash_ids": list(r.prefix_hashes)}
    if r.user_id:
        rec["user_id"] = r.user_id
    return json.dumps(rec, separators=(", ", ": "))


@dataclass(frozen=True, slots=True)
class MultiTurnSpec:
    """Conversations in which a user comes back with a growing prompt: an app's system prompt, then every earlier
    user message and answer of the conversation, then the new message (what a chat front end sends each turn)."""

    conversations: int = 800
    rate_conversations_per_s: float = 1.0
    """New conversations per second (Poisson)."""
    turns_mean: float = 5.0
    """Turns per conversation (geometric, at least 1)."""
    think_s_mean: float = 20.0
    """Time between an answer and the user's next message (exponential)."""
    apps: int = 16
    """Distinct system prompts; apps are drawn Zipf(1.1), so a few prompts are shared by most users."""
    system_tokens_mean: float = 1500.0
    message_tokens_mean: float = 300.0
    answer_tokens_mean: float = 250.0
    sigma: float = 0.6
    """Lognormal sigma of system prompt, message and answer lengths."""
    max_prompt_tokens: int = 30_000
    """A conversation ends once its next prompt would be longer."""
    vocab: int = 150_000
    block_tokens: int = 512


def multiturn(spec: MultiTurnSpec, rng: random.Random,
              hash_ids: Callable[[Sequence[int], int], tuple[int, ...]]) -> list[TraceRequest]:
    """A multi-turn trace: `hash_ids(token_ids, block_tokens)` gives each prompt's prefix-block hashes (pass
    `pipeline.tokens.prefix_hashes_from_ids`, the gateway's function for a tokenized prompt)."""

    def tokens(mean: float) -> list[int]:
        n = max(1, round(_lognormal(rng, mean, spec.sigma)))
        return [rng.randrange(spec.vocab) for _ in range(n)]

    systems = [tokens(spec.system_tokens_mean) for _ in range(spec.apps)]
    app_cum: list[float] = []
    acc = 0.0
    for w in zipf_weights(spec.apps, 1.1):
        acc += w
        app_cum.append(acc)
    out: list[TraceRequest] = []
    t = 0.0
    p_end = 1.0 / max(1.0, spec.turns_mean)
    for c in range(spec.conversations):
        t += rng.expovariate(spec.rate_conversations_per_s) * 1000.0
        app = rng.choices(range(spec.apps), cum_weights=app_cum)[0]
        history = list(systems[app])
        at = t
        while True:
            history += tokens(spec.message_tokens_mean)
            if len(history) > spec.max_prompt_tokens:
                break
            answer = max(1, round(_lognormal(rng, spec.answer_tokens_mean, spec.sigma)))
            out.append(TraceRequest(at, len(history), answer, f"conv-{c:05d}",
                                    hash_ids(history, spec.block_tokens)))
            if rng.random() < p_end:
                break
            history += [rng.randrange(spec.vocab) for _ in range(answer)]
            at += rng.expovariate(1.0 / (spec.think_s_mean * 1000.0))
    out.sort(key=lambda r: r.arrival_ms)
    return out


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    requests: int = 10_000
    rate_rps: float = 5.5
    arrival: str = "poisson"
    """`poisson` (exponential gaps) or `gamma` (bursty: gaps with coefficient of variation `cv`)."""
    cv: float = 3.0
    in_mean: float = 1155.0
    """Mean prompt tokens (lognormal; defaults are the Azure conv trace's)."""
    in_sigma: float = 0.8
    out_mean: float = 211.0
    out_sigma: float = 0.8
    max_tokens: int = 32_000
    shared_prefix_users: float = 0.0
    """Fraction of requests that start with their user's system prompt (shared prefix blocks)."""
    prefix_blocks: int = 4


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    mu = math.log(mean) - sigma * sigma / 2
    return rng.lognormvariate(mu, sigma)


def synthetic(spec: SyntheticSpec, rng: random.Random) -> Iterator[TraceRequest]:
    t = 0.0
    mean_gap = 1000.0 / spec.rate_rps
    for _ in range(spec.requests):
        if spec.arrival == "poisson":
            t += rng.expovariate(1.0 / mean_gap)
        elif spec.arrival == "gamma":
            shape = 1.0 / (spec.cv * spec.cv)
            t += rng.gammavariate(shape, mean_gap / shape)
        else:
            raise ValueError(f"unknown arrival process {spec.arrival!r}; allowed: poisson, gamma")
        tin = min(spec.max_tokens, max(1, round(_lognormal(rng, spec.in_mean, spec.in_sigma))))
        tout = min(spec.max_tokens, max(1, round(_lognormal(rng, spec.out_mean, spec.out_sigma))))
        yield TraceRequest(t, tin, tout)


def scale_rate(reqs: Iterable[TraceRequest], factor: float) -> Iterator[TraceRequest]:
    """Multiply the request rate by `factor` (arrival times divided by it)."""
    if factor <= 0:
        raise ValueError(f"rate scale must be > 0, got {factor}")
    for r in reqs:
        yield replace(r, arrival_ms=r.arrival_ms / factor)


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k**s) for k in range(1, n + 1)]


def assign_users(
    reqs: Sequence[TraceRequest], users: int, s: float, rng: random.Random, shared_prefix_blocks: int = 0
) -> list[TraceRequest]:
    """Give requests without a user a Zipf-distributed user id; with `shared_prefix_blocks`, requests of one user
    start with that user's prefix blocks (a system prompt), so prefix reuse follows users."""
    cum: list[float] = []
    acc = 0.0
    for w in zipf_weights(users, s):
        acc += w
        cum.append(acc)
    out = []
    for r in reqs:
        if r.user_id:
            out.append(r)
            continue
        k = rng.choices(range(users), cum_weights=cum)[0]
        uid = f"user-{k:05d}"
        hashes = r.prefix_hashes
        if shared_prefix_blocks and not hashes:
            n = min(shared_prefix_blocks, r.in_tokens // 512)
            hashes = tuple(((k + 1) << 20) + j for j in range(n))
        out.append(replace(r, user_id=uid, prefix_hashes=hashes))
    return out


def superpose(reqs: Sequence[TraceRequest], copies: int, rng: random.Random) -> list[TraceRequest]:
    """`copies` independent replicas of a trace over the same time span (each shifted by a random fraction of the
    mean gap and given its own users): k times the load with the trace's own arrival pattern and lengths."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    if not reqs:
        return []
    span = max(r.arrival_ms for r in reqs)
    gap = span / max(1, len(reqs))
    out: list[TraceRequest] = []
    for k in range(copies):
        shift = rng.uniform(0, gap) if k else 0.0
        for r in reqs:  # the constructor, not dataclasses.replace: 2 M copies at 50 M requests a day
            user = f"{r.user_id}#{k}" if r.user_id and k else r.user_id
            out.append(TraceRequest(r.arrival_ms + shift, r.in_tokens, r.out_tokens, user, r.prefix_hashes, r.model,
                                    r.max_tokens, r.tenant, r.priority))
    out.sort(key=lambda r: r.arrival_ms)
    return out
