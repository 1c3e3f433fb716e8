"""TrainJob building: the API shape, strict validation and clear errors for bad input."""

from __future__ import annotations

import re

import pytest
import yaml

from tunepack.core.errors import (
    BadValueError,
    ConflictError,
    UnknownKeyError,
    UnknownRuntimeError,
)
from tunepack.jobs.naming import max_name_length
from tunepack.jobs.trainjob import (
    TrainJobSpec,
    build_trainjob,
    pod_resources,
    to_yaml,
)
from tunepack.runtimes import catalog, host
from tunepack.runtimes.validate import validate_trainjob


def _build(**overrides) -> dict:
    kwargs = {
        "name": "tiny-lora",
        "runtime": "tunepack-tiny-llama3",
        "dataset_uri": "file:///data/alpaca.jsonl",
        "model_uri": "file:///models/tiny-llama3",
        "trainer_args": ["method=lora", "epochs=2"],
    }
    return build_trainjob(TrainJobSpec(**(kwargs | overrides)))


ARGS_ENV = {"name": "TUNEPACK_TRAINER_ARGS", "value": '["method=lora", "epochs=2"]'}


def test_trainjob_has_the_api_fields():
    job = _build(num_nodes=2, namespace="team-a")
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert job["kind"] == "TrainJob"
    assert job["metadata"] == {"name": "tiny-lora", "namespace": "team-a"}
    assert job["spec"] == {
        "runtimeRef": {
            "name": "tunepack-tiny-llama3",
            "apiGroup": "trainer.kubeflow.org",
            "kind": "ClusterTrainingRuntime",
        },
        # The initializers cannot see spec.trainer.args: they get them to check before any
        # download (initializers/trainer_args.py).
        "initializer": {
            "dataset": {"storageUri": "file:///data/alpaca.jsonl", "env": [ARGS_ENV]},
            "model": {"storageUri": "file:///models/tiny-llama3", "env": [ARGS_ENV]},
        },
        # Always set: left out, the platform's "auto" would mean the CPU request on this
        # CPU-only runtime.
        "trainer": {"args": ["method=lora", "epochs=2"], "numNodes": 2, "numProcPerNode": 1},
    }
    validate_trainjob(job)


def test_optional_fields_are_left_out_and_model_names_resolve():
    job = _build(runtime="tiny-llama3")
    assert job["spec"]["runtimeRef"]["name"] == "tunepack-tiny-llama3"
    assert "numNodes" not in job["spec"]["trainer"]
    assert "namespace" not in job["metadata"]


def test_to_yaml_round_trips():
    job = _build()
    text = to_yaml(job)
    assert yaml.safe_load(text) == job
    assert text.index("apiVersion") < text.index("spec")  # written in build order, not sorted


# What a name that is not a DNS-1123 label is told to be.
DNS_LABEL = (
    "use at most 63 lowercase letters, digits and '-', starting and ending with a letter or "
    "digit (e.g. 'llama-lora-1')"
)


@pytest.mark.parametrize(
    ("name", "line"),
    [
        ("Tiny_LoRA", f"TrainJob name 'Tiny_LoRA' is not a valid DNS-1123 label: {DNS_LABEL}"),
        ("tiny-", f"TrainJob name 'tiny-' is not a valid DNS-1123 label: {DNS_LABEL}"),
        ("", f"TrainJob name '' is not a valid DNS-1123 label: {DNS_LABEL}"),
        (
            "1st-run",
            "TrainJob name '1st-run' must start with a letter: it also names the job's network "
            "Service",
        ),
        (
            "a" * 34,
            f"TrainJob name '{'a' * 34}' is 34 characters; at most 33 are allowed so that the pod "
            "names JobSet derives from it fit in 63 characters",
        ),
    ],
)
def test_bad_names_are_explained(name, line):
    with pytest.raises(BadValueError) as caught:
        _build(name=name)
    assert str(caught.value) == line


def test_longest_allowed_name_is_accepted():
    assert max_name_length() == 33  # <name>-dataset-initializer-0-0-xxxxx fits in 63
    _build(name="a" * 33)


def test_unknown_runtime_lists_the_runtimes():
    with pytest.raises(UnknownRuntimeError) as caught:
        _build(runtime="torchtune-llama3.2-1b")
    known = ", ".join(entry.runtime_name for entry in catalog.CATALOG.values())
    assert str(caught.value) == (
        f"unknown runtime or model 'torchtune-llama3.2-1b'; tunepack runtimes are: {known}"
    )
    assert "tunepack-llama3.2-1b" in known


@pytest.mark.parametrize(
    ("overrides", "hint"),
    [
        ({"namespace": "Team_A"}, f"namespace 'Team_A' is not a valid DNS-1123 label: {DNS_LABEL}"),
        ({"num_nodes": 0}, "num_nodes must be a positive integer, got 0"),
        ({"num_nodes": True}, "num_nodes must be a positive integer, got True"),
        ({"dataset_uri": " "}, "dataset_uri must be a non-empty storage URI, got ' '"),
        ({"num_proc_per_node": 0}, "num_proc_per_node must be a positive integer, got 0"),
        (
            {"active_deadline_seconds": 0},
            "active_deadline_seconds must be a positive integer, got 0",
        ),
        (
            {"runtime_kind": "Runtime"},
            "runtime_kind 'Runtime' is not a runtime kind: expected ClusterTrainingRuntime "
            "(cluster-wide) or TrainingRuntime (in the TrainJob's namespace)",
        ),
        (
            {"trainer_args": "method=lora"},
            "trainer_args must be a list of 'key=value' strings, got 'method=lora'",
        ),
    ],
)
def test_other_bad_input(overrides, hint):
    with pytest.raises(BadValueError) as caught:
        _build(**overrides)
    assert str(caught.value) == hint


# The API's CEL rule for spec.initializer.{dataset,model}.storageUri (Trainer v2.3.0).
STORAGE_URI_RULE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://.+$")


@pytest.mark.parametrize(
    ("given", "written"),
    [
        ("/pvc/data/train.jsonl", "file:///pvc/data/train.jsonl"),
        ("/pvc/my data/train.jsonl", "file:///pvc/my%20data/train.jsonl"),
        ("file:/pvc/data/train.jsonl", "file:///pvc/data/train.jsonl"),
        ("file:///pvc/data/train.jsonl", "file:///pvc/data/train.jsonl"),
        ("hf://tatsu-lab/alpaca", "hf://tatsu-lab/alpaca"),
        ("s3://bucket/data/", "s3://bucket/data/"),
    ],
)
def test_storage_uris_are_written_as_the_api_requires(given, written):
    job = _build(dataset_uri=given, model_uri=given.replace("train.jsonl", "model"))
    dataset = job["spec"]["initializer"]["dataset"]["storageUri"]
    assert dataset == written
    assert STORAGE_URI_RULE.match(dataset)
    assert STORAGE_URI_RULE.match(job["spec"]["initializer"]["model"]["storageUri"])


@pytest.mark.parametrize("path", ["data/train.jsonl", "./train.jsonl", "~/train.jsonl"])
def test_relative_paths_are_refused_for_the_cluster_and_kept_locally(path):
    with pytest.raises(BadValueError) as caught:
        _build(dataset_uri=path)
    assert str(caught.value) == (
        f"dataset storage URI {path!r} is a relative path: a TrainJob's storage URI is read "
        "inside the dataset initializer container on the cluster, so a path must be absolute "
        "(/abs/path or file:///abs/path), or use a URI such as hf://org/name or s3://bucket/key"
    )
    with pytest.raises(BadValueError) as caught:
        _build(model_uri="models/m")
    assert str(caught.value) == (
        "model storage URI 'models/m' is a relative path: a TrainJob's storage URI is read "
        "inside the model initializer container on the cluster, so a path must be absolute "
        "(/abs/path or file:///abs/path), or use a URI such as hf://org/name or s3://bucket/key"
    )
    # The local backend reads the path on this machine, relative to where it runs.
    job = _build(dataset_uri=path, local=True)
    assert job["spec"]["initializer"]["dataset"]["storageUri"] == path


@pytest.mark.parametrize(
    ("overrides", "procs"),
    [
        ({"runtime": "tunepack-llama3.1-70b"}, 8),  # the runtime's GPUs per node
        ({"runtime": "tunepack-llama3.2-1b"}, 1),
        ({"runtime": "tunepack-llama3.1-70b", "resources_per_node": {"gpu": 4}}, 4),
        ({"runtime": "tunepack-llama3.1-70b", "resources_per_node": {"nvidia.com/gpu": 2}}, 2),
        # resourcesPerNode is merged into the runtime's: no GPU named, the runtime's 8 stay.
        ({"runtime": "tunepack-llama3.1-70b", "resources_per_node": {"cpu": 16}}, 8),
        ({"runtime": "tunepack-llama3.1-70b", "resources_per_node": {"cpu": 16, "gpu": 0}}, 1),
        ({"runtime": "tunepack-llama3.1-70b", "num_proc_per_node": 8}, 8),
        ({"resources_per_node": {"cpu": 8}}, 1),  # CPU-only: never the CPU count
        ({"num_proc_per_node": 3}, 3),  # CPU-only: the processes are free
        ({"runtime": "tunepack-llama3.1-70b", "resources_per_node": {"gpu": 0},
          "num_proc_per_node": 3}, 3),
    ],
)  # fmt: skip
def test_num_proc_per_node_is_always_set(overrides, procs):
    job = _build(**overrides)
    assert job["spec"]["trainer"]["numProcPerNode"] == procs


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"runtime": "tunepack-llama3.1-70b", "num_proc_per_node": 3},
            "FineTune.num_proc_per_node=3 asks for 3 processes a node, but a trainer node holds "
            "8 GPUs (runtime tunepack-llama3.1-70b's) and runs one process per GPU: give "
            "resources_per_node={'gpu': 3} for 3 GPUs a node, or leave "
            "FineTune.num_proc_per_node out",
        ),
        (
            {"runtime": "tunepack-llama3.2-1b", "num_proc_per_node": 1,
             "resources_per_node": {"nvidia.com/gpu": 2}},
            "FineTune.num_proc_per_node=1 asks for 1 process a node, but a trainer node holds "
            "2 GPUs (resources_per_node={'nvidia.com/gpu': 2}) and runs one process per GPU: "
            "give resources_per_node={'gpu': 1} for 1 GPU a node, or leave "
            "FineTune.num_proc_per_node out",
        ),
        # Locally, GPUs the job names bind its processes as on a cluster.
        (
            {"runtime": "tunepack-llama3.2-1b", "num_proc_per_node": 4, "local": True,
             "resources_per_node": {"gpu": 2}},
            "FineTune.num_proc_per_node=4 asks for 4 processes a node, but a trainer node holds "
            "2 GPUs (resources_per_node={'gpu': 2}) and runs one process per GPU: give "
            "resources_per_node={'gpu': 4} for 4 GPUs a node, or leave "
            "FineTune.num_proc_per_node out",
        ),
    ],
)  # fmt: skip
def test_processes_other_than_the_gpus_are_refused(overrides, message):
    """Issue 49, 2: one process per GPU on a pod with GPUs; another number is refused here, not
    by the launcher on the node after the downloads."""
    with pytest.raises(ConflictError) as err:
        _build(**overrides)
    assert str(err.value) == message
    assert err.value.exit_code == 65


def test_local_processes_on_a_gpu_runtime_are_the_machines_to_decide():
    # This machine's GPUs, not the runtime's, are the run's: with no GPUs named, 2 stay 2 (on a
    # CPU, two processes; on GPUs, the launcher refuses more than there are).
    job = _build(runtime="tunepack-llama3.2-1b", num_proc_per_node=2, local=True)
    assert job["spec"]["trainer"]["numProcPerNode"] == 2
    job = _build(runtime="tunepack-llama3.2-1b", resources_per_node={"gpu": 2}, local=True)
    assert job["spec"]["trainer"]["numProcPerNode"] == 2


@pytest.mark.parametrize(
    ("request_", "limits", "procs"),
    [
        # A CPU-only request on a GPU runtime: the pod keeps the runtime's GPU, one process on it.
        ({"cpu": 4, "memory": "8Gi"}, {"cpu": 4, "memory": "8Gi", "nvidia.com/gpu": 1}, 1),
        ({"cpu": 4, "gpu": 0}, {"cpu": 4, "nvidia.com/gpu": 0}, 1),  # CPU only, as asked
        ({"gpu": 2}, {"nvidia.com/gpu": 2}, 2),
        # A MIG slice replaces the whole GPU instead of joining it.
        ({"mig-1g.10gb": 1}, {"nvidia.com/mig-1g.10gb": 1, "nvidia.com/gpu": 0}, 1),
    ],
)
def test_processes_follow_what_the_merged_pod_holds(request_, limits, procs):
    job = _build(runtime="tunepack-llama3.2-1b", resources_per_node=request_)
    trainer = job["spec"]["trainer"]
    entry = catalog.get("tunepack-llama3.2-1b")
    pod = pod_resources(trainer["resourcesPerNode"], entry)
    assert pod["limits"] == limits
    assert trainer["numProcPerNode"] == procs
    # The runtime's requests stay where the request names nothing else, but for more GPUs
    # (more processes) than the runtime's: sized for them (the next test).
    runtime_memory = host.trainer_requests(entry)["memory"]
    sized = host.node_shape(entry, procs).memory if "gpu" in request_ else runtime_memory
    assert pod["requests"]["memory"] == request_.get("memory", sized)


def test_more_gpus_than_the_runtimes_get_cpu_and_memory_for_their_processes():
    # tunepack-llama3.1-8b is sized for 1 GPU: 2 CPUs, 20Gi (15 GiB of weights + 3 + 2).
    job = _build(runtime="tunepack-llama3.1-8b", resources_per_node={"gpu": 4})
    requested = job["spec"]["trainer"]["resourcesPerNode"]
    assert requested["requests"] == {"nvidia.com/gpu": 4, "cpu": "8", "memory": "29Gi"}
    assert requested["limits"] == {"nvidia.com/gpu": 4}
    # A request that names CPU or memory itself is the user's: nothing is added.
    job = _build(runtime="tunepack-llama3.1-8b", resources_per_node={"gpu": 4, "memory": "64Gi"})
    assert "cpu" not in job["spec"]["trainer"]["resourcesPerNode"]["requests"]


def test_local_trainjobs_leave_num_proc_per_node_to_the_launcher():
    assert "numProcPerNode" not in _build(local=True)["spec"]["trainer"]
    assert _build(local=True, num_proc_per_node=2)["spec"]["trainer"]["numProcPerNode"] == 2


def test_namespaced_runtime_kind():
    job = _build(runtime_kind="TrainingRuntime", namespace="team-a")
    assert job["spec"]["runtimeRef"] == {
        "name": "tunepack-tiny-llama3",
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
    }
    validate_trainjob(job)


def test_queue_labels_annotations_and_the_sdk_option_fields():
    patch = {
        "manager": "trainer.kubeflow.org/kubeflow-sdk",
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": "node",
                            "template": {
                                "spec": {"template": {"spec": {"nodeSelector": {"pool": "a"}}}}
                            },
                        }
                    ]
                }
            }
        },
    }
    job = _build(
        queue="team-a-queue",
        labels={"team": "a", "example.com/cost-center": "ml-1"},
        annotations={"example.com/owner": "Jane Doe <jane@example.com>"},
        active_deadline_seconds=3600,
        runtime_patches=[patch],
    )
    assert job["metadata"]["labels"] == {
        "team": "a",
        "example.com/cost-center": "ml-1",
        "kueue.x-k8s.io/queue-name": "team-a-queue",
    }
    assert job["metadata"]["annotations"] == {"example.com/owner": "Jane Doe <jane@example.com>"}
    assert job["spec"]["activeDeadlineSeconds"] == 3600
    assert job["spec"]["runtimePatches"] == [patch]
    validate_trainjob(job)


QUEUE_NAME = (
    "use at most 63 lowercase letters, digits, '-' and '.', starting and ending with a letter "
    "or digit"
)
LABEL_KEY = (
    "write [prefix/]name, with a name of at most 63 letters, digits, '-', '_' and '.' starting "
    "and ending with a letter or digit, and an optional DNS-subdomain prefix (e.g. 'team' or "
    "'example.com/team')"
)
LABEL_VALUE = (
    "use at most 63 letters, digits, '-', '_' and '.', starting and ending with a letter or "
    "digit (or an empty string)"
)


@pytest.mark.parametrize(
    ("overrides", "kind", "message"),
    [
        (
            {"queue": "Team_Queue"},
            BadValueError,
            "queue 'Team_Queue' (label kueue.x-k8s.io/queue-name) is not a valid Kueue "
            f"LocalQueue name: {QUEUE_NAME}",
        ),
        (
            {"labels": {"kueue.x-k8s.io/queue-name": "q_1"}},
            BadValueError,
            "queue 'q_1' (label kueue.x-k8s.io/queue-name) is not a valid Kueue LocalQueue name: "
            f"{QUEUE_NAME}",
        ),
        (
            {"queue": "a", "labels": {"kueue.x-k8s.io/queue-name": "b"}},
            ConflictError,
            "queue 'a' and the label kueue.x-k8s.io/queue-name='b' disagree: give the queue once",
        ),
        (
            {"labels": {"bad key": "x"}},
            BadValueError,
            f"label key 'bad key' is not valid: {LABEL_KEY}",
        ),
        (
            {"labels": {"team": "a b"}},
            BadValueError,
            f"label team='a b' has an invalid value: {LABEL_VALUE}",
        ),
        (
            {"labels": {"team": 1}},
            BadValueError,
            f"label team=1 has an invalid value: {LABEL_VALUE}",
        ),
        ({"labels": ["team"]}, BadValueError, "labels must be a dict of strings, got ['team']"),
        (
            {"annotations": {"Example.com/x": "v"}},
            BadValueError,
            f"annotation key 'Example.com/x' is not valid: {LABEL_KEY}",
        ),
        (
            {"annotations": {"note": 3}},
            BadValueError,
            "annotation 'note' must have a string value, got 3",
        ),
    ],
)
def test_bad_labels_and_queues_are_named(overrides, kind, message):
    with pytest.raises(kind) as caught:
        _build(**overrides)
    assert type(caught.value) is kind
    assert str(caught.value) == message


def test_trainer_args_are_checked_against_the_vocabulary():
    with pytest.raises(UnknownKeyError) as caught:
        _build(trainer_args=["method=lora", "lora_rnk=8"])
    assert str(caught.value) == "unknown trainer argument 'lora_rnk'; did you mean 'lora_rank'?"
    assert (caught.value.key, caught.value.suggestions) == ("lora_rnk", ("lora_rank",))
    with pytest.raises(UnknownKeyError):
        _build(trainer_args=["model._component_=os.system"])
