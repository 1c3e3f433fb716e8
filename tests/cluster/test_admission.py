"""Admission on the real API server: TrainJobs on tunepack runtimes that could not run are refused
by the policy ``tunepack install`` applies (``tunepack.tools.admission``), with the Trainer's
webhooks live, in the words the SDK and the trainer use; a valid TrainJob is still admitted.

The TrainJobs are written as upstream's examples are (``examples/yaml`` of Trainer v2.3.0: a
runtimeRef, ``spec.trainer``, optionally ``spec.initializer``) and created with a real
``kubectl create``, as a person applying YAML would.
"""

from __future__ import annotations

import copy
import uuid

import pytest

from tests.cluster import kube
from tunepack.core.errors import BadInputError
from tunepack.runtimes import catalog
from tunepack.runtimes.args import parse_trainer_args
from tunepack.tools import admission
from tunepack.tools.install import describe

pytestmark = pytest.mark.controlplane

RUNTIME = "tunepack-tiny-llama3"
DENIED = (
    f"ValidatingAdmissionPolicy '{admission.POLICY_NAME}' with binding "
    f"'{admission.POLICY_NAME}' denied request: "
)


def _trainjob(args: list[str], runtime: str = RUNTIME, initializer: bool = True) -> dict:
    spec: dict = {
        "runtimeRef": {"name": runtime},
        "trainer": {"numNodes": 1, "numProcPerNode": 1, "args": list(args)},
    }
    if initializer:
        spec["initializer"] = {
            "dataset": {"storageUri": "hf://datasets/tatsu-lab/alpaca"},
            "model": {"storageUri": "hf://meta-llama/Llama-3.2-1B-Instruct"},
        }
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": f"adm-{uuid.uuid4().hex[:8]}"},
        "spec": spec,
    }


def _create(controlplane, namespace: str, obj: dict, *, dry_run: bool = False):
    return kube.create(obj, namespace, kubeconfig=controlplane.kubeconfig, dry_run=dry_run)


def _refusal(done) -> str:
    """The policy's message in kubectl's error line (which must be the last, and only, line)."""
    assert done.returncode != 0, done.stdout
    line = done.stderr.strip()
    assert "\n" not in line, line
    assert DENIED in line, line
    return line.split(DENIED, 1)[1]


def _sdk_message(args: list[str], runtime: str = RUNTIME) -> str:
    """What ``tunepack render`` / the SDK / the trainer say about the same arguments."""
    with pytest.raises(BadInputError) as refused:
        parse_trainer_args(args, catalog.get(runtime))
    return str(refused.value)


@pytest.fixture
def policy(api, controlplane, installed_runtimes, namespace):
    """``tunepack install`` applied the policy; wait until the API server enforces it (its
    policy informer picks the binding up asynchronously)."""
    lines = installed_runtimes.stdout.splitlines()
    for obj in admission.policy_objects():
        assert any(line.startswith(describe(obj)) for line in lines), installed_runtimes.stdout
    probe = _trainjob(["lora_rank=-1"])
    kube.wait_for(
        lambda: DENIED in _create(controlplane, namespace, probe, dry_run=True).stderr,
        30,
        "the admission policy to be enforced",
    )


def test_the_api_server_keeps_the_generated_policy(api, policy):
    """It compiled every expression (the API server refuses a policy whose CEL does not
    compile, naming the expression) and kept every field."""
    served = api.custom.get_cluster_custom_object(
        "admissionregistration.k8s.io", "v1", "validatingadmissionpolicies", admission.POLICY_NAME
    )
    generated = admission.policy_objects()[0]["spec"]
    for key in ("matchConditions", "variables", "validations", "failurePolicy"):
        assert served["spec"][key] == generated[key], key


@pytest.mark.parametrize("step", ["dataset", "model"])
def test_a_missing_storage_uri_is_refused(controlplane, namespace, policy, step):
    """Upstream's examples 01-03 and 05 (and every CustomTrainer job) have no initializer."""
    obj = _trainjob(["method=lora"])
    del obj["spec"]["initializer"][step]
    message = _refusal(_create(controlplane, namespace, obj))
    assert message == admission._missing_storage_message(step)(RUNTIME)
    bare = _trainjob(["method=lora"], initializer=False)
    assert "spec.initializer.dataset.storageUri is not set" in _refusal(
        _create(controlplane, namespace, bare)
    )


# Each: trainer arguments the SDK refuses, on a runtime; the API server must say the same.
REFUSED = {
    "unknown key": (["unknown_key=1"], RUNTIME),
    "torchtune override": (["model._component_=torch.nn.Linear"], RUNTIME),
    "not key=value": (["epochs"], RUNTIME),
    "given twice": (["epochs=1", "epochs=2"], RUNTIME),
    "negative lora_rank": (["lora_rank=-1"], RUNTIME),
    "lr out of range": (["lr=2"], RUNTIME),
    "lr not a number": (["lr=fast"], RUNTIME),
    "bool": (["packed=maybe"], RUNTIME),
    "choice": (["dtype=fp16"], RUNTIME),
    "subset": (["lora_attn_modules=q_proj,gate_proj"], RUNTIME),
    "name": (["tracker_project=my/project"], RUNTIME),
    "tracker uri": (["tracker=mlflow", "tracker_uri=mlflow.internal"], RUNTIME),
    "LoRA keys with method=full": (["method=full", "lora_rank=8", "lora_alpha=16"], RUNTIME),
    "method the model lacks": (["method=qlora"], RUNTIME),
    "beyond the context window": (["max_seq_len=100000"], RUNTIME),
    "beyond the sliding window": (["max_seq_len=8192"], "tunepack-mistral-7b"),
    "packing a family that cannot": (["packed=true"], "tunepack-gemma2-2b"),
    "DPO keys without dpo": (["beta=0.2"], RUNTIME),
    "packed with group_by_length": (["packed=true", "group_by_length=true"], RUNTIME),
    "packed DPO": (["method=dpo", "packed=true"], RUNTIME),
    "tracker_uri without mlflow": (["tracker_uri=http://mlflow:5000"], RUNTIME),
    "LoRA on a projector a text model lacks": (["lora_projector=true"], RUNTIME),
    "dropout on the experts' LoRA": (
        ["lora_mlp=yes", "lora_dropout=0.050"],
        "tunepack-qwen3-30b-a3b",
    ),
    "DoRA on the experts": (["method=dora", "lora_mlp=true"], "tunepack-qwen3-30b-a3b"),
}


@pytest.mark.parametrize(("args", "runtime"), REFUSED.values(), ids=REFUSED.keys())
def test_invalid_trainer_arguments_are_refused_with_the_sdks_message(
    controlplane, namespace, policy, args, runtime
):
    message = _refusal(_create(controlplane, namespace, _trainjob(args, runtime)))
    assert message == _sdk_message(args, runtime)


def test_credentials_in_the_tracker_uri_are_refused_without_echoing_them(
    controlplane, namespace, policy
):
    args = ["tracker=mlflow", "tracker_uri=https://alice:s3cr3t@mlflow.example.com"]
    message = _refusal(_create(controlplane, namespace, _trainjob(args)))
    assert message == _sdk_message(args)
    assert "s3cr3t" not in message


def test_a_valid_trainjob_is_admitted_and_rendered(api, controlplane, namespace, policy, on_kwok):
    args = ["method=lora", "lora_rank=8", "lr=1e-4", "max_seq_len=256", "packed=false"]
    parse_trainer_args(args, catalog.get(RUNTIME))  # the SDK accepts them too
    obj = _trainjob(args)
    done = _create(controlplane, namespace, obj)
    assert done.returncode == 0, done.stderr
    js = api.wait_jobset(namespace, obj["metadata"]["name"])  # the Trainer rendered it
    node = next(j for j in js["spec"]["replicatedJobs"] if j["name"] == "node")
    container = node["template"]["spec"]["template"]["spec"]["containers"][0]
    assert sorted(container["args"]) == sorted(args)
    # A metadata-only update (a label, a finalizer the controller removes) is not re-checked.
    # (spec.trainer and spec.initializer cannot change: the CRD makes them immutable.)
    labelled = kube.kubectl(
        "label", "trainjob", obj["metadata"]["name"], "team=a", "-n", namespace,
        kubeconfig=controlplane.kubeconfig,
    )  # fmt: skip
    assert labelled.returncode == 0, labelled.stderr


def test_a_trainjob_on_another_runtime_is_not_checked(controlplane, namespace, policy):
    obj = copy.deepcopy(_trainjob(["unknown_key=1"], initializer=False))
    obj["spec"]["runtimeRef"]["name"] = "torch-distributed"
    done = _create(controlplane, namespace, obj, dry_run=True)
    assert DENIED not in done.stderr  # whatever the Trainer says of a runtime it lacks
