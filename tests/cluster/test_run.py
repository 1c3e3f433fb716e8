"""Real runs: the whole platform, and tunepack's programs executed for real.

The TrainJob goes through the real apiserver, webhooks, Trainer, JobSet, Job controller and
scheduler; the pods land on the real node, whose kubelet runs the dataset-initializer,
model-initializer and trainer in tunepack's images under containerd, with the env, args and
volumes the control plane resolved, and reports their real exit codes. The result is read from
the volume behind the TrainJob's PVC (a hostPath PV of the tier's provisioner).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.cluster import kube

pytestmark = pytest.mark.controlplane

TINY = "tunepack-tiny-llama3"
RUN_TIMEOUT = 600


def _client(namespace: str):
    return kube.training_client(namespace)


def _train(namespace, sources, **finetune):
    from tunepack import FineTune, Initializer

    return _client(namespace).train(
        runtime=TINY,
        initializer=Initializer(dataset=sources["dataset"], model=sources["model"]),
        trainer=FineTune(**finetune),
    )


def _volume(api, namespace: str, name: str) -> Path:
    """The host directory behind the TrainJob's workspace PVC (a hostPath PV)."""
    pvc = api.core.read_namespaced_persistent_volume_claim(f"initializer-{name}", namespace)
    pv = api.core.read_persistent_volume(pvc.spec.volume_name)
    return Path(pv.spec.host_path.path)


def training_pod(api, namespace: str, job: str):
    """The trainer pod of TrainJob ``job`` once it runs and has logged its first metrics (so
    that a signal now interrupts training, not its start)."""

    def running():
        selector = (
            f"jobset.sigs.k8s.io/jobset-name={job},jobset.sigs.k8s.io/replicatedjob-name=node"
        )
        return next((p for p in api.pods(namespace, selector) if p.status.phase == "Running"), None)

    pod = kube.wait_for(running, RUN_TIMEOUT, f"{job}'s trainer pod to run")
    kube.wait_for(
        lambda: (_volume(api, namespace, job) / "output" / "metrics.jsonl").exists(),
        RUN_TIMEOUT,
        f"{job}'s first metrics",
    )
    return pod


def test_sdk_trains_tiny_llama3_for_real(
    api, controlplane, namespace, installed_runtimes, on_node, sources
):
    client = _client(namespace)
    name = _train(namespace, sources, method="lora", epochs=2)
    job = client.wait_for_job_status(name, timeout=RUN_TIMEOUT)
    assert job.status == "Complete", api.diagnose(namespace, name)

    out = _volume(api, namespace, name) / "output"
    result = json.loads((out / "result.json").read_text())
    assert result["method"] == "lora"
    assert result["final_loss"] < result["first_loss"]
    adapter = out / "adapter"
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").stat().st_size > 0
    # Written by the pods' user, not root: the runtime's securityContext was honoured.
    assert (adapter / "adapter_model.safetensors").stat().st_uid == 1000

    # The adapter loads in peft over the base model the model initializer verified.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(_volume(api, namespace, name) / "model")
    PeftModel.from_pretrained(base, adapter)

    # Every step ran in its image on the real node, as its kubelet reports containerd's
    # containers: the image ID of this machine's build.
    ran = {}
    for pod in api.pods(namespace):
        assert pod.spec.node_name == api.real_node()
        images = {c.name: c.image for c in pod.spec.containers}
        for cs in pod.status.container_statuses:
            assert cs.container_id.startswith("containerd://"), cs
            ran[images[cs.name]] = cs.image_id  # the status's `image` may be another name
    assert ran == {image: kube.local_image_id(image) for image in ran}
    assert len(ran) == 3  # dataset-initializer, model-initializer, trainer

    # Logs through the apiserver, from the kubelet: each metrics line the trainer wrote to the
    # volume is in what the SDK, `tunepack logs` and `kubectl logs` show of its pod.
    metrics = (out / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) >= 2
    sdk = "\n".join(client.get_job_logs(name)).splitlines()
    cli = kube.tunepack("logs", name, "--namespace", namespace, kubeconfig=controlplane.kubeconfig)
    assert cli.returncode == 0, cli.stderr
    (trainer,) = api.pods(namespace, "jobset.sigs.k8s.io/replicatedjob-name=node")
    shown = kube.kubectl(
        "logs", trainer.metadata.name, "--namespace", namespace, kubeconfig=controlplane.kubeconfig
    )
    assert shown.returncode == 0, shown.stderr
    for lines in (sdk, cli.stdout.splitlines(), shown.stdout.splitlines()):
        assert all(line in lines for line in metrics), lines[-20:]


def test_two_nodes_rendezvous_with_the_platforms_ranks(
    api, namespace, installed_runtimes, on_node, sources
):
    """Two trainer pods (1 CPU each: both fit the real node's 2) rendezvous through the JobSet's
    pod DNS name (cluster DNS on the real node) with the ranks the platform gave them."""
    client = _client(namespace)
    name = _train(
        namespace, sources, method="lora", epochs=1, num_nodes=2, resources_per_node={"cpu": 1}
    )
    job = client.wait_for_job_status(name, timeout=RUN_TIMEOUT)
    assert job.status == "Complete", api.diagnose(namespace, name)
    pods = api.pods(namespace, "jobset.sigs.k8s.io/replicatedjob-name=node")
    ranks = sorted(p.metadata.annotations["batch.kubernetes.io/job-completion-index"] for p in pods)
    assert ranks == ["0", "1"]
    result = json.loads((_volume(api, namespace, name) / "output" / "result.json").read_text())
    assert result["world_size"] == 2
    assert result["final_loss"] < result["first_loss"]


def test_bad_input_fails_at_once_without_retries(
    api, namespace, installed_runtimes, on_node, sources
):
    """Exit 65 from the dataset initializer: the Job's podFailurePolicy fails it, the JobSet's
    BadInput rule fails the JobSet, the TrainJob is Failed, nothing is retried."""
    from tunepack import FineTune, Initializer

    missing = sources["dataset"].replace("instructions.jsonl", "no-such-file.jsonl")
    name = _client(namespace).train(
        runtime=TINY,
        initializer=Initializer(dataset=missing, model=sources["model"]),
        trainer=FineTune(method="lora", epochs=1),
    )
    assert api.wait_finished(namespace, name, timeout=RUN_TIMEOUT) == "Failed"
    pods = api.pods(namespace, "jobset.sigs.k8s.io/replicatedjob-name=dataset-initializer")
    assert len(pods) == 1
    terminated = pods[0].status.container_statuses[0].state.terminated
    assert terminated.exit_code == 65
    assert "no-such-file.jsonl" in (terminated.message or "")
    assert api.jobset(namespace, name)["status"].get("restarts", 0) == 0
    assert not api.pods(namespace, "jobset.sigs.k8s.io/replicatedjob-name=node")


def _wait_for_checkpoint(api, namespace, name):
    def checkpointed():
        try:
            root = _volume(api, namespace, name) / "checkpoints"
        except Exception:
            return None
        return root.is_dir() and any(
            p.is_dir() and not p.name.startswith(".") for p in root.iterdir()
        )

    kube.wait_for(
        checkpointed,
        RUN_TIMEOUT,
        "a complete checkpoint",
        interval=0.5,
        diagnose=lambda: api.diagnose(namespace, name),
    )


def _trainer_pid(api, controlplane, namespace: str, name: str) -> int:
    """The PID of the trainer container's main process (containerd's task of it)."""
    from tests.controlplane.node import task_pid

    pod = training_pod(api, namespace, name)
    status = next(cs for cs in pod.status.container_statuses if cs.name == "node")
    return task_pid(kube.tier_root(controlplane), status.container_id)


def test_a_killed_trainer_is_restarted_and_resumes(
    api, controlplane, namespace, installed_runtimes, on_node, sources
):
    """SIGKILL of the trainer container's process (a crash): the JobSet restarts, the trainer
    resumes from its newest checkpoint and the TrainJob completes."""
    name = _train(namespace, sources, method="lora", epochs=6, checkpoint_every_steps=8)
    _wait_for_checkpoint(api, namespace, name)
    os.kill(_trainer_pid(api, controlplane, namespace, name), signal.SIGKILL)

    job = _client(namespace).wait_for_job_status(name, timeout=RUN_TIMEOUT)
    assert job.status == "Complete", api.diagnose(namespace, name)
    assert api.jobset(namespace, name)["status"]["restarts"] == 1
    result = json.loads((_volume(api, namespace, name) / "output" / "result.json").read_text())
    assert result["resumed_from_step"] >= 8


def test_an_evicted_trainer_checkpoints_exits_75_and_resumes(
    api, namespace, installed_runtimes, on_node, sources
):
    """Deleting the trainer pod (what a preemption does): SIGTERM, a checkpoint, exit 75; the
    failure is retriable, the JobSet restarts and the trainer resumes where it stopped."""
    name = _train(namespace, sources, method="lora", epochs=6, checkpoint_every_steps=1000)
    pod = training_pod(api, namespace, name)
    exit_codes = kube.watch_exit_codes(api, namespace, pod.metadata.name)
    api.core.delete_namespaced_pod(pod.metadata.name, namespace)
    assert kube.wait_for(lambda: exit_codes.get("node"), 120, "the evicted pod's exit code") == 75
    job = _client(namespace).wait_for_job_status(name, timeout=RUN_TIMEOUT)
    assert job.status == "Complete", api.diagnose(namespace, name)
    assert api.jobset(namespace, name)["status"]["restarts"] == 1
    # The checkpoint taken at SIGTERM (none was due: checkpoint_every_steps=1000) was resumed.
    result = json.loads((_volume(api, namespace, name) / "output" / "result.json").read_text())
    assert result["resumed_from_step"] >= 1


# ------------------------------------------------------------- Llama 3.2 Vision, for real

VISION = "tunepack-llama3.2-vision-11b"
_COLORS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (30, 60, 220)}


@pytest.fixture(scope="session")
def vision_sources(s3_sources):
    """A tiny random Llama 3.2 Vision checkpoint (indexed as the published ones are; the
    runtime builds any size from config.json) and a picture dataset whose rows name their images
    by s3:// URL, in the S3 the pods read with the namespace's Secret."""
    import shutil
    import tempfile

    from PIL import Image, ImageDraw
    from safetensors import safe_open

    from tunepack.runtimes import catalog
    from tunepack.tiny import write_tiny_model

    root = Path(tempfile.mkdtemp(prefix="tunepack-vision-"))
    try:
        model = write_tiny_model(root / "tiny-mllama", catalog.TINY_VISION["mllama"])
        with safe_open(model / "model.safetensors", "pt") as weights:
            weight_map = dict.fromkeys(weights.keys(), "model.safetensors")
        index = {"metadata": {}, "weight_map": weight_map}
        (model / "model.safetensors.index.json").write_text(json.dumps(index))
        (root / "vision" / "pics").mkdir(parents=True)
        rows = []
        for n in range(8):
            color = list(_COLORS)[n % 3]
            picture = Image.new("RGB", (30 + 10 * (n % 4), 40), (245, 245, 245))
            ImageDraw.Draw(picture).rectangle((6, 8, 24, 32), fill=_COLORS[color])
            picture.save(root / "vision" / "pics" / f"{n}.png")
            rows.append({
                "messages": [
                    {"role": "user", "content": [
                        {"type": "image"}, {"type": "text", "text": "What color is the square?"}
                    ]},
                    {"role": "assistant", "content": f"The square is {color}."},
                ],
                "images": [f"s3://sources/vision/pics/{n}.png"],
            })  # fmt: skip
        lines = "".join(json.dumps(row) + "\n" for row in rows)
        (root / "vision" / "train.jsonl").write_text(lines)
        for path in root.rglob("*"):
            if path.is_file():
                key = path.relative_to(root).as_posix()
                s3_sources["client"].upload_file(str(path), "sources", key)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"model": "s3://sources/tiny-mllama", "dataset": "s3://sources/vision/train.jsonl"}


def test_the_vision_runtime_trains_on_images_for_real(
    api, namespace, installed_runtimes, on_node, sources, vision_sources
):
    """The published Llama 3.2 Vision runtime through the whole platform: the dataset
    initializer fetches and checks each picture from S3 (Pillow, in its image), the model
    initializer the checkpoint, and the trainer (torchvision, in its image) trains LoRA on the
    text model and the projector; CPU pods of 1 CPU and 4 GiB (the runtime asks 2 GPUs, 16 CPUs
    and 160 GiB: resources_per_node replaces them), one process."""
    from tunepack import FineTune, Initializer

    client = _client(namespace)
    name = client.train(
        runtime=VISION,
        initializer=Initializer(dataset=vision_sources["dataset"], model=vision_sources["model"]),
        trainer=FineTune(
            method="lora", max_steps=6, epochs=10, lr=3e-3, warmup_steps=0, batch_size=4,
            lora_projector=True, num_proc_per_node=1,
            resources_per_node={"gpu": 0, "cpu": 1, "memory": "4Gi"},
        ),
    )  # fmt: skip
    job = client.wait_for_job_status(name, timeout=RUN_TIMEOUT)
    assert job.status == "Complete", api.diagnose(namespace, name)

    volume = _volume(api, namespace, name)
    manifest = json.loads((volume / "dataset" / "tunepack-manifest.json").read_text())
    assert manifest["schema"] == "image_chat" and manifest["images"]["count"] == 8
    normalized = (volume / "dataset" / "train.jsonl").read_text()
    assert "s3://" not in normalized  # rows name the checked copies, never the URLs
    result = json.loads((volume / "output" / "result.json").read_text())
    assert (result["method"], result["chat_template"]) == ("lora", "llama3.2-vision")
    assert result["final_loss"] < result["first_loss"]
    adapter = volume / "output" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert "multi_modal_projector" in config["target_modules"]
    assert (adapter / "adapter_model.safetensors").stat().st_uid == 1000
    ran = {c.image for pod in api.pods(namespace) for c in pod.spec.containers}
    assert len(ran) == 3, ran  # dataset-initializer, model-initializer, trainer
