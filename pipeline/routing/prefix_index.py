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

from pipeline.events import BlockEvent


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


class BlockIndex:
    """Precise prefix index: which owners (nodes, or racks) hold which prefix blocks, kept from the engines' own
    block events (stored / removed, as vLLM publishes them and as llm-d's precise-prefix scorer and Dynamo's KV router
    consume them). Unlike `PrefixIndex` it never guesses: a block is listed for an owner from the moment the engine
    reports it cached until the engine reports it evicted (or the owner is cleared: a dead node, a restart).

    One hash may be held by several owners (a hot system prompt on every node); `matches` walks a prompt's leading
    hashes once and returns, per owner, how many of them it holds in a row.
    """

    def __init__(self) -> None:
        self._owners: dict[int, set[str]] = {}
        self._held: dict[str, set[int]] = {}

    def stored(self, owner: str, hashes: Sequence[int]) -> None:
        held = self._held.setdefault(owner, set())
        owners = self._owners
        for h in hashes:
            if h not in held:
                held.add(h)
                s = owners.get(h)
                if s is None:
                    owners[h] = {owner}
                else:
                    s.add(owner)

    def removed(self, owner: str, hashes: Sequence[int]) -> None:
        held = self._held.get(owner)
        if not held:
            return
        owners = self._owners
        for h in hashes:
            if h in held:
                held.discard(h)
                s = owners.get(h)
                if s is not None:
                    s.discard(owner)
                    if not s:
                        del owners[h]

    def clear(self, owner: str) -> None:
        held = self._held.pop(owner, None)
        if held:
            owners = self._owners
            for h in held:
                s = owners.get(h)
                if s is not None:
                    s.discard(owner)
                    if not s:
                        del owners[h]

    def matches(self, hashes: Sequence[int]) -> dict[str, int]:
        """Owner -> number of leading blocks of `hashes` it holds (owners holding none are left out)."""
        out: dict[str, int] = {}
        if not hashes:
            return out
        first = self._owners.get(hashes[0])
        if not first:
            return out
        alive = set(first)
        k = 1
        for h in hashes[1:]:
            s = self._owners.get(h)
            if s is None:
                break
            gone = alive - s
            if gone:
                for o in gone:
                    out[o] = k
                alive -= gone
                if not alive:
                    break
            k += 1
        for o in alive:
            out[o] = k
        return out

    def size(self, owner: str) -> int:
        return len(self._held.get(owner, ()))

    def owners(self) -> list[str]:
        return sorted(o for o, held in self._held.items() if held)


def apply_block_event(index: BlockIndex, ev: BlockEvent) -> None:
    """One node's prefix-cache changes, in the order the engine made them: a clear first (it lost everything), then
    what it evicted, then what it stored."""
    if ev.cleared:
        index.clear(ev.node)
    if ev.removed:
        index.removed(ev.node, ev.removed)
    if ev.stored:
        index.stored(ev.node, ev.stored)
