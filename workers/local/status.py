"""`rackflow status`: the operator's view of a running cluster, read from where the roles publish it.

- nodes: the config's racks and nodes; from etcd, whether the worker is registered (its lease alive), the monitor's
  verdict (draining, dead) and its reason, the health agent's heartbeat; from Valkey, the worker's status (running
  and waiting sequences, KV use, step time, when it last reported), the health score the monitor's scorer gives
  the node's recent agent samples (`rf:health`), and its last injected fault;
- roles: the monitor's leader (etcd), the router and batcher consumers of their groups with their idle time, the
  gateways (their reply streams);
- events: the last drains, recoveries and migrations on `rf:decisions`, with wall-clock times.
Nothing here writes.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from redis.exceptions import ResponseError

from pipeline.config import RackflowConfig
from pipeline.events import DecisionEvent, HealthEvent
from pipeline.health import HealthSample, HealthScorer
from streams import codec, keys
from streams.codec import DecodeError

__all__ = ["cluster_status", "format_status"]

HEALTH_SCAN = 4000
"""Entries of `rf:health` read back for the scores (agents sample every second or so: a minute of a large
cluster's samples; the score needs a node's last few)."""
DECISION_SCAN = 5000
EVENTS_SHOWN = 12


def _clock(ms: float) -> str:
    if ms <= 0:
        return "-"
    return datetime.datetime.fromtimestamp(ms / 1000.0).astimezone().strftime("%H:%M:%S")


async def cluster_status(config: RackflowConfig, redis_url: str, etcd_url: str, now_ms: float) -> dict[str, Any]:
    from streams.runner import connect
    from workers.health import faults
    from workers.stores.etcd import etcd_client

    r = connect(redis_url)
    etcd = etcd_client(etcd_url)
    try:
        def prefixed(resp: Any, prefix: str) -> dict[str, dict[str, Any]]:
            out: dict[str, dict[str, Any]] = {}
            for kv in resp:
                try:
                    out[kv.key.decode()[len(prefix):]] = json.loads(kv.value)
                except ValueError:
                    out[kv.key.decode()[len(prefix):]] = {}
            return out

        registered = prefixed(await etcd.get_prefix(keys.ETCD_NODES.encode()), keys.ETCD_NODES)
        admin = prefixed(await etcd.get_prefix(keys.ETCD_ADMIN.encode()), keys.ETCD_ADMIN)
        beats = set(prefixed(await etcd.get_prefix(keys.ETCD_HEARTBEAT.encode()), keys.ETCD_HEARTBEAT))
        got = await etcd.get(keys.ETCD_MONITOR_LEADER.encode())
        leader = got.value.decode() if got is not None else ""

        # the monitor's scorer over each node's recent agent samples, oldest first
        samples: dict[str, list[HealthEvent]] = {}
        for _eid, fields in reversed(await r.xrevrange(keys.HEALTH, count=HEALTH_SCAN)):
            try:
                ev = codec.decode(fields)
            except DecodeError:
                continue
            if isinstance(ev, HealthEvent) and ev.source in ("nvml", "sim"):
                samples.setdefault(ev.node, []).append(ev)
        scorer = HealthScorer(config.policies.health)
        scores: dict[str, tuple[float, tuple[str, ...]]] = {}
        for node, evs in samples.items():
            for ev in evs:
                v = scorer.observe(HealthSample(ev.node, ev.ts_ms, xid_errors=ev.xid_errors,
                                                ecc_errors=ev.ecc_errors, nvlink_crc_errors=ev.nvlink_crc_errors,
                                                temp_c=ev.temp_c, avg_latency_ms=ev.avg_latency_ms))
                scores[node] = (v.score, v.reasons)

        nodes = []
        for spec in config.nodes():
            n = spec.name
            raw = await r.hgetall(keys.node_status(n))
            st: HealthEvent | None = None
            if raw:
                try:
                    dec = codec.decode(raw)
                    st = dec if isinstance(dec, HealthEvent) else None
                except DecodeError:
                    st = None
            verdict = admin.get(n, {})
            state = str(verdict.get("state") or ("active" if n in registered else "not registered"))
            fl = sorted((await faults.listing(r, n)).values(), key=lambda f: f.at_ms)
            last = fl[-1] if fl else None
            score = scores.get(n)
            nodes.append({
                "node": n, "rack": config.rack_of(n), "gpu": spec.gpu, "state": state,
                "reason": str(verdict.get("reason", "")), "since_ms": float(verdict.get("ts", 0) or 0),
                "worker": "registered" if n in registered else "absent",
                "engine": str(registered.get(n, {}).get("engine", "")),
                "agent_heartbeat": n in beats,
                "health_score": round(score[0], 3) if score else None,
                "health_reasons": list(score[1]) if score else [],
                "running": st.running if st else 0, "waiting": st.waiting if st else 0,
                "kv_used_frac": round(st.kv_used_kb / st.kv_capacity_kb, 3) if st and st.kv_capacity_kb else 0.0,
                "step_ms": round(st.avg_latency_ms, 2) if st else 0.0,
                "status_age_s": round(max(0.0, now_ms - st.ts_ms) / 1000.0, 1) if st else None,
                "last_fault": ({"kind": last.kind, "from_ms": last.at_ms, "until_ms": last.until_ms,
                                "active": last.active_at(now_ms)} if last else None),
            })

        roles: list[dict[str, Any]] = [{"role": "monitor", "name": leader or "-", "alive": bool(leader),
                                        "detail": "leader" if leader else "no leader in etcd"}]
        groups = [(keys.INGRESS, keys.GROUP_ROUTER, "router")]
        groups += [(keys.rack_requests(rack), keys.GROUP_BATCHER, "batcher") for rack in config.rack_names()]
        for stream, group, role in groups:
            try:
                consumers = await r.xinfo_consumers(stream, group)
            except ResponseError:  # no stream or group yet: the role never started
                consumers = []
            for c in consumers:
                name = c["name"].decode() if isinstance(c["name"], bytes) else str(c["name"])
                idle_s = float(c.get("idle", 0)) / 1000.0
                roles.append({"role": role, "name": name, "alive": idle_s < 30.0,
                              "detail": f"{stream}: idle {idle_s:.1f} s, {c.get('pending', 0)} pending"})
        async for key in r.scan_iter(match="rf:gw:*:out", count=500):
            name = key.decode() if isinstance(key, bytes) else str(key)
            roles.append({"role": "gateway", "name": name.split("{")[-1].split("}")[0], "alive": True,
                          "detail": f"reply stream {name}"})

        events = []
        for _eid, fields in await r.xrevrange(keys.DECISIONS, count=DECISION_SCAN):
            try:
                ev = codec.decode(fields)
            except DecodeError:
                continue
            if not isinstance(ev, DecisionEvent) or ev.kind not in ("failover", "migration"):
                continue
            if ev.kind == "failover":
                node, _, to = ev.choice.partition(":")
                what = f"{node} -> {to}" + (f" ({ev.batch_id})" if ev.batch_id else "")
            else:
                what = (f"sequence {ev.request_ids[0] if ev.request_ids else '?'} moved {ev.batch_id} -> {ev.choice}"
                        f" in {ev.scores.get('ms', 0.0):.1f} ms")
            events.append({"ts_ms": ev.ts_ms, "kind": ev.kind, "what": what})
            if len(events) >= EVENTS_SHOWN:
                break
    finally:
        await r.aclose()
        close = getattr(etcd, "close", None)
        if close is not None:
            await close()
    return {"ts_ms": now_ms, "nodes": nodes, "roles": roles, "events": events}


def format_status(s: dict[str, Any]) -> str:
    lines = [f"rackflow status at {_clock(s['ts_ms'])}", ""]
    lines.append(f"{'node':<10} {'rack':<6} {'state':<15} {'health':>6} {'run':>4} {'wait':>5} {'KV':>5} "
                 f"{'step ms':>8} {'status':>7}  last fault")
    for n in s["nodes"]:
        score = "-" if n["health_score"] is None else f"{n['health_score']:.2f}"
        age = "-" if n["status_age_s"] is None else f"{n['status_age_s']:.0f}s"
        f = n["last_fault"]
        fault = "-" if f is None else (f"{f['kind']} {_clock(f['from_ms'])}-{_clock(f['until_ms'])}"
                                       + (" (active)" if f["active"] else ""))
        state = n["state"] + ("" if n["agent_heartbeat"] else "*")
        lines.append(f"{n['node']:<10} {n['rack']:<6} {state:<15} {score:>6} {n['running']:>4} {n['waiting']:>5} "
                     f"{n['kv_used_frac']:>5.0%} {n['step_ms']:>8.1f} {age:>7}  {fault}")
        if n["reason"] and n["state"] != "active":
            lines.append(f"{'':<10} {n['state']} since {_clock(n['since_ms'])}: {n['reason']}")
    if any(not n["agent_heartbeat"] for n in s["nodes"]):
        lines.append("* no health agent heartbeat in etcd for this node")
    lines += ["", f"{'role':<9} {'name':<28} {'alive':<6} detail"]
    for ro in s["roles"]:
        lines.append(f"{ro['role']:<9} {ro['name'][:28]:<28} {'yes' if ro['alive'] else 'NO':<6} {ro['detail']}")
    lines += ["", "recent drains, recoveries and migrations:" if s["events"] else "no drain or migration recorded"]
    for ev in s["events"]:
        lines.append(f"  {_clock(ev['ts_ms'])}  {ev['kind']:<9} {ev['what']}")
    return "\n".join(lines)
