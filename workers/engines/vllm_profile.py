"""Step-time profile of the real vLLM engine, and the linear step cost the simulator fits to it (issue 17: the
simulator checked against a real engine).

`python -m workers.engines.vllm_profile --config-dir DIR [--config FILE] --json` runs in an interpreter with vLLM
(`.venv-vllm`). It builds the engine exactly as a `vllm` worker does (`VllmEngine`'s arguments: the config's
`policies.worker.vllm`, its engine core in its own process as in a worker), then times single engine iterations of
known composition:
- prefill: one prompt of P tokens (P over PREFILL_TOKENS), and batches of prompts prefilled in one iteration;
- decode: B sequences (B over DECODE_BATCHES) decoding together, at short and long context, and a few batches at
  the long contexts a trace reaches (DECODE_LONG: prefilled once, then decoded from the prefix cache);
- prefill after a cached prefix (PREFILL_CONTEXT): new tokens attending to a long context.
A phase is timed as a whole, from `add_request` to every request's first token (the prefill iteration, intake
included) and from there to the last finish (the decode iterations): single `step()` returns of vLLM's `LLMEngine`
are not single iterations of its engine core (the frontend reads ahead or behind). Every prompt has its own token
ids, so nothing is served from the prefix cache (but the second runs of DECODE_LONG and PREFILL_CONTEXT, on
purpose).

`fit_linear` fits `step_ms = base + per_decode_seq x decode sequences + per_kv_token x KV tokens read by decode
(+ prefill_base + per_prefill_token x prefill tokens + per_prefill_attn x the prefill's new x context token pairs,
in an iteration that prefills)` by least squares, the decode
terms on the decode samples and then the prefill terms on the prefill ones (coefficients clipped at 0), and
`LinearStepCost` is that model behind the simulator's `StepCost` protocol (`pipeline.sim.node`). Both are pure and
run in any environment."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.costmodel.linear import LinearStepCost, prefill_attn

PREFILL_TOKENS = (16, 64, 256, 512, 1024, 2048)
PREFILL_BATCHES = ((4, 128), (8, 256), (16, 64))
"""(prompts, tokens each) prefilled in one iteration."""
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
DECODE_PROMPTS = (32, 768)
"""Prompt tokens of the decoding sequences (short and long context: the KV term)."""
DECODE_LONG = ((4, 3072), (12, 3072))
"""(sequences, prompt tokens) decoding at the long contexts a served trace reaches: the per-KV-token term is fitted
where it weighs (measured: fitted on contexts up to 1.6 k tokens it came out 0.27 to 0.88 us per token from run to
run, and a trace's arrivals scaled by it spanned 38 or 90 s). Their prompts take several iterations to prefill, so
they give decode samples only."""
PREFILL_CONTEXT = ((1024, 256), (1024, 1024), (2048, 256), (2048, 1024), (3072, 256), (3072, 1024))
"""(cached tokens, new tokens): a prompt prefilled after its first `cached` tokens were cached by an earlier run, so
that its new tokens attend to a long context, as a conversation's next turn and the later chunks of a long prompt
do. Without them the fit priced a turn's prefill by its new tokens alone: measured in the decisions tier
(2026-12-06), a live prefill took 1.35x the fitted price at the median and 1.6x for 2,048+ new tokens."""
DECODE_STEPS = 48
REPEATS = 3


@dataclass(frozen=True, slots=True)
class StepSample:
    prefill_tokens: int
    decode_seqs: int
    decode_kv_tokens: int
    ms: float
    prefill_attn: float = 0.0
    """The prefill's attention work (`pipeline.costmodel.linear.prefill_attn`): new x context token pairs."""


def _fit(x: Any, y: Any) -> Any:
    """Least squares weighted by relative error (every iteration counts alike, short or long); a coefficient the
    data makes negative is dropped and the fit redone without it."""
    import numpy as np

    w = 1.0 / np.maximum(y, 1e-6)
    keep = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    for _ in range(x.shape[1]):
        sol, *_ = np.linalg.lstsq(x[:, keep] * w[:, None], y * w, rcond=None)
        coef = np.zeros(x.shape[1])
        coef[keep] = sol
        neg = [k for k in keep if coef[k] < 0]
        if not neg:
            break
        keep = [k for k in keep if k not in neg]
    return np.maximum(coef, 0.0)


def _predict(cost: LinearStepCost, s: StepSample) -> float:
    """The cost's time for a sample, its prefill's attention work as measured (a batch of prompts or a prompt
    after a cached prefix, which the sample's total new tokens alone do not say)."""
    pre = (cost.prefill_base_ms + cost.per_prefill_token_ms * s.prefill_tokens
           + cost.per_prefill_attn_ms * s.prefill_attn) if s.prefill_tokens else 0.0
    return cost.base_ms + pre + cost.per_decode_seq_ms * s.decode_seqs + cost.per_kv_token_ms * s.decode_kv_tokens


def fit_linear(samples: Sequence[StepSample]) -> tuple[LinearStepCost, dict[str, float]]:
    """The decode terms (base, per sequence, per KV token) from the decode-only samples; then the prefill terms
    (per token, and the fixed extra of an iteration that prefills, over the decode base) from the prefill-only
    ones. One joint fit let the prefill samples (intake included) pull the decode base, and lost the decode cost's
    growth with the batch (measured: 3.7 to 4.8 ms from 1 to 4 sequences, fitted flat). Without both kinds of
    samples, one joint fit. Returns the cost and its fit quality."""
    import numpy as np

    if len(samples) < 4:
        raise ValueError(f"fit_linear needs at least 4 samples, got {len(samples)}")
    dec = [s for s in samples if s.prefill_tokens == 0 and s.decode_seqs > 0]
    pre = [s for s in samples if s.prefill_tokens > 0 and s.decode_seqs == 0]
    if len(dec) >= 3 and len(pre) >= 2:
        d = _fit(np.array([[1.0, s.decode_seqs, s.decode_kv_tokens] for s in dec]), np.array([s.ms for s in dec]))
        p = _fit(np.array([[1.0, s.prefill_tokens, s.prefill_attn] for s in pre]), np.array([s.ms for s in pre]))
        cost = LinearStepCost(float(d[0]), float(p[1]), float(d[1]), float(d[2]), max(0.0, float(p[0] - d[0])),
                              float(p[2]))
    else:
        c = _fit(np.array([[1.0, s.prefill_tokens, s.decode_seqs, s.decode_kv_tokens] for s in samples]),
                 np.array([s.ms for s in samples]))
        cost = LinearStepCost(*(float(v) for v in c))
    y = np.array([s.ms for s in samples])
    pred = np.array([_predict(cost, s) for s in samples])
    rel = np.abs(pred - y) / np.maximum(y, 1e-9)
    return cost, {"samples": float(len(samples)), "median_rel_error": float(np.median(rel)),
                  "p90_rel_error": float(np.percentile(rel, 90))}


# -- the engines' cores -------------------------------------------------------------------------------------------
def _tree(root: int) -> list[int]:
    """`root` and its live descendants (from /proc)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                parents[int(d.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += [c for c, pp in parents.items() if pp == pid]
    return out


def isolate_engines(root: int, shield: bool = False) -> dict[str, Any]:
    """Give the engines their cores alone, as an engine has its GPU (with `shield`, from every other process of the
    machine too: `shield_cores`). vLLM's CPU build pins its model executor's
    threads to some cores and reserves the rest for the host (`VLLM_CPU_OMP_THREADS_BIND=auto`). Here vLLM's own
    processes (`VLLM::EngineCore`, the scheduler, and `VLLM::Worker`, the executor: they run one after the other, a
    step at a time) go on the pinned cores, and every other thread under `root` (the rackflow worker with vLLM's
    frontend, the roles, Valkey, etcd) on the reserved ones. Without it the roles' work preempts the scheduler and
    the steps slow with the load (measured in `rackflow sim validate`). Per thread: Linux affinity is a thread's.
    A no-op where nothing is pinned, or where nothing would be left for the rest."""
    every = set(range(os.cpu_count() or 1))
    threads: dict[int, tuple[bool, set[int]]] = {}
    for pid in _tree(root):
        try:
            engine = Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::")
            tasks = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue
        for tid in tasks:
            try:
                threads[tid] = (engine, set(os.sched_getaffinity(tid)))
            except OSError:
                continue
    pinned = set().union(*(a for e, a in threads.values() if e and a != every)) if threads else set()
    rest = every - pinned
    moved: dict[int, list[int]] = {}
    if pinned and rest:
        for tid, (engine, a) in threads.items():
            want = pinned if engine else rest
            if a == every or (engine and not a <= pinned) or (not engine and a & pinned):
                try:
                    os.sched_setaffinity(tid, want)
                    moved[tid] = sorted(a)
                except OSError:
                    continue
    shielded = shield_cores(pinned, root, moved) if shield and pinned and rest else 0
    return {"engine_cpus": sorted(pinned), "other_cpus": sorted(rest), "moved_threads": len(moved) - shielded,
            "shielded_threads": shielded, "_before": moved, "_root": root, "_rest": sorted(rest)}


def shield_cores(cores: set[int], root: int, moved: dict[int, list[int]]) -> int:
    """Move every thread of the machine outside `root`'s tree off `cores` (what `cset shield` does): another
    process's work on an engine's core slows its steps, which an engine on a GPU never sees, and the simulator,
    timed by the engine's profile, cannot know. Threads that cannot move (per-CPU kernel threads, another user's
    without the right) stay. Each moved thread's old affinity goes into `moved` (for `restore_affinity`); returns how
    many moved this call. Call it again to catch processes started since."""
    ours = set(_tree(root))
    n = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in ours:
            continue
        try:
            tasks = [int(t.name) for t in (d / "task").iterdir()]
        except OSError:
            continue
        for tid in tasks:
            if tid in moved:
                continue
            try:
                a = set(os.sched_getaffinity(tid))
                if a & cores and a - cores:
                    os.sched_setaffinity(tid, a - cores)
                    moved[tid] = sorted(a)
                    n += 1
            except OSError:
                continue
    return n


def restore_affinity(split: dict[str, Any]) -> None:
    """Undo `isolate_engines` for the threads it moved that still live (a caller that goes on running, e.g. a test
    session, must not stay on one core; nor may what it starts later, which inherits the affinity)."""
    before: dict[int, list[int]] = split.pop("_before", {})
    for tid, cpus in before.items():
        try:
            os.sched_setaffinity(tid, set(cpus))
        except OSError:
            continue
    # threads the root process started since, which inherited the narrowed affinity
    rest, root = set(split.pop("_rest", [])), split.pop("_root", None)
    if root is None or not rest:
        return
    try:
        tasks = [int(t.name) for t in Path(f"/proc/{root}/task").iterdir()]
    except OSError:
        return
    every = set(range(os.cpu_count() or 1))
    for tid in tasks:
        try:
            if tid not in before and set(os.sched_getaffinity(tid)) == rest:
                os.sched_setaffinity(tid, every)
        except OSError:
            continue


# -- the measurement (vLLM's interpreter only) --------------------------------------------------------------------
def _engine(config_dir: Path, config_file: Path | None) -> tuple[Any, dict[str, Any]]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from pipeline.config import load_config
    from workers.engines.vllm_engine import VllmEngine

    config = load_config(config_dir, [config_file] if config_file else [])
    wc = config.policies.worker
    eng = VllmEngine(wc.vllm, lambda: 0.0)
    if eng.on_cpu:  # as VllmEngine.start
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{wc.vllm.cpu_kvcache_space_gb:g}")
    llm = LLMEngine.from_engine_args(EngineArgs(**eng.args), enable_multiprocessing=True)
    sc = llm.vllm_config.scheduler_config
    cc = llm.vllm_config.cache_config
    info = {"max_num_seqs": int(sc.max_num_seqs), "max_num_batched_tokens": int(sc.max_num_batched_tokens),
            "num_blocks": int(cc.num_gpu_blocks or 0), "block_size": int(cc.block_size),
            "vocab": len(llm.get_tokenizer()), "on_cpu": eng.on_cpu, "model": eng.model,
            "max_model_len": int(llm.vllm_config.model_config.max_model_len),
            "prefix_caching": bool(eng.args.get("enable_prefix_caching", True))}
    return llm, info


def _ids(n: int, vocab: int) -> list[int]:
    seed = uuid.uuid4().int
    return [(seed + 7919 * i) % (vocab - 16) + 8 for i in range(n)]


def _run(llm: Any, prompts: Sequence[int], max_tokens: int, vocab: int,
         ids: Sequence[list[int]] | None = None) -> tuple[float, float]:
    """Add one request per prompt length (or per given token ids), step until all finish. Returns (ms from the add
    to the moment every request has its first token: the prefill iteration, intake included; ms from then to the
    last finish)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    waiting = set()
    for k, p in enumerate(prompts):
        rid = uuid.uuid4().hex
        waiting.add(rid)
        llm.add_request(rid, {"prompt_token_ids": list(ids[k]) if ids is not None else _ids(p, vocab)}, params)
    t_first = None
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.outputs and out.outputs[0].token_ids:
                waiting.discard(out.request_id)
        if t_first is None and not waiting:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    t_first = t_end if t_first is None else t_first
    return (t_first - t0) * 1000.0, (t_end - t_first) * 1000.0


def measure(llm: Any, info: dict[str, Any], progress: bool = True) -> list[StepSample]:
    """Per composition, REPEATS runs: one prefill sample (all prompts in one iteration: they fit the token budget)
    and one decode sample, the mean iteration of DECODE_STEPS steps of B sequences at their mean KV length (a phase
    timed as a whole: single `step()` returns are not single iterations, the frontend may read ahead or behind)."""
    vocab = info["vocab"]
    cap = info["max_num_batched_tokens"]
    seqs = info["max_num_seqs"]
    plan: list[tuple[str, list[int], int]] = []
    plan += [("prefill", [p], 1) for p in PREFILL_TOKENS if p <= cap]
    plan += [("prefill", [p] * b, 1) for b, p in PREFILL_BATCHES if b * p <= cap and b <= seqs]
    plan += [("decode", [p] * b, DECODE_STEPS + 1) for p in DECODE_PROMPTS for b in DECODE_BATCHES
             if b <= seqs and b * p <= cap]
    blocks = info.get("num_blocks") or 0
    bt = info.get("block_size") or 1
    plan += [("decode-long", [p] * b, DECODE_STEPS + 1) for b, p in DECODE_LONG
             if b <= seqs and (not blocks or b * -(-(p + DECODE_STEPS + 1) // bt) <= blocks * 0.8)]
    max_len = info.get("max_model_len") or 0
    # only with a prefix cache: without one the second run prefills the whole prompt, not its n new tokens
    plan += [("prefill-context", [k, n], 1) for k, n in PREFILL_CONTEXT if info.get("prefix_caching", True)
             and n <= cap and (not max_len or k + n < max_len) and (not blocks or -(-(k + n) // bt) <= blocks * 0.8)]
    _run(llm, [64], 4, vocab)  # warm-up
    samples: list[StepSample] = []
    for i, (kind, prompts, steps) in enumerate(plan):
        for _ in range(REPEATS):
            if kind == "prefill-context":
                # the first k tokens (whole blocks) prefilled and cached by one run, then the whole prompt: only
                # its n new tokens prefill, in one iteration, attending to the k cached ones
                k, n = prompts
                whole = _ids(k + n, vocab)
                _run(llm, [k], 1, vocab, [whole[:k]])
                first_ms, _ = _run(llm, [k + n], 1, vocab, [whole])
                samples.append(StepSample(n, 0, 0, first_ms, prefill_attn([n], [k])))
                continue
            if kind == "decode-long":
                # the prompts are prefilled once (their prefill spans iterations), then run again from the prefix
                # cache: only their last partial blocks prefill, in one iteration, and the B sequences decode in
                # step from there (without a prefix cache the tail of the phase has fewer: a bound, not a fault)
                ids = [_ids(p, vocab) for p in prompts]
                _run(llm, prompts, 1, vocab, ids)
                first_ms, rest_ms = _run(llm, prompts, steps, vocab, ids)
            else:
                first_ms, rest_ms = _run(llm, prompts, steps, vocab)
                samples.append(StepSample(sum(prompts), 0, 0, first_ms, prefill_attn(prompts)))
            if kind.startswith("decode"):
                b, p = len(prompts), prompts[0]
                samples.append(StepSample(0, b, b * (p + 1 + steps // 2), rest_ms / (steps - 1)))
        if progress:
            print(f"vllm profile: {i + 1}/{len(plan)} {kind} {len(prompts)}x{prompts[0]}", file=sys.stderr,
                  flush=True)
    return samples


def _summary(samples: Sequence[StepSample]) -> list[dict[str, Any]]:
    """Median ms per distinct (prefill, decode seqs) composition, for the report."""
    by: dict[tuple[int, int], list[float]] = {}
    for s in samples:
        by.setdefault((s.prefill_tokens, s.decode_seqs), []).append(s.ms)
    return [{"prefill_tokens": p, "decode_seqs": d, "median_ms": round(statistics.median(v), 3), "n": len(v)}
            for (p, d), v in sorted(by.items())]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workers.engines.vllm_profile", description=__doc__.split("\n")[0])
    ap.add_argument("--config-dir", default="configs")
    ap.add_argument("--config", default=None)
    ap.add_argument("-o", "--out", default=None, help="write the JSON here too")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--isolate", action="store_true", help="move every thread but the engine's pinned compute "
                                                           "threads off their cores (isolate_engines)")
    args = ap.parse_args(argv)
    llm, info = _engine(Path(args.config_dir), Path(args.config) if args.config else None)
    if args.isolate:
        split = isolate_engines(os.getpid())
        info["cpus"] = {k: v for k, v in split.items() if not k.startswith("_")}
    t0 = time.perf_counter()
    samples = measure(llm, info, progress=not args.no_progress)
    cost, quality = fit_linear(samples)
    out = {"engine": info, "fit": asdict(cost), "fit_quality": quality, "steps": _summary(samples),
           "samples": [asdict(s) for s in samples], "wall_s": round(time.perf_counter() - t0, 1)}
    text = json.dumps(out)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":  # vLLM spawns its engine core: the engine is made under __main__ only
    raise SystemExit(main())
