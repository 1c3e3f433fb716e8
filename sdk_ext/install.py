"""Server-side apply of tunepack's runtimes, as ``kubectl apply --server-side`` does it.

Each object is sent as ``PATCH`` with ``Content-Type: application/apply-patch+yaml``,
``fieldManager=tunepack`` and ``force=true`` (tunepack owns these objects' fields), through the
``kubernetes`` client, so it works from a notebook or CI without kubectl.
"""

from __future__ import annotations

from kubernetes import client

from tunepack.runtimes import catalog
from tunepack.runtimes.generate import API_GROUP, load_runtime

FIELD_MANAGER = "tunepack"
PLURALS = {
    "ClusterTrainingRuntime": "clustertrainingruntimes",
    "TrainingRuntime": "trainingruntimes",
}


def runtime_objects(names: list[str] | None = None, namespace: str | None = None) -> list[dict]:
    """The generated runtimes (all, or ``names``); namespace-scoped TrainingRuntimes when
    ``namespace`` is given."""
    entries = [catalog.get(n) for n in names] if names else list(catalog.CATALOG.values())
    objects = []
    for entry in entries:
        obj = load_runtime(entry.runtime_name)
        if namespace:
            obj["kind"] = "TrainingRuntime"
            obj["metadata"]["namespace"] = namespace
        objects.append(obj)
    return objects


def apply(api_client: client.ApiClient, obj: dict) -> dict:
    """Server-side apply one trainer.kubeflow.org object; returns the server's answer."""
    group, version = obj["apiVersion"].split("/")
    if group != API_GROUP:
        raise ValueError(f"apply() handles {API_GROUP} objects, got {obj['apiVersion']}")
    plural = PLURALS[obj["kind"]]
    name = obj["metadata"]["name"]
    namespace = obj["metadata"].get("namespace")
    path = f"/apis/{group}/{version}"
    path += f"/namespaces/{namespace}/{plural}/{name}" if namespace else f"/{plural}/{name}"
    return api_client.call_api(
        path,
        "PATCH",
        query_params=[("fieldManager", FIELD_MANAGER), ("force", "true")],
        header_params={
            "Content-Type": "application/apply-patch+yaml",  # JSON is YAML: the body is JSON
            "Accept": "application/json",
        },
        body=obj,
        response_type="object",
        auth_settings=["BearerToken"],
        _return_http_data_only=True,
    )
