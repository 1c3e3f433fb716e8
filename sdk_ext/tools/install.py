"""Install tunepack's runtimes (and, cluster-wide, the admission policy) by server-side apply.

``PATCH`` as ``application/apply-patch+yaml`` (``fieldManager=tunepack``, ``force=true``) through
the ``kubernetes`` client, so it works from a notebook or CI without kubectl. Images checked
first, immutable fields, runtimes in use: docs/cluster.md, "Install the runtimes", "Images" and
"Upgrading installed runtimes"."""

from __future__ import annotations

import time

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tunepack.backends.api_errors import api_message
from tunepack.core.errors import RuntimeInUseError
from tunepack.runtimes import catalog
from tunepack.runtimes.contract import API_GROUP, KIND, NAMESPACED_KIND
from tunepack.runtimes.store import load_runtime
from tunepack.tools import admission
from tunepack.tools.images import ImageSource, retarget

FIELD_MANAGER = "tunepack"
PLURALS = {
    KIND: "clustertrainingruntimes",
    NAMESPACED_KIND: "trainingruntimes",
    admission.POLICY_KIND: "validatingadmissionpolicies",
    admission.BINDING_KIND: "validatingadmissionpolicybindings",
}
_GROUPS = (API_GROUP, admission.API_VERSION.split("/")[0])  # what apply() sends
CREATED, CONFIGURED, UNCHANGED, REPLACED = "created", "configured", "unchanged", "replaced"
# The API server does not serve ValidatingAdmissionPolicy (before Kubernetes 1.30): the runtimes
# are installed all the same, and the initializers check tunepack's TrainJobs (docs/cluster.md).
SKIPPED = "skipped: this cluster does not serve admissionregistration.k8s.io/v1 (Kubernetes 1.30+)"
DELETE_TIMEOUT = 60.0  # seconds install waits for a replaced runtime's delete to finish
_REQUEST_TIMEOUT = 30  # seconds per API request
_MAX_JOBS_NAMED = 10


def runtime_objects(
    names: list[str] | None = None,
    namespace: str | None = None,
    images: ImageSource | None = None,
) -> list[dict]:
    """The generated runtimes (all, or ``names``); namespace-scoped TrainingRuntimes when
    ``namespace`` is given; their images from ``images`` (``tunepack install --registry``)."""
    entries = [catalog.get(n) for n in names] if names else list(catalog.CATALOG.values())
    objects = []
    for entry in entries:
        obj = retarget(load_runtime(entry.runtime_name), images or ImageSource())
        if namespace:
            obj["kind"] = NAMESPACED_KIND
            obj["metadata"]["namespace"] = namespace
        objects.append(obj)
    return objects


def admission_objects(namespace: str | None = None) -> list[dict]:
    """The admission policy and its binding, for a cluster-wide install (none for a namespace:
    they are cluster-scoped, and a team that installs into its namespace may not create them)."""
    return [] if namespace else admission.policy_objects()


def dry_run_text(objects: list[dict]) -> str:
    """What ``tunepack install --dry-run`` prints: ``objects`` as YAML documents, as ``kubectl
    apply --dry-run=client -o yaml`` shows what it would apply (and ``kubectl apply -f -``
    takes back)."""
    from tunepack.runtimes.builder import to_yaml

    return "".join(f"---\n{to_yaml(obj)}" for obj in objects)


def describe(obj: dict) -> str:
    """How kubectl names an object in its output: ``clustertrainingruntime.<group>/<name>``."""
    group = obj["apiVersion"].split("/")[0]
    return f"{obj['kind'].lower()}.{group}/{obj['metadata']['name']}"


def install(
    api_client: client.ApiClient,
    obj: dict,
    *,
    delete_timeout: float = DELETE_TIMEOUT,
    poll_interval: float = 1.0,
) -> str:
    """Apply ``obj``, re-creating it when an immutable field changed.

    Returns what happened, in kubectl's words: ``created``, ``configured``, ``unchanged`` or
    ``replaced`` (``SKIPPED``: an admission object on a cluster without its API). Raises
    ``RuntimeInUseError`` when a runtime to re-create is not deleted within ``delete_timeout``
    seconds, and ``RuntimeError`` (caused by the API error) when the server refuses anything
    else.
    """
    current = _get(api_client, obj)
    if current is not None and current["metadata"].get("deletionTimestamp"):
        # Left terminating by an earlier replace that could not finish: wait for it once more.
        _wait_deleted(api_client, obj, delete_timeout, poll_interval)
        current = None
    try:
        answer = apply(api_client, obj)
    except ApiException as err:
        message = api_message(err) or ""
        if err.status == 404 and obj["kind"] in (admission.POLICY_KIND, admission.BINDING_KIND):
            return SKIPPED
        if current is None or err.status != 422 or "immutable" not in message.lower():
            raise _failed("apply", obj, err) from err
        _delete(api_client, obj, current["metadata"].get("uid"))
        _wait_deleted(api_client, obj, delete_timeout, poll_interval)
        try:
            apply(api_client, obj)
        except Exception as again:
            raise _failed("re-create", obj, again, " after deleting it") from again
        return REPLACED
    except Exception as err:
        raise _failed("apply", obj, err) from err
    if current is None:
        return CREATED
    before = current["metadata"].get("resourceVersion")
    return UNCHANGED if answer["metadata"].get("resourceVersion") == before else CONFIGURED


def apply(api_client: client.ApiClient, obj: dict) -> dict:
    """Server-side apply one runtime or admission object; returns the server's answer."""
    group, version = obj["apiVersion"].split("/")
    if group not in _GROUPS:
        raise ValueError(
            f"apply() handles {' and '.join(_GROUPS)} objects, got {obj['apiVersion']}"
        )
    return api_client.call_api(
        _path(obj),
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
        _request_timeout=_REQUEST_TIMEOUT,
    )


def _path(obj: dict, name: str | None = None) -> str:
    group_version = obj["apiVersion"]
    plural = PLURALS[obj["kind"]]
    namespace = obj["metadata"].get("namespace")
    path = f"/apis/{group_version}"
    path += f"/namespaces/{namespace}/{plural}" if namespace else f"/{plural}"
    return path + f"/{obj['metadata']['name'] if name is None else name}"


def _call(api_client: client.ApiClient, method: str, path: str, body=None) -> dict:
    return api_client.call_api(
        path,
        method,
        header_params={"Accept": "application/json", "Content-Type": "application/json"},
        body=body,
        response_type="object",
        auth_settings=["BearerToken"],
        _return_http_data_only=True,
        _request_timeout=_REQUEST_TIMEOUT,
    )


def _get(api_client: client.ApiClient, obj: dict) -> dict | None:
    try:
        return _call(api_client, "GET", _path(obj))
    except ApiException as err:
        if err.status == 404:
            return None
        raise _failed("read", obj, err) from err
    except Exception as err:
        raise _failed("read", obj, err) from err


def _delete(api_client: client.ApiClient, obj: dict, uid: str | None) -> None:
    # The uid precondition: never delete a runtime someone else re-created in the meantime.
    body = {"kind": "DeleteOptions", "apiVersion": "v1"}
    if uid:
        body["preconditions"] = {"uid": uid}
    try:
        _call(api_client, "DELETE", _path(obj), body)
    except ApiException as err:
        if err.status != 404:
            raise _failed("delete", obj, err, _TO_RECREATE) from err
    except Exception as err:
        raise _failed("delete", obj, err, _TO_RECREATE) from err


def _wait_deleted(api_client, obj: dict, timeout: float, poll_interval: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        current = _get(api_client, obj)
        if current is None:
            return
        if time.monotonic() >= deadline:
            raise RuntimeInUseError(_in_use_message(api_client, obj, current, timeout))
        time.sleep(poll_interval)


def _in_use_message(api_client, obj: dict, current: dict, timeout: float) -> str:
    kind, name = obj["kind"], obj["metadata"]["name"]
    finalizers = ", ".join(current["metadata"].get("finalizers") or []) or "none"
    try:
        jobs = _trainjobs_using(api_client, obj)
    except Exception as err:  # the listing is a courtesy; the error must still be reported
        users = f"the TrainJobs that use it could not be listed ({api_message(err) or err})"
    else:
        if jobs:
            shown = ", ".join(jobs[:_MAX_JOBS_NAMED])
            more = f" and {len(jobs) - _MAX_JOBS_NAMED} more" if len(jobs) > _MAX_JOBS_NAMED else ""
            users = f"it is in use by TrainJobs {shown}{more}"
        else:
            users = "no TrainJob references it now"
    return (
        f"{kind} {name} is still being deleted after {timeout:g} s (finalizers: {finalizers}); "
        f"{users}. tunepack deletes a runtime to re-create it when fields that cannot change in "
        "place (failurePolicy, volumeClaimPolicies, dependsOn, ...) differ from the installed "
        f"one; the delete finishes when the runtime is no longer in use. Run `tunepack install` "
        f"again when those TrainJobs have finished (or are deleted) to re-create {name}"
    )


def _trainjobs_using(api_client, obj: dict) -> list[str]:
    """``namespace/name`` of the TrainJobs whose runtimeRef is ``obj``."""
    group_version, kind, name = obj["apiVersion"], obj["kind"], obj["metadata"]["name"]
    namespace = obj["metadata"].get("namespace")
    path = f"/apis/{group_version}"
    path += f"/namespaces/{namespace}/trainjobs" if namespace else "/trainjobs"
    items = _call(api_client, "GET", path).get("items") or []
    out = []
    for job in items:
        ref = (job.get("spec") or {}).get("runtimeRef") or {}
        # runtimeRef.kind defaults to ClusterTrainingRuntime in the API.
        if ref.get("name") == name and ref.get("kind", KIND) == kind:
            meta = job.get("metadata") or {}
            out.append(f"{meta.get('namespace')}/{meta.get('name')}")
    return sorted(out)


_TO_RECREATE = " to re-create it (fields that cannot change in place differ)"


def _failed(action: str, obj: dict, err: BaseException, purpose: str = "") -> RuntimeError:
    where = obj["metadata"].get("namespace")
    target = f"{where}/{obj['metadata']['name']}" if where else obj["metadata"]["name"]
    reason = api_message(err)
    return RuntimeError(
        f"Failed to {action} {obj['kind']} {target}{purpose}" + (f": {reason}" if reason else "")
    )
