"""The pure parts of the pod executor (tests/controlplane/executor.py): Pod spec in, plans out.

Everything here works on Pods as the API serves them (plain JSON dicts, camelCase keys) and
needs neither a cluster nor a process: environment resolution and ``$(VAR)`` expansion with the
kubelet's rules, the user a container runs as, the volume and mount plan, the hosts file, and the
status fields the executor writes. The executor does the I/O around them.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal

HOSTS_HEADER = (
    "# Kubernetes-managed hosts file (tunepack pod executor: every pod is 127.0.0.1).\n"
    "127.0.0.1\tlocalhost\n"
    "::1\tlocalhost ip6-localhost ip6-loopback\n"
)
MESSAGE_MAX_BYTES = 4000  # under the 4 KiB the brief allows; the kubelet keeps 2048 or 80 lines
MESSAGE_MAX_LINES = 80


class ConfigError(Exception):
    """The container cannot start as specified (the kubelet's CreateContainerConfigError).

    ``retriable`` errors name an object that may appear later (a Secret, a ConfigMap, a key)."""

    def __init__(self, message: str, *, retriable: bool = False):
        super().__init__(message)
        self.retriable = retriable


# ---------------------------------------------------------------------------------------------
# $(VAR) expansion: the kubelet's third_party/forked/golang/expansion rules.
#   $(VAR)  -> the value if VAR is defined, else left as "$(VAR)"
#   $$      -> "$"   (so "$$(VAR)" is the literal "$(VAR)")
#   $x      -> "$x"  (any other character after "$" is kept, as is a trailing "$")
#   "$(" without a closing ")" is kept as written.
def expand(text: str, mapping: Mapping[str, str]) -> str:
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    n = len(text)
    while cursor < n:
        if text[cursor] == "$" and cursor + 1 < n:
            out.append(text[checkpoint:cursor])
            nxt = text[cursor + 1]
            if nxt == "$":
                out.append("$")
                advance = 1
            elif nxt == "(":
                close = text.find(")", cursor + 2)
                if close == -1:
                    out.append("$(")
                    advance = 1
                else:
                    name = text[cursor + 2 : close]
                    out.append(mapping[name] if name in mapping else f"$({name})")
                    advance = close - cursor
            else:
                out.append("$" + nxt)
                advance = 1
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    out.append(text[checkpoint:])
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Downward API and resources
_SUBSCRIPT = re.compile(r"^metadata\.(labels|annotations)\['(.*)'\]$")


def field_ref(pod: dict, path: str) -> str:
    """The value of a ``fieldRef.fieldPath`` for env (the subset the kubelet supports)."""
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    m = _SUBSCRIPT.match(path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": "127.0.0.1",
        "status.podIPs": "127.0.0.1",
        "status.hostIP": "127.0.0.1",
        "status.hostIPs": "127.0.0.1",
    }
    if path not in simple:
        raise ConfigError(f"unsupported fieldRef fieldPath {path!r}")
    return simple[path]


_SUFFIXES = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


def parse_quantity(value: str | int | float) -> Decimal:
    """A Kubernetes resource quantity ("16Gi", "500m", "1e3") as a Decimal."""
    m = _QUANTITY.match(str(value).strip())
    if not m:
        raise ConfigError(f"invalid quantity {value!r}")
    number = Decimal(m.group(1)) * (Decimal(10) ** int(m.group(2)[1:]) if m.group(2) else 1)
    return number * Decimal(_SUFFIXES[m.group(3) or ""])


NODE_ALLOCATABLE = {"cpu": "16", "memory": "64Gi", "ephemeral-storage": "100Gi", "pods": "50"}


def resource_field_ref(container: dict, ref: dict) -> str:
    """``resourceFieldRef`` as the kubelet computes it: limits default to node allocatable."""
    resource = ref.get("resource", "")
    kind, _, name = resource.partition(".")
    if kind not in ("limits", "requests") or name not in ("cpu", "memory", "ephemeral-storage"):
        raise ConfigError(f"unsupported resourceFieldRef resource {resource!r}")
    resources = container.get("resources") or {}
    value = (resources.get(kind) or {}).get(name)
    if value is None and kind == "requests":
        value = (resources.get("limits") or {}).get(name)
    if value is None:
        value = NODE_ALLOCATABLE[name] if kind == "limits" else "0"
    divisor = parse_quantity(ref.get("divisor") or "1")
    quotient = parse_quantity(value) / divisor
    return str(math.ceil(quotient))  # the kubelet rounds up


# ---------------------------------------------------------------------------------------------
# Environment
Lookup = Callable[[str, str], "dict[str, str] | None"]  # (kind, name) -> data or None (absent)


def decode_data(obj: dict, kind: str) -> dict[str, bytes]:
    """The keys of a Secret ("secret") or ConfigMap ("configMap") as bytes."""
    if kind == "secret":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return data


def resolve_env(pod: dict, container: dict, lookup: Lookup) -> dict[str, str]:
    """The environment the pod spec gives a container, as the kubelet builds it.

    The image's ENV lines are not part of it (the runtime adds them underneath, and the kubelet
    never expands ``$(NAME)`` against them). ``lookup("secret"|"configMap", name)`` returns the
    object's data decoded to str, or None when the object does not exist. envFrom comes first,
    then env in order; a ``value`` may refer to any variable defined before it with ``$(NAME)``;
    valueFrom values are not expanded.
    """
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind in ("configMapRef", "secretRef"):
            if kind in source:
                ref = source[kind]
                what = "configmap" if kind == "configMapRef" else "secret"
                data = lookup("configMap" if kind == "configMapRef" else "secret", ref["name"])
                if data is None:
                    if ref.get("optional"):
                        continue
                    raise ConfigError(f'{what} "{ref["name"]}" not found', retriable=True)
                for key, value in data.items():
                    env[prefix + key] = value
    for var in container.get("env") or []:
        name = var["name"]
        source = var.get("valueFrom")
        if source is None:
            env[name] = expand(var.get("value", ""), env)
        elif "fieldRef" in source:
            env[name] = field_ref(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            env[name] = resource_field_ref(container, source["resourceFieldRef"])
        elif "secretKeyRef" in source or "configMapKeyRef" in source:
            kind = "secret" if "secretKeyRef" in source else "configMap"
            ref = source["secretKeyRef" if kind == "secret" else "configMapKeyRef"]
            what = "secret" if kind == "secret" else "configmap"
            data = lookup(kind, ref["name"])
            if data is None or ref["key"] not in data:
                if ref.get("optional"):
                    continue
                if data is None:
                    msg = f'{what} "{ref["name"]}" not found'
                else:
                    msg = f"couldn't find key {ref['key']} in {what.capitalize()} "
                    msg += f"{pod['metadata'].get('namespace')}/{ref['name']}"
                raise ConfigError(msg, retriable=True)
            env[name] = data[ref["key"]]
        else:
            raise ConfigError(f"env {name}: unsupported valueFrom {sorted(source)}")
    return env


def expand_command(container: dict, env: Mapping[str, str]) -> list[str]:
    """command + args with $(VAR) expanded against the pod-given environment (``resolve_env``)."""
    command = list(container.get("command") or [])
    if not command:
        raise ConfigError(
            f'container "{container["name"]}" has no command: the executor runs no images, so '
            "it cannot know the image's entrypoint; set command in the pod spec"
        )
    return [expand(a, env) for a in command + list(container.get("args") or [])]


# ---------------------------------------------------------------------------------------------
# Identity
@dataclass(frozen=True)
class Identity:
    uid: int
    gid: int
    groups: tuple[int, ...]
    fs_group: int | None


def run_as_group(pod: dict, container: dict) -> int | None:
    for sc in (container.get("securityContext"), pod.get("spec", {}).get("securityContext")):
        if sc and sc.get("runAsGroup") is not None:
            return int(sc["runAsGroup"])
    return None


def identity(
    pod: dict, container: dict, image_user: tuple[int | None, int | None] = (None, None)
) -> Identity:
    """Who the container runs as: container securityContext over the pod's, then the image's
    USER (``image_user``: uid, gid; none when the container runs without an image).

    No user at all means root (uid 0); no group means gid 0 (what runc does for a uid missing from
    the image's /etc/passwd). runAsNonRoot without a non-zero user is refused, as the kubelet
    refuses it for an image that runs as root.
    """
    psc = pod.get("spec", {}).get("securityContext") or {}
    csc = container.get("securityContext") or {}

    def pick(key):
        return csc[key] if csc.get(key) is not None else psc.get(key)

    uid, gid, non_root = pick("runAsUser"), pick("runAsGroup"), pick("runAsNonRoot")
    if uid is None:
        uid = image_user[0]
        gid = gid if gid is not None else image_user[1]
    if non_root:
        if uid is None:
            raise ConfigError(
                "container has runAsNonRoot and image will run as root "
                f'(pod: "{pod["metadata"]["name"]}", container: '
                f"{container['name']})"
            )
        if int(uid) == 0:
            raise ConfigError(
                "container's runAsUser breaks non-root policy "
                f'(pod: "{pod["metadata"]["name"]}", container: '
                f"{container['name']})"
            )
    fs_group = psc.get("fsGroup")
    groups = set(psc.get("supplementalGroups") or [])
    if fs_group is not None:
        groups.add(int(fs_group))
    return Identity(
        uid=int(uid or 0),
        gid=int(gid or 0),
        groups=tuple(sorted(int(g) for g in groups)),
        fs_group=None if fs_group is None else int(fs_group),
    )


# ---------------------------------------------------------------------------------------------
# Volumes and mounts
SUPPORTED_VOLUMES = (
    "persistentVolumeClaim",
    "emptyDir",
    "secret",
    "configMap",
    "hostPath",
    "projected",  # the ServiceAccount admission plugin adds kube-api-access-* to every pod
    "downwardAPI",
)


@dataclass(frozen=True)
class Volume:
    name: str
    kind: str  # one of SUPPORTED_VOLUMES
    source: dict  # the volume's source object (e.g. {"claimName": ...})

    @property
    def memory(self) -> bool:
        return self.kind == "emptyDir" and self.source.get("medium") == "Memory"


def classify_volumes(pod: dict) -> dict[str, Volume]:
    """The pod's volumes by name; a type the executor cannot provide is a ConfigError."""
    volumes = {}
    for vol in pod.get("spec", {}).get("volumes") or []:
        kinds = [k for k in vol if k != "name"]
        kind = next((k for k in kinds if k in SUPPORTED_VOLUMES), None)
        if kind is None:
            raise ConfigError(
                f'volume "{vol["name"]}" has type {"/".join(kinds) or "none"}, which the test '
                f"pod executor does not provide (it provides {', '.join(SUPPORTED_VOLUMES)})"
            )
        volumes[vol["name"]] = Volume(vol["name"], kind, vol[kind] or {})
    return volumes


def tmpfs_size(volume: Volume) -> int | None:
    limit = volume.source.get("sizeLimit")
    return None if limit in (None, "") else int(parse_quantity(limit))


@dataclass(frozen=True)
class Mount:
    target: str  # mountPath in the container
    source: str | None  # host path to bind; None for a tmpfs
    read_only: bool = False
    tmpfs_bytes: int | None = None
    is_file: bool = False  # a file bind (subPath onto a file, /etc/hosts)


def mount_plan(
    container: dict,
    volumes: Mapping[str, Volume],
    dirs: Mapping[str, str],
    env: Mapping[str, str] | None = None,
) -> list[Mount]:
    """The mounts of one container, parents before children. ``dirs`` maps a volume name to its
    host directory (tmpfs volumes have none); ``env`` expands ``subPathExpr``."""
    mounts = []
    for vm in container.get("volumeMounts") or []:
        name, target = vm["name"], vm["mountPath"]
        if name not in volumes:
            raise ConfigError(f'volumeMount "{name}" names no volume of the pod')
        if not target.startswith("/"):
            raise ConfigError(f'mountPath "{target}" is not absolute')
        vol = volumes[name]
        read_only = bool(vm.get("readOnly")) or vol.kind in FILE_VOLUMES
        sub = vm.get("subPath") or expand(vm.get("subPathExpr") or "", env or {})
        if vol.memory:
            if sub:
                raise ConfigError(f'subPath on the Memory emptyDir "{name}" is not supported')
            mounts.append(Mount(target, None, read_only, tmpfs_bytes=tmpfs_size(vol) or 0))
            continue
        if sub and (sub.startswith("/") or ".." in sub.split("/")):
            raise ConfigError(f'subPath "{sub}" must be a relative path without ".."')
        source = dirs[name].rstrip("/") + ("/" + sub if sub else "")
        mounts.append(Mount(target, source, read_only))
    return sorted(mounts, key=lambda m: m.target.rstrip("/").count("/"))


def projection_files(
    data: Mapping[str, bytes], source: dict, kind: str, name: str
) -> list[tuple[str, bytes, int]]:
    """Files (relative path, content, mode) of a secret/configMap volume, ``items`` honoured."""
    default_mode = source.get("defaultMode", 0o644)
    items = source.get("items")
    if not items:
        return [(k, v, default_mode) for k, v in sorted(data.items())]
    files = []
    for item in items:
        if item["key"] not in data:
            if source.get("optional"):
                continue
            raise ConfigError(f'{kind} "{name}": key "{item["key"]}" not found', retriable=True)
        path = item["path"]
        if path.startswith("/") or ".." in path.split("/"):
            raise ConfigError(f'{kind} "{name}": item path "{path}" is not relative')
        files.append((path, data[item["key"]], item.get("mode", default_mode)))
    return files


FILE_VOLUMES = ("secret", "configMap", "projected", "downwardAPI")  # files the executor writes


def downward_files(pod: dict, items: list[dict], default_mode: int) -> list[tuple[str, bytes, int]]:
    """Files of a downwardAPI volume (or projection): fieldRef values; whole label and
    annotation maps as ``key="value"`` lines, as the kubelet writes them."""
    files = []
    for item in items or []:
        if "fieldRef" not in item:
            raise ConfigError(f'downwardAPI item "{item.get("path")}": only fieldRef is supported')
        path = item["fieldRef"]["fieldPath"]
        if path in ("metadata.labels", "metadata.annotations"):
            values = pod["metadata"].get(path.split(".")[1]) or {}
            text = "\n".join(f"{k}={json.dumps(v)}" for k, v in sorted(values.items()))
        else:
            text = field_ref(pod, path)
        files.append((item["path"], text.encode(), item.get("mode", default_mode)))
    return files


def projected_files(
    pod: dict,
    source: dict,
    lookup: Callable[[str, str], dict[str, bytes] | None],
    token: Callable[[str | None, int], str],
) -> list[tuple[str, bytes, int]]:
    """Files of a projected volume: ``lookup(kind, name)`` gives a Secret's or ConfigMap's data
    (None when absent), ``token(audience, expirationSeconds)`` a service account token."""
    mode = source.get("defaultMode", 0o644)
    files = []
    for src in source.get("sources") or []:
        if "serviceAccountToken" in src:
            t = src["serviceAccountToken"]
            value = token(t.get("audience"), int(t.get("expirationSeconds") or 3600))
            files.append((t["path"], value.encode(), mode))
        elif "configMap" in src or "secret" in src:
            kind = "configMap" if "configMap" in src else "secret"
            ref = src[kind]
            data = lookup(kind, ref.get("name", ""))
            if data is None:
                if ref.get("optional"):
                    continue
                what = "configmap" if kind == "configMap" else "secret"
                raise ConfigError(f'{what} "{ref.get("name")}" not found', retriable=True)
            files += projection_files(data, {**ref, "defaultMode": mode}, kind, ref.get("name"))
        elif "downwardAPI" in src:
            files += downward_files(pod, src["downwardAPI"].get("items"), mode)
        else:
            raise ConfigError(f"unsupported projected volume source {sorted(src)}")
    return files


# ---------------------------------------------------------------------------------------------
# Names and hosts
def pod_hostname(pod: dict) -> str:
    """The container's hostname: spec.hostname, else the pod name (63 characters at most)."""
    return (pod["spec"].get("hostname") or pod["metadata"]["name"])[:63].rstrip("-.")


def host_names(hostname: str, subdomain: str | None, namespace: str) -> list[str]:
    if not subdomain:
        return [hostname]
    fqdn = f"{hostname}.{subdomain}.{namespace}.svc"
    return [hostname, f"{hostname}.{subdomain}", fqdn, f"{fqdn}.cluster.local"]


def hosts_file(
    own: tuple[str, str | None, str],
    peers: Iterable[tuple[str, str | None, str]],
    services: Iterable[str] = (),
):
    """The hosts file of one pod: ``own`` and ``peers`` are (hostname, subdomain, namespace).

    Peers count only when they share the pod's namespace and (non-empty) subdomain, as the
    headless Service of a JobSet would make their names resolvable. ``services`` are the DNS
    names of the cluster's ClusterIP Services (``service_names``): each is 127.0.0.1 too, where
    the servers of this tier listen."""
    lines = [HOSTS_HEADER]
    lines += [f"127.0.0.1\t{name}\n" for name in services]
    seen = set()
    hostname, subdomain, namespace = own
    for entry in [own, *sorted(p for p in peers if p != own)]:
        if entry != own and not (subdomain and entry[1:] == (subdomain, namespace)):
            continue
        if entry in seen:
            continue
        seen.add(entry)
        lines.append("127.0.0.1\t" + " ".join(host_names(*entry)) + "\n")
    return "".join(lines)


def service_names(services: Iterable[dict]) -> list[str]:
    """The cluster DNS names of the ClusterIP Services among ``services`` (API objects):
    ``<name>.<namespace>.svc`` and the same under ``.cluster.local``. Headless Services (a
    JobSet's) are left out: their pods' own names are the peers' entries."""
    names = []
    for svc in services:
        if (svc.get("spec") or {}).get("clusterIP") in (None, "", "None"):
            continue
        fqdn = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc"
        names += [fqdn, f"{fqdn}.cluster.local"]
    return sorted(names)


# ---------------------------------------------------------------------------------------------
# Status
def restarts(policy: str, exit_code: int) -> bool:
    """Whether the kubelet restarts a container that exited with ``exit_code``."""
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)


def tail_message(text: str) -> str:
    """The last lines of a container's output, as a termination message (FallbackToLogs)."""
    lines = text.splitlines()[-MESSAGE_MAX_LINES:]
    message = "\n".join(lines)
    raw = message.encode()
    if len(raw) > MESSAGE_MAX_BYTES:
        message = raw[-MESSAGE_MAX_BYTES:].decode(errors="replace")
    return message


@dataclass
class ContainerState:
    """What the executor knows of one container; ``status()`` is its API ContainerStatus."""

    name: str
    image: str
    waiting: tuple[str, str] | None = ("ContainerCreating", "")  # (reason, message)
    started_at: str | None = None
    finished_at: str | None = None
    exit_code: int | None = None
    reason: str = ""
    message: str = ""
    pid: int | None = None
    restart_count: int = 0
    last: dict | None = field(default=None)  # lastState.terminated
    image_id: str | None = None  # the image it ran from (--images), as the kubelet reports it
    runtime: str = "executor"  # containerID's scheme: runc when it ran from its image

    @property
    def running(self) -> bool:
        return self.started_at is not None and self.exit_code is None and self.waiting is None

    @property
    def terminated(self) -> bool:
        return self.exit_code is not None and self.waiting is None

    def terminate(self, exit_code: int, reason: str, message: str, at: str):
        self.exit_code, self.reason, self.message = exit_code, reason, message
        self.finished_at = at
        self.started_at = self.started_at or at
        self.waiting = None

    def status(self) -> dict:
        container_id = f"{self.runtime}://{self.pid}" if self.pid else None
        if self.waiting is not None:
            state = {
                "waiting": {"reason": self.waiting[0], "message": self.waiting[1] or None},
                "running": None,
                "terminated": None,
            }
        elif self.exit_code is None:
            state = {"running": {"startedAt": self.started_at}, "waiting": None, "terminated": None}
        else:
            term = {
                "exitCode": self.exit_code,
                "reason": self.reason,
                "startedAt": self.started_at,
                "finishedAt": self.finished_at,
                "containerID": container_id,
            }
            if self.message:
                term["message"] = self.message
            state = {"terminated": term, "waiting": None, "running": None}
        return {
            "name": self.name,
            "image": self.image,
            "imageID": self.image_id or f"executor://{self.image}",
            "containerID": container_id,
            "state": state,
            "lastState": {"terminated": self.last} if self.last else {},
            "ready": self.running,
            "started": self.running,
            "restartCount": self.restart_count,
        }


def pod_phase(init: list[ContainerState], main: list[ContainerState], policy: str) -> str:
    """The pod phase from its containers (no restarts pending)."""
    if any(c.terminated and c.exit_code != 0 for c in init) and policy == "Never":
        return "Failed"
    if not all(c.terminated and c.exit_code == 0 for c in init):
        return "Pending"
    if main and all(c.terminated for c in main):
        if all(c.exit_code == 0 for c in main):
            return "Succeeded"
        return "Failed" if policy != "Always" else "Running"
    if all(c.started_at is not None for c in main):
        return "Running"
    return "Pending"
