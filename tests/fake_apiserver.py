"""An HTTP server on loopback that answers the Kubernetes API requests tunepack's SDK sends.

NOT a cluster: it stores objects in memory, records every request, and answers create/get/list/
delete/apply of TrainJobs, (Cluster)TrainingRuntimes and Katib's Experiments and Trials, plus
namespace reads and pod list/log reads, the way the API server does (status codes, Status bodies
on errors). Tests play the controller by adding pods and
status to the store.

Like the API server it also keeps ``resourceVersion`` (bumped only when an object changes), holds
an object with ``finalizers`` in deletion (``deletionTimestamp``) until ``finalize`` releases it,
and refuses an apply that changes one of ``IMMUTABLE``'s runtime fields with 422 "Value is
immutable", as the runtime CRDs' ``self == oldSelf`` rules do. ``fail`` makes a request answer an
error; ``after`` callbacks run after each answer (to change the store between two requests).
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
KATIB_PATH = "/apis/kubeflow.org/v1beta1"
RUNTIME_PLURALS = ("clustertrainingruntimes", "trainingruntimes")
# Runtime fields the CRDs declare immutable (a few of them: the JobSet spec's).
IMMUTABLE = (
    ("spec", "template", "spec", "failurePolicy"),
    ("spec", "template", "spec", "successPolicy"),
    ("spec", "template", "spec", "volumeClaimPolicies"),
)
ALL_NAMESPACES = "*"
ROUTES = [
    (re.compile(rf"^{GROUP_PATH}/(clustertrainingruntimes)(?:/([^/]+))?$"), None),
    (re.compile(rf"^{GROUP_PATH}/(trainjobs)$"), ALL_NAMESPACES),
    (
        re.compile(rf"^{GROUP_PATH}/namespaces/([^/]+)/(trainingruntimes|trainjobs)(?:/([^/]+))?$"),
        "ns",
    ),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/(pods)(?:/([^/]+))?(/log)?$"), "core"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/(configmaps)/([^/]+)$"), "core"),
    (re.compile(r"^/api/v1/(namespaces)/([^/]+)$"), None),
    # Katib's kinds (tunepack.OptimizerClient on a cluster)
    (re.compile(rf"^{KATIB_PATH}/namespaces/([^/]+)/(experiments|trials)(?:/([^/]+))?$"), "ns"),
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
    fail: dict = field(default_factory=dict)  # (method, path) -> (code, message), every time
    after: list = field(default_factory=list)  # callables(request), run after each answer
    resource_version: int = 0

    def finalize(self, plural: str, namespace: str | None, name: str) -> None:
        """What the finalizers' owners do when they let go: the object goes if it is deleted."""
        obj = self.objects[(plural, namespace, name)]
        obj["metadata"].pop("finalizers", None)
        if obj["metadata"].get("deletionTimestamp"):
            del self.objects[(plural, namespace, name)]

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
                for callback in server.after:
                    callback(req)
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
        if (req.method, req.path) in self.fail:
            return _status(*self.fail[(req.method, req.path)])
        for pattern, scope in ROUTES:
            m = pattern.match(req.path)
            if not m:
                continue
            if scope is None:
                namespace, plural, name = None, m.group(1), m.group(2)
            elif scope == ALL_NAMESPACES:
                namespace, plural, name = ALL_NAMESPACES, m.group(1), None
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
                for (p, ns, _), o in sorted(self.objects.items(), key=lambda kv: str(kv[0]))
                if p == plural and (ns == namespace or namespace == ALL_NAMESPACES)
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
            self.objects[key] = self._created(obj, namespace)
            return 201, self.objects[key]
        if req.method == "PATCH":
            if req.content_type != "application/apply-patch+yaml":
                return _status(415, f"unsupported patch type {req.content_type}")
            if "fieldManager" not in req.query:
                return _status(422, "fieldManager is required for apply requests")
            old = self.objects.get(key)
            if old is None:
                self.objects[key] = self._created(req.body, namespace)
                return 201, self.objects[key]
            new = json.loads(json.dumps(req.body))
            if plural in RUNTIME_PLURALS:
                for path in IMMUTABLE:
                    if _get(old, path) != _get(new, path):
                        return _status(
                            422,
                            f'{old["kind"]}.trainer.kubeflow.org "{name}" is invalid: '
                            f'{".".join(path)}: Invalid value: "object": Value is immutable',
                        )
            server_meta = {
                k: v
                for k, v in old["metadata"].items()
                if k
                in (
                    "namespace",
                    "uid",
                    "creationTimestamp",
                    "resourceVersion",
                    "finalizers",
                    "deletionTimestamp",
                )
            }
            new["metadata"] = {**new.get("metadata", {}), **server_meta}
            if {k: v for k, v in new.items() if k != "status"} != {
                k: v for k, v in old.items() if k != "status"
            }:
                new["metadata"]["resourceVersion"] = self._next_version()
            if "status" in old:
                new["status"] = old["status"]
            self.objects[key] = new
            return 200, new
        if req.method == "DELETE":
            obj = self.objects.get(key)
            if obj is None:
                return _status(404, f'{plural} "{name}" not found')
            uid = ((req.body or {}).get("preconditions") or {}).get("uid")
            if uid and uid != obj["metadata"].get("uid"):
                return _status(409, f"Precondition failed: UID in precondition: {uid}")
            if obj["metadata"].get("finalizers"):
                obj["metadata"].setdefault("deletionTimestamp", _now())
                return 200, obj
            del self.objects[key]
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        return _status(405, "method not allowed")

    def _next_version(self) -> str:
        self.resource_version += 1
        return str(self.resource_version)

    def _created(self, obj: dict, namespace: str | None) -> dict:
        obj = json.loads(json.dumps(obj))
        meta = obj.setdefault("metadata", {})
        if namespace:
            meta["namespace"] = namespace
        meta.setdefault("creationTimestamp", _now())
        meta.setdefault("uid", f"uid-{meta['name']}-{self.resource_version + 1}")
        meta["resourceVersion"] = self._next_version()
        return obj


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _get(obj, path: tuple[str, ...]):
    for part in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
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
    reason = {
        403: "Forbidden",
        404: "NotFound",
        409: "AlreadyExists",
        415: "UnsupportedMediaType",
    }.get(code, "Invalid")
    return code, {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
