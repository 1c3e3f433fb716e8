"""Upstream artefacts keep their meaning on the real platform (issue 29), one test per finding.

Each is written from the upstream artefact's shape (a notebook's ``BuiltinTrainer`` /
``TorchTuneConfig`` / ``HuggingFace*Initializer``, or TrainJob YAML as a person writes it) and
judged on what the real apiserver, Trainer and JobSet made of it: the rendered pods, their env and
resources, the workspace the dataset initializer wrote. Finding 1 (TrainJobs that cannot run are
refused at admission) is ``test_admission.py``.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from tests.cluster import kube
from tunepack.runtimes.contract import container, replicated_job

pytestmark = pytest.mark.controlplane

TINY = "tunepack-tiny-llama3"  # CPU: node requests cpu 2
GPU_RUNTIME = "tunepack-llama3.2-1b"  # node limits nvidia.com/gpu 1
HUB_DATASET = "hf://datasets/tatsu-lab/alpaca"
HUB_MODEL = "hf://meta-llama/Llama-3.2-1B-Instruct"
RUN_TIMEOUT = 600


def _node_pod(api, namespace: str, name: str, timeout: float = 60):
    """The first trainer pod JobSet created for TrainJob ``name`` (after the initializers)."""
    selector = f"jobset.sigs.k8s.io/jobset-name={name},jobset.sigs.k8s.io/replicatedjob-name=node"
    return kube.wait_for(
        lambda: next(iter(api.pods(namespace, selector)), None),
        timeout,
        f"the node pod of {namespace}/{name}",
        diagnose=lambda: api.diagnose(namespace, name),
    )


def _node_container(pod):
    node = next(c for c in pod.spec.containers if c.name == "node")
    env = {e.name: e.value for e in node.env or []}
    return node.resources, env


def _raw_trainjob(runtime: str, trainer: dict, **spec) -> dict:
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": f"up-{uuid.uuid4().hex[:8]}"},
        "spec": {
            "runtimeRef": {"name": runtime},
            "initializer": {
                "dataset": {"storageUri": HUB_DATASET},
                "model": {"storageUri": HUB_MODEL},
            },
            "trainer": {"args": ["method=lora"], **trainer},
            **spec,
        },
    }


# --- 2: TorchTuneConfig without peft_config is a full fine-tune ----------------------------------


def test_torchtune_config_without_peft_is_a_full_fine_tune(
    api, namespace, installed_runtimes, on_kwok
):
    from kubeflow.trainer import BuiltinTrainer, TorchTuneConfig

    from tunepack import Initializer

    client = kube.training_client(namespace)
    name = client.train(
        runtime=GPU_RUNTIME,
        initializer=Initializer(dataset=HUB_DATASET, model=HUB_MODEL),
        trainer=BuiltinTrainer(config=TorchTuneConfig(epochs=1)),
    )
    js = api.wait_jobset(namespace, name)
    assert sorted(container(replicated_job(js, "node"), "node")["args"]) == [
        "epochs=1",
        "method=full",
    ]
    assert api.wait_finished(namespace, name) == "Complete"


# --- 3: Parquet, a split slice, access_token ------------------------------------------------------


@pytest.fixture
def parquet_sources(sources, s3_sources):
    """A hub-style Parquet dataset (two train shards) beside the tiny model, in the tier's S3."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"instruction": f"Say {i}.", "input": "", "output": f"{i}"} for i in range(120)]
    for shard, part in enumerate((rows[:70], rows[70:])):
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(part), buf)
        s3_sources["client"].put_object(
            Bucket="sources",
            Key=f"alpaca/data/train-0000{shard}-of-00002.parquet",
            Body=buf.getvalue(),
        )
    return {"dataset": "s3://sources/alpaca", "model": sources["model"]}


def test_the_notebooks_parquet_split_slice_trains_on_those_rows(
    api, namespace, installed_runtimes, on_node, parquet_sources
):
    from kubeflow.trainer import (
        BuiltinTrainer,
        DataFormat,
        LoraConfig,
        TorchTuneConfig,
        TorchTuneInstructDataset,
    )

    from tunepack import Initializer

    client = kube.training_client(namespace)
    name = client.train(
        runtime=TINY,
        initializer=Initializer(**parquet_sources),
        trainer=BuiltinTrainer(
            config=TorchTuneConfig(
                epochs=1,
                peft_config=LoraConfig(lora_rank=4),
                dataset_preprocess_config=TorchTuneInstructDataset(
                    source=DataFormat.PARQUET, split="train[:10%]"
                ),
            )
        ),
    )
    job = client.wait_for_job_status(name, timeout=RUN_TIMEOUT)
    assert job.status == "Complete", api.diagnose(namespace, name)
    # The workspace the real dataset initializer wrote: 10% of the 120 rows, from Parquet.
    pvc = api.core.read_namespaced_persistent_volume_claim(f"initializer-{name}", namespace)
    volume = Path(api.core.read_persistent_volume(pvc.spec.volume_name).spec.host_path.path)
    manifest = json.loads((volume / "dataset" / "tunepack-manifest.json").read_text())
    assert manifest["rows"] == 12 and manifest["split_rows"] == 120
    assert (manifest["split"], manifest["slice"]) == ("train", "train[:10%]")
    assert manifest["source_format"] == "parquet"
    rows = (volume / "dataset" / "train.jsonl").read_text().splitlines()
    assert [json.loads(r)["instruction"] for r in rows] == [f"Say {i}." for i in range(12)]


def test_an_access_token_never_reaches_the_cluster_and_the_secret_way_works(
    api, controlplane, namespace, installed_runtimes, on_kwok
):
    from kubeflow.trainer import HuggingFaceDatasetInitializer, HuggingFaceModelInitializer
    from kubeflow.trainer import Initializer as KfInitializer

    from tunepack import FineTune, Initializer
    from tunepack.core.errors import BadInputError

    token = "hf_" + uuid.uuid4().hex
    client = kube.training_client(namespace)
    with pytest.raises(BadInputError) as err:
        client.train(
            runtime=GPU_RUNTIME,
            initializer=KfInitializer(
                dataset=HuggingFaceDatasetInitializer(storage_uri="tatsu-lab/alpaca"),
                model=HuggingFaceModelInitializer(
                    storage_uri="meta-llama/Llama-3.2-1B-Instruct", access_token=token
                ),
            ),
            trainer=FineTune(method="lora"),
        )
    assert token not in str(err.value)
    assert "model_secret='hf-token'" in str(err.value)
    assert not api.custom.list_namespaced_custom_object(
        kube.GROUP, kube.VERSION, namespace, "trainjobs"
    )["items"]

    # What the message says to do.
    created = kube.kubectl(
        "create",
        "secret",
        "generic",
        "hf-token",
        "-n",
        namespace,
        f"--from-literal=HF_TOKEN={token}",
        kubeconfig=controlplane.kubeconfig,
    )
    assert created.returncode == 0, created.stderr
    name = client.train(
        runtime=GPU_RUNTIME,
        initializer=Initializer(
            dataset=HuggingFaceDatasetInitializer(storage_uri="tatsu-lab/alpaca"),
            model=HuggingFaceModelInitializer(storage_uri="meta-llama/Llama-3.2-1B-Instruct"),
            model_secret="hf-token",
        ),
        trainer=FineTune(method="lora"),
    )
    js = api.wait_jobset(namespace, name)
    model = container(replicated_job(js, "model-initializer"), "model-initializer")
    assert {"secretRef": {"name": "hf-token"}} in model.get("envFrom", [])
    assert token not in json.dumps(api.trainjob(namespace, name)) + json.dumps(js)
    assert api.wait_finished(namespace, name) == "Complete"


# --- 4: resourcesPerNode is merged into the runtime's resources ----------------------------------


def test_a_cpu_only_request_on_a_gpu_runtime_runs_one_process_per_gpu_the_pod_holds(
    api, namespace, installed_runtimes, on_kwok
):
    from kubeflow.trainer import BuiltinTrainer, LoraConfig, TorchTuneConfig

    from tunepack import Initializer

    client = kube.training_client(namespace)
    name = client.train(
        runtime="tunepack-qwen2.5-14b",  # node limits nvidia.com/gpu 2
        initializer=Initializer(dataset=HUB_DATASET, model="hf://Qwen/Qwen2.5-14B-Instruct"),
        trainer=BuiltinTrainer(
            config=TorchTuneConfig(
                peft_config=LoraConfig(), resources_per_node={"cpu": 4, "memory": "8Gi"}
            )
        ),
    )
    resources, env = _node_container(_node_pod(api, namespace, name))
    # The Trainer merged the request into the runtime's resources: its 2 GPUs stayed
    # (and Kubernetes defaults their request from the limit).
    assert resources.limits == {"cpu": "4", "memory": "8Gi", "nvidia.com/gpu": "2"}
    assert resources.requests == {"cpu": "4", "memory": "8Gi", "nvidia.com/gpu": "2"}
    assert env["PET_NPROC_PER_NODE"] == "2"  # one process per GPU the pod holds
    assert api.wait_finished(namespace, name) == "Complete"


def test_gpu_0_asks_for_no_gpu_and_gets_none(api, namespace, installed_runtimes, on_kwok):
    from tunepack import FineTune, Initializer

    client = kube.training_client(namespace)
    name = client.train(
        runtime=GPU_RUNTIME,
        initializer=Initializer(dataset=HUB_DATASET, model=HUB_MODEL),
        trainer=FineTune(method="lora", resources_per_node={"cpu": 4, "gpu": 0}),
    )
    pod = _node_pod(api, namespace, name)
    resources, env = _node_container(pod)
    assert resources.limits["nvidia.com/gpu"] == "0"
    assert env["PET_NPROC_PER_NODE"] == "1"
    assert api.wait_finished(namespace, name) == "Complete"


# --- 5: numProcPerNode left unset (raw YAML, the upstream SDK's TrainerClient) -------------------


@pytest.mark.parametrize(
    ("runtime", "resources", "procs", "gpus"),
    [
        (TINY, None, "2", None),  # the runtime's CPU request
        (TINY, {"requests": {"cpu": 8}}, "8", None),  # the TrainJob's CPU request
        # The torch plugin counts on the request alone while the pod keeps the runtime's GPU:
        # 3 processes on a pod with one GPU (docs/cluster.md says to set numProcPerNode).
        (GPU_RUNTIME, {"requests": {"cpu": 3}}, "3", "1"),
    ],
)
def test_num_proc_per_node_unset_takes_the_cpu_request(
    api, controlplane, namespace, installed_runtimes, on_kwok, runtime, resources, procs, gpus
):

    trainer = {"resourcesPerNode": resources} if resources else {}
    obj = _raw_trainjob(runtime, trainer)
    created = kube.create(obj, namespace, kubeconfig=controlplane.kubeconfig)
    assert created.returncode == 0, created.stderr
    name = obj["metadata"]["name"]
    limits, env = _node_container(_node_pod(api, namespace, name))
    assert env["PET_NPROC_PER_NODE"] == procs
    assert (limits.limits or {}).get("nvidia.com/gpu") == gpus


# --- 6: the exporter is a step --------------------------------------------------------------


def test_the_exporter_is_one_of_the_jobs_steps(api, namespace, installed_runtimes, on_kwok):
    from tunepack import FineTune, Initializer

    client = kube.training_client(namespace)
    name = client.train(
        runtime=TINY,
        initializer=Initializer(dataset="file:///data/x.jsonl", model="file:///models/tiny"),
        trainer=FineTune(method="lora", export="s3://results/run-1"),
    )
    assert api.wait_finished(namespace, name) == "Complete"
    steps = {s.name: s.status for s in client.get_job(name).steps}
    assert steps.get("exporter") == "Succeeded", steps
    assert {"dataset-initializer", "model-initializer"} <= set(steps)


# --- 7: a suspended TrainJob already holds its workspace PVC ------------------------------------


def test_a_suspended_trainjob_holds_its_workspace_pvc(
    api, controlplane, namespace, installed_runtimes, on_kwok
):

    obj = _raw_trainjob(TINY, {"numProcPerNode": 1}, suspend=True)
    name = obj["metadata"]["name"]
    created = kube.create(obj, namespace, kubeconfig=controlplane.kubeconfig)
    assert created.returncode == 0, created.stderr
    read = api.core.read_namespaced_persistent_volume_claim
    pvc = kube.wait_for(
        lambda: kube._get_or_none(lambda: read(f"initializer-{name}", namespace)),
        60,
        f"the workspace PVC of the suspended TrainJob {name}",
        diagnose=lambda: api.diagnose(namespace, name),
    )
    assert pvc.spec.resources.requests["storage"] == "1Gi"
    assert api.trainjob(namespace, name)["spec"]["suspend"] is True
    assert not api.pods(namespace)  # nothing runs, yet the claim is there
