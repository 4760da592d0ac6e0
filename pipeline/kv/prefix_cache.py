"""The prefix cache of one engine, in blocks of chained prefix hashes, with a host-memory tier under it.

Like vLLM's automatic prefix caching: a prompt is cut into blocks of `block_tokens`, block i's hash chains blocks
0..i, and a new prompt skips the prefill of its longest run of leading blocks the engine still holds. Blocks are
evicted least recently used. Below GPU memory sits an optional host-memory tier (vLLM's OffloadingConnector, LMCache's
CPU backend, Dynamo's KVBM G2): a block evicted from GPU memory moves there, and a hit on it is loaded back over the
host link instead of being recomputed (the caller charges the load time). A block leaving the last tier is gone.

Every change of what the engine holds is reported to `listener(stored, removed)` (vLLM's KV events: BlockStored /
BlockRemoved), which feeds the routers' precise prefix indexes. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BlockListener = Callable[[tuple[int, ...], tuple[int, ...]], None]
"""(hashes newly held by the engine, hashes it no longer holds in any tier)."""


@dataclass(frozen=True, slots=True)
class PrefixHit:
    blocks: int
    """Leading blocks of the prompt found in either tier."""
    host_blocks: int
    """Of those, the blocks found only in host memory (to be loaded back over the host link)."""


class PrefixCache:
    def __init__(self, gpu_blocks: int, host_blocks: int = 0, listener: BlockListener | None = None) -> None:
        if gpu_blocks < 1 or host_blocks < 0:
            raise ValueError(f"need gpu_blocks >= 1 and host_blocks >= 0, got {gpu_blocks}, {host_blocks}")
        self.gpu_capacity = gpu_blocks
        self.host_capacity = host_blocks
        self.listener = listener
        self.gpu: OrderedDict[int, None] = OrderedDict()
        self.host: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.gpu) + len(self.host)

    def __contains__(self, h: int) -> bool:
        return h in self.gpu or h in self.host

    def lookup(self, hashes: Sequence[int]) -> PrefixHit:
        """The longest run of leading blocks held in either tier; GPU hits count as used (LRU)."""
        gpu, host = self.gpu, self.host
        k = on_host = 0
        for h in hashes:
            if h in gpu:
                gpu.move_to_end(h)
            elif h in host:
                on_host += 1
            else:
                break
            k += 1
        return PrefixHit(k, on_host)

    def insert(self, hashes: Sequence[int]) -> None:
        """A prompt's blocks were computed (or loaded back) into GPU memory. Tail blocks go in first, so the leading
        blocks are the most recently used: eviction takes a prompt from its tail, as vLLM does, and a partly evicted
        prompt still matches its head."""
        gpu, host = self.gpu, self.host
        stored: list[int] = []
        for h in reversed(hashes):
            if h in gpu:
                gpu.move_to_end(h)
                continue
            if h in host:
                del host[h]
            else:
                stored.append(h)
            gpu[h] = None
        removed = self._evict()
        if self.listener is not None and (stored or removed):
            self.listener(tuple(stored), tuple(removed))

    def resize(self, gpu_blocks: int) -> None:
        """The GPU tier now holds at most `gpu_blocks` (at least 1): the least recently used blocks beyond it move
        down a tier, or are gone. For an engine whose cached blocks share its KV pool with the running sequences
        (vLLM's), the room left for them moves with the sequences' KV."""
        self.gpu_capacity = max(1, gpu_blocks)
        if len(self.gpu) > self.gpu_capacity:
            removed = self._evict()
            if self.listener is not None and removed:
                self.listener((), tuple(removed))

    def _evict(self) -> list[int]:
        gpu, host = self.gpu, self.host
        removed: list[int] = []
        while len(gpu) > self.gpu_capacity:
            h, _ = gpu.popitem(last=False)
            if self.host_capacity:
                host[h] = None
            else:
                removed.append(h)
        while len(host) > self.host_capacity:
            h, _ = host.popitem(last=False)
            removed.append(h)
        return removed

    def clear(self) -> None:
        """The engine lost everything (a restart, a dead node)."""
        gone = (*self.gpu, *self.host)
        self.gpu.clear()
        self.host.clear()
        if self.listener is not None and gone:
            self.listener((), gone)


def ideal_hit_rate(prompts: Sequence[tuple[int, Sequence[int]]], block_tokens: int) -> float:
    """Share of prompt tokens an unbounded prefix cache would not prefill over a trace of (prompt tokens, block
    hashes) in arrival order: the best any cluster could do, whatever its memory and routing."""
    seen: set[int] = set()
    hit = total = 0
    for tokens, hashes in prompts:
        k = 0
        for h in hashes:
            if h not in seen:
                break
            k += 1
        hit += min(tokens - 1, k * block_tokens) if k else 0
        total += tokens
        seen.update(hashes)
    return hit / total if total else 0.0
