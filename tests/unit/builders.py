"""Builders of test objects with sensible defaults; every field can be overridden by keyword.

No fakes of Redis or etcd live here: unit tests exercise the pure `pipeline` and `streams.codec` code only.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Mapping
from typing import Any

from pipeline.batching.window import PendingRequest, WindowBatcher
from pipeline.config import BatcherPolicy, NodeSelectionPolicy, RackflowConfig, load_config
from pipeline.events import RequestEvent, TokenEvent
from pipeline.routing.registry import NodePolicySet
from pipeline.routing.views import NodeView, RackView

SEED_IN_KB = 200
SEED_OUT_KB = 1500
BLOCK_TOKENS = 16
"""Prefix block size of the node-policy sets built here (small, so a test's prompts span many blocks)."""


def request(**overrides: Any) -> RequestEvent:
    """A RequestEvent for qwen2-7b; `mem_est_kb` defaults to the seed formula of the (overridden) token counts."""
    fields: dict[str, Any] = {
        "request_id": str(uuid.uuid4()),
        "version": 1,
        "tenant": "tenant-a",
        "user_id": f"user-{uuid.uuid4().hex[:8]}",
        "model": "qwen2-7b",
        "in_tokens": 100,
        "out_tokens": 200,
        "max_tokens": 200,
        "arrival_ms": 0.0,
        "route_policy": "",
        "prefix_hashes": (),
    }
    fields.update(overrides)
    fields.setdefault("mem_est_kb", float(fields["in_tokens"] * SEED_IN_KB + fields["out_tokens"] * SEED_OUT_KB))
    return RequestEvent(**fields)


def token_event(**overrides: Any) -> TokenEvent:
    """Two tokens of one request; `texts` holds the decoded text of each token."""
    fields: dict[str, Any] = {
        "request_id": str(uuid.uuid4()),
        "version": 1,
        "index": 0,
        "token_ids": (9906, 1917),
        "texts": ("Hello", " world"),
        "ts_ms": 0.0,
        "node": "r0-n0",
    }
    fields.update(overrides)
    return TokenEvent(**fields)


def node_view(name: str, **overrides: Any) -> NodeView:
    """An active, idle H100 node with half its memory free, light PCIe load and a 5 ms step latency."""
    fields: dict[str, Any] = {
        "name": name,
        "active": True,
        "vram_total_gb": 80.0,
        "free_vram_gb": 40.0,
        "pcie_util_pct": 10.0,
        "avg_latency_ms": 5.0,
        "kv_capacity_kb": 72e6,
        "kv_free_kb": 36e6,
        "running": 0,
        "waiting": 0,
    }
    fields.update(overrides)
    return NodeView(**fields)


def rack_view(name: str, **overrides: Any) -> RackView:
    fields: dict[str, Any] = {"name": name, "healthy": True, "load": 0.0}
    fields.update(overrides)
    return RackView(**fields)


def pending(req: RequestEvent | None = None, *, enqueued_ms: float = 0.0, entry_id: str = "") -> PendingRequest:
    req = req if req is not None else request()
    return PendingRequest(req, entry_id or f"{int(enqueued_ms)}-0", enqueued_ms)


def batcher_policy(**overrides: Any) -> BatcherPolicy:
    return BatcherPolicy(**overrides)


def node_selection(**overrides: Any) -> NodeSelectionPolicy:
    """Node-selection parameters (the config's default policy, work_aware, unless `policy` is given); every override
    is allowed."""
    return NodeSelectionPolicy(**overrides)


def policy_set(
    seed: int = 0,
    *,
    scope: str = "r0",
    node_gpus: Mapping[str, str] | None = None,
    block_tokens: int = BLOCK_TOKENS,
    **params: Any,
) -> NodePolicySet:
    """A NodePolicySet for one rack; `params` are NodeSelectionPolicy fields (policy=..., static_weights=...)."""
    return NodePolicySet(node_selection(**params), seed, scope, dict(node_gpus or {}), block_tokens)


def window_batcher(
    caps: Mapping[str, float],
    seed: int = 0,
    *,
    node_models: Mapping[str, frozenset[str]] | None = None,
    selection: Mapping[str, Any] | None = None,
    **policy: Any,
) -> WindowBatcher:
    """A WindowBatcher over nodes with the given caps (KB); `policy` are BatcherPolicy fields, `selection` the
    NodeSelectionPolicy fields of its node-policy set. Unless overridden it is the seed's window: node policy
    `weighted`, and a window that waits `window_ms` while no node is idle (close_when_room off), the rules the
    window tests pin down; the config's defaults are tested on their own."""
    policy.setdefault("close_when_room", False)
    sel = {"policy": "weighted", **dict(selection or {})}
    return WindowBatcher(BatcherPolicy(**policy), policy_set(seed, **sel), dict(caps), node_models)


@functools.cache
def config() -> RackflowConfig:
    """The repository's configuration (configs/*.yaml); frozen, so one instance is shared."""
    return load_config()
