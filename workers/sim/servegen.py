"""A request trace drawn from ServeGen's published client data (Alibaba Cloud Model Studio; Xiang et al., "ServeGen:
Workload Characterization and Generation of Large Language Model Serving in Production", arXiv 2505.09999, 2025;
github.com/alibaba/ServeGen, Apache-2.0).

ServeGen does not publish requests. It publishes, per client of a model's service (a `chunk-N`), a day in 10-minute
windows: the client's mean rate, the coefficient of variation of its inter-arrival times and the fitted arrival
distribution (`chunk-N-trace.csv`: `start_s,rate,cv,Gamma|Weibull,shape,scale`, an empty pattern where the client
sent nothing), and in 6-hour windows the distributions of its prompt and output lengths (`chunk-N-dataset.json`:
`{"start_s": {"input_tokens": "{tokens: probability, ...}", "output_tokens": ..., ...}}`). The trace written here
is one draw of requests from those: each client keeps its own arrival process, rate and length distributions, and its
requests carry the client's id as `user_id` (what the control plane's per-user history sees). ServeGen publishes no
prefix information, so the requests carry no prefix hashes.

The draw (own code, following the data's documented meaning): in each 10-minute window of the chosen span where a
client has a rate, its number of requests is the window's mean rate times its length (rounded, the fraction drawn);
their gaps are drawn from the window's fitted distribution and scaled so that the requests fill the window (as
ServeGen's own generator scales them to the target rate); each request's prompt and output lengths are drawn from the
client's distributions of the 6-hour window that holds it. `keep` thins the result (each request kept with that
probability) so that a busy hour fits the matrix's request limit and the repository."""

from __future__ import annotations

import ast
import bisect
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.sim.traces import TraceError, TraceRequest

WINDOW_S = 600


@dataclass(frozen=True, slots=True)
class ArrivalWindow:
    start_s: int
    rate: float
    """Requests per second, the window's mean."""
    pattern: str
    """"Gamma" or "Weibull": the distribution fitted to the window's inter-arrival times."""
    shape: float
    scale: float


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A discrete distribution of token counts, sampled by its cumulative probabilities."""

    values: tuple[int, ...]
    cdf: tuple[float, ...]

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        pdf = ast.literal_eval(text) if isinstance(text, str) else text
        if not isinstance(pdf, dict) or not pdf:
            raise TraceError(f"a length distribution must be a non-empty {{tokens: probability}} map, got {text!r:.60}")
        items = sorted((int(k), float(v)) for k, v in pdf.items())
        total = sum(p for _, p in items)
        if total <= 0:
            raise TraceError("a length distribution has no probability mass")
        acc, cdf = 0.0, []
        for _, p in items:
            acc += p / total
            cdf.append(acc)
        return cls(tuple(v for v, _ in items), tuple(cdf))

    def draw(self, rng: random.Random) -> int:
        return self.values[min(len(self.values) - 1, bisect.bisect_left(self.cdf, rng.random()))]


@dataclass(frozen=True, slots=True)
class Client:
    client_id: str
    windows: tuple[ArrivalWindow, ...]
    lengths: tuple[tuple[int, LengthDist, LengthDist], ...]
    """(start_s, prompt lengths, output lengths), ascending."""

    def lengths_at(self, t_s: float) -> tuple[LengthDist, LengthDist]:
        """The distributions of the latest 6-hour window starting at or before `t_s` (else the first one)."""
        k = max(0, bisect.bisect_right(self.lengths, t_s, key=lambda w: w[0]) - 1)
        return self.lengths[k][1], self.lengths[k][2]


def parse_arrivals(lines: Iterator[str] | list[str]) -> tuple[ArrivalWindow, ...]:
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        f = line.strip().split(",")
        try:
            start, rate = int(float(f[0])), float(f[1])
            if rate > 0 and f[3]:
                out.append(ArrivalWindow(start, rate, f[3], float(f[4]), float(f[5])))
        except (IndexError, ValueError) as e:
            raise TraceError(f"line {i + 1}: {type(e).__name__}: {e}") from None
    return tuple(out)


def load_client(trace_csv: Path, dataset_json: Path) -> Client:
    windows = parse_arrivals(trace_csv.read_text(encoding="utf-8").splitlines())
    data = json.loads(dataset_json.read_text(encoding="utf-8"))
    lengths = []
    for start, fields in sorted(data.items(), key=lambda kv: int(kv[0])):
        if not _has_mass(fields.get("input_tokens")) or not _has_mass(fields.get("output_tokens")):
            continue  # a 6-hour window in which the client sent nothing: its requests use the nearest earlier one
        try:
            lengths.append((int(start), LengthDist.parse(fields["input_tokens"]),
                            LengthDist.parse(fields["output_tokens"])))
        except KeyError as e:
            raise TraceError(f"{dataset_json.name}: window {start} has no {e}") from None
    return Client(trace_csv.name.split("-trace")[0], windows, tuple(lengths))


def _has_mass(text: object) -> bool:
    return isinstance(text, str) and text.strip() not in ("", "{}")


def load_clients(data_dir: Path) -> list[Client]:
    """Every `chunk-N` of a model's directory of ServeGen data with both files and some length data."""
    out = []
    for trace_csv in sorted(data_dir.glob("chunk-*-trace.csv"), key=lambda p: int(p.name.split("-")[1])):
        ds = trace_csv.with_name(trace_csv.name.replace("-trace.csv", "-dataset.json"))
        if ds.exists():
            client = load_client(trace_csv, ds)
            if client.lengths:
                out.append(client)
    if not out:
        raise TraceError(f"{data_dir}: no chunk-N-trace.csv with its chunk-N-dataset.json")
    return out


def _gap(w: ArrivalWindow, rng: random.Random) -> float:
    if w.pattern == "Gamma":
        return rng.gammavariate(w.shape, w.scale)
    if w.pattern == "Weibull":
        return rng.weibullvariate(w.scale, w.shape)
    raise TraceError(f"unknown arrival pattern {w.pattern!r} (Gamma or Weibull)")


def draw(clients: list[Client], start_s: int, duration_s: int, seed: int, keep: float = 1.0) -> list[TraceRequest]:
    """The requests of [start_s, start_s + duration_s) of ServeGen's day, by arrival; times from the span's start."""
    if not 0.0 < keep <= 1.0:
        raise ValueError("keep must be in (0, 1]")
    out: list[TraceRequest] = []
    for c in clients:
        rng = random.Random(f"{seed}:{c.client_id}")
        for w in c.windows:
            if not start_s <= w.start_s < start_s + duration_s:
                continue
            mean_n = w.rate * WINDOW_S
            n = int(mean_n) + (1 if rng.random() < mean_n - int(mean_n) else 0)
            if n == 0:
                continue
            gaps = [max(1e-9, _gap(w, rng)) for _ in range(n + 1)]
            total, acc = sum(gaps), 0.0
            for g in gaps[:n]:
                acc += g
                t_s = w.start_s + WINDOW_S * acc / total
                p_in, p_out = c.lengths_at(t_s)
                tin, tout = p_in.draw(rng), p_out.draw(rng)
                if rng.random() < keep:
                    out.append(TraceRequest((t_s - start_s) * 1000.0, max(1, tin), max(1, tout),
                                            user_id=f"client-{c.client_id.split('-')[-1]}"))
    out.sort(key=lambda r: r.arrival_ms)
    return out


def busiest_hour(clients: list[Client]) -> int:
    """The hour of the day (0-23) with the most requests, by the clients' mean rates."""
    per_hour = [0.0] * 24
    for c in clients:
        for w in c.windows:
            per_hour[(w.start_s // 3600) % 24] += w.rate * WINDOW_S
    return max(range(24), key=lambda h: per_hour[h])


def summary(reqs: list[TraceRequest]) -> dict[str, float]:
    """Counts and means of a drawn trace (what SOURCES.md records)."""
    if not reqs:
        return {"requests": 0}
    span = reqs[-1].arrival_ms / 1000.0
    ins = sorted(r.in_tokens for r in reqs)
    outs = sorted(r.out_tokens for r in reqs)
    return {"requests": len(reqs), "span_s": round(span, 1), "rate_rps": round(len(reqs) / max(1.0, span), 2),
            "users": len({r.user_id for r in reqs}),
            "input_mean": round(sum(ins) / len(ins), 1), "input_p50": ins[len(ins) // 2],
            "input_p99": ins[min(len(ins) - 1, math.ceil(0.99 * len(ins)) - 1)],
            "output_mean": round(sum(outs) / len(outs), 1), "output_p50": outs[len(outs) // 2],
            "output_p99": outs[min(len(outs) - 1, math.ceil(0.99 * len(outs)) - 1)]}
