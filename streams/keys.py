"""Key names of every stream, hash and marker (ARCHITECTURE §1, §6).

Per-rack, per-node and per-request keys carry their id as a Redis Cluster hash tag (`{...}`), so the keys one
command touches together live in one slot. The final-result marker carries the tag `{rf:results}`, which hashes
like the results stream itself, so the Lua script that writes a result exactly once touches a single slot.
"""

from __future__ import annotations

import re

INGRESS = "rf:ingress"
ADMITTED = "rf:admitted"
"""The record of the requests a gateway routed itself (`gateway.routing: inline`), as admitted and routed: what
`rf:ingress` is for the requests the router routes. No consumer group reads it; `rackflow replay` does."""
DECISIONS = "rf:decisions"
RESULTS = "rf:results"
HEALTH = "rf:health"
HEALTH_MAXLEN = 100_000
"""rf:health is capped at about this many entries (XADD MAXLEN ~) ..."""
HEALTH_TRIM_EVERY_MS = 5_000.0
"""... and, by each publisher this often, trimmed to the streams' retention (XTRIM MINID ~): the tighter bound wins."""
DLQ = "rf:dlq"
CONFIG = "rf:config"
"""The config in force (JSON), written by the router at start; `replay export` records it."""

GROUP_ROUTER = "router"
GROUP_BATCHER = "batcher"
GROUP_WORKER = "worker"


def rack_requests(rack: str) -> str:
    return f"rf:rack:{{{rack}}}:req"


def rack_status(rack: str) -> str:
    """The rack's batcher backlog as its batchers see it (hash: pending requests, their prompt tokens, ts_ms), for
    the router's work figure of the rack."""
    return f"rf:rack:{{{rack}}}:status"


def rack_blocks(rack: str) -> str:
    """BlockEvents of the rack's nodes' prefix caches (read by the rack's batchers and by the routers)."""
    return f"rf:rack:{{{rack}}}:blocks"


def rack_room(rack: str) -> str:
    """Pub/sub channel: a node of the rack has room again (its worker rewrote its status after sequences finished;
    the message is the node's name). The rack's batchers holding requests wake on it instead of at their next poll."""
    return f"rf:room:{{{rack}}}"


def node_batches(node: str) -> str:
    return f"rf:node:{{{node}}}:batch"


def node_status(node: str) -> str:
    """The worker's live status (engine load, free KV): a HealthEvent written by the worker."""
    return f"rf:node:{{{node}}}:status"


def node_gpu(node: str) -> str:
    """The health agent's last GPU sample of the node: a HealthEvent written by the agent (NVML or sim)."""
    return f"rf:node:{{{node}}}:gpu"


def node_faults(node: str) -> str:
    """Injected faults of a simulated node (`rackflow fault inject`): kind -> JSON {until_ms, factor, id}."""
    return f"rf:node:{{{node}}}:faults"


def node_control(node: str) -> str:
    """Control messages to a node's worker (release a sequence being migrated away)."""
    return f"rf:node:{{{node}}}:ctl"



def request_out(request_id: str) -> str:
    return f"rf:out:{{{request_id}}}"


GATEWAY_REPLIES_KEEP_MS = 60_000
"""A gateway's reply stream keeps this much of its newest entries (XADD MINID, approximate): its reader keeps up in
milliseconds, and a request it missed is read from the request's own stream. A stopped gateway's stream expires
(the gateway refreshes its TTL while it runs)."""
_GATEWAY_REPLIES = re.compile(r"rf:gw:\{[A-Za-z0-9_.-]{1,64}\}:out")


def gateway_replies(gateway_id: str) -> str:
    """One gateway process's reply stream: every token chunk and final result of the requests it admitted (beside
    each request's own `request_out` stream, which stays the durable copy, readable by id)."""
    key = f"rf:gw:{{{gateway_id}}}:out"
    if not _GATEWAY_REPLIES.fullmatch(key):
        raise ValueError(f"gateway id {gateway_id!r}: use 1-64 letters, digits, '_', '.' or '-'")
    return key


def is_gateway_replies(key: str) -> bool:
    """Whether `key` (a request's `reply_to`, from the stream: untrusted) names a gateway reply stream, and nothing
    else a writer could be made to append to."""
    return bool(_GATEWAY_REPLIES.fullmatch(key))


def result_done(request_id: str) -> str:
    return f"{{{RESULTS}}}:done:{request_id}"


CANCEL_TTL_S = 24 * 3600
"""How long a cancellation marker lives (a request still queued after that is run after all)."""


def request_cancelled(request_id: str) -> str:
    """Cancellation marker of a request (a revoked job), set with a TTL of CANCEL_TTL_S by whoever cancels it: a
    worker that admits the request writes its cancelled result instead of running it. It carries the tag of the
    final-result marker, so a worker reads both markers of a batch in one MGET, also on Redis Cluster."""
    return f"{{{RESULTS}}}:cancel:{request_id}"


JOB_TTL_S = 24 * 3600
"""How long an async job's record lives (as long as Celery keeps its results: `result_expires`)."""


def job(job_id: str) -> str:
    """An async job's record (hash: tenant, user, kind task|group, task ids, created_ms, cancelled_ms): who may read
    or cancel it through the gateway."""
    return f"rf:job:{{{job_id}}}"


def job_admitted(request_id: str) -> str:
    """Set once a job's task has admitted its request into rf:ingress: a redelivered task waits for the result
    instead of admitting the request a second time."""
    return f"rf:job:{{{request_id}}}:admitted"



def batch(batch_id: str) -> str:
    """A Batch API batch (hash: `record`, the OpenAI batch object as data (pipeline/batch_state.py); `completed`,
    `failed`, its line counts; `tenant`, `user`, `models`, who created it and what its lines may use; `next`, the
    token of the task run expected next; `lease`'s holder is in `batch_lease`). The per-batch keys share its hash
    tag, so one script touches them together, also on Redis Cluster."""
    return f"rf:batch:{{{batch_id}}}"


def batch_lines(batch_id: str) -> str:
    """A batch's ended lines (hash: line index -> its output- or error-file line, JSON), each written once."""
    return f"rf:batch:{{{batch_id}}}:lines"


def batch_admitted(batch_id: str) -> str:
    """A batch's admitted lines (hash: line index -> `admitted_ms,max_tokens`): a resumed runner waits for these
    instead of admitting them again."""
    return f"rf:batch:{{{batch_id}}}:admitted"


def batch_lease(batch_id: str) -> str:
    """The runner that holds the batch (a token with a TTL, renewed while it works)."""
    return f"rf:batch:{{{batch_id}}}:lease"


def tenant_batches(tenant_hash: str) -> str:
    """A tenant's batches (sorted set: batch id by creation time), for `GET /v1/batches`; `tenant_hash` is a hash of
    the tenant's name (a token's claim is never a key by itself)."""
    return f"rf:batches:{{{tenant_hash}}}"


# etcd keys
ETCD_PREFIX = "/rackflow/"
ETCD_NODES = "/rackflow/nodes/"
ETCD_ADMIN = "/rackflow/admin/"
ETCD_HEARTBEAT = "/rackflow/heartbeat/"
ETCD_SEQ = "/rackflow/seq/"
ETCD_MONITOR_LEADER = "/rackflow/monitor/leader"


def etcd_node(node: str) -> str:
    """A worker's registration (its lease): state active|draining as the worker sees itself."""
    return f"{ETCD_NODES}{node}"


def etcd_admin(node: str) -> str:
    """The monitor's verdict on a node: draining|dead (no lease; cleared when the node recovers)."""
    return f"{ETCD_ADMIN}{node}"


def etcd_heartbeat(node: str) -> str:
    """The health agent's heartbeat under a short lease."""
    return f"{ETCD_HEARTBEAT}{node}"


def etcd_seq(seq_id: str) -> str:
    """Ownership record of a live sequence: owner node, version, rack, last_update_ts."""
    return f"{ETCD_SEQ}{seq_id}"


def user_out_ewma(tenant: str, user_id: str) -> str:
    """A user's output-length EWMA (profiling's output estimate), per tenant."""
    return f"rf:user:{{{tenant}:{user_id}}}:out_ewma"


def tenant_tpm(tenant: str, minute: int) -> str:
    """The tokens a tenant's interactive requests were charged in one wall-clock minute (workers/stores/rate_limit.py;
    an integer string, expires after two minutes)."""
    return f"rf:tpm:{{{tenant}}}:{minute}"


def seq_released(seq_id: str, version: int) -> str:
    """Set by the old owner once it has stopped a sequence being moved to `version` (and exported its KV)."""
    return f"rf:seq:{{{seq_id}}}:released:{version}"
