"""Render the rackflow chart with real Helm, offline, and write every object it would create as JSON.

There is no Kubernetes cluster on the development machine, and Helm's install action needs an API server. This
script runs a minimal fake API server on loopback (legacy discovery for the kinds the chart uses, creates echoed
back) and runs Helm's install action against it through `helm-sdkpy` (a Python binding of the Helm v4 Go library;
needs Python >= 3.12):

    python3.12 -m venv /tmp/helm312 && /tmp/helm312/bin/pip install helm-sdkpy==0.1.32
    /tmp/helm312/bin/python deploy/helm/tools/render_offline.py OUT_DIR [VALUES_JSON]

Helm renders the templates (values validated against values.schema.json), maps every kind through discovery and
"creates" the objects; each one lands in OUT_DIR as NNN-Kind-name.json (the release Secret excepted). Validate
them with e.g. `kubernetes-validate -k 1.33.0 --strict OUT_DIR/*.json` (PyPI package kubernetes-validate). Nothing
here proves that pods start: no kubelet, no scheduler, no admission webhooks.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

CHART = Path(__file__).resolve().parent.parent / "rackflow"
NAMESPACE = "rackflow"
RESOURCES = {
    "v1": [("configmaps", "ConfigMap", True), ("services", "Service", True), ("secrets", "Secret", True),
           ("pods", "Pod", True), ("namespaces", "Namespace", False), ("serviceaccounts", "ServiceAccount", True),
           ("persistentvolumeclaims", "PersistentVolumeClaim", True)],
    "apps/v1": [("deployments", "Deployment", True), ("statefulsets", "StatefulSet", True),
                ("daemonsets", "DaemonSet", True)],
    "monitoring.coreos.com/v1": [("servicemonitors", "ServiceMonitor", True), ("podmonitors", "PodMonitor", True)],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget", True)],
}


def _resource_list(gv: str) -> dict[str, Any]:
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": [
        {"name": n, "singularName": k.lower(), "namespaced": ns, "kind": k,
         "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]} for n, k, ns in RESOURCES[gv]]}


def serve(out: Path) -> ThreadingHTTPServer:
    out.mkdir(parents=True, exist_ok=True)
    store: dict[str, Any] = {}
    lock = threading.Lock()
    counter = [0]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, code: int, obj: Any) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> dict[str, Any]:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}"
            try:
                return json.loads(raw)  # type: ignore[no-any-return]
            except ValueError:  # Helm's release record goes out as protobuf: answer with a stand-in Secret
                names = re.findall(rb"sh\.helm\.release\.v1\.[A-Za-z0-9.-]+", raw)
                return {"kind": "Secret", "apiVersion": "v1",
                        "metadata": {"name": names[0].decode() if names else "release", "namespace": NAMESPACE}}

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path == "/version":
                return self._send(200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0",
                                        "platform": "linux/amd64"})
            if path == "/api":
                return self._send(200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]})
            if path == "/apis":
                groups = [{"name": gv.split("/")[0], "versions": [{"groupVersion": gv, "version": gv.split("/")[1]}],
                           "preferredVersion": {"groupVersion": gv, "version": gv.split("/")[1]}}
                          for gv in RESOURCES if gv != "v1"]
                return self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
            if path == "/api/v1":
                return self._send(200, _resource_list("v1"))
            m = re.match(r"^/apis/([^/]+)/([^/]+)$", path)
            if m and f"{m[1]}/{m[2]}" in RESOURCES:
                return self._send(200, _resource_list(f"{m[1]}/{m[2]}"))
            with lock:
                if path in store:
                    return self._send(200, store[path])
            if re.search(r"/(secrets|configmaps)$", path):  # release storage lookups
                return self._send(200, {"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                                        "items": []})
            return self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                                    "code": 404})

        def do_POST(self) -> None:
            obj = self._body()
            md = obj.setdefault("metadata", {})
            md.setdefault("resourceVersion", "1")
            with lock:
                counter[0] += 1
                md.setdefault("uid", f"00000000-0000-0000-0000-{counter[0]:012d}")
                store[self.path.split("?")[0] + "/" + md.get("name", "")] = obj
                if obj.get("kind") != "Secret":
                    (out / f"{counter[0]:03d}-{obj.get('kind')}-{md.get('name')}.json").write_text(
                        json.dumps(obj, indent=1))
            self._send(201, obj)

        def do_PUT(self) -> None:
            obj = self._body()
            with lock:
                store[self.path.split("?")[0]] = obj
            self._send(200, obj)

        def do_PATCH(self) -> None:
            with lock:
                obj = store.get(self.path.split("?")[0], {})
            self._send(200, obj)

        def do_DELETE(self) -> None:
            self._send(200, {"kind": "Status", "status": "Success"})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


async def install(port: int, values: dict[str, Any]) -> dict[str, Any]:
    from helm_sdkpy import Configuration
    from helm_sdkpy.actions import Install

    kubeconfig = (
        "apiVersion: v1\nkind: Config\n"
        f'clusters: [{{name: fake, cluster: {{server: "http://127.0.0.1:{port}"}}}}]\n'
        "users: [{name: u, user: {token: x}}]\n"
        f"contexts: [{{name: fake, context: {{cluster: fake, user: u, namespace: {NAMESPACE}}}}}]\n"
        "current-context: fake\n"
    )
    cfg = Configuration(namespace=NAMESPACE, kubeconfig=kubeconfig)
    return await Install(cfg).run("rf", str(CHART), values=values, wait=False, timeout=60)  # type: ignore[no-any-return]


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    values = json.loads(sys.argv[2]) if len(sys.argv) == 3 else {}
    server = serve(out)
    try:
        result = asyncio.run(install(server.server_address[1], values))
    finally:
        server.shutdown()
    print(f"{result.get('info', {}).get('status')}: {len(list(out.glob('*.json')))} objects in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
