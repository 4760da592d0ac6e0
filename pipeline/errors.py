"""RackflowError: the root of every rackflow exception, in the pure core so that the core's own errors derive from
it too (as redis-py's `exceptions.py` roots its hierarchy in RedisError).

Each error says whether the same operation may succeed if retried (`retryable`): a server unreachable, loading or
timing out is retryable (callers back off, `pipeline/backoff.py`); a bad argument, a bad config, a malformed event,
a refused request is not (retrying changes nothing: the message says what to change). Catch `RackflowError` to
catch rackflow's failures and nothing else; library errors are translated into these at the edge (the stores).

Errors that were ValueError / RuntimeError before keep that base as well, so existing `except ValueError` callers
keep working.
"""

from __future__ import annotations


class RackflowError(Exception):
    """Root of rackflow's own exceptions."""

    retryable: bool = False
    """True when the same call may succeed later (transient: an outage, a timeout); False when the input must
    change."""
