"""What the simulated world knows and the control plane does not (the oracle-free simulator).

A live control plane never learns a request's output length before it ends, and never knows exactly how fast a node
runs. The simulator used to hand it both: each request's true output length (as its expected output and in its
memory estimate) and the very cost model that timed the engines. Here the two are split.

Output length (`ClientModel`):
- The engine runs each request to its true length (the trace's) and stops there (`finish_reason: "stop"`).
- The control plane sees what the client sends: `max_tokens` or nothing. Public evidence on what clients send:
  * the OpenAI API leaves `max_tokens` optional and most SDK calls omit it; Azure OpenAI's provisioned-throughput
    docs say "If the max_tokens parameter is not specified, the service estimates a value", and ask customers to set
    it "as close as possible to the true generation size" because they mostly do not;
  * practitioners report it "either unset, set to the model's maximum, or set to some round number like 4096"
    (tianpan.co, "The max_tokens knob nobody tunes", 2026), and default caps of 256 or 512 in frameworks (Statsig,
    "Max tokens: output length optimization", 2025);
  * a cap is at or above the true length for a request that was not truncated, which is every request of a trace.
  The default model: 40% of requests unset; the rest send a round cap (256, 512, 1,024, 2,048, 4,096, or the
  smallest multiple of 1,024 that holds the answer) at or above their true length times a headroom of 1, 2 or 8
  (a cap set from the route's own lengths, a "2x safety margin", a default far above the need), drawn uniformly.
- The control plane's expected output is then what it is live (`pipeline.profiling.expected_out_tokens`):
  `max_tokens`, else the user's history (the gateway's EWMA of the user's output lengths, updated at each
  completion), else the model's default.

Engine speed (`WorldSpec`, `NodeWorld`):
- Each node runs a world cost model: the control plane's model times a hidden factor per operator class (prefill,
  decode), drawn lognormal with the spread `rackflow sim validate` measures for the model against held-out profiles
  (median 6%, p90 17% per operator: sigma 0.10 for prefill; decode errs more, by about a third on a large model at
  TP4: sigma 0.12), times per-iteration noise (lognormal, sigma 0.05 per iteration, averaged over a stretch) and
  rare stalls (0.1% of iterations take 100 ms more).
- Some nodes (one in eight, at least one) run 1.3x slower than their GPU type in both classes, with no health
  signal: a throttled or badly cooled GPU that reports nothing.
- Seeds make all of it reproducible: a node's factors depend only on (seed, node name).
The control plane learns each node's speed from the iterations it reports (`pipeline.costmodel.online`).
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, field

__all__ = ["ClientModel", "NodeWorld", "WorldSpec"]


@dataclass(frozen=True, slots=True)
class ClientModel:
    unset_frac: float = 0.4
    """Share of requests whose client sends no `max_tokens`."""
    caps: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    """The round caps clients send (above the largest: the smallest multiple of 1,024 that holds the answer)."""
    headrooms: tuple[float, ...] = (1.0, 2.0, 8.0)
    """A sent cap holds the true length times one of these (drawn uniformly), rounded up to a cap."""

    def draw(self, true_out: int, rng: random.Random) -> int | None:
        """What the client sends as `max_tokens` for a request whose answer is `true_out` tokens (None: unset)."""
        if rng.random() < self.unset_frac:
            return None
        need = math.ceil(true_out * rng.choice(self.headrooms))
        for c in self.caps:
            if c >= need:
                return c
        return max(true_out, -(-need // 1024) * 1024)


@dataclass(frozen=True, slots=True)
class WorldSpec:
    client: ClientModel = field(default_factory=ClientModel)
    prefill_sigma: float = 0.10
    decode_sigma: float = 0.12
    noise_sigma: float = 0.05
    stall_prob: float = 0.001
    stall_ms: float = 100.0
    slow_node_frac: float = 0.125
    slow_node_factor: float = 1.3
    seed: int = 0
    """Mixed with the run's seed (`policies.seed`)."""

    def slow_nodes(self, names: list[str], seed: int) -> set[str]:
        """The nodes that run slower than their GPU type (at least one when the fraction is above 0)."""
        if self.slow_node_frac <= 0 or not names:
            return set()
        k = max(1, round(self.slow_node_frac * len(names)))
        rng = random.Random(_mix(seed, self.seed, "slow-nodes"))
        return set(rng.sample(sorted(names), min(k, len(names))))

    def node(self, name: str, seed: int, slow: bool) -> NodeWorld:
        rng = random.Random(_mix(seed, self.seed, name))
        f_pre = math.exp(rng.gauss(0.0, self.prefill_sigma))
        f_dec = math.exp(rng.gauss(0.0, self.decode_sigma))
        if slow:
            f_pre *= self.slow_node_factor
            f_dec *= self.slow_node_factor
        return NodeWorld(f_pre, f_dec, self.noise_sigma, self.stall_prob, self.stall_ms,
                         random.Random(_mix(seed, self.seed, name + "/iterations")))


def _mix(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


class NodeWorld:
    """One node's hidden truth: its factors per operator class and the noise of its iterations."""

    __slots__ = ("decode", "noise_sigma", "prefill", "rng", "stall_ms", "stall_prob")

    def __init__(self, prefill: float, decode: float, noise_sigma: float, stall_prob: float, stall_ms: float,
                 rng: random.Random) -> None:
        self.prefill = prefill
        self.decode = decode
        self.noise_sigma = noise_sigma
        self.stall_prob = stall_prob
        self.stall_ms = stall_ms
        self.rng = rng

    def noise(self, steps: int) -> float:
        """The multiplicative noise of `steps` iterations summed (mean 1: their noises average out)."""
        if self.noise_sigma <= 0:
            return 1.0
        s = self.noise_sigma / math.sqrt(max(1, steps))
        return math.exp(gauss(self.rng, -s * s / 2.0, s))

    def stalls_ms(self, steps: int) -> float:
        """Extra time of the stalls among `steps` iterations (most often none)."""
        if self.stall_prob <= 0:
            return 0.0
        p_any = 1.0 - (1.0 - self.stall_prob) ** max(1, steps)
        return self.stall_ms if self.rng.random() < p_any else 0.0


_TWOPI = 2.0 * math.pi


def gauss(rng: random.Random, mu: float, sigma: float) -> float:
    """`rng.gauss(mu, sigma)`, the same draw to the last bit and the same state after it (CPython's Box-Muller, its
    spare value kept in `rng.gauss_next`), written out so that it compiles: the interpreted one was 2.4% of the
    10 k GPU hour, once per engine iteration. `tests/unit/test_world.py` compares the two streams."""
    z: float | None = rng.gauss_next  # type: ignore[attr-defined]
    rng.gauss_next = None  # type: ignore[attr-defined]
    if z is None:
        x2pi = rng.random() * _TWOPI
        g2rad = math.sqrt(-2.0 * math.log(1.0 - rng.random()))
        z = math.cos(x2pi) * g2rad
        rng.gauss_next = math.sin(x2pi) * g2rad  # type: ignore[attr-defined]
    return mu + z * sigma
