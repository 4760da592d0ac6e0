"""The deployment files in deploy/ are checked against the code they start, without Docker, Kubernetes or systemd:

- every `rackflow` command line in docker-compose.yml, the systemd units and the Helm templates parses with the real
  argument parser (`workers.cli.main.build_parser`), with real subcommands and flags;
- the topology they run (a batcher per rack, a worker and an agent per node) is the one of configs/cluster.yaml;
- docker-compose.yml refers only to services, secrets and files it defines, has the health checks the roles depend
  on, and Prometheus scrapes every role that serves /metrics;
- the Helm chart's templates only use values that values.yaml defines, values.yaml validates against
  values.schema.json, and the config the chart renders from its values is a valid rackflow config;
- no secret is written in any of these files.

docs/DEPLOYMENT.md ("What was validated") lists what was checked beyond this (real Helm, compose-spec schema, ...).
"""

from __future__ import annotations

import functools
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.config import ConfigError, load_config, parse_config, raw_config
from tests.conftest import REPO
from workers.cli.main import build_parser
from workers.stores.etcd import parse_etcd_urls

DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
SYSTEMD = DEPLOY / "systemd"
CHART = DEPLOY / "helm" / "rackflow"
DOCKERFILE = DEPLOY / "Dockerfile"

CONFIG = load_config()
RACKS = CONFIG.rack_names()
NODES = [n.name for n in CONFIG.nodes()]


@functools.cache
def _parser() -> Any:
    return build_parser()


def _parse_rackflow(argv: list[str], where: str) -> Any:
    """argv after `rackflow`, parsed by the CLI's own parser; a bad subcommand or flag fails with its location."""
    try:
        return _parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: `rackflow {shlex.join(argv)}` does not parse with workers.cli.main.build_parser ({e})")


# -- docker-compose.yml --------------------------------------------------------------------------------------------
@functools.cache
def _compose() -> dict[str, Any]:
    """The parsed compose file (cached: the tests only read it)."""
    return yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _rackflow_services(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Services that run the rackflow image with its `rackflow` entrypoint (Flower overrides it with celery)."""
    return {
        name: s for name, s in c["services"].items()
        if str(s.get("image", "")).startswith("${RACKFLOW") and "entrypoint" not in s
    }


def test_compose_rackflow_commands_parse_and_match_the_cluster() -> None:
    c = _compose()
    parsed = {name: _parse_rackflow(s["command"], f"docker-compose.yml service {name}")
              for name, s in _rackflow_services(c).items()}
    roles: dict[str, list[tuple[str, Any]]] = {}
    for name, ns in parsed.items():
        roles.setdefault(ns.fn.__name__, []).append((name, ns))
    by_fn = {fn: [ns for _n, ns in items] for fn, items in roles.items()}
    assert sorted(ns.rack for ns in by_fn["cmd_batcher"]) == sorted(RACKS)
    sim_workers = [ns for n, ns in roles["cmd_worker"] if "profiles" not in c["services"][n]]
    vllm_workers = [ns for n, ns in roles["cmd_worker"] if c["services"][n].get("profiles") == ["vllm"]]
    assert sorted(ns.node for ns in sim_workers) == sorted(NODES)
    assert {ns.engine for ns in sim_workers} == {"sim"}
    assert sorted(ns.node for ns in vllm_workers) == sorted(NODES)
    assert {ns.engine for ns in vllm_workers} == {"vllm"}
    agents = roles["cmd_agent"]
    assert sorted(ns.node for n, ns in agents if ns.source == "sim") == sorted(NODES)
    assert sorted(ns.node for n, ns in agents if ns.source == "nvml") == sorted(NODES)
    assert all(c["services"][n].get("profiles") == ["vllm"] for n, ns in agents if ns.source == "nvml")
    assert len(by_fn["cmd_monitor"]) == 2, "two monitors: one leader, one standby"
    assert len(by_fn["cmd_router"]) >= 1 and len(by_fn["cmd_gateway"]) == 1 and len(by_fn["cmd_celery_worker"]) >= 1
    gw = by_fn["cmd_gateway"][0]
    assert gw.host == "0.0.0.0" and not gw.no_auth


def test_compose_vllm_workers_reserve_one_gpu_each() -> None:
    c = _compose()
    ids = []
    for name, s in c["services"].items():
        if s.get("profiles") == ["vllm"]:
            devices = s["deploy"]["resources"]["reservations"]["devices"]
            assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"], name
            if name.startswith("vllm-worker-"):
                ids += devices[0]["device_ids"]
    assert len(ids) == len(NODES) == len(set(ids))


def test_compose_references_are_defined() -> None:
    c = _compose()
    services = c["services"]
    for name, s in services.items():
        for dep in s.get("depends_on", {}):
            assert dep in services, f"{name} depends on undefined service {dep}"
        for sec in s.get("secrets", []):
            assert (sec if isinstance(sec, str) else sec["source"]) in c.get("secrets", {}), f"{name}: secret {sec}"
        for vol in s.get("volumes", []):
            src = vol.split(":", 1)[0]
            if src.startswith((".", "/")):
                assert (DEPLOY / src).exists(), f"{name} mounts missing {src}"
            elif not src.startswith("$"):
                assert src in c.get("volumes", {}), f"{name} uses undefined volume {src}"
        assert s.get("restart") == "unless-stopped", f"{name} has no restart policy"
        assert "image" in s, name
    rackflow = _rackflow_services(c)
    for name, s in rackflow.items():
        deps = s.get("depends_on", {})
        assert {"valkey", "etcd-0", "etcd-1", "etcd-2"} <= set(deps), f"{name} must wait for valkey and etcd"
        assert all(d["condition"] == "service_healthy" for d in deps.values())


def test_compose_healthchecks_and_etcd_cluster() -> None:
    s = _compose()["services"]
    assert "/healthz" in " ".join(s["gateway"]["healthcheck"]["test"])
    assert s["valkey"]["healthcheck"]["test"][1:] == ["valkey-cli", "ping"]
    members = [n for n in s if re.fullmatch(r"etcd-\d", n)]
    assert len(members) == 3
    for m in members:
        assert s[m]["healthcheck"]["test"][1:] == ["etcdctl", "--endpoints=http://127.0.0.1:2379", "endpoint",
                                                   "health"]
        flags = dict(a.removeprefix("--").split("=", 1) for a in s[m]["command"])
        assert flags["name"] == m
        peers = dict(p.split("=", 1) for p in flags["initial-cluster"].split(","))
        assert peers == {x: f"http://{x}:2380" for x in members}
        assert flags["initial-advertise-peer-urls"] == f"http://{m}:2380"
    url = _compose()["x-rackflow"]["environment"]["RACKFLOW_ETCD_URL"]
    assert parse_etcd_urls(url) == [(m, 2379) for m in members], "the roles must know every etcd member"


def test_prometheus_scrapes_every_role_with_metrics() -> None:
    c = _compose()
    targets = {t for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
               for sc in job["static_configs"] for t in sc["targets"]}
    for name, s in _rackflow_services(c).items():
        ns = _parse_rackflow(s["command"], name)
        if getattr(ns, "metrics_port", None) is not None:
            assert f"{name}:{ns.metrics_port}" in targets, f"Prometheus does not scrape {name}"
    assert "gateway:8000" in targets
    assert all(t.split(":")[0] in c["services"] for t in targets), "a target names no compose service"


def test_grafana_provisioning_uses_the_repository_dashboard() -> None:
    s = _compose()["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in s["volumes"] if v.startswith("."))
    dash = next(src for src, dst in mounts.items() if dst.endswith("rackflow-dashboard.json"))
    assert (DEPLOY / dash).resolve() == (DEPLOY / "grafana" / "rackflow-dashboard.json").resolve()
    prov = DEPLOY / next(src for src, dst in mounts.items() if dst == "/etc/grafana/provisioning")
    provider = yaml.safe_load((prov / "dashboards" / "rackflow.yml").read_text())
    assert Path(mounts[dash]).parent == Path(provider["providers"][0]["options"]["path"])
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"


def test_compose_vllm_config_override_is_valid() -> None:
    load_config(overrides=[DEPLOY / "compose" / "vllm.yaml"])


# -- systemd -------------------------------------------------------------------------------------------------------
def _unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as section -> key -> values (keys may repeat, as systemd allows)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            out.setdefault(section, {})
            continue
        assert section is not None and "=" in line, f"{path.name}: bad line {raw!r}"
        k, v = line.split("=", 1)
        out[section].setdefault(k.strip(), []).append(v.strip())
    return out


def _env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            env[k.strip()] = v.strip()
    return env


def _expand_exec(cmd: str, env: dict[str, str], instance: str) -> list[str]:
    """systemd's ExecStart expansion: %i, `$VAR` as zero or more words, `${VAR}` as one word."""
    out: list[str] = []
    for word in shlex.split(cmd.replace("%i", instance)):
        m = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if m:
            out += env[m.group(1)].split()
        else:
            out.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda g: env[g.group(1)], word))
    return out


UNITS = {
    "rackflow-gateway.service": ("cmd_gateway", None),
    "rackflow-router.service": ("cmd_router", None),
    "rackflow-monitor.service": ("cmd_monitor", None),
    "rackflow-celery.service": ("cmd_celery_worker", None),
    "rackflow-batcher@.service": ("cmd_batcher", "r0"),
    "rackflow-worker@.service": ("cmd_worker", "r0-n0"),
    "rackflow-agent@.service": ("cmd_agent", "r0-n0"),
}


def test_systemd_units_are_the_expected_set() -> None:
    assert sorted(p.name for p in SYSTEMD.glob("*.service")) == sorted(UNITS)


@pytest.mark.parametrize("name", sorted(UNITS))
def test_systemd_unit(name: str) -> None:
    fn, instance = UNITS[name]
    u = _unit(SYSTEMD / name)
    assert set(u) == {"Unit", "Service", "Install"}
    assert "network-online.target" in " ".join(u["Unit"]["After"]) and u["Unit"]["Wants"] == ["network-online.target"]
    svc = u["Service"]
    assert "/etc/rackflow/rackflow.env" in svc["EnvironmentFile"]
    assert svc["Restart"] == ["on-failure"]
    assert svc["NoNewPrivileges"] == ["yes"] and svc["ProtectSystem"] == ["strict"]
    assert svc["User"] == ["rackflow"] and svc["CapabilityBoundingSet"] == [""]
    if name in ("rackflow-worker@.service", "rackflow-agent@.service"):
        assert "/dev/shm" in svc["ReadWritePaths"]
        # PrivateDevices or any DeviceAllow (ProtectClock implies one) would hide /dev/nvidia*
        assert not {"PrivateDevices", "DeviceAllow", "DevicePolicy", "ProtectClock"} & set(svc)
    env = _env_file(SYSTEMD / "rackflow.env.example")
    if instance is not None:
        assert f"/etc/rackflow/instances/{'%i'}.env" in svc["EnvironmentFile"]
        inst = SYSTEMD / "instances" / f"{instance}.env.example"
        env |= _env_file(inst)
    (exec_start,) = svc["ExecStart"]
    argv = _expand_exec(exec_start, env, instance or "")
    assert argv[0] == "/opt/rackflow/venv/bin/rackflow"
    ns = _parse_rackflow(argv[1:], name)
    assert ns.fn.__name__ == fn
    assert ns.config == ["/etc/rackflow/rackflow.yaml"]
    if instance is not None:
        assert instance in (getattr(ns, "rack", None), getattr(ns, "node", None))
    if fn == "cmd_agent":
        assert ns.source == "nvml" and ns.gpus == "0"


def test_systemd_example_files_hold_no_secrets_and_a_valid_config() -> None:
    env = _env_file(SYSTEMD / "rackflow.env.example")
    assert "RACKFLOW_JWT_SECRET" not in env
    assert "@" not in env["RACKFLOW_REDIS_URL"], "no password in the shared env file"
    load_config(overrides=[SYSTEMD / "rackflow.yaml.example"])


# -- Helm chart ----------------------------------------------------------------------------------------------------
def _values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _templates() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted((CHART / "templates").iterdir())}


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "rackflow" and chart["type"] == "application"
    assert {"_helpers.tpl", "NOTES.txt", "configmap.yaml", "gateway.yaml", "router.yaml", "batcher.yaml",
            "worker.yaml", "monitor.yaml", "celery.yaml", "flower.yaml", "metrics.yaml"} <= set(_templates())


def test_chart_template_actions_are_balanced_and_helpers_defined() -> None:
    defined = set(re.findall(r'{{-?\s*define\s+"([^"]+)"', _templates()["_helpers.tpl"]))
    for name, text in _templates().items():
        assert text.count("{{") == text.count("}}"), f"{name}: unbalanced {{{{ }}}}"
        for used in re.findall(r'(?:include|template)\s+"([^"]+)"', text):
            assert used in defined, f"{name} includes undefined template {used}"
        opens = len(re.findall(r"{{-?\s*(?:if|range|with|define)\b", text))
        ends = len(re.findall(r"{{-?\s*end\s*-?}}", text))
        assert opens == ends, f"{name}: {opens} blocks opened, {ends} ended"


def test_chart_uses_only_defined_values() -> None:
    values = _values()
    for name, text in _templates().items():
        for path in re.findall(r"\$?\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)", text):
            node: Any = values
            for part in path.strip(".").split("."):
                assert isinstance(node, dict) and part in node, f"{name}: .Values{path} is not in values.yaml"
                node = node[part]


def _check_schema(instance: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """The JSON-schema keywords values.schema.json uses (draft-07 subset), for when jsonschema is not installed."""
    errs: list[str] = []
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": (int, float)}
    t = schema.get("type")
    if t is not None:
        ok = any(isinstance(instance, types[x]) and not (x in ("integer", "number") and isinstance(instance, bool))
                 for x in ([t] if isinstance(t, str) else t))
        if not ok:
            return [f"{path or '/'}: {instance!r} is not {t}"]
    if "enum" in schema and instance not in schema["enum"]:
        errs.append(f"{path}: {instance!r} not in {schema['enum']}")
    if isinstance(instance, str):
        if "pattern" in schema and not re.search(schema["pattern"], instance):
            errs.append(f"{path}: {instance!r} does not match {schema['pattern']}")
        if len(instance) < schema.get("minLength", 0) or len(instance) > schema.get("maxLength", 1 << 30):
            errs.append(f"{path}: length of {instance!r}")
    bounds = (schema.get("minimum", -(1 << 62)), schema.get("maximum", 1 << 62))
    if isinstance(instance, int) and not isinstance(instance, bool) and not bounds[0] <= instance <= bounds[1]:
        errs.append(f"{path}: {instance} out of bounds")
    if isinstance(instance, dict):
        props = schema.get("properties", {})
        errs += [f"{path}/{k}: required" for k in schema.get("required", []) if k not in instance]
        for k, v in instance.items():
            if k in props:
                errs += _check_schema(v, props[k], f"{path}/{k}")
            elif schema.get("additionalProperties") is False:
                errs.append(f"{path}/{k}: not allowed")
            elif isinstance(schema.get("additionalProperties"), dict):
                errs += _check_schema(v, schema["additionalProperties"], f"{path}/{k}")
    if isinstance(instance, list):
        if len(instance) < schema.get("minItems", 0):
            errs.append(f"{path}: fewer than {schema['minItems']} items")
        for i, v in enumerate(instance):
            errs += _check_schema(v, schema.get("items", {}), f"{path}/{i}")
    return errs


def _schema_errors(values: Any) -> list[str]:
    schema = json.loads((CHART / "values.schema.json").read_text())
    try:
        import jsonschema  # type: ignore[import-untyped]
    except ImportError:
        return _check_schema(values, schema)
    return [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(values)]


def test_chart_values_validate_against_schema() -> None:
    assert _schema_errors(_values()) == []
    bad = _values()
    bad["engine"] = "gpu"
    bad["racks"][0]["name"] = "Rack_0"
    bad["gateway"]["jwtSecret"] = {"name": "x"}
    bad["surprise"] = 1
    assert len(_schema_errors(bad)) >= 4


def test_chart_racks_render_a_valid_config() -> None:
    """The ConfigMap is .Values.config with cluster.racks = .Values.racks (rackflow.configYaml in _helpers.tpl)."""
    values = _values()
    assert 'set $cfg "cluster" (dict "racks" .Values.racks)' in _templates()["_helpers.tpl"]
    over = {**values["config"], "cluster": {"racks": values["racks"]}}
    raw = raw_config()
    raw["cluster"] = over["cluster"]
    cfg = parse_config(raw)
    assert cfg.rack_names() == RACKS and [n.name for n in cfg.nodes()] == NODES
    with pytest.raises(ConfigError):  # a rack the config rejects is rejected at pod start, not silently
        raw["cluster"] = {"racks": [{"name": "r0", "node_count": 1, "node": {"gpu": "nope", "models": ["qwen2-7b"]}}]}
        parse_config(raw)


def _eval_item(expr: str, values: dict[str, Any], rack: str) -> str:
    """The few template forms the chart's `args:` items use, evaluated with values.yaml and rack `rack`."""

    def val(token: str) -> Any:
        token = token.removeprefix("$")
        if token.startswith(".Values."):
            node: Any = values
            for part in token.removeprefix(".Values.").split("."):
                node = node[part]
            return node
        if token == "rack.name":
            return rack
        if token == "agentSource":
            return "sim"
        if token.startswith(".Release.") or token.startswith("name"):
            return "rf"
        raise AssertionError(f"unknown template value {token}")

    def ev(m: re.Match[str]) -> str:
        body = m.group(1).strip().removesuffix("| quote").strip()
        if body.startswith("printf"):
            fmt, arg = re.fullmatch(r'printf\s+"([^"]*)"\s+(\S+)', body).groups()  # type: ignore[union-attr]
            return fmt.replace("%s", str(val(arg)))
        if body.startswith("add "):
            _, a, b = body.split()
            return str(int(val(a)) + int(b))
        return str(val(body))

    return re.sub(r"{{-?\s*(.*?)\s*-?}}", ev, expr).strip().strip('"')


def _chart_argvs() -> list[tuple[str, list[str]]]:
    """Every `args:` list of a rackflow container in the templates, as argv (global args expanded, `if` blocks
    taken), with $(POD_INDEX) = 0."""
    values = _values()
    out = []
    for name, text in _templates().items():
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.strip() != "args:" or name in ("etcd.yaml", "valkey.yaml", "flower.yaml"):
                continue
            indent = len(line) - len(line.lstrip())
            argv: list[str] = []
            for item in lines[i + 1:]:
                s = item.strip()
                if len(item) - len(item.lstrip()) <= indent and s:
                    break
                if 'include "rackflow.globalArgs"' in s:
                    argv += ["--config", "/etc/rackflow/rackflow.yaml"]
                elif s.startswith("- "):
                    argv.append(_eval_item(s[2:], values, RACKS[0]).replace("$(POD_INDEX)", "0"))
            out.append((f"{name}:{i + 1}", argv))
    return out


def test_chart_rackflow_commands_parse() -> None:
    argvs = _chart_argvs()
    fns = {}
    for where, argv in argvs:
        ns = _parse_rackflow(argv, where)
        fns[ns.fn.__name__] = ns
        assert ns.config == ["/etc/rackflow/rackflow.yaml"], where
    assert set(fns) == {"cmd_gateway", "cmd_router", "cmd_batcher", "cmd_worker", "cmd_agent", "cmd_monitor",
                        "cmd_celery_worker"}
    assert fns["cmd_worker"].node == f"{RACKS[0]}-n0" and fns["cmd_agent"].node == f"{RACKS[0]}-n0"
    assert fns["cmd_batcher"].rack == RACKS[0]
    assert fns["cmd_gateway"].host == "0.0.0.0"


def test_chart_gateway_probes_and_worker_node_ids() -> None:
    t = _templates()
    gw = t["gateway.yaml"]
    assert gw.count("path: /healthz") == 2 and "readinessProbe" in gw and "livenessProbe" in gw
    w = t["worker.yaml"]
    assert "kind: StatefulSet" in w and "replicas: {{ $rack.node_count }}" in w
    assert "metadata.labels['apps.kubernetes.io/pod-index']" in w
    assert "$.Values.gpu.resourceName" in w


def test_chart_flower_and_etcd_urls() -> None:
    t = _templates()
    assert 'exec celery --broker "${RACKFLOW_CELERY_BROKER_URL:-$RACKFLOW_REDIS_URL}" -A workers.control.app' in (
        t["flower.yaml"])
    assert '{{- join "," $urls -}}' in t["_helpers.tpl"]
    pattern = json.loads((CHART / "values.schema.json").read_text())["properties"]["etcd"]["properties"]["url"]
    for ok in ("http://e0:2379", "http://e0:2379,http://e1:2379,http://e2:2379"):
        assert re.search(pattern["pattern"], ok) and parse_etcd_urls(ok)
    assert not re.search(pattern["pattern"], "https://e0:2379")


def test_chart_secrets_only_by_reference() -> None:
    for name, text in _templates().items():
        assert not re.search(r"^kind:\s*Secret\b", text, re.M), f"{name} creates a Secret"
        for block in re.findall(r"secretKeyRef:\s*\n\s*name: (.*)\n\s*key: (.*)", text):
            assert all(".Values." in part for part in block), f"{name}: secretKeyRef with literal {block}"


# -- Valkey ACL users ----------------------------------------------------------------------------------------------
def test_valkey_acl_example_has_one_user_per_role_and_no_password() -> None:
    users = {}
    for line in (DEPLOY / "valkey" / "users.acl.example").read_text().splitlines():
        if line.startswith("user "):
            parts = line.split()
            users[parts[1]] = parts[2:]
    assert set(users) == {f"rf-{r}" for r in ("router", "batcher", "worker", "agent", "monitor", "gateway", "celery",
                                              "flower", "ops")}
    for name, rules in users.items():
        assert rules[:2] == ["on", "#SHA256"], f"{name}: the password must stay a placeholder"
        assert not any(r.startswith(">") for r in rules), name
        assert "-@all" in rules and any(r.startswith("~") for r in rules), name
        assert "~*" not in rules and "+@all" not in rules and "+@dangerous" not in rules, name
    # each consumer role may touch its own stream
    own = {"rf-router": "rf:ingress", "rf-batcher": "rf:rack:*", "rf-worker": "rf:node:*", "rf-monitor": "rf:health"}
    for name, pattern in own.items():
        assert f"~{pattern}" in users[name] and "+xreadgroup" in users[name], name


# -- Dockerfile and secrets ----------------------------------------------------------------------------------------
def test_dockerfile() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert re.search(r"^ARG BASE=python:3\.11-slim", text, re.M) and re.search(r"^FROM \$\{BASE\}", text, re.M)
    assert re.search(r'^ARG EXTRAS=""', text, re.M)
    assert re.search(r'^ENTRYPOINT \["rackflow"\]$', text, re.M)
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    for src in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (REPO / src).exists(), f"Dockerfile copies missing {src}"
    assert 'pip install -e ".${EXTRAS:+[${EXTRAS}]}"' in text
    extras = set(re.findall(r"^(\w+) = \[", (REPO / "pyproject.toml").read_text().split(
        "[project.optional-dependencies]")[1].split("[project.scripts]")[0], re.M))
    assert {"torch", "vllm"} <= extras


SECRET_PATTERNS = [
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"(?:JWT_SECRET|PASSWORD|BASIC_AUTH|requirepass)\s*[:=]\s*(?![\s\"']*(?:\$|$|\{\{))[\"']?\w", re.I),
    re.compile(r"redis[s]?://[^:@/\s]*:(?!\$)[^@/\s]+@"),
]


def test_no_secret_literals_in_deploy_files() -> None:
    """Neither the deployment files nor the shipped configs (configs/) hold a secret: they name where one comes
    from (an environment variable, a Kubernetes Secret)."""
    files = [p for p in DEPLOY.rglob("*") if p.is_file() and "grafana" not in p.relative_to(DEPLOY).parts[:1]]
    configs = [p for p in (REPO / "configs").rglob("*") if p.is_file()]
    assert len(files) > 20 and len(configs) >= 4
    files += configs
    for p in files:
        text = p.read_text(encoding="utf-8")
        for line in text.splitlines():
            if line.lstrip().startswith("#"):
                continue
            line = re.sub(r"\$\{[^}]*\}", "${}", line)  # compose interpolations (their error texts included)
            for pat in SECRET_PATTERNS:
                assert not pat.search(line), f"{p.relative_to(REPO)}: looks like a secret: {line.strip()}"
    env = _compose()["services"]["gateway"]["environment"]
    assert env["RACKFLOW_JWT_SECRET"].startswith("${RACKFLOW_JWT_SECRET:?")
