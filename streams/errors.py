"""One exception root for the stream layer; library errors are translated here, marked retryable or not."""

from __future__ import annotations

from pipeline.errors import RackflowError


class StreamError(RackflowError):
    """A Redis/Valkey operation failed."""


class TransientStreamError(StreamError):
    """The server is unreachable, loading or timed out: retry with backoff."""

    retryable = True


class DecodeError(RackflowError):
    """A stream entry does not decode into a valid event (the sender's mistake): it goes to the dead-letter
    stream with this message as the reason."""
