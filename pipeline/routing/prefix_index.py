"""Approximate prefix index: which prompt-prefix blocks each node has probably cached.

A prompt is cut into blocks of `prefix_block_tokens`; block i's hash chains blocks 0..i (as vLLM's prefix cache
does), so a node holds a prompt's first k blocks iff it holds hash k-1 and the match length is the number of
leading hashes present. The index learns from dispatches (where each request was sent) and forgets by LRU per node,
like llm-d's approximate prefix-cache scorer; it can be wrong after a node evicts or restarts, which costs only a
less good placement, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._nodes: dict[str, OrderedDict[int, None]] = {}

    def insert(self, node: str, hashes: Sequence[int]) -> None:
        lru = self._nodes.setdefault(node, OrderedDict())
        # Tail blocks first, so the leading blocks are the most recent: LRU evicts a prompt from its tail (as
        # vLLM does) and a half-evicted prompt still matches its head.
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def matched_blocks(self, node: str, hashes: Sequence[int]) -> int:
        lru = self._nodes.get(node)
        if not lru:
            return 0
        k = 0
        for h in hashes:
            if h not in lru:
                break
            k += 1
        return k

    def forget(self, node: str) -> None:
        self._nodes.pop(node, None)

    def size(self, node: str) -> int:
        return len(self._nodes.get(node, ()))
