"""`CalibratedCostModel.chunk_ms` and `decode_step_ms` (a placement's list-free prices) are `step_ms` of one chunk
and of a decode-only iteration to the last bit: the simulator's decisions depend on them (the digests of
tests/integration/test_sim_compiled.py)."""

from __future__ import annotations

import random

from pipeline.config import load_config
from pipeline.costmodel import CalibratedCostModel


def test_chunk_ms_is_step_ms_of_one_chunk_bit_for_bit() -> None:
    config = load_config()
    rng = random.Random(7)
    models = [CalibratedCostModel.for_node(config, (g, m, tp)) for g in ("h100-80gb", "a100-80gb")
              for m in ("qwen2-7b", "qwen2-72b") for tp in (1, 4)
              if g in config.gpus and m in config.models]
    assert models
    for cost in models:
        for _ in range(400):
            t = rng.choice((1, 2, 15, 16, 17, 511, 512, 4095, 8192)) + rng.randrange(0, 3)
            cached = rng.choice((0, 0, 1, 512, 3000))
            d = rng.choice((0, 0, 1, 7, 64, 255))
            kv = d * rng.randrange(0, 4000)
            want = cost.step_ms([t], d, kv, [cached]) if cached else cost.step_ms([t], d, kv)
            assert cost.chunk_ms(t, cached, d, kv) == want, (t, cached, d, kv)
            assert cost.decode_step_ms(d, kv) == cost.step_ms([], d, kv), (d, kv)
