"""Serving a result with vLLM: the manifest follows what was trained (issue 12, item 5)."""

from __future__ import annotations

import pytest
import yaml

from tunepack.cli import main
from tunepack.core.errors import BadInputError
from tunepack.tools import serving

RUNTIME = "tunepack-llama3.1-8b"


def _render(capsys, *argv: str) -> tuple[int, list[dict], str]:
    code = main(["render", "serving", "--runtime", RUNTIME, "--name", "my-job", *argv])
    out, err = capsys.readouterr()
    return code, [o for o in yaml.safe_load_all(out) if o], err


def _args(objects: list[dict]) -> list[str]:
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_kustomize_manifest_is_the_builders_output():
    assert serving.MANIFEST.read_text() == serving.manifest_text(), (
        "manifests/serving/vllm.yaml is stale: run python -m tunepack.tools.serving"
    )


@pytest.mark.parametrize(
    ("rank", "expected"), [(1, 1), (8, 8), (16, 16), (17, 32), (100, 128), (300, 320), (512, 512)]
)
def test_max_lora_rank_is_the_smallest_vllm_accepts_above_the_trained_rank(rank, expected):
    assert serving.max_lora_rank(rank) == expected


def test_a_lora_run_is_served_as_base_plus_adapter_from_its_pvc(capsys):
    code, objects, err = _render(capsys, "lora_rank=48", "epochs=2")
    assert code == 0, err
    assert _args(objects) == [
        "--model=/workspace/model",
        "--served-model-name=base",
        "--enable-lora",
        "--lora-modules=tunepack-lora=/workspace/output/adapter",
        "--max-lora-rank=64",
        "--port=8000",
    ]
    pod = objects[0]["spec"]["template"]["spec"]
    claim = pod["volumes"][0]["persistentVolumeClaim"]
    assert claim == {"claimName": "initializer-my-job", "readOnly": True}
    assert [o["kind"] for o in objects] == ["Deployment", "Service"]


def test_the_catalog_default_rank_is_served_without_arguments(capsys):
    code, objects, _ = _render(capsys)
    assert code == 0
    assert "--max-lora-rank=16" in _args(objects)  # llama3.1-8b's default lora_rank is 16


@pytest.mark.parametrize(
    ("argv", "model"),
    [
        (["method=full"], "/workspace/output/model"),
        (["method=dora", "merge=true"], "/workspace/output/merged"),
        (["merge=true"], "/workspace/output/merged"),
    ],
)
def test_full_and_merged_results_are_served_without_lora(capsys, argv, model):
    code, objects, err = _render(capsys, *argv)
    assert code == 0, err
    args = _args(objects)
    assert args[0] == f"--model={model}"
    assert not [a for a in args if "lora" in a]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["method=dora"],
            "tunepack: error: method=dora: vLLM does not load DoRA adapters; train with "
            "merge=true as well and serve the merged model",
        ),
        (
            ["lora_rank=600"],
            "tunepack: error: lora_rank=600: vLLM serves LoRA adapters up to rank 512; train "
            "with merge=true and serve the merged model instead",
        ),
        (["lora_rank=0"], "tunepack: error: lora_rank='0' is not valid: expected an integer"),
        (["--gpus", "0"], "tunepack: error: --gpus 0 is not valid: expected at least 1"),
        (
            ["--name", "My_Job"],
            "tunepack: error: TrainJob name (--name) 'My_Job' is not a valid DNS-1123",
        ),
    ],
)
def test_what_vllm_cannot_serve_is_refused_in_one_line(capsys, argv, message):
    code, objects, err = _render(capsys, *argv)
    assert code == 65 and objects == []
    assert err.startswith(message), err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [[], ["merge=true"], ["method=full"]])
def test_a_vision_model_is_refused_saying_what_to_do_instead(capsys, argv):
    """The serving image's vLLM (v0.11) no longer has Llama 3.2 Vision (encoder-decoder models
    other than Whisper were dropped); its V0 engine never took LoRA on it."""
    code = main(["render", "serving", "--runtime", "tunepack-llama3.2-vision-11b", "--name",
                 "my-job", *argv])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 65 and out == ""
    assert err == (
        "tunepack: error: llama3.2-vision-11b: vLLM v0.11.0 does not serve Llama 3.2 Vision (it "
        "dropped encoder-decoder models in v0.11); train with merge=true and serve the merged "
        "model with transformers (docs/serving.md, Llama 3.2 Vision)\n"
    )


def test_served_result_refuses_an_unknown_runtime():
    with pytest.raises(BadInputError, match="unknown runtime or model 'tunepack-nope'"):
        serving.served_result("tunepack-nope", [])


def test_each_served_result_has_its_own_deployment_service_and_chat_template(capsys):
    """Two results served in one namespace: nothing of one replaces or selects the other."""
    served = {}
    for job in ("run-a", "run-b"):
        code = main(["render", "serving", "--runtime", "tunepack-qwen3-0.6b", "--name", job])
        out, err = capsys.readouterr()
        assert code == 0, err
        served[job] = {o["kind"]: o for o in yaml.safe_load_all(out) if o}
    for job, objects in served.items():
        assert {kind: o["metadata"]["name"] for kind, o in objects.items()} == {
            "Deployment": f"{job}-vllm",
            "Service": f"{job}-vllm",
            "ConfigMap": f"{job}-vllm-chat-template",  # Qwen 3 is served with its template
        }
        deployment, service = objects["Deployment"], objects["Service"]
        pod = deployment["spec"]["template"]
        assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        assert service["spec"]["selector"]["app.kubernetes.io/instance"] == job
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "chat-template")
        assert volume["configMap"]["name"] == f"{job}-vllm-chat-template"
    # run-a's Service does not select run-b's pods.
    pod_b = served["run-b"]["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert not served["run-a"]["Service"]["spec"]["selector"].items() <= pod_b.items()


def test_lora_on_a_mixture_of_experts_experts_is_served_merged_or_refused(capsys):
    """vLLM v0.11.0 refuses an adapter with expert weights: lora_mlp=true on Qwen3-MoE serves
    only merged; attention's LoRA alone (the runtime's default) is served as base + adapter."""
    moe = ["render", "serving", "--runtime", "tunepack-qwen3-30b-a3b", "--name", "my-job"]
    code = main([*moe, "lora_mlp=true"])
    out, err = capsys.readouterr()
    assert code == 65 and not out.strip()
    assert err.strip() == (
        "tunepack: error: lora_mlp=true: the adapter holds LoRA on qwen3-30b-a3b's experts, "
        "which vLLM v0.11.0 does not load; train with merge=true as well and serve the merged "
        "model (render serving with the same arguments then serves it), or with lora_mlp=false"
    )
    assert main([*moe, "lora_mlp=true", "merge=true"]) == 0
    merged = [o for o in yaml.safe_load_all(capsys.readouterr().out) if o]
    assert _args(merged)[0] == "--model=/workspace/output/merged"
    assert main(moe) == 0
    adapter = [o for o in yaml.safe_load_all(capsys.readouterr().out) if o]
    assert any(a.startswith("--lora-modules=") for a in _args(adapter))
