"""The pod executor's pure parts (tests/controlplane/podspec.py), no cluster. Its container init,
which starts processes: tests/integration/test_executor_units.py.

The expansion cases are the kubelet's own rules (third_party/forked/golang/expansion)."""

from __future__ import annotations

import base64

import pytest

from tests.controlplane import podspec
from tests.controlplane.podspec import ConfigError, ContainerState


def pod(**spec) -> dict:
    return {
        "metadata": {
            "name": "job-node-0-0-abcde",
            "namespace": "team",
            "uid": "u-1",
            "labels": {"app": "x"},
            "annotations": {"batch.kubernetes.io/job-completion-index": "3"},
        },
        "spec": {"nodeName": "tunepack-executor", "serviceAccountName": "default", **spec},
    }


VARS = {"VAR_A": "A", "VAR_B": "B", "VAR_EMPTY": "", "VAR_REF": "$(VAR_A)"}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("$(VAR_A)", "A"),
        ("___$(VAR_B)___", "___B___"),
        ("$(VAR_A)-$(VAR_A)", "A-A"),
        ("$(VAR_A", "$(VAR_A"),
        ("$$(VAR_B)_$(VAR_A)", "$(VAR_B)_A"),
        ("$$$(VAR_B)", "$B"),
        ("$$$$(VAR_A)", "$$(VAR_A)"),
        ("$(VAR_DNE)", "$(VAR_DNE)"),
        ("$VAR_A", "$VAR_A"),
        ("$()", "$()"),
        ("$", "$"),
        ("$$", "$"),
        ("f000-$$VAR_A", "f000-$VAR_A"),
        ("foo\\$(VAR_A)bar", "foo\\Abar"),
        ("$(VAR_A)$", "A$"),
        ("$(", "$("),
        ("$)", "$)"),
        ("$((VAR_A))", "$((VAR_A))"),
        ("$(VAR_EMPTY)", ""),
        ("$(VAR_REF)", "$(VAR_A)"),  # no recursion
        ("no refs at all", "no refs at all"),
        ("", ""),
    ],
)
def test_expand_follows_the_kubelet(text, expected):
    assert podspec.expand(text, VARS) == expected


def lookup_from(objects: dict):
    return lambda kind, name: objects.get((kind, name))


INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def test_env_values_field_refs_and_order():
    container = {
        "name": "node",
        "env": [
            {"name": "FIRST", "value": "x-$(LATER)-$(PET_NODE_RANK)"},
            {
                "name": "PET_NODE_RANK",
                "valueFrom": {"fieldRef": {"fieldPath": INDEX}},
            },
            {"name": "LATER", "value": "rank=$(PET_NODE_RANK) $$(PET_NODE_RANK)"},
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "NOPE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['nope']"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "SA", "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
            {"name": "EMPTY"},
        ],
    }
    env = podspec.resolve_env(pod(), container, lookup_from({}))
    assert env == {
        "FIRST": "x-$(LATER)-$(PET_NODE_RANK)",  # only variables defined before it expand
        "PET_NODE_RANK": "3",
        "LATER": "rank=3 $(PET_NODE_RANK)",
        "POD": "job-node-0-0-abcde",
        "NS": "team",
        "UID": "u-1",
        "APP": "x",
        "NOPE": "",
        "NODE": "tunepack-executor",
        "SA": "default",
        "IP": "127.0.0.1",
        "HOST": "127.0.0.1",
        "EMPTY": "",
    }


def test_env_from_secrets_and_config_maps():
    objects = {
        ("configMap", "cm"): {"A": "1", "B": "2"},
        ("secret", "creds"): {"token": "s3cr3t"},
    }
    container = {
        "name": "c",
        "envFrom": [
            {"configMapRef": {"name": "cm"}, "prefix": "CM_"},
            {"secretRef": {"name": "absent", "optional": True}},
        ],
        "env": [
            {"name": "CM_A", "value": "overridden-$(CM_B)"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
            {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "B"}}},
            {
                "name": "OPT",
                "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k", "optional": True}},
            },
            {
                "name": "OPTKEY",
                "valueFrom": {"secretKeyRef": {"name": "creds", "key": "k", "optional": True}},
            },
        ],
    }
    env = podspec.resolve_env(pod(), container, lookup_from(objects))
    assert env == {"CM_A": "overridden-2", "CM_B": "2", "TOKEN": "s3cr3t", "B": "2"}


@pytest.mark.parametrize(
    "source, message",
    [
        ({"secretKeyRef": {"name": "creds", "key": "nokey"}}, "couldn't find key nokey in Secret"),
        ({"secretKeyRef": {"name": "gone", "key": "k"}}, 'secret "gone" not found'),
        ({"configMapKeyRef": {"name": "gone", "key": "k"}}, 'configmap "gone" not found'),
    ],
)
def test_missing_required_keys_are_retriable_config_errors(source, message):
    container = {"name": "c", "env": [{"name": "X", "valueFrom": source}]}
    with pytest.raises(ConfigError, match=message) as err:
        podspec.resolve_env(pod(), container, lookup_from({("secret", "creds"): {"t": "1"}}))
    assert err.value.retriable


def test_env_from_a_missing_required_object_is_an_error():
    container = {"name": "c", "envFrom": [{"secretRef": {"name": "absent"}}]}
    with pytest.raises(ConfigError, match='secret "absent" not found'):
        podspec.resolve_env(pod(), container, lookup_from({}))


def test_resource_field_refs():
    container = {
        "name": "c",
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "env": [
            {"name": "REQ_CPU", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu"}}},
            {"name": "LIM_CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            {
                "name": "LIM_MEM",
                "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
            },
        ],
    }
    env = podspec.resolve_env(pod(), container, lookup_from({}))
    assert env == {"REQ_CPU": "1", "LIM_CPU": "16", "LIM_MEM": "2048"}


def test_command_and_args_expand_against_the_pod_env():
    container = {
        "name": "c",
        "command": ["python", "-m", "$(MOD)"],
        "args": ["--rank=$(RANK)", "$$(RANK)", "$(UNSET)"],
    }
    argv = podspec.expand_command(container, {"MOD": "tunepack.trainers.launch", "RANK": "0"})
    assert argv == ["python", "-m", "tunepack.trainers.launch", "--rank=0", "$(RANK)", "$(UNSET)"]
    with pytest.raises(ConfigError, match="no command"):
        podspec.expand_command({"name": "c", "args": ["x"]}, {})


def test_identity_follows_security_contexts():
    p = pod(securityContext={"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 2000,
                             "supplementalGroups": [3000]})  # fmt: skip
    assert podspec.identity(p, {"name": "c"}) == podspec.Identity(1000, 0, (2000, 3000), 2000)
    c = {"name": "c", "securityContext": {"runAsUser": 1001, "runAsGroup": 1001}}
    assert podspec.identity(p, c).uid == 1001 and podspec.identity(p, c).gid == 1001
    assert podspec.identity(pod(), {"name": "c"}) == podspec.Identity(0, 0, (), None)
    with pytest.raises(ConfigError, match="runAsNonRoot and image will run as root"):
        podspec.identity(pod(securityContext={"runAsNonRoot": True}), {"name": "c"})
    with pytest.raises(ConfigError, match="breaks non-root policy"):
        podspec.identity(pod(), {"name": "c", "securityContext": {"runAsNonRoot": True,
                                                                  "runAsUser": 0}})  # fmt: skip


def test_volumes_and_mount_plan():
    p = pod(
        volumes=[
            {"name": "workspace", "persistentVolumeClaim": {"claimName": "initializer-job"}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
            {"name": "creds", "secret": {"secretName": "creds"}},
            {"name": "scratch", "emptyDir": {}},
        ]
    )
    volumes = podspec.classify_volumes(p)
    assert volumes["dshm"].memory and not volumes["scratch"].memory
    dirs = {"workspace": "/pv/ws/", "creds": "/root/pods/u/creds", "scratch": "/root/pods/u/s"}
    container = {
        "name": "node",
        "volumeMounts": [
            {"name": "workspace", "mountPath": "/workspace/model", "subPath": "model"},
            {"name": "workspace", "mountPath": "/workspace", "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "creds", "mountPath": "/etc/creds"},
        ],
    }
    plan = podspec.mount_plan(container, volumes, dirs)
    assert plan == [  # parents before children
        podspec.Mount("/workspace", "/pv/ws", read_only=True),
        podspec.Mount("/workspace/model", "/pv/ws/model"),
        podspec.Mount("/dev/shm", None, tmpfs_bytes=16 * 2**30),
        podspec.Mount("/etc/creds", "/root/pods/u/creds", read_only=True),
    ]
    bad = {"name": "c", "volumeMounts": [{"name": "scratch", "mountPath": "/x", "subPath": "../e"}]}
    with pytest.raises(ConfigError, match="without"):
        podspec.mount_plan(bad, volumes, dirs)
    with pytest.raises(ConfigError, match="names no volume"):
        podspec.mount_plan({"name": "c", "volumeMounts": [{"name": "x", "mountPath": "/x"}]},
                           volumes, dirs)  # fmt: skip


def test_unsupported_volume_types_fail_clearly():
    p = pod(volumes=[{"name": "data", "nfs": {"server": "nfs", "path": "/"}}])
    with pytest.raises(ConfigError, match='volume "data" has type nfs'):
        podspec.classify_volumes(p)


def test_projected_files_of_secrets_and_config_maps():
    data = podspec.decode_data({"data": {"a": base64.b64encode(b"1").decode()}}, "secret")
    assert data == {"a": b"1"}
    cm = podspec.decode_data(
        {"data": {"x": "y"}, "binaryData": {"b": base64.b64encode(b"\0").decode()}}, "configMap"
    )
    assert cm == {"x": b"y", "b": b"\0"}
    assert podspec.projection_files(cm, {}, "configMap", "cm") == [
        ("b", b"\0", 0o644),
        ("x", b"y", 0o644),
    ]
    items = {"items": [{"key": "x", "path": "dir/x.txt", "mode": 0o600}], "defaultMode": 0o400}
    assert podspec.projection_files(cm, items, "configMap", "cm") == [("dir/x.txt", b"y", 0o600)]
    missing = {"items": [{"key": "nope", "path": "n"}]}
    with pytest.raises(ConfigError, match='key "nope" not found'):
        podspec.projection_files(cm, missing, "configMap", "cm")
    assert podspec.projection_files(cm, {**missing, "optional": True}, "configMap", "cm") == []


def test_projected_volumes_like_kube_api_access():
    """The ServiceAccount admission plugin adds this volume to every pod."""
    source = {
        "defaultMode": 0o644,
        "sources": [
            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
            {"configMap": {"name": "kube-root-ca.crt",
                           "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [
                {"path": "namespace", "fieldRef": {"apiVersion": "v1",
                                                   "fieldPath": "metadata.namespace"}},
                {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
            ]}},
            {"secret": {"name": "absent", "optional": True}},
        ],
    }  # fmt: skip
    tokens = []

    def token(audience, seconds):
        tokens.append((audience, seconds))
        return "jwt"

    objects = {("configMap", "kube-root-ca.crt"): {"ca.crt": b"PEM"}}
    files = podspec.projected_files(pod(), source, lookup_from(objects), token)
    assert files == [
        ("token", b"jwt", 0o644),
        ("ca.crt", b"PEM", 0o644),
        ("namespace", b"team", 0o644),
        ("labels", b'app="x"', 0o644),
    ]
    assert tokens == [(None, 3607)]
    with pytest.raises(ConfigError, match='configmap "kube-root-ca.crt" not found') as err:
        podspec.projected_files(pod(), source, lookup_from({}), token)
    assert err.value.retriable


def test_sub_path_expr_expands_with_the_container_env():
    volumes = podspec.classify_volumes(pod(volumes=[{"name": "w", "emptyDir": {}}]))
    container = {"volumeMounts": [{"name": "w", "mountPath": "/w", "subPathExpr": "$(POD)"}]}
    plan = podspec.mount_plan(container, volumes, {"w": "/e"}, {"POD": "p-0"})
    assert plan == [podspec.Mount("/w", "/e/p-0")]


def test_hosts_file_maps_the_pods_of_one_subdomain():
    own = ("job-node-0-1", "job", "team")
    peers = [
        own,
        ("job-node-0-0", "job", "team"),
        ("job-node-0-0", "job", "other-namespace"),
        ("other-node-0-0", "other", "team"),
        ("lonely", None, "team"),
    ]
    text = podspec.hosts_file(own, peers)
    assert text.startswith(podspec.HOSTS_HEADER)
    entries = text[len(podspec.HOSTS_HEADER) :].splitlines()
    assert entries == [
        "127.0.0.1\tjob-node-0-1 job-node-0-1.job job-node-0-1.job.team.svc "
        "job-node-0-1.job.team.svc.cluster.local",
        "127.0.0.1\tjob-node-0-0 job-node-0-0.job job-node-0-0.job.team.svc "
        "job-node-0-0.job.team.svc.cluster.local",
    ]
    assert podspec.hosts_file(("solo", None, "team"), peers).endswith("127.0.0.1\tsolo\n")
    assert podspec.pod_hostname(pod(hostname="h", subdomain="s")) == "h"
    assert podspec.pod_hostname(pod()) == "job-node-0-0-abcde"


def test_hosts_file_maps_cluster_ip_services_to_loopback():
    """The cluster DNS stand-in: a ClusterIP Service's names are 127.0.0.1 (the Trainer's status
    server's URL names its Service); a headless one (a JobSet's) adds nothing."""
    services = [
        {"metadata": {"name": "trainer", "namespace": "kf"}, "spec": {"clusterIP": "10.96.0.7"}},
        {"metadata": {"name": "job", "namespace": "team"}, "spec": {"clusterIP": "None"}},
    ]
    names = podspec.service_names(services)
    assert names == ["trainer.kf.svc", "trainer.kf.svc.cluster.local"]
    text = podspec.hosts_file(("solo", None, "team"), [], names)
    assert text[len(podspec.HOSTS_HEADER) :].splitlines() == [
        "127.0.0.1\ttrainer.kf.svc",
        "127.0.0.1\ttrainer.kf.svc.cluster.local",
        "127.0.0.1\tsolo",
    ]


def test_quantities():
    assert podspec.parse_quantity("16Gi") == 16 * 2**30
    assert podspec.parse_quantity("500m") * 1000 == 500
    assert podspec.parse_quantity("1e3") == 1000
    assert podspec.parse_quantity("2k") == 2000
    with pytest.raises(ConfigError):
        podspec.parse_quantity("lots")


def test_status_and_phase():
    st = ContainerState("node", "img")
    assert st.status()["state"]["waiting"]["reason"] == "ContainerCreating"
    st.pid, st.started_at, st.waiting = 42, "2026-01-01T00:00:00Z", None
    s = st.status()
    assert s["ready"] and s["started"] and s["state"]["running"]["startedAt"]
    assert s["containerID"] == "executor://42"
    st.terminate(65, "Error", "bad input", "2026-01-01T00:00:05Z")
    term = st.status()["state"]
    assert term["running"] is None and term["terminated"]["exitCode"] == 65
    assert term["terminated"]["message"] == "bad input"

    def states(*codes):
        out = []
        for code in codes:
            c = ContainerState("c", "i", waiting=None, started_at="t")
            if code is not None:
                c.terminate(code, "", "", "t")
            out.append(c)
        return out

    assert podspec.pod_phase(states(0), states(None), "Never") == "Running"
    assert podspec.pod_phase(states(0), states(0, 0), "Never") == "Succeeded"
    assert podspec.pod_phase([], states(0, 75), "Never") == "Failed"
    assert podspec.pod_phase(states(1), [ContainerState("c", "i")], "Never") == "Failed"
    assert podspec.pod_phase([], [ContainerState("c", "i")], "Never") == "Pending"
    assert podspec.restarts("OnFailure", 1) and not podspec.restarts("OnFailure", 0)
    assert podspec.restarts("Always", 0) and not podspec.restarts("Never", 1)


def test_tail_message_is_short():
    text = "".join(f"line {i} " + "x" * 100 + "\n" for i in range(500))
    message = podspec.tail_message(text)
    assert len(message.encode()) <= podspec.MESSAGE_MAX_BYTES
    assert message.endswith("line 499 " + "x" * 100)


# --- --images: a container from its image (tests/controlplane/oci.py) -------------------------
def _image(tmp_path, **config):
    from tests.controlplane import oci

    (tmp_path / "etc").mkdir(exist_ok=True)
    (tmp_path / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\ntunepack:x:1000:1000::/home/tunepack:/usr/sbin/nologin\n"
    )
    return oci.Image(name="img", rootfs=str(tmp_path), **config)


def test_command_and_args_merge_with_the_images_entrypoint_as_a_kubelet_merges_them(tmp_path):
    from tests.controlplane import oci

    image = _image(tmp_path, entrypoint=["python", "-m", "prog"], cmd=["--help"])
    same = str
    assert oci.argv({"name": "c"}, image, same) == ["python", "-m", "prog", "--help"]
    assert oci.argv({"name": "c", "args": ["a=1"]}, image, same) == ["python", "-m", "prog", "a=1"]
    # A command replaces the ENTRYPOINT and drops the CMD.
    assert oci.argv({"name": "c", "command": ["sh"]}, image, same) == ["sh"]
    env = {"N": "2"}
    got = oci.argv({"name": "c", "args": ["n=$(N)"]}, image, lambda a: podspec.expand(a, env))
    assert got[-1] == "n=2"
    with pytest.raises(ConfigError, match="no command and the image has none"):
        oci.argv({"name": "c"}, _image(tmp_path), same)


def test_the_images_user_and_its_groups(tmp_path):
    from tests.controlplane import oci

    assert oci.image_user(_image(tmp_path, user="1000:1000"), str(tmp_path)) == (1000, 1000)
    assert oci.image_user(_image(tmp_path, user="tunepack"), str(tmp_path)) == (1000, 1000)
    assert oci.image_user(_image(tmp_path), str(tmp_path)) == (None, None)
    with pytest.raises(ConfigError, match="'nobody' is not in its /etc/passwd"):
        oci.image_user(_image(tmp_path, user="nobody"), str(tmp_path))
    assert oci.primary_gid(1000, str(tmp_path), default=0) == 1000
    assert oci.primary_gid(4242, str(tmp_path), default=0) == 0
    assert oci.home_of(1000, str(tmp_path)) == "/home/tunepack"
    assert oci.home_of(4242, str(tmp_path)) == "/"
    # The pod's runAsUser wins over the image's USER; the image's applies when the pod sets none.
    p = pod(securityContext={"runAsNonRoot": True})
    assert podspec.identity(p, {"name": "c"}, (1000, 1000)).uid == 1000
    with pytest.raises(ConfigError, match="image will run as root"):
        podspec.identity(p, {"name": "c"}, (None, None))
    p = pod(securityContext={"runAsUser": 2000})
    assert podspec.identity(p, {"name": "c"}, (1000, 1000)).uid == 2000


def test_the_oci_spec_carries_the_pods_security_context():
    from tests.controlplane import oci

    dropped = {"name": "c", "securityContext": {"capabilities": {"drop": ["ALL"]}}}
    assert oci.capabilities(dropped) == []
    added = {
        "name": "c",
        "securityContext": {"capabilities": {"drop": ["NET_RAW"], "add": ["SYS_PTRACE"]}},
    }
    caps = oci.capabilities(added)
    assert "CAP_NET_RAW" not in caps and "CAP_SYS_PTRACE" in caps and "CAP_CHOWN" in caps
    mounts = [
        {"target": "/workspace", "source": "/srv/pv", "read_only": False, "tmpfs_bytes": None},
        {"target": "/dev/shm", "source": None, "read_only": False, "tmpfs_bytes": 1 << 30},
        {"target": "/etc/hosts", "source": "/srv/hosts", "read_only": True, "tmpfs_bytes": None},
    ]
    spec = oci.spec(
        args=["python"], env={"A": "1"}, cwd="/workspace", uid=1000, gid=1000, groups=[1000],
        hostname="job-node-0-0", mounts=mounts, read_only=True, no_new_privs=True, caps=[],
        cgroup="/tunepack-executor/x",
    )  # fmt: skip
    assert spec["process"]["user"] == {"uid": 1000, "gid": 1000, "additionalGids": [1000],
                                       "umask": 0o022}  # fmt: skip
    assert spec["process"]["noNewPrivileges"] is True
    assert spec["process"]["capabilities"] == {"bounding": [], "effective": [], "permitted": []}
    assert spec["root"] == {"path": "rootfs", "readonly": True}
    by_target = {m["destination"]: m for m in spec["mounts"]}
    assert by_target["/workspace"]["options"] == ["rbind", "rw"]
    assert by_target["/etc/hosts"]["options"] == ["rbind", "ro"]
    # The pod's /dev/shm (a memory emptyDir) replaces the default 64 MiB one, with its size.
    assert [m["destination"] for m in spec["mounts"]].count("/dev/shm") == 1
    assert f"size={1 << 30}" in by_target["/dev/shm"]["options"]
    # Host network and the init's PID namespace: only mount, UTS and IPC are the container's.
    assert [n["type"] for n in spec["linux"]["namespaces"]] == ["mount", "uts", "ipc"]
