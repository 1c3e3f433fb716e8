"""An HTTP server on loopback that answers the Kubernetes API requests tunepack's SDK sends.

NOT a cluster: it stores objects in memory, records every request, and answers create/get/list/
delete/apply of TrainJobs and (Cluster)TrainingRuntimes plus pod list/log reads the way the API
server does (status codes, Status bodies on errors). Tests play the controller by adding pods and
status to the store.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

GROUP_PATH = "/apis/trainer.kubeflow.org/v1alpha1"
ROUTES = [
    (re.compile(rf"^{GROUP_PATH}/(clustertrainingruntimes)(?:/([^/]+))?$"), None),
    (
        re.compile(rf"^{GROUP_PATH}/namespaces/([^/]+)/(trainingruntimes|trainjobs)(?:/([^/]+))?$"),
        "ns",
    ),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/(pods)(?:/([^/]+))?(/log)?$"), "core"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/(configmaps)/([^/]+)$"), "core"),
]


@dataclass
class Request:
    method: str
    path: str
    query: dict
    content_type: str | None
    body: object


@dataclass
class FakeApiServer:
    objects: dict = field(default_factory=dict)  # (plural, namespace, name) -> object
    logs: dict = field(default_factory=dict)  # (namespace, pod, container) -> text
    requests: list = field(default_factory=list)

    def start(self) -> str:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _handle(self):
                parts = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                req = Request(
                    self.command,
                    parts.path,
                    parse_qs(parts.query),
                    self.headers.get("Content-Type"),
                    body,
                )
                server.requests.append(req)
                code, payload = server.answer(req)
                data = (
                    payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                )
                self.send_response(code)
                ctype = "text/plain" if isinstance(payload, str) else "application/json"
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = do_PATCH = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # --- the API -----------------------------------------------------------------------------

    def answer(self, req: Request):
        for pattern, scope in ROUTES:
            m = pattern.match(req.path)
            if not m:
                continue
            if scope is None:
                namespace, plural, name = None, m.group(1), m.group(2)
            else:
                namespace, plural, name = m.group(1), m.group(2), m.group(3)
            if plural == "pods" and m.group(4):
                key = (namespace, name, req.query.get("container", [""])[0])
                if key not in self.logs:
                    return _status(404, f'pods "{name}" not found')
                return 200, self.logs[key]
            return self._crud(req, plural, namespace, name)
        return _status(404, "the server could not find the requested resource")

    def _crud(self, req, plural, namespace, name):
        key = (plural, namespace, name)
        if req.method == "GET" and name:
            obj = self.objects.get(key)
            return (200, obj) if obj else _status(404, f'{plural} "{name}" not found')
        if req.method == "GET":
            items = [
                o
                for (p, ns, _), o in sorted(self.objects.items())
                if p == plural and ns == namespace
            ]
            selector = req.query.get("labelSelector", [""])[0]
            items = [o for o in items if _matches(o, selector)]
            return 200, {"apiVersion": "v1", "kind": "List", "metadata": {}, "items": items}
        if req.method == "POST":
            obj = req.body
            name = obj["metadata"]["name"]
            key = (plural, namespace, name)
            if key in self.objects:
                return _status(409, f'{plural} "{name}" already exists')
            self.objects[key] = _created(obj, namespace)
            return 201, self.objects[key]
        if req.method == "PATCH":
            if req.content_type != "application/apply-patch+yaml":
                return _status(415, f"unsupported patch type {req.content_type}")
            if "fieldManager" not in req.query:
                return _status(422, "fieldManager is required for apply requests")
            existed = key in self.objects
            self.objects[key] = _created(req.body, namespace)
            return (200 if existed else 201), self.objects[key]
        if req.method == "DELETE":
            if key not in self.objects:
                return _status(404, f'{plural} "{name}" not found')
            del self.objects[key]
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        return _status(405, "method not allowed")


def _created(obj: dict, namespace: str | None) -> dict:
    obj = json.loads(json.dumps(obj))
    meta = obj.setdefault("metadata", {})
    if namespace:
        meta["namespace"] = namespace
    meta.setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    meta.setdefault("uid", f"uid-{meta['name']}")
    return obj


def _matches(obj: dict, selector: str) -> bool:
    """Label selectors as the SDK writes them: ``k=v`` and ``k in (a, b)`` terms."""
    labels = obj.get("metadata", {}).get("labels", {})
    for term in re.split(r",(?![^()]*\))", selector) if selector else []:
        term = term.strip()
        if m := re.match(r"^(\S+)\s+in\s+\((.*)\)$", term):
            if labels.get(m.group(1)) not in [v.strip() for v in m.group(2).split(",")]:
                return False
        elif "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k) != v:
                return False
    return True


def _status(code: int, message: str):
    reason = {404: "NotFound", 409: "AlreadyExists", 415: "UnsupportedMediaType"}.get(
        code, "Invalid"
    )
    return code, {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
