"""The vllm engine adapter on vLLM's real engine (in this process): its KV numbers are vLLM's own, export/import
resumes a sequence with exactly the tokens of an uninterrupted greedy run, the prefix cache hits for a repeated
prefix (vLLM's counters) and is off for a request the long-prompt rule keeps out of it (`cache_salt`)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from pipeline.events import RequestEvent
from tests.vllm.conftest import Reference
from workers.shell.runtime import WALL

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

PROMPT = ("Large language model inference clusters route every request to a rack and a GPU node. " * 6).strip()


def _req(prompt: str, n: int, prefix_cache: bool = True) -> RequestEvent:
    return RequestEvent(str(uuid.uuid4()), 1, "t", "u", "m", len(prompt) // 4, n, n, 1000.0, WALL.now_ms(),
                        prompt=prompt, prefix_cache=prefix_cache)


def test_stats_are_vllms_real_kv_numbers(reference: Reference, tiny_ckpt: Path) -> None:
    eng = reference.engine
    vc = eng.engine.vllm_config
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (
        cfg["hidden_size"] // cfg["num_attention_heads"]) * 4  # float32
    s = eng.stats()
    assert s.kv_blocks_total == vc.cache_config.num_gpu_blocks > 0
    assert s.kv_block_tokens == vc.cache_config.block_size
    assert eng.bytes_per_token == per_token
    assert s.kv_capacity_kb == pytest.approx(s.kv_blocks_total * s.kv_block_tokens * per_token / 1000)
    # VLLM_CPU_KVCACHE_SPACE=1 (GiB): the blocks vLLM allocated fill that space
    assert s.kv_capacity_kb * 1000 == pytest.approx(1 << 30, rel=0.05)
    assert s.kv_blocks_free == s.kv_blocks_total and s.kv_usage == 0.0 and s.running == 0


def test_export_then_import_resumes_with_the_uninterrupted_tokens(reference: Reference) -> None:
    eng = reference.engine
    whole = _req(PROMPT, 48)
    want = reference.run([whole])[whole.request_id]
    assert len(want) == 48 and len(set(want)) > 10, f"degenerate greedy output {want[:12]}"

    async def interrupted() -> tuple[list[int], int]:
        part = _req(PROMPT, 48)
        eng.submit(part)
        got: list[int] = []
        while len(got) < 12:
            got += [t.token_id for t in (await eng.step()).tokens if t.request_id == part.request_id]
        snap = eng.export_kv(part.request_id, 2, remove=True)
        assert snap.generated == tuple(got) and snap.meta["kv"] == "re-prefill"
        assert not eng.live, "remove=True takes the sequence out of the engine"
        eng.import_kv(snap, part)
        while eng.has_work():
            got += [t.token_id for t in (await eng.step()).tokens if t.request_id == part.request_id]
        return got, len(snap.generated)

    got, cut = reference._call(interrupted(), 120)
    assert cut >= 12
    diff = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    assert got == want, f"resumed after {cut}: first difference at index {diff}"


def test_prefix_cache_hits_for_a_repeated_prefix_and_is_off_by_the_rule(reference: Reference) -> None:
    eng = reference.engine
    prefix = PROMPT * 3  # several 128-token blocks
    before = eng.stats()
    reference.run([_req(prefix + " First question?", 4)])
    first = eng.stats()
    reference.run([_req(prefix + " Second question?", 4)])
    second = eng.stats()
    block = second.kv_block_tokens
    prompt_len = len(eng.prompt_ids(_req(prefix + " Second question?", 1)))
    assert second.prompt_tokens - first.prompt_tokens == prompt_len  # vLLM queried every prompt token
    hits = second.prefix_hit_tokens - first.prefix_hit_tokens
    assert hits >= block and hits % block == 0 and hits <= prompt_len, (hits, prompt_len, block)
    assert first.prefix_hit_tokens - before.prefix_hit_tokens < hits
    # the seed's long-prompt rule says "no prefix cache": a unique cache_salt, so the same prefix hits nothing
    reference.run([_req(prefix + " Second question?", 4, prefix_cache=False)])
    third = eng.stats()
    assert third.prefix_hit_tokens == second.prefix_hit_tokens
    assert third.prompt_tokens - second.prompt_tokens == prompt_len


def test_abort_stops_the_sequence_inside_vllm(reference: Reference) -> None:
    eng = reference.engine

    async def body() -> tuple[int, int]:
        r = _req(PROMPT, 2000)
        eng.submit(r)
        n = 0
        while n < 5:
            n += sum(1 for t in (await eng.step()).tokens if t.request_id == r.request_id)
        assert eng.abort(r.request_id) and not eng.abort(r.request_id)
        late = 0
        for _ in range(10):
            late += sum(1 for t in (await eng.step()).tokens if t.request_id == r.request_id)
        return late, eng.counters.running

    late, running = reference._call(body(), 120)
    assert late == 0, "tokens of an aborted sequence came out"
    assert running == 0, "vLLM's scheduler still runs the aborted request"


def test_a_prompt_past_the_models_context_ends_as_an_error_not_a_length_finish(reference: Reference) -> None:
    """vLLM refuses a prompt that leaves no room for an answer in max_model_len: the sequence ends with the engine's
    reason as its error (the worker writes an `error` result), never as an `ok` answer of no tokens."""
    eng = reference.engine
    too_long = eng.engine.vllm_config.model_config.max_model_len + 8
    r = RequestEvent(str(uuid.uuid4()), 1, "t", "u", "m", too_long, 4, 4, 1000.0, WALL.now_ms())

    async def body() -> list[Any]:
        eng.submit(r)
        done = []
        for _ in range(200):
            done += [f for f in (await eng.step()).finished if f.request_id == r.request_id]
            if done:
                break
        return done

    done = reference._call(body(), 120)
    assert len(done) == 1 and done[0].out_tokens == 0
    assert "maximum" in done[0].error and "length" in done[0].error, done[0].error
    assert not eng.live


def _median_step(reference: Reference, tag: str, requests: int, tokens: int) -> float:
    """The engine's median iteration time (ms) over `requests` sequences of `tokens` decoded together, unpriced."""
    eng = reference.engine
    eng.cost = None
    reference.run([_req(PROMPT + f" {tag} {i}", tokens) for i in range(requests)], together=True)
    steps = sorted(ms for _ts, ms in list(eng.counters.step_ms)[-(requests * tokens) // 6:])
    return steps[len(steps) // 2]


def test_the_speed_belief_learns_the_engines_own_step_time_against_its_price(reference: Reference) -> None:
    """The live control plane's belief of a vLLM node (`slowdown` in its status): the engine's measured iterations
    against the price the node is given. Priced 3x too fast, the node is seen about 3x slower than its price; priced
    3x too slow, about 3x faster. The price is set from this run's own step time, so the test holds on any host."""
    from pipeline.costmodel.linear import LinearStepCost

    eng = reference.engine
    try:
        step = _median_step(reference, "warm", 4, 150)
        got = {}
        for scale in (1 / 3, 3.0):
            eng.cost = LinearStepCost(base_ms=step * scale, per_prefill_token_ms=0.0, per_decode_seq_ms=0.0,
                                      per_kv_token_ms=0.0)
            eng.reset_belief()
            reference.run([_req(PROMPT + f" run {scale} {i}", 150) for i in range(4)], together=True)
            got[scale] = eng.stats().slowdown
        assert 1.8 < got[1 / 3] < 5.0, (step, got)
        assert 0.2 < got[3.0] < 0.55, (step, got)
    finally:
        eng.cost = None
        eng.reset_belief()


def _trace_req(hashes: list[int], n_in: int, prefix_cache: bool = True) -> RequestEvent:
    """A trace-replayed request: a length and the trace's prefix hashes, no text (block k of its prompt is built
    from hash k, so shared hashes share tokens)."""
    return RequestEvent(str(uuid.uuid4()), 1, "t", "u", "m", n_in, 4, 4, 1000.0, WALL.now_ms(),
                        prefix_hashes=tuple(hashes), prefix_cache=prefix_cache)


def _held_after(eng: Any, want: set[int], index: Any, timeout_s: float = 10.0) -> set[int]:
    """Feed the engine's block events to `index` until `want` is held (they come from vLLM's engine core over ZMQ,
    a moment after the step that stored them) or the time is up; returns what the engine holds."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        for stored, removed in eng.take_block_events():
            index.removed("n", removed)
            index.stored("n", stored)
        held: set[int] = eng.kv_events.translator.held()
        if want <= held or time.monotonic() > deadline:
            return held
        time.sleep(0.02)


def test_vllms_own_kv_events_become_the_prefix_hashes_the_batchers_index(reference: Reference) -> None:
    """The precise index's feed from a real vLLM engine: what vLLM's prefix cache stored (its KV events, its own
    128-token block hashes) comes out as the request's own prefix hashes (512-token blocks); a second prompt sharing
    two of them is known at intake to find 1,024 tokens cached, and vLLM's own counter hits exactly those; a salted
    prompt (the long-prompt rule) stores nothing the index would match."""
    from pipeline.routing.prefix_index import BlockIndex

    eng = reference.engine
    assert eng.kv_events is not None, "kv events are on by default with prefix caching"
    index = BlockIndex()
    _held_after(eng, set(), index, 0.0)  # what earlier tests left: the index starts from the engine's state
    base = 7_000_000 + uuid.uuid4().int % 1_000_000  # fresh ids: the shared engine has served other tests
    a = _trace_req([base + 1, base + 2, base + 3], 1600)  # 3 full 512-token blocks and a partial one
    reference.run([a])
    assert _held_after(eng, {base + 1, base + 2, base + 3}, index) >= {base + 1, base + 2, base + 3}
    b = _trace_req([base + 1, base + 2, base + 4, base + 5], 2100)
    assert index.matches(list(b.prefix_hashes))["n"] == 2
    before = eng.stats()

    async def intake() -> int:
        eng.submit(b)
        cached = eng.live[b.request_id].cached
        while eng.has_work():
            await eng.step()
        return cached

    assert reference._call(intake(), 120) == 1024
    after = eng.stats()
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 1024  # vLLM's own counter: what the index said
    assert _held_after(eng, {base + 4, base + 5}, index) >= {base + 4, base + 5}
    salted = _trace_req([base + 6, base + 7], 1100, prefix_cache=False)
    reference.run([salted])
    held = _held_after(eng, {base + 6}, index, timeout_s=2.0)
    assert not held & {base + 6, base + 7}, "a salted prompt's blocks are not prefix hits for anyone"


def test_the_speed_belief_does_not_count_idle_time_as_prefill(reference: Reference) -> None:
    """An iteration after an idle spell is timed from the submission of the request that woke the engine, not from
    the last iteration before the spell. Requests arrive one at a time, a second apart, and every iteration is priced
    at 50 ms, far above what a short prompt's prefill takes this engine (a few ms): timed right, the prefill belief
    stays under 1 (its floor is 0.2); with the idle second counted, each observation reads over 20 times its price,
    and the belief sits at its clip, 20. The margin does not depend on how fast this host runs the engine: the
    prefill would have to take 250 ms for the assertion to fail."""
    import time

    from pipeline.costmodel.linear import LinearStepCost

    eng = reference.engine
    try:
        eng.cost = LinearStepCost(base_ms=50.0, per_prefill_token_ms=0.0, per_decode_seq_ms=0.0, per_kv_token_ms=0.0)
        eng.reset_belief()
        for i in range(10):
            time.sleep(1.0)
            reference.run([_req(PROMPT + f" idle {i}", 8)])
        s = eng.stats()
        assert eng.belief.n_pre >= 1, "every request's first iteration prefills: 10 of them make an observation"
        assert s.prefill_slowdown < 5.0, s.prefill_slowdown
    finally:
        eng.cost = None
        eng.reset_belief()
