"""Tokenizers of the `torch` engine: text <-> token ids, and per-sequence streaming detokenization.

Owns the byte-level vocabulary of the built-from-config models (ids 0..255 are the UTF-8 bytes, then BOS, EOS,
PAD) and the adapter that puts a checkpoint's `tokenizer.json` (Hugging Face `tokenizers`) behind the same small
interface. A stream decoder turns ids into text pieces as they arrive and never splits a multi-byte character:
the concatenation of the pieces equals `decode` of all ids. It never downloads anything.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

BOS = 256
EOS = 257
PAD = 258
BYTE_VOCAB = 259
"""Size of the byte vocabulary: 256 bytes + BOS, EOS, PAD (a model's vocab may be larger: padding rows)."""


class StreamDecoder(Protocol):
    def feed(self, token_id: int) -> str:
        """Text completed by this token ("" while a character is still incomplete, or for a special token)."""
        ...

    def flush(self) -> str:
        """Whatever is still buffered at the end of the sequence (an incomplete character becomes U+FFFD)."""
        ...


class TextTokenizer(Protocol):
    name: str
    vocab_size: int
    """Ids `0 .. vocab_size-1` are real tokens; a model may have more rows (never chosen)."""
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def stream(self) -> StreamDecoder: ...


class ByteStreamDecoder:
    """Incremental UTF-8 over the byte ids: bytes of a character split across tokens are held until complete."""

    __slots__ = ("_dec",)

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if not 0 <= token_id < 256:
            return ""
        return self._dec.decode(bytes((token_id,)))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0..255), BOS=256, EOS=257, PAD=258."""

    name = "bytes"
    vocab_size = BYTE_VOCAB
    bos_id: int | None = BOS
    eos_id: int | None = EOS
    pad_id: int | None = PAD

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def stream(self) -> StreamDecoder:
        return ByteStreamDecoder()


class HfStreamDecoder:
    """Incremental detokenization for subword tokenizers (the prefix/read offset scheme of TGI and vLLM): decode a
    short window of ids and emit only the text that is new and does not end in an incomplete character."""

    __slots__ = ("_ids", "_prefix", "_read", "_tok")

    def __init__(self, tok: HfTokenizer) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def feed(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            piece = new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self._ids)
            return piece
        return ""

    def flush(self) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]


class HfTokenizer:
    """A checkpoint's `tokenizer.json` through the `tokenizers` library, behind the same interface."""

    def __init__(self, path: Path, bos_id: int | None = None, eos_id: int | None = None,
                 pad_id: int | None = None) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.name = f"hf:{path.parent.name}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def stream(self) -> StreamDecoder:
        return HfStreamDecoder(self)


def load_tokenizer(checkpoint: str | Path | None, bos_id: int | None = None, eos_id: int | None = None,
                   pad_id: int | None = None) -> TextTokenizer:
    """The checkpoint's `tokenizer.json` when there is one, else the byte tokenizer."""
    if checkpoint is not None:
        path = Path(checkpoint) / "tokenizer.json"
        if path.is_file():
            return HfTokenizer(path, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    return ByteTokenizer()


def stream_text(tok: TextTokenizer, ids: Sequence[int]) -> list[str]:
    """The pieces a stream decoder emits for `ids`, the last one including the flush (for tests and tools)."""
    dec = tok.stream()
    pieces = [dec.feed(i) for i in ids]
    if pieces:
        pieces[-1] += dec.flush()
    return pieces
