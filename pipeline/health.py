"""Health score of a node in [0, 1] from its GPU metrics, with hysteresis (ARCHITECTURE §5).

score = max(0, 1 - sum(weight_i x penalty_i)); penalties in [0, 1]: new Xid events, new uncorrectable ECC errors,
NVLink CRC/replay errors per sample, temperature over the warning level, step latency over the node's baseline,
missing heartbeat. A node is drained when its score falls below `drain_below`; it is active again only after
`recover_samples` consecutive samples above `recover_above`, or as long a streak of them in time at the
agents' interval (a flapping node does not bounce). Pure: samples carry
their own timestamps; the same scorer runs in the live monitor and in the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config import HealthPolicy


@dataclass(frozen=True, slots=True)
class HealthSample:
    node: str
    ts_ms: float
    xid_errors: int = 0
    """Cumulative counters (as NVML reports them); the scorer takes differences."""
    ecc_errors: int = 0
    nvlink_crc_errors: int = 0
    temp_c: float = 0.0
    avg_latency_ms: float = 0.0
    heartbeat_ok: bool = True


@dataclass(slots=True)
class _NodeHealth:
    last: HealthSample | None = None
    baseline_latency_ms: float = 0.0
    draining: bool = False
    good_streak: int = 0
    good_since_ms: float = 0.0
    score: float = 1.0
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class HealthVerdict:
    node: str
    score: float
    draining: bool
    changed: bool
    """The node's state flipped with this sample (active -> draining or back)."""
    reasons: tuple[str, ...]


def _clamp(x: float) -> float:
    return 0.0 if x < 0 else 1.0 if x > 1 else x


@dataclass
class HealthScorer:
    policy: HealthPolicy
    nodes: dict[str, _NodeHealth] = field(default_factory=dict)

    def penalties(self, s: HealthSample, prev: HealthSample | None, baseline: float) -> dict[str, float]:
        p = self.policy
        d_xid = s.xid_errors - prev.xid_errors if prev else 0
        d_ecc = s.ecc_errors - prev.ecc_errors if prev else 0
        d_crc = s.nvlink_crc_errors - prev.nvlink_crc_errors if prev else 0
        temp = _clamp((s.temp_c - p.temp_warn_c) / max(1e-9, p.temp_limit_c - p.temp_warn_c))
        lat = 0.0
        if baseline > 0 and s.avg_latency_ms > 0:
            lat = _clamp((s.avg_latency_ms / baseline - 1.0) / (p.slow_factor - 1.0))
        return {
            "xid": 1.0 if d_xid > 0 else 0.0,
            "ecc": 1.0 if d_ecc > 0 else 0.0,
            "nvlink": _clamp(d_crc / p.nvlink_errors_limit),
            "temperature": temp,
            "latency": lat,
            "heartbeat": 0.0 if s.heartbeat_ok else 1.0,
        }

    def observe(self, s: HealthSample) -> HealthVerdict:
        st = self.nodes.setdefault(s.node, _NodeHealth())
        pen = self.penalties(s, st.last, st.baseline_latency_ms)
        w = self.policy.weights
        weights = {"xid": w.xid, "ecc": w.ecc, "nvlink": w.nvlink, "temperature": w.temperature,
                   "latency": w.latency, "heartbeat": w.heartbeat}
        score = max(0.0, 1.0 - sum(weights[k] * v for k, v in pen.items()))
        reasons = tuple(sorted(k for k, v in pen.items() if v > 0))
        # the latency baseline follows a healthy node slowly and never learns from a sick one
        if score >= self.policy.recover_above and s.avg_latency_ms > 0:
            b = st.baseline_latency_ms
            st.baseline_latency_ms = s.avg_latency_ms if b == 0 else min(b * 1.05, 0.95 * b + 0.05 * s.avg_latency_ms)
        st.last = s
        st.score = score
        st.reasons = reasons
        changed = False
        if not st.draining and score < self.policy.drain_below:
            st.draining, st.good_streak, changed = True, 0, True
        elif st.draining:
            st.good_streak = st.good_streak + 1 if score > self.policy.recover_above else 0
            if st.good_streak == 1:
                st.good_since_ms = s.ts_ms
            # recover_samples samples above the bar, or as long as they take at the agents' interval: an agent
            # whose node is idle and quiet samples less often, and the time is what the hysteresis is for
            n, every = self.policy.recover_samples, self.policy.interval_ms
            if st.good_streak >= n or (st.good_streak > 1
                                       and s.ts_ms - st.good_since_ms >= (n - 1) * every - every / 2):
                st.draining, changed = False, True
        return HealthVerdict(s.node, score, st.draining, changed, reasons)

    def is_draining(self, node: str) -> bool:
        st = self.nodes.get(node)
        return bool(st and st.draining)


@dataclass
class HeartbeatWatch:
    """Failure detector of the workers' heartbeats (their status events on `rf:health`), on the stream's own clock.

    Every entry of the stream carries the time the stream server appended it (its id); the newest one seen is
    "now". A node is silent when `timeout_ms` of that clock went by since its last heartbeat. Judged this way, a
    monitor that reads late (starved, just elected, catching up on a backlog) sees the heartbeats exactly as late as
    the clock, and never takes a live node for dead. A jump of the clock larger than `gap_ms` between two entries
    is a silence of the whole stream (a Valkey outage or restart, every writer stalled at once): nobody is judged
    until the stream has flowed again for `settle_ms` (the writers come back one by one, each after its own
    reconnect backoff). A node is judged only once it has been heard: one whose worker never started, or a node
    just declared dead (`forget`), is silent by nature, and the worker lease decides about it. Pure: it is fed the
    entries' times and reads no clock.
    """

    timeout_ms: float
    settle_ms: float = 3000.0
    gap_ms: float = 0.0
    """0: half of `timeout_ms`."""
    interval_ms: float = 0.0
    """The workers' configured heartbeat interval (`worker.status_interval_ms`); 0: a quarter of `timeout_ms`. A
    worker that announces a longer one (`HealthEvent.next_ms`: it beats slower while idle) gets the same number of
    missed beats: its timeout is `timeout_ms` x announced / `interval_ms`."""
    clock_ms: float = 0.0
    quiet_until_ms: float = 0.0
    last: dict[str, float] = field(default_factory=dict)
    announced: dict[str, float] = field(default_factory=dict)
    """node -> the interval its last heartbeat announced (only nodes that announced one longer than the default)."""

    def __post_init__(self) -> None:
        if self.timeout_ms <= 0:
            raise ValueError(f"timeout_ms must be positive, got {self.timeout_ms}")
        if self.gap_ms <= 0:
            self.gap_ms = self.timeout_ms / 2.0
        if self.interval_ms <= 0:
            self.interval_ms = self.timeout_ms / 4.0

    def observe(self, ts_ms: float, node: str | None = None, next_ms: float = 0.0) -> None:
        """One entry of the stream, appended at `ts_ms` (its id's time); `node`: it is that node's heartbeat, and
        `next_ms` the interval it announced to its next one (0: the default)."""
        if self.clock_ms and ts_ms - self.clock_ms > self.gap_ms and ts_ms - self.clock_ms > self.quiet_gap_ms():
            self.quiet_until_ms = ts_ms + self.settle_ms
        if ts_ms > self.clock_ms:
            self.clock_ms = ts_ms
        if node is not None and ts_ms > self.last.get(node, float("-inf")):
            self.last[node] = ts_ms
            if next_ms > self.interval_ms:
                self.announced[node] = next_ms
            else:
                self.announced.pop(node, None)

    def quiet_gap_ms(self) -> float:
        """The longest silence of the whole stream that is not an outage: `gap_ms` while any heard node beats at the
        default rate; when every one announced a longer interval (an idle cluster), 1.5 x the shortest of them. A
        quiet cluster is not an outage, and a node that beats fast again makes the threshold fast again."""
        if not self.last or len(self.announced) < len(self.last):
            return self.gap_ms
        return max(self.gap_ms, 1.5 * min(self.announced[n] for n in self.last))

    def idle_pace_ms(self, cap_ms: float = 250.0) -> float:
        """How long a reader of the stream may let entries gather between two reads: 0 while any heard node beats
        at the default rate; when every one announced a longer interval (an idle cluster), a quarter of the
        shortest of them, at most `cap_ms`. Judged on the stream's clock, a late read never makes a node look
        silent; it only delays a verdict by this much, and only while nothing runs."""
        if not self.last or len(self.announced) < len(self.last):
            return 0.0
        return min(cap_ms, 0.25 * min(self.announced[n] for n in self.last))

    def limit_ms(self, node: str) -> float:
        """The silence after which `node` is missed: `timeout_ms`, stretched by the interval it announced."""
        a = self.announced.get(node)
        return self.timeout_ms if a is None else self.timeout_ms * a / self.interval_ms

    def silent_ms(self, node: str) -> float | None:
        """How long the node has been silent on the stream's clock (None: not heard since it was last forgotten)."""
        t = self.last.get(node)
        return None if t is None else self.clock_ms - t

    def missed(self) -> list[tuple[str, float]]:
        """(node, silent ms) of every heard node silent longer than its timeout, most silent first; none while the
        stream settles after a silence of its own."""
        if self.clock_ms < self.quiet_until_ms:
            return []
        out = [(n, self.clock_ms - t) for n, t in self.last.items() if self.clock_ms - t > self.limit_ms(n)]
        return sorted(out, key=lambda x: (-x[1], x[0]))

    def fresh(self, node: str) -> bool:
        """Heard within its timeout (and since it was last forgotten)."""
        s = self.silent_ms(node)
        return s is not None and s <= self.limit_ms(node)

    def forget(self, node: str) -> None:
        """The node was declared dead: it is judged again only after it is heard again."""
        self.last.pop(node, None)
        self.announced.pop(node, None)

    def reset(self, node: str) -> None:
        """The node is back in service: a full timeout from now before it can be judged silent."""
        self.last[node] = self.clock_ms
