"""Key names of every stream, hash and marker (ARCHITECTURE §1, §6).

Per-rack, per-node and per-request keys carry their id as a Redis Cluster hash tag (`{...}`), so the keys one
command touches together live in one slot. The final-result marker carries the tag `{rf:results}`, which hashes
like the results stream itself, so the Lua script that writes a result exactly once touches a single slot.
"""

from __future__ import annotations

INGRESS = "rf:ingress"
DECISIONS = "rf:decisions"
RESULTS = "rf:results"
HEALTH = "rf:health"
DLQ = "rf:dlq"

GROUP_ROUTER = "router"
GROUP_BATCHER = "batcher"
GROUP_WORKER = "worker"


def rack_requests(rack: str) -> str:
    return f"rf:rack:{{{rack}}}:req"


def rack_status(rack: str) -> str:
    return f"rf:rack:{{{rack}}}:status"


def node_batches(node: str) -> str:
    return f"rf:node:{{{node}}}:batch"


def node_status(node: str) -> str:
    return f"rf:node:{{{node}}}:status"


def request_out(request_id: str) -> str:
    return f"rf:out:{{{request_id}}}"


def result_done(request_id: str) -> str:
    return f"{{{RESULTS}}}:done:{request_id}"


# etcd keys
ETCD_PREFIX = "/rackflow/"
ETCD_NODES = "/rackflow/nodes/"


def etcd_node(node: str) -> str:
    return f"{ETCD_NODES}{node}"


def user_out_ewma(tenant: str, user_id: str) -> str:
    """A user's output-length EWMA (profiling's output estimate), per tenant."""
    return f"rf:user:{{{tenant}:{user_id}}}:out_ewma"
