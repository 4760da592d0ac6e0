"""The `torch` engine on the real tiny Qwen2 model: tokenizer streaming, continuous batching, batched == alone,
EOS, KV export/import, swap-out under a tiny L0, abort, and refusal of snapshots from other weights.

Everything here is a real transformer forward (no stubs): the model is small enough that the whole file runs in a
few seconds on one CPU thread.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.config import TorchEngineConfig, load_config
from pipeline.events import RequestEvent
from pipeline.kv.snapshot import KvSnapshot, decode, encode
from tests.unit.builders import request
from workers.engines.base import EngineError, EngineStats, SeqFinished, TokenOut
from workers.engines.tokenizer import BOS, EOS, ByteTokenizer, HfTokenizer, load_tokenizer, stream_text
from workers.engines.torch_engine import TorchEngine

CONFIG = load_config()
SPEC = CONFIG.models["tiny-qwen2"]
TEXT = "Grüße, 世界! naïve café — 🚀 done"


class TickClock:
    """A virtual clock that advances 1 ms per read (timestamps are ordered without sleeping)."""

    def __init__(self) -> None:
        self._t = itertools.count(1_000)

    def now_ms(self) -> float:
        return float(next(self._t))


def engine(**overrides: Any) -> TorchEngine:
    hook = overrides.pop("logits_hook", None)
    return TorchEngine(TorchEngineConfig(**overrides), SPEC, now_ms=TickClock().now_ms, logits_hook=hook)


def req(rid: str, prompt: str = "", *, max_tokens: int = 12, in_tokens: int = 20) -> RequestEvent:
    return request(request_id=rid, model="tiny-qwen2", prompt=prompt, in_tokens=in_tokens, out_tokens=max_tokens,
                   max_tokens=max_tokens)


PROMPTS = {
    "a": "The quick brown fox",
    "b": "Once upon a time, in a rack far away, a node served tokens.",
    "c": "KV",
    "d": "",  # synthesized from the request id: 37 tokens
    "e": "Zürich → 東京",
}


@dataclass
class Run:
    tokens: dict[str, list[TokenOut]] = field(default_factory=lambda: defaultdict(list))
    finished: dict[str, SeqFinished] = field(default_factory=dict)
    steps: list[tuple[int, set[str]]] = field(default_factory=list)
    """Per step: the engine's decode batch size and the sequences that got a token."""

    def ids(self, rid: str) -> list[int]:
        return [t.token_id for t in self.tokens[rid]]


def step(e: TorchEngine, run: Run) -> None:
    out = asyncio.run(e.step())
    for t in out.tokens:
        run.tokens[t.request_id].append(t)
    for f in out.finished:
        run.finished[f.request_id] = f
    run.steps.append((e.last_decode_batch, {t.request_id for t in out.tokens}))


def drain(e: TorchEngine, run: Run | None = None, limit: int = 10_000) -> Run:
    run = run or Run()
    for _ in range(limit):
        if not e.has_work():
            return run
        step(e, run)
    raise AssertionError("engine did not finish")


def alone(rid: str, prompt: str, max_tokens: int, **cfg: Any) -> list[int]:
    e = engine(**cfg)
    e.submit(req(rid, prompt, max_tokens=max_tokens, in_tokens=37))
    return drain(e).ids(rid)


# -- tokenizer ---------------------------------------------------------------------------------------------------
def test_byte_tokenizer_round_trip_and_streaming_never_splits_a_character() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids[0] == BOS and ids[1:] == list(TEXT.encode())
    assert tok.decode(ids) == TEXT
    assert tok.decode([*ids, EOS]) == TEXT  # specials carry no text
    pieces = stream_text(tok, ids[1:])
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    # a 4-byte character arrives in 4 tokens: nothing until its last byte, then the whole character
    rocket = list("🚀".encode())
    dec = tok.stream()
    assert [dec.feed(b) for b in rocket] == ["", "", "", "🚀"]
    # a sequence cut inside a character: the flush gives U+FFFD, never raises
    dec = tok.stream()
    assert dec.feed(0xE4) == "" and dec.flush() == "\ufffd"


def test_hf_tokenizer_json_behind_the_same_interface(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator([TEXT, "the cat sat on the mat", "café café café"] * 20, trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path, eos_id=0)
    assert isinstance(tok, HfTokenizer)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    pieces = stream_text(tok, ids)
    assert "".join(pieces) == TEXT and all("\ufffd" not in p for p in pieces)
    assert isinstance(load_tokenizer(tmp_path / "missing"), ByteTokenizer)


# -- generation --------------------------------------------------------------------------------------------------
def test_generates_max_tokens_per_request_with_ordered_indices_text_and_timing() -> None:
    e = engine()
    for rid, p in PROMPTS.items():
        e.submit(req(rid, p, max_tokens=9, in_tokens=37))
    run = drain(e)
    tok = ByteTokenizer()
    for rid in PROMPTS:
        toks = run.tokens[rid]
        assert [t.index for t in toks] == list(range(9))
        assert all(0 <= t.token_id < 256 or t.token_id == EOS for t in toks)
        assert "".join(t.text for t in toks) == tok.decode(t.token_id for t in toks)
        f = run.finished[rid]
        assert (f.out_tokens, f.reason) == (9, "length")
        assert f.start_ms <= f.first_token_ms < f.finish_ms
    s = e.stats()
    assert (s.running, s.waiting, s.kv_used_kb, s.tokens) == (0, 0, 0.0, 9 * len(PROMPTS))
    assert s.kv_capacity_kb == 64_000 and s.steps == 9 and s.avg_step_ms > 0


def test_empty_prompt_prefills_in_tokens_synthesized_tokens_capped_at_the_context() -> None:
    e = engine()
    ids = e.prompt_ids(req("trace-1", "", in_tokens=37))
    assert len(ids) == 37 and ids == e.prompt_ids(req("trace-1", "", in_tokens=37))
    assert ids != e.prompt_ids(req("trace-2", "", in_tokens=37))
    assert len(e.prompt_ids(req("trace-3", "", in_tokens=100_000))) == SPEC.context - 1
    assert len(e.prompt_ids(req("long", "x" * 10_000))) == SPEC.context - 1


def test_continuous_batching_sequences_join_and_leave_mid_flight() -> None:
    e = engine()
    run = Run()
    e.submit(req("a", PROMPTS["a"], max_tokens=4))
    e.submit(req("b", PROMPTS["b"], max_tokens=10))
    step(e, run)  # both prefilled (first tokens)
    step(e, run)
    e.submit(req("c", PROMPTS["c"], max_tokens=6))
    step(e, run)  # c is prefilled while a and b decode in one forward
    assert run.steps[-1] == (2, {"a", "b", "c"})
    step(e, run)  # c joined the decode batch
    assert run.steps[-1] == (3, {"a", "b", "c"})
    assert run.finished["a"].out_tokens == 4  # a left
    drain(e, run)
    assert [batch for batch, _ in run.steps] == [0, 2, 2, 3, 2, 2, 2, 2, 1, 1]
    for rid, n in (("a", 4), ("b", 10), ("c", 6)):
        assert [t.index for t in run.tokens[rid]] == list(range(n))
        assert run.ids(rid) == alone(rid, PROMPTS[rid], n)


def test_batched_decoding_gives_the_tokens_of_decoding_each_sequence_alone_float64() -> None:
    """float64: rounding differences between batch shapes are ~1e-16, far below any greedy margin."""
    e = engine(dtype="float64")
    run = Run()
    for rid, p in PROMPTS.items():  # staggered arrivals: ragged lengths, changing batches
        e.submit(req(rid, p, max_tokens=16, in_tokens=37))
        step(e, run)
    drain(e, run)
    assert max(b for b, _ in run.steps) == len(PROMPTS)
    for rid, p in PROMPTS.items():
        assert run.ids(rid) == alone(rid, p, 16, dtype="float64"), rid


def test_batched_float32_logits_match_alone_within_tolerance_and_margins_make_tokens_equal() -> None:
    """float32 batches change matmul shapes, so logits may differ in the last bits: we check they agree within
    1e-4 AND that every greedy choice had a top-2 margin larger than twice the measured difference, which proves the
    tokens are equal by construction for these seeds, not by luck."""
    batched: dict[tuple[str, int], torch.Tensor] = {}
    e = engine(logits_hook=lambda rid, i, row: batched.__setitem__((rid, i), row.clone()))
    run = Run()
    for rid, p in PROMPTS.items():
        e.submit(req(rid, p, max_tokens=16, in_tokens=37))
        step(e, run)
    drain(e, run)
    single: dict[tuple[str, int], torch.Tensor] = {}
    for rid, p in PROMPTS.items():
        e1 = engine(logits_hook=lambda r, i, row: single.__setitem__((r, i), row.clone()))
        e1.submit(req(rid, p, max_tokens=16, in_tokens=37))
        assert drain(e1).ids(rid) == run.ids(rid)
    assert batched.keys() == single.keys()
    diff = max(float((batched[k] - single[k]).abs().max()) for k in batched)
    assert diff < 1e-4
    margins = []
    for row in single.values():
        top = torch.topk(row[:256], 2).values  # real byte ids (EOS never wins here)
        margins.append(float(top[0] - top[1]))
    assert min(margins) > 2 * diff


def test_eos_stops_a_sequence_when_stop_at_eos() -> None:
    """A real model crafted to emit EOS: EOS's lm_head row becomes 1.5x the row of the token greedily chosen at
    step K, so EOS outscores every token no later than step K (that token's logit is positive there); until then
    the run is the unmodified one."""
    K = 6
    ref_logits: dict[int, torch.Tensor] = {}
    e = engine(logits_hook=lambda rid, i, row: ref_logits.__setitem__(i, row.clone()))
    e.submit(req("s", PROMPTS["b"], max_tokens=20))
    ref = drain(e).ids("s")
    assert EOS not in ref and float(ref_logits[K].max()) > 0

    def crafted(stop: bool) -> Run:
        e = engine(stop_at_eos=stop)
        with torch.no_grad():
            e.model.lm_head.weight[EOS] = 1.5 * e.model.lm_head.weight[ref[K]]
        e.submit(req("s", PROMPTS["b"], max_tokens=20))
        return drain(e)

    run = crafted(True)
    ids = run.ids("s")
    assert ids[-1] == EOS and 1 < len(ids) <= K + 1 and ids[:-1] == ref[: len(ids) - 1]
    f = run.finished["s"]
    assert (f.reason, f.out_tokens) == ("stop", len(ids))
    assert "".join(t.text for t in run.tokens["s"]) == ByteTokenizer().decode(ids)  # EOS: no text, only the flush
    no_stop = crafted(False)
    assert no_stop.finished["s"].reason == "length" and len(no_stop.ids("s")) == 20
    assert no_stop.ids("s")[: len(ids)] == ids


# -- KV export / import ------------------------------------------------------------------------------------------
def test_export_import_in_process_continues_exactly() -> None:
    n, k = 24, 7
    ref = alone("m", PROMPTS["b"], n)
    a = engine()
    run_a = Run()
    a.submit(req("m", PROMPTS["b"], max_tokens=n))
    for _ in range(k):
        step(a, run_a)
    kept = a.export_kv("m", version=1)  # without remove: a snapshot, the sequence keeps running here
    assert a.stats().running == 1
    snap = decode(encode(a.export_kv("m", version=2, remove=True)))
    assert not a.has_work() and a.stats().kv_used_kb == 0
    assert (snap.engine, snap.model, snap.version) == ("torch", a.model_id, 2)
    assert snap.generated == tuple(run_a.ids("m")) and len(snap.generated) == k
    assert snap.token_ids == tuple(ByteTokenizer().encode(PROMPTS["b"])) + snap.generated
    assert snap.meta["kv_tokens"] == len(snap.token_ids) - 1
    assert len(snap.data) == snap.meta["kv_tokens"] * a.kv_bytes_per_token
    assert kept.data == snap.data

    b = engine()
    b.import_kv(snap, req("m", PROMPTS["b"], max_tokens=n))
    run_b = drain(b)
    assert [t.index for t in run_b.tokens["m"]] == list(range(k, n))
    assert run_a.ids("m") + run_b.ids("m") == ref
    f = run_b.finished["m"]
    assert f.out_tokens == n and f.start_ms == snap.meta["start_ms"] and f.first_token_ms == snap.meta["first_token_ms"]
    text = "".join(t.text for t in [*run_a.tokens["m"], *run_b.tokens["m"]])
    assert text == ByteTokenizer().decode(ref)  # the resumed stream decoder picks up mid-character


def test_export_of_a_waiting_sequence_resumes_from_prefill() -> None:
    a = engine()
    a.submit(req("w", PROMPTS["a"], max_tokens=8))
    snap = a.export_kv("w", version=1, remove=True)
    assert snap.data == b"" and snap.generated == () and snap.meta["kv_tokens"] == 0
    b = engine()
    b.import_kv(snap, req("w", PROMPTS["a"], max_tokens=8))
    assert drain(b).ids("w") == alone("w", PROMPTS["a"], 8)


def test_snapshot_without_kv_is_rebuilt_by_re_prefill() -> None:
    """The migration fallback (KV lost from the tiers): re-prefill prompt + generated tokens. Exact up to rounding;
    float64 makes that far below the greedy margins."""
    ref = alone("r", PROMPTS["b"], 16, dtype="float64")
    a = engine(dtype="float64")
    run = Run()
    a.submit(req("r", PROMPTS["b"], max_tokens=16))
    for _ in range(5):
        step(a, run)
    full = a.export_kv("r", 1, remove=True)
    bare = KvSnapshot(seq_id=full.seq_id, version=1, model=full.model, engine="torch", token_ids=full.token_ids,
                      prompt_len=full.prompt_len, generated=full.generated, max_tokens=16,
                      meta={**full.meta, "kv_tokens": 0})
    b = engine(dtype="float64")
    b.import_kv(bare, req("r", PROMPTS["b"], max_tokens=16))
    assert run.ids("r") + drain(b).ids("r") == ref


def test_snapshot_from_other_weights_or_engine_is_refused() -> None:
    a = engine()
    a.submit(req("x", PROMPTS["a"], max_tokens=8))
    for _ in range(3):
        asyncio.run(a.step())
    snap = a.export_kv("x", 1)
    for other in (engine(seed=1), engine(dtype="float64")):
        with pytest.raises(EngineError, match="only resumes on the same engine and weights"):
            other.import_kv(snap, req("x", PROMPTS["a"], max_tokens=8))
        assert not other.has_work()
    sim = KvSnapshot(seq_id="x", version=1, model="sim:2x64", engine="sim", token_ids=(1, 2), prompt_len=1,
                     generated=(2,), max_tokens=8)
    with pytest.raises(EngineError, match="sim/sim:2x64"):
        engine().import_kv(sim, req("x", PROMPTS["a"], max_tokens=8))
    with pytest.raises(EngineError, match="offered for request"):
        engine().import_kv(snap, req("y", PROMPTS["a"], max_tokens=8))
    truncated = replace(snap, data=snap.data[:-4])
    with pytest.raises(EngineError, match="bytes of KV"):
        engine().import_kv(truncated, req("x", PROMPTS["a"], max_tokens=8))
    with pytest.raises(EngineError, match="holds no sequence"):
        a.export_kv("nope", 1)


# -- L0 capacity, swap, abort ------------------------------------------------------------------------------------
SWAP_PROMPT = "x" * 29  # + BOS = 30 tokens; with max_tokens 20 a sequence reserves 50 tokens = 25.6 KB
SMALL_L0_MB = 0.06  # room for two such sequences, not three


@dataclass
class SwapStore:
    blobs: dict[str, bytes] = field(default_factory=dict)
    puts: list[str] = field(default_factory=list)
    lose: bool = False
    refuse: bool = False

    def put(self, snap: KvSnapshot) -> bool:
        self.puts.append(snap.seq_id)
        if self.refuse:
            return False  # like KvTierManager.put when no tier can take it
        self.blobs[snap.seq_id] = encode(snap)
        return True

    def get(self, seq_id: str) -> KvSnapshot | None:
        blob = self.blobs.pop(seq_id, None)
        return None if blob is None or self.lose else decode(blob)


def small_l0_run(e: TorchEngine, store: SwapStore | None) -> tuple[Run, list[tuple[int, int, int]]]:
    """a and b fill L0; c arrives two steps later. Returns the run and per step (running, waiting, swapped)."""
    if store is not None:
        e.set_swap(store.put, store.get)
    run = Run()
    seen = []
    e.submit(req("a", SWAP_PROMPT, max_tokens=20))
    e.submit(req("b", SWAP_PROMPT + "b", max_tokens=16))
    step(e, run)
    step(e, run)
    e.submit(req("c", SWAP_PROMPT + "c", max_tokens=10))
    while e.has_work():
        step(e, run)
        assert e._reserved <= e.kv_capacity_bytes
        s = e.stats()
        assert s.kv_used_kb <= s.kv_capacity_kb
        seen.append((s.running, s.waiting, s.swapped_out))
    return run, seen


def expected_small_l0() -> dict[str, list[int]]:
    return {rid: alone(rid, SWAP_PROMPT + p, n) for rid, p, n in (("a", "", 20), ("b", "b", 16), ("c", "c", 10))}


def test_swap_out_lru_under_a_tiny_l0_and_resume_continues_exactly() -> None:
    store = SwapStore()
    e = engine(kv_capacity_mb=SMALL_L0_MB)
    run, seen = small_l0_run(e, store)
    assert store.puts == ["a"]  # the least recently used (earliest admitted) made room for c
    assert seen[0] == (2, 0, 1) and e.swaps_total == 1
    assert not store.blobs  # a came back
    for rid, ids in expected_small_l0().items():
        assert [t.index for t in run.tokens[rid]] == list(range(len(ids)))
        assert run.ids(rid) == ids, rid
    assert e.stats().swapped_out == 0


@pytest.mark.parametrize("refusing_store", [False, True], ids=["no-store", "store-refuses"])
def test_without_a_swap_store_new_sequences_wait_for_room(refusing_store: bool) -> None:
    store = SwapStore(refuse=True) if refusing_store else None
    e = engine(kv_capacity_mb=SMALL_L0_MB)
    run, seen = small_l0_run(e, store)
    assert seen[0] == (2, 1, 0)  # c queued, nobody swapped
    if store is not None:
        assert store.puts == ["a"]  # refused once; not retried every iteration
    assert max(r for r, _, _ in seen) == 2
    first_c = next(i for i, (_, got) in enumerate(run.steps) if "c" in got)
    assert run.finished["b"] and first_c > 2
    assert {rid: run.ids(rid) for rid in "abc"} == expected_small_l0()


def test_swapped_kv_lost_from_the_tiers_is_rebuilt_by_re_prefill() -> None:
    store = SwapStore(lose=True)
    e = engine(kv_capacity_mb=2 * SMALL_L0_MB, dtype="float64")  # 8-byte elements: twice the bytes per token
    run, _ = small_l0_run(e, store)
    assert store.puts == ["a"]
    assert run.ids("a") == alone("a", SWAP_PROMPT, 20, dtype="float64")


def test_abort_frees_kv_of_running_and_drops_waiting() -> None:
    e = engine()
    e.submit(req("a", PROMPTS["a"], max_tokens=30))
    e.submit(req("b", PROMPTS["b"], max_tokens=30))
    run = Run()
    step(e, run)
    step(e, run)
    before = e.stats()
    assert before.running == 2 and before.kv_used_kb > 0
    assert e.abort("a") is True
    after = e.stats()
    a_tokens = len(ByteTokenizer().encode(PROMPTS["a"])) + 1
    assert after.running == 1
    assert after.kv_used_kb == pytest.approx(before.kv_used_kb - a_tokens * e.kv_bytes_per_token / 1000)
    e.submit(req("w", PROMPTS["c"], max_tokens=5))
    assert e.abort("w") is True and e.abort("a") is False and e.abort("nope") is False
    drain(e, run)
    assert len(run.tokens["a"]) == 2 and "w" not in run.tokens and "a" not in run.finished
    assert run.finished["b"].out_tokens == 30
    assert e.stats().kv_used_kb == 0


def test_abort_during_an_iteration_in_flight_is_applied_when_it_ends() -> None:
    e = engine()
    e.submit(req("a", "", in_tokens=4000, max_tokens=5))

    async def go() -> tuple[bool, Any]:
        task = asyncio.create_task(e.step())
        while not e._lock.locked():  # wait until the long prefill runs in the compute thread
            await asyncio.sleep(0)
        found = e.abort("a")
        return found, await task

    found, out = asyncio.run(go())
    assert found is True and out.tokens == () and not e.has_work() and e.stats().kv_used_kb == 0


def test_step_runs_off_the_event_loop() -> None:
    e = engine()
    e.submit(req("long", "", in_tokens=4000, max_tokens=1))

    async def go() -> int:
        ticks = 0
        task = asyncio.create_task(e.step())
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.001)
        await task
        return ticks

    assert asyncio.run(go()) >= 3


# -- wiring ------------------------------------------------------------------------------------------------------
def test_worker_and_registry_build_the_torch_engine() -> None:
    from workers.engines import build_engine

    e = build_engine(CONFIG, CONFIG.nodes()[0].name, "torch")
    assert isinstance(e, TorchEngine) and e.model_id.startswith("tiny-qwen2-seed0:float32:")
    e2 = TorchEngine(TorchEngineConfig(), SPEC, now_ms=TickClock().now_ms)
    assert isinstance(e2, TorchEngine) and e2.model_id == e.model_id  # same seed: same weights, same id
    assert engine(seed=3).model_id != e.model_id



def test_local_checkpoint_loads_without_download(tmp_path: Path) -> None:
    seeded = engine()
    seeded.model.save_pretrained(tmp_path / "tiny")
    e = engine(checkpoint=str(tmp_path / "tiny"))
    assert e.model_id.startswith("ckpt-tiny:float32:") and e.model_id.split(":")[-1] == seeded.model_id.split(":")[-1]
    e.submit(req("k", PROMPTS["a"], max_tokens=8))
    assert drain(e).ids("k") == alone("k", PROMPTS["a"], 8)
    with pytest.raises(EngineError, match=r"no config\.json"):
        engine(checkpoint=str(tmp_path / "missing"))


def test_the_speed_belief_learns_from_the_iterations_the_engine_runs() -> None:
    """The node's speed against the price it is given (`cost`), from its own iterations: priced a thousand times too
    fast it is seen slower than its price (decode and prefill both), priced a thousand times too slow, faster; no
    iteration's time moves that far whatever the host's load. Without a price the belief stays at 1."""
    from pipeline.costmodel.linear import LinearStepCost

    def run(scale: float | None) -> EngineStats:
        e = engine()
        if scale is not None:
            e.cost = LinearStepCost(base_ms=0.5 * scale, per_prefill_token_ms=0.01 * scale,
                                    per_decode_seq_ms=0.05 * scale, per_kv_token_ms=0.0)
        for i in range(4):
            e.submit(req(f"s{i}", PROMPTS["b"], max_tokens=20))
        drain(e)
        return e.stats()

    fast, slow, none = run(1e-3), run(1e3), run(None)
    assert fast.slowdown > 5.0 and fast.prefill_slowdown > 5.0, fast
    assert slow.slowdown < 0.5 and 0.0 < slow.prefill_slowdown < 0.5, slow
    assert none.slowdown == 1.0 and none.prefill_slowdown == 0.0
