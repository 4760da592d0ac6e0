"""vLLM's KV events turned into rackflow's prefix hashes (`workers.engines.vllm_kv_events.BlockTranslator`), fed with
events of vLLM's own layout (block hashes chained through the parent, token ids, block size, extra keys): the hashes
it reports held are exactly the gateway's chained hashes of the prompt's 512-token blocks (or the ids the request came
with), whatever vLLM's block size and however vLLM split the stores; evictions, salts, unknown parents and clears
take them away or never add them. The real vLLM engine's events are checked in tests/vllm/test_engine.py."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest

from pipeline.routing.prefix_index import BlockIndex
from pipeline.tokens import prefix_hashes_from_ids
from workers.engines.vllm_kv_events import BlockTranslator


@dataclass
class BlockStored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    extra_keys: list[Any] | None = None
    medium: str | None = "GPU"


@dataclass
class BlockRemoved:
    block_hashes: list[Any]
    medium: str | None = "GPU"


class AllBlocksCleared:
    pass


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def _vllm_blocks(ids: list[int], bs: int, salt: str = "") -> list[Any]:
    """vLLM's chained block hashes of the full blocks of `ids` (any injective chain will do: the translator never
    reads them, it only follows parents)."""
    out: list[Any] = []
    parent: Any = None
    for i in range(len(ids) // bs):
        parent = ("vllm", salt, parent, tuple(ids[i * bs : (i + 1) * bs]))
        out.append(parent)
    return out


def _store(tr: BlockTranslator, ids: list[int], bs: int, per_event: int, salt: str = "") -> list[tuple[Any, ...]]:
    """Store the prompt's blocks as vLLM does, `per_event` blocks an event; returns what became held, per event."""
    blocks = _vllm_blocks(ids, bs, salt)
    events = []
    for k in range(0, len(blocks), per_event):
        chunk = blocks[k : k + per_event]
        events.append(BlockStored(chunk, blocks[k - 1] if k else None, ids[k * bs : (k + len(chunk)) * bs], bs,
                                  [("salt", salt)] * len(chunk) if salt else None))
    return [st for st, _ in tr.apply(events)]


@pytest.mark.parametrize("bs,per_event", [(128, 1), (128, 3), (16, 7), (16, 1000), (48, 2), (512, 1), (1024, 1)])
def test_held_hashes_are_the_gateways_chained_hashes_whatever_vllms_block_size(bs: int, per_event: int) -> None:
    ids = _ids(3 * 1024 + 100, bs)
    tr = BlockTranslator(512)
    stored = [h for st in _store(tr, ids, bs, per_event) for h in st]
    full = (len(ids) // bs) * bs  # vLLM stores full blocks only
    want = prefix_hashes_from_ids(ids[:full], 512)
    assert stored == list(want) and tr.held() == set(want)
    assert tr.matched_blocks(prefix_hashes_from_ids(ids, 512)) == len(want)


def test_an_alias_reports_the_ids_the_request_came_with() -> None:
    ids = _ids(1600, 1)
    trace_ids = [11, 22, 33, 44]  # a trace's hash ids: 3 full blocks of 512 and a partial one
    tr = BlockTranslator(512)
    tr.alias(ids, trace_ids)
    assert [h for st in _store(tr, ids, 128, 2) for h in st] == [11, 22, 33]
    assert tr.matched_blocks([11, 22, 99]) == 2


def test_a_shared_prefix_is_counted_once_and_an_eviction_takes_only_what_it_held() -> None:
    shared = _ids(1024, 2)
    a, b = shared + _ids(600, 3), shared + _ids(600, 4)
    tr = BlockTranslator(512)
    idx = BlockIndex()
    for ids in (a, b):
        blocks = _vllm_blocks(ids, 128)
        # b's first 8 blocks are a's (vLLM stores only its new blocks, children of a's 8th)
        new = blocks[8:] if ids is b else blocks
        parent = blocks[7] if ids is b else None
        for st, rm in tr.apply([BlockStored(new, parent, ids[(len(blocks) - len(new)) * 128 : len(blocks) * 128],
                                            128)]):
            idx.stored("n", st)
            idx.removed("n", rm)
    ha, hb = prefix_hashes_from_ids(a, 512), prefix_hashes_from_ids(b, 512)
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    assert idx.matches(ha) == {"n": 3} and idx.matches(hb) == {"n": 3}
    # vLLM evicts a's tail block (tokens 1408..1536, where a's 3rd boundary falls)
    gone = tr.apply([BlockRemoved([_vllm_blocks(a, 128)[11]])])
    assert gone == [((), (ha[2],))]
    idx.removed("n", gone[0][1])
    assert idx.matches(ha) == {"n": 2} and idx.matches(hb) == {"n": 3}


def test_salted_blocks_unknown_parents_and_other_media_are_not_ours() -> None:
    ids = _ids(2048, 5)
    tr = BlockTranslator(512)
    assert _store(tr, ids, 128, 4, salt="rackflow-nocache-x") == []
    blocks = _vllm_blocks(ids, 128)
    # a child whose parent was never stored here (events lost, or the parent salted): its prefix is unknown
    assert tr.apply([BlockStored(blocks[4:8], ("never", "seen"), ids[512:1024], 128)]) == []
    assert tr.apply([BlockStored(blocks[:4], None, ids[:512], 128, medium="CPU")]) == []
    assert tr.held() == set() and tr.skipped == 16 + 4 + 4


def test_a_cleared_cache_removes_everything_and_a_block_stored_twice_counts_once() -> None:
    ids = _ids(1100, 6)
    tr = BlockTranslator(512)
    first = _store(tr, ids, 128, 8)
    assert _store(tr, ids, 128, 8) == []  # stored again without an eviction: nothing new
    want = prefix_hashes_from_ids(ids, 512)
    assert [h for st in first for h in st] == list(want)
    cleared = tr.apply([AllBlocksCleared()])
    assert cleared == [((), tuple(want))] and tr.held() == set()
    assert tr.apply([BlockRemoved(_vllm_blocks(ids, 128))]) == []  # nothing left to remove
