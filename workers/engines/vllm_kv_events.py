"""vLLM's own KV-cache events, turned into the prefix blocks rackflow's policies index (`BlockEvent`s).

vLLM publishes what its prefix cache stores and evicts (`--kv-events-config`, `vllm.distributed.kv_events`: a ZMQ
PUB socket of msgpack `KVEventBatch`es of `BlockStored` / `BlockRemoved` / `AllBlocksCleared`), the feed Dynamo's KV
router and llm-d's precise prefix-cache scorer consume. Its blocks are not ours:
- vLLM hashes blocks of `block_size` tokens (16 on a GPU, 128 on the CPU build) with its own seeded hash, chained
  through `parent_block_hash`;
- rackflow's policies look prompts up by the gateway's prefix hashes: chained blake2b of 512-token blocks of token
  ids (`pipeline.tokens.prefix_hashes_from_ids`), or whatever ids the request came with (a Mooncake trace's
  `hash_ids`, the gateway's byte-cut hashes of an untokenized prompt).

`BlockTranslator` bridges the two as Dynamo's and llm-d's indexers do (they hash the request's tokens on the router
side in the engine's way; here the engine side hashes in the router's way, since each event carries the block's
token ids):
- per vLLM block it keeps the running blake2b of every token id from the prompt's start to the block's end, from its
  parent's (a block whose parent it never saw is skipped: its prefix is unknown);
- where a 512-token boundary falls inside a stored block, that boundary's chained hash is a prefix block of ours;
- the engine registers, at intake, each request's own prefix hashes against the chained hashes of its prompt's
  token ids (`alias`), so a block stored for that prompt is reported under the id the router looks it up by;
- a block vLLM evicts takes its boundary hashes with it (each counted, so a hash two vLLM blocks map to stays until
  both are gone); `AllBlocksCleared` clears everything;
- blocks with extra hash keys (a `cache_salt`: the long-prompt rule keeps the request out of the shared cache; a
  LoRA; multimodal inputs) and blocks of another medium than the GPU's are not ours: nothing can hit them by prefix.

`VllmKvEvents` is the subscriber: a ZMQ SUB socket on the endpoint the engine core publishes on, read without
blocking once per engine step (`poll`)."""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from pipeline.tokens import chain_hash, new_prefix_chain, prefix_hashes_from_ids, token_block_bytes

log = logging.getLogger(__name__)

BlockChanges = tuple[tuple[int, ...], tuple[int, ...]]
"""(stored, removed) prefix hashes, in the order the engine made the changes: what `take_block_events` returns."""


class BlockTranslator:
    def __init__(self, prefix_block_tokens: int = 512, max_aliases: int = 1 << 18) -> None:
        if prefix_block_tokens < 1:
            raise ValueError(f"prefix_block_tokens must be >= 1, got {prefix_block_tokens}")
        self.bt = prefix_block_tokens
        self.max_aliases = max_aliases
        self._chain: dict[Any, tuple[int, Any]] = {}
        """vLLM block hash -> (tokens from the prompt's start to the block's end, blake2b over their ids)."""
        self._ours: dict[Any, tuple[int, ...]] = {}
        """vLLM block hash -> the prefix hashes whose 512-token boundary falls inside it."""
        self._held: dict[int, int] = {}
        """Prefix hash -> how many cached vLLM blocks carry it."""
        self._alias: OrderedDict[int, int] = OrderedDict()
        """Chained token-id hash -> the request's own prefix hash for that block (LRU, bounded)."""
        self.skipped = 0
        """Stored blocks not translated: parent unknown, salted or another medium."""

    def alias(self, token_ids: Sequence[int], prefix_hashes: Sequence[int]) -> None:
        """A request's prompt, at intake: its k-th 512-token block is known to the router as `prefix_hashes[k]`."""
        if not prefix_hashes:
            return
        alias = self._alias
        for mine, h in zip(prefix_hashes_from_ids(token_ids[: len(prefix_hashes) * self.bt], self.bt), prefix_hashes,
                           strict=False):
            alias[mine] = int(h)
            alias.move_to_end(mine)
        while len(alias) > self.max_aliases:
            alias.popitem(last=False)

    def held(self) -> set[int]:
        """The prefix hashes this engine holds now."""
        return set(self._held)

    def matched_blocks(self, prefix_hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt this engine holds (its expected prefix hit, in blocks)."""
        k = 0
        for h in prefix_hashes:
            if h not in self._held:
                break
            k += 1
        return k

    def stored(self, block_hashes: Sequence[Any], parent: Any, token_ids: Sequence[int], block_size: int,
               extra_keys: Sequence[Any] | None = None, medium: str | None = None) -> tuple[int, ...]:
        """vLLM stored these blocks (consecutive, each `block_size` of `token_ids`, the first a child of `parent`):
        the prefix hashes that became held."""
        if medium not in (None, "GPU") or block_size < 1:
            self.skipped += len(block_hashes)
            return ()
        if parent is None:
            pos, running = 0, new_prefix_chain()
        else:
            known = self._chain.get(parent)
            if known is None:
                self.skipped += len(block_hashes)
                return ()
            pos, running = known[0], known[1].copy()
        out: list[int] = []
        bt = self.bt
        for i, vh in enumerate(block_hashes):
            if extra_keys is not None and i < len(extra_keys) and extra_keys[i]:
                self.skipped += len(block_hashes) - i  # salted (or LoRA, multimodal): and so are its children
                break
            ids = token_ids[i * block_size : (i + 1) * block_size]
            if len(ids) < block_size:
                self.skipped += len(block_hashes) - i
                break
            boundaries: list[int] = []
            start = pos
            cut = 0
            # every 512-token boundary inside (start, start + block_size]: hash up to it, then go on
            for b in range((start // bt + 1) * bt, start + block_size + 1, bt):
                running.update(token_block_bytes(ids[cut : b - start]))
                cut = b - start
                mine = chain_hash(running)
                boundaries.append(self._alias.get(mine, mine))
            if cut < block_size:
                running.update(token_block_bytes(ids[cut:]))
            pos = start + block_size
            if vh in self._chain:  # stored again without a removal between: its hashes are counted already
                self._chain[vh] = (pos, running.copy())
                continue
            self._chain[vh] = (pos, running.copy())
            if boundaries:
                self._ours[vh] = tuple(boundaries)
                for h in boundaries:
                    n = self._held.get(h, 0)
                    self._held[h] = n + 1
                    if n == 0:
                        out.append(h)
        return tuple(out)

    def removed(self, block_hashes: Iterable[Any], medium: str | None = None) -> tuple[int, ...]:
        """vLLM evicted these blocks: the prefix hashes no longer held."""
        if medium not in (None, "GPU"):
            return ()
        out: list[int] = []
        for vh in block_hashes:
            self._chain.pop(vh, None)
            for h in self._ours.pop(vh, ()):
                n = self._held.get(h, 0) - 1
                if n <= 0:
                    self._held.pop(h, None)
                    if n == 0:
                        out.append(h)
                else:
                    self._held[h] = n
        return tuple(out)

    def cleared(self) -> tuple[int, ...]:
        """vLLM dropped its whole cache: every prefix hash held, now removed."""
        out = tuple(self._held)
        self._chain.clear()
        self._ours.clear()
        self._held.clear()
        return out

    def apply(self, events: Iterable[Any]) -> list[BlockChanges]:
        """vLLM's events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`, by class name) in order, as changes."""
        out: list[BlockChanges] = []
        for ev in events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                got = self.stored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size,
                                  getattr(ev, "extra_keys", None), getattr(ev, "medium", None))
                if got:
                    out.append((got, ()))
            elif kind == "BlockRemoved":
                gone = self.removed(ev.block_hashes, getattr(ev, "medium", None))
                if gone:
                    out.append(((), gone))
            elif kind == "AllBlocksCleared":
                gone = self.cleared()
                if gone:
                    out.append(((), gone))
        return out


class VllmKvEvents:
    """The engine core's KV events over ZMQ, translated. `engine_config()` is what the engine is started with;
    `poll()` drains what arrived (never blocks)."""

    def __init__(self, endpoint: str, prefix_block_tokens: int = 512) -> None:
        import zmq
        from msgspec.msgpack import Decoder
        from vllm.distributed.kv_events import KVEventBatch

        self.endpoint = endpoint
        self.translator = BlockTranslator(prefix_block_tokens)
        self._decoder = Decoder(type=KVEventBatch)
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(endpoint)  # before the publisher binds: zmq connects when it does, no event is missed
        self._again = zmq.Again
        self._noblock = zmq.NOBLOCK
        self.batches = 0
        self.gaps = 0
        """Sequence numbers skipped (events lost in transit: the index may hold a block vLLM evicted since, until
        vLLM stores or evicts it again)."""
        self._seq = -1

    def engine_config(self) -> Any:
        from vllm.config import KVEventsConfig

        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=self.endpoint, topic="")

    def poll(self, limit: int = 10_000) -> list[BlockChanges]:
        out: list[BlockChanges] = []
        for _ in range(limit):
            try:
                frames = self._sub.recv_multipart(flags=self._noblock)
            except self._again:
                break
            if len(frames) != 3:
                continue
            _topic, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big")
            if self._seq >= 0 and seq > self._seq + 1:
                self.gaps += seq - self._seq - 1
                log.warning("vllm kv events: %d batches lost (seq %d after %d)", seq - self._seq - 1, seq, self._seq)
            self._seq = seq
            try:
                batch = self._decoder.decode(payload)
            except Exception as e:  # a newer vLLM's event layout: say so once per batch, lose only the index
                log.warning("vllm kv events: undecodable batch %d (%s)", seq, e)
                continue
            self.batches += 1
            out += self.translator.apply(batch.events)
        return out

    def close(self) -> None:
        self._sub.close(linger=0)
        if self.endpoint.startswith("ipc://"):
            try:
                os.unlink(self.endpoint[len("ipc://"):])
            except OSError:
                pass
