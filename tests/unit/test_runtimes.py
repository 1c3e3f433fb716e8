"""The generated ClusterTrainingRuntimes: strict API validity, freshness and platform contract."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from tunepack import __version__
from tunepack.core.errors import EXIT_BAD_INPUT, BadValueError, UnknownRuntimeError
from tunepack.runtimes import builder, catalog, contract, generate, host
from tunepack.runtimes.builder import build_runtime
from tunepack.runtimes.contract import container, env, env_refs, pod_spec, replicated_jobs
from tunepack.runtimes.store import list_runtimes, load_runtime
from tunepack.runtimes.validate import validate_runtime, validate_trainjob

ENTRIES = list(catalog.CATALOG.values())
IDS = [entry.name for entry in ENTRIES]
TINY = catalog.get("tiny-llama3")
GPU = catalog.get("llama3.2-1b")


def _jobs(runtime: dict) -> dict[str, dict]:
    return {job["name"]: job for job in replicated_jobs(runtime)}


def _container(job: dict) -> dict:
    (only,) = pod_spec(job)["containers"]
    assert only is container(job)  # named after its job
    return only


# --- validity and freshness ---------------------------------------------------------------------


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_every_runtime_validates_strictly(entry):
    validate_runtime(build_runtime(entry))


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_committed_runtime_is_what_the_catalog_builds(entry):
    assert load_runtime(entry.runtime_name) == build_runtime(entry)
    assert load_runtime(entry.name) == build_runtime(entry)  # a model name works too


def test_committed_files_are_not_stale():
    problems = generate.check()
    assert not problems, (
        "runtimes/generated/ does not match runtimes/catalog.py; run `make generate` "
        f"and commit the result: {problems}"
    )


def test_check_reports_stale_missing_and_extra_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(generate, "GENERATED_DIR", tmp_path)
    assert generate.main([]) == 0
    assert generate.main(["--check"]) == 0

    (tmp_path / f"{TINY.runtime_name}.yaml").write_text("edited by hand\n")
    (tmp_path / f"{GPU.runtime_name}.yaml").unlink()
    (tmp_path / "tunepack-removed.yaml").write_text("kind: ClusterTrainingRuntime\n")
    assert generate.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "make generate" in err
    assert f"stale: {TINY.runtime_name}.yaml" in err
    assert f"missing: {GPU.runtime_name}.yaml" in err
    assert "extra: tunepack-removed.yaml" in err

    generate.main([])  # regenerating repairs all three
    assert generate.check(tmp_path) == []


def test_generated_files_are_deterministic_with_header_and_kustomization():
    files = builder.generated_files()
    assert files == builder.generated_files()
    assert all(text.startswith("# Generated from runtimes/catalog.py") for text in files.values())
    assert all("do not edit" in text for text in files.values())
    kustomization = yaml.safe_load(files["kustomization.yaml"])
    runtime_files = sorted(f"{entry.runtime_name}.yaml" for entry in ENTRIES)
    assert kustomization["kind"] == "Kustomization"
    assert kustomization["resources"] == runtime_files
    assert sorted(files) == sorted([*runtime_files, "kustomization.yaml"])
    assert "&id" not in "".join(files.values())  # no YAML anchors from shared constants


# --- the platform contract ----------------------------------------------------------------------


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_metadata(entry):
    meta = build_runtime(entry)["metadata"]
    assert meta["name"] == entry.runtime_name
    # torch, not torchtune: the upstream torchtune plugin refuses runtimes it does not know.
    assert meta["labels"] == {
        "trainer.kubeflow.org/framework": "torch",
        "app.kubernetes.io/part-of": "tunepack",
        "tunepack.dev/model": entry.name,
    }
    notes = meta["annotations"]
    assert notes["tunepack.dev/hub-id"] == entry.hub_id
    # Every real model takes every method; the tiny one is too small for NF4 (QLoRA), and
    # Qwen3-MoE's stacked experts are not quantized (trainers/models/qwen3_moe.py).
    no_nf4 = entry.name == "tiny-llama3" or entry.shape.num_experts
    methods = (
        "full,grpo_full,lora,dora,dpo,orpo,kto,grpo"
        if no_nf4
        else "full,grpo_full,lora,qlora,dora,dpo,orpo,kto,grpo"
    )
    if entry.family.reads_images:  # Llama 3.2 Vision: supervised fine-tuning only, so far
        methods = "full,lora,qlora,dora"
    assert notes["tunepack.dev/methods"] == methods
    # A bring-your-own runtime's size is its checkpoint's: no annotation.
    assert notes.get("tunepack.dev/parameters") == (
        None if entry.custom else str(entry.parameter_count)
    )
    assert notes["tunepack.dev/default-gpus"] == str(entry.resources.gpus)
    assert notes["tunepack.dev/description"] == entry.description


def test_ml_policy():
    spec = build_runtime(GPU)["spec"]
    assert spec["mlPolicy"] == {"numNodes": 1, "torch": {}}  # no numProcPerNode in v2.3


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_no_pod_group_policy(entry):
    """A PodGroup counts the initializer pods too, which never run with the trainer pods."""
    spec = build_runtime(entry)["spec"]
    assert "podGroupPolicy" not in spec
    assert set(spec) == {"mlPolicy", "template"}
    # Kueue's queue label belongs on the TrainJob, not on the JobSet the Trainer owns.
    assert "metadata" not in spec["template"]


def test_multi_node_runtime():
    spec = build_runtime(catalog.get("llama3.1-405b"))["spec"]
    assert spec["mlPolicy"] == {"numNodes": 2, "torch": {}}


def test_steps_labels_names_images_and_commands():
    jobs = _jobs(build_runtime(GPU))
    assert list(jobs) == ["dataset-initializer", "model-initializer", "node", "exporter"]
    expected = {  # job: (ancestor-step label, image name, module)
        "dataset-initializer": (
            "dataset-initializer",
            "dataset-initializer",
            "initializers.dataset",
        ),
        "model-initializer": ("model-initializer", "model-initializer", "initializers.model"),
        "node": ("trainer", "trainer", "trainers.launch"),
        # After the trainer, in the initializers' image (docs/export.md).
        "exporter": ("exporter", "model-initializer", "initializers.export"),
    }
    for name, (ancestor, image, module) in expected.items():
        job, container = jobs[name], _container(jobs[name])
        assert job["replicas"] == 1
        assert job["template"]["metadata"]["labels"] == {
            "trainer.kubeflow.org/trainjob-ancestor-step": ancestor
        }
        assert container["name"] == name  # the controller finds containers by name
        assert container["image"] == f"ghcr.io/tunepack/{image}:{__version__}"
        assert container["command"] == ["python", "-m", f"tunepack.{module}"]


def test_trainer_waits_for_both_initializers():
    jobs = _jobs(build_runtime(GPU))
    assert jobs["node"]["dependsOn"] == [
        {"name": "dataset-initializer", "status": "Complete"},
        {"name": "model-initializer", "status": "Complete"},
    ]
    assert "dependsOn" not in jobs["dataset-initializer"]
    assert "dependsOn" not in jobs["model-initializer"]
    assert jobs["exporter"]["dependsOn"] == [{"name": "node", "status": "Complete"}]


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_shared_workspace(entry):
    jobset = contract.jobset_spec(build_runtime(entry))
    (policy,) = jobset["volumeClaimPolicies"]
    (claim,) = policy["templates"]
    assert claim["metadata"]["name"] == "initializer"
    # The result must outlive the TrainJob: JobSet deletes the PVC with it unless retained.
    assert policy["retentionPolicy"] == {"whenDeleted": "Retain"}
    # Trainer pods on several nodes share the workspace.
    mode = "ReadWriteMany" if entry.resources.nodes > 1 else "ReadWriteOnce"
    assert claim["spec"]["accessModes"] == [mode]
    assert claim["spec"]["resources"]["requests"]["storage"] == entry.resources.workspace_storage
    for job in replicated_jobs(build_runtime(entry)):
        mounts = {m["name"]: m["mountPath"] for m in _container(job)["volumeMounts"]}
        assert mounts["initializer"] == "/workspace"
        # JobSet adds the claim itself and refuses a pod volume of the same name.
        assert "initializer" not in {v["name"] for v in pod_spec(job).get("volumes", [])}


def test_initializer_containers_pass_the_trainjob_webhook():
    """Trainer v2.3 rejects a TrainJob with spec.initializer.dataset/.model unless the
    dataset-initializer/model-initializer container mounts a volume named exactly
    ``initializer`` (jobsetplgconsts.VolumeNameInitializer)."""
    jobs = _jobs(build_runtime(GPU))
    for name in ("dataset-initializer", "model-initializer"):
        mounts = container(jobs[name], name)["volumeMounts"]
        assert "initializer" in {m["name"] for m in mounts}
    assert contract.INITIALIZER_VOLUME == "initializer"
    assert contract.WORKSPACE_VOLUME == contract.INITIALIZER_VOLUME  # the name sdk_ext imports


def test_workspace_pvc_name_is_what_jobset_creates():
    # JobSet names the PVC <claim>-<jobset>; the JobSet is named after the TrainJob.
    assert contract.workspace_pvc("my-job") == "initializer-my-job"


def test_node_job_is_third():
    """manifests/components/gpu-nodes patches replicatedJobs/2 (and tests that it is `node`)."""
    for entry in ENTRIES:
        jobs = replicated_jobs(build_runtime(entry))
        assert jobs[2]["name"] == "node"


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_environment(entry):
    jobs = _jobs(build_runtime(entry))
    for job in jobs.values():
        values = env(_container(job))
        assert values["TUNEPACK_MODEL"] == entry.name
        assert values["TUNEPACK_WORKSPACE"] == "/workspace"
        # Injected by the Trainer controller from the TrainJob; a runtime value would be a trap.
        assert "STORAGE_URI" not in values
        assert not any(name.startswith("PET_") for name in values)
    for job in ("dataset-initializer", "model-initializer"):
        refs = env_refs(_container(jobs[job]))
        # Credentials only by reference to optional Secrets, never as literal values.
        assert refs["HF_TOKEN"] == {
            "secretKeyRef": {"name": "tunepack-hub-token", "key": "token", "optional": True}
        }
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            assert refs[name] == {
                "secretKeyRef": {"name": "tunepack-s3-credentials", "key": name, "optional": True}
            }
        assert not {"HF_TOKEN", "ACCESS_TOKEN", "AWS_SECRET_ACCESS_KEY"} & set(
            env(_container(jobs[job]))
        )
    trainer_env = env(_container(jobs["node"]))
    refs = env_refs(_container(jobs["node"]))
    # The tracker's credentials, by reference to one optional Secret (a run without one works);
    # the job's name and uid from JobSet's pod labels (tests/integration/test_workspace_owner.py).
    job_refs = {"TUNEPACK_JOB_NAME", "TUNEPACK_JOB_UID"}
    assert job_refs <= set(refs)
    assert {k: v for k, v in refs.items() if k not in job_refs} == {
        name: {
            "secretKeyRef": {"name": "tunepack-tracker-credentials", "key": name, "optional": True}
        }
        for name in (
            "MLFLOW_TRACKING_TOKEN",
            "MLFLOW_TRACKING_USERNAME",
            "MLFLOW_TRACKING_PASSWORD",
            "WANDB_API_KEY",
        )
    }
    assert trainer_env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert trainer_env["TOKENIZERS_PARALLELISM"] == "false"
    assert trainer_env["NCCL_DEBUG"] == "WARN"
    assert trainer_env["HF_HUB_OFFLINE"] == "1"


def test_trainer_resources_and_shm():
    gpu_node, cpu_node = _jobs(build_runtime(GPU))["node"], _jobs(build_runtime(TINY))["node"]
    assert _container(gpu_node)["resources"] == {
        "requests": host.trainer_requests(GPU),
        "limits": {"nvidia.com/gpu": GPU.resources.gpus},
    }
    assert "limits" not in _container(cpu_node)["resources"]  # the tiny model runs on CPU
    for node, size in ((gpu_node, "16Gi"), (cpu_node, "1Gi")):
        (shm,) = pod_spec(node)["volumes"]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": size}
        assert {"name": shm["name"], "mountPath": "/dev/shm"} in _container(node)["volumeMounts"]
    for name in ("dataset-initializer", "model-initializer"):
        requests = _container(_jobs(build_runtime(GPU))[name])["resources"]["requests"]
        assert set(requests) == {"cpu", "memory"}


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_security_context(entry):
    for job in _jobs(build_runtime(entry)).values():
        assert pod_spec(job)["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        assert _container(job)["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }


def test_bad_input_exit_code_is_not_retried():
    jobset = contract.jobset_spec(build_runtime(GPU))
    (rule,) = jobset["failurePolicy"]["rules"]
    assert rule["action"] == "FailJobSet"
    assert rule["onJobFailureReasons"] == ["PodFailurePolicy"]
    for job in replicated_jobs(build_runtime(GPU)):
        fail_job = contract.job_spec(job)["podFailurePolicy"]["rules"][0]
        assert fail_job["action"] == "FailJob"
        assert fail_job["onExitCodes"]["values"] == [EXIT_BAD_INPUT]
        assert fail_job["onExitCodes"]["containerName"] == job["name"]
        assert pod_spec(job)["restartPolicy"] == "Never"  # required by podFailurePolicy


# --- the catalog views --------------------------------------------------------------------------


def test_list_runtimes():
    rows = {row["name"]: row for row in list_runtimes()}
    assert sorted(rows) == sorted(entry.runtime_name for entry in ENTRIES)
    tiny = rows[TINY.runtime_name]
    assert tiny["model"] == "tiny-llama3"
    assert tiny["methods"] == [
        "full",
        "grpo_full",
        "lora",
        "dora",
        "dpo",
        "orpo",
        "kto",
        "grpo",
    ]  # too small for NF4: no qlora
    assert tiny["params"] == TINY.parameter_count
    assert tiny["gpus"] == 0


def test_load_unknown_runtime_lists_the_known_ones():
    with pytest.raises(UnknownRuntimeError) as caught:
        load_runtime("tunepack-gpt-5")
    known = ", ".join(entry.runtime_name for entry in catalog.CATALOG.values())
    assert str(caught.value) == (
        f"unknown runtime or model 'tunepack-gpt-5'; tunepack runtimes are: {known}"
    )
    assert caught.value.runtime == "tunepack-gpt-5"


# --- strict validation --------------------------------------------------------------------------


def test_misspelled_field_is_caught_with_its_path():
    runtime = build_runtime(GPU)
    node = _container(_jobs(runtime)["node"])
    node["volumeMount"] = node.pop("volumeMounts")
    with pytest.raises(BadValueError) as caught:
        validate_runtime(runtime)
    message = str(caught.value)
    path = "spec.template.spec.replicatedJobs[2].template.spec.template.spec.containers[0]"
    assert f"{path}.volumeMount: unknown field (did you mean 'volumeMounts'?)" in message


def test_every_lost_field_is_listed():
    runtime = build_runtime(GPU)
    runtime["spec"]["mlPolicy"]["torch"]["numProcPerNode"] = 2  # removed in v2.3
    runtime["metadata"]["lables"] = {}
    message = _failure(runtime)
    assert "spec.mlPolicy.torch.numProcPerNode: unknown field here" in message
    assert "metadata.lables: unknown field (did you mean 'labels'?)" in message


def test_wrong_type_names_the_path():
    runtime = build_runtime(GPU)
    runtime["spec"]["mlPolicy"]["numNodes"] = "1"
    assert "spec.mlPolicy.numNodes: Input should be a valid integer (got '1')" in _failure(runtime)


def test_benign_normalizations_are_accepted():
    runtime = build_runtime(GPU)
    node = _container(_jobs(runtime)["node"])
    node["resources"]["limits"]["nvidia.com/gpu"] = 2  # comes back as 2.0
    node["args"] = None  # null means absent; the round trip drops it
    node["ports"] = [{"containerPort": 29500}]  # comes back with protocol: TCP added
    runtime["metadata"]["creationTimestamp"] = "2025-01-01T00:00:00Z"  # comes back a datetime
    validate_runtime(runtime)


def test_bool_is_not_an_int():
    runtime = build_runtime(GPU)
    runtime["spec"]["mlPolicy"]["numNodes"] = True
    assert "spec.mlPolicy.numNodes" in _failure(runtime)


def test_validate_trainjob_rejects_typos():
    trainjob = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": "x"},
        "spec": {"runtimeRef": {"name": TINY.runtime_name}, "trainer": {"arg": ["epochs=1"]}},
    }
    fixed = copy.deepcopy(trainjob)
    fixed["spec"]["trainer"]["args"] = fixed["spec"]["trainer"].pop("arg")
    validate_trainjob(fixed)
    with pytest.raises(BadValueError) as err:
        validate_trainjob(trainjob)
    assert str(err.value) == (
        "TrainJob 'x' has fields the Kubeflow Trainer API does not know or cannot keep (they "
        "would be silently dropped):\n  spec.trainer.arg: unknown field (did you mean 'args'?)"
    )


def _failure(obj: dict) -> str:
    with pytest.raises(BadValueError) as caught:
        validate_runtime(obj)
    return str(caught.value)


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_trainer_pod_outlasts_torchruns_checkpoint_grace(entry):
    """SIGTERM -> checkpoint -> exit 75 needs torchrun's 30 s grace and then some."""
    pods = {job["name"]: pod_spec(job) for job in replicated_jobs(build_runtime(entry))}
    assert pods["node"]["terminationGracePeriodSeconds"] > 30
    assert "terminationGracePeriodSeconds" not in pods["dataset-initializer"]


# RFC 1123 subdomain: what the API server accepts as a cluster-scoped object's name.
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_every_runtime_name_is_a_kubernetes_name(entry):
    """An underscore (tunepack-qwen3_moe-custom) made the API server refuse the whole install;
    only the control-plane tier saw it."""
    name = build_runtime(entry)["metadata"]["name"]
    assert _SUBDOMAIN.fullmatch(name) and len(name) <= 253, name
