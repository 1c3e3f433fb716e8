"""Serving a result with vLLM: the manifest follows what was trained (issue 12, item 5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tunepack.cli import main
from tunepack.core.errors import UnknownRuntimeError
from tunepack.runtimes import catalog
from tunepack.tools import serving, serving_memory

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
        "--max-model-len=2048",  # the run's max_seq_len (llama3.1-8b's default)
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
    with pytest.raises(UnknownRuntimeError):
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


# --- a model that needs several GPUs (issue 41, item 3) ----------------------------------------
BIG = "tunepack-llama3.1-70b"


def _serve(capsys, runtime: str, *argv: str) -> tuple[int, list[dict], str]:
    code = main(["render", "serving", "--runtime", runtime, "--name", "my-job", *argv])
    out, err = capsys.readouterr()
    return code, [o for o in yaml.safe_load_all(out) if o], err


def _gpus(objects: list[dict]) -> int:
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"
    ]


@pytest.mark.parametrize("argv", [[], ["--gpus", "4"]])
def test_a_70b_model_is_split_over_the_gpus_that_hold_it(capsys, argv):
    """Before: one GPU by default, and --gpus 4 set the limit without --tensor-parallel-size, so
    vLLM loaded the 131 GiB of weights on one GPU and failed."""
    code, objects, err = _serve(capsys, BIG, *argv)
    assert code == 0, err
    assert _gpus(objects) == 4
    assert "--tensor-parallel-size=4" in _args(objects)
    assert err == (
        "tunepack: serving llama3.1-70b on 4 x H100-80GB: 38.2 of 71.3 GiB per GPU (32.9 "
        "weights + 1.2 KV cache (8 x 2048 tokens) + 0.3 LoRA + 3.8 vLLM)\n"
    )


def test_the_fewest_gpus_that_hold_the_model_follow_the_gpu_type(capsys):
    code, objects, err = _serve(capsys, BIG, "--gpu", "h200")
    assert code == 0, err
    assert _gpus(objects) == 2 and "--tensor-parallel-size=2" in _args(objects)
    code, objects, err = _serve(capsys, "tunepack-llama3.1-8b", "--gpu", "L4")
    assert code == 0, err
    assert _gpus(objects) == 1 and not [a for a in _args(objects) if "tensor-parallel" in a]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--gpus", "1"],
            "tunepack: error: --gpus 1: llama3.1-70b needs 141.5 GiB per GPU on 1 x H100-80GB "
            "(131.4 weights + 5.0 KV cache (8 x 2048 tokens) + 0.3 LoRA + 4.8 vLLM), more than "
            "the 71.3 GiB vLLM uses of each; --gpus 4 fits (38.2 GiB of 71.3 per GPU)",
        ),
        (
            ["--gpus", "3"],
            "tunepack: error: --gpus 3: vLLM cannot split llama3.1-70b over 3 GPUs (tensor "
            "parallelism): its 64 attention heads do not split evenly over 3 GPUs; --gpus 4 fits "
            "(38.2 GiB of 71.3 per GPU)",
        ),
        (
            ["--gpu", "l4", "--max-model-len", "131072"],
            "tunepack: error: llama3.1-70b does not fit on 8 x L4-24GB at --max-model-len 131072 "
            "with --concurrency 8: it needs 59.2 GiB per GPU (16.4 weights + 40.0 KV cache (8 x "
            "131072 tokens) + 0.3 LoRA + 2.4 vLLM), more than the 19.8 GiB vLLM uses of each; "
            "serve on a larger --gpu, or with a shorter --max-model-len or a lower --concurrency",
        ),
        (
            ["--max-model-len", "200000"],
            "tunepack: error: --max-model-len 200000 is longer than llama3.1-70b's context of "
            "131072 tokens",
        ),
        (
            ["--concurrency", "0"],
            "tunepack: error: --concurrency 0 is not valid: expected at least 1",
        ),
        (["--gpu", "tpu"], "tunepack: error: gpu='tpu' is not known: expected one of H100-80GB"),
    ],
)
def test_a_layout_that_cannot_hold_the_model_is_refused_saying_what_fits(capsys, argv, message):
    code, objects, err = _serve(capsys, BIG, *argv)
    assert code == 65 and objects == []
    assert err.startswith(message), err
    assert len(err.strip().splitlines()) == 1


def test_a_longer_context_is_asked_of_vllm_and_planned():
    """The KV cache is keys and values of every layer for each token, over the GPUs' KV heads."""
    entry = catalog.get("llama3.1-8b")
    plan = serving_memory.plan(entry, "H100-80GB", 1, context=2048, concurrency=8)
    per_token = 2 * 32 * 8 * 128 * 2  # K and V, layers, KV heads, head_dim, bf16 bytes
    assert plan.kv_cache == per_token * 2048 * 8 / 2**30 == 2.0
    assert plan.weights == entry.shape.parameter_count() * 2 / 2**30
    assert serving_memory.plan(entry, "H100-80GB", 2, 2048, 8).kv_cache == 1.0


def test_kv_heads_fewer_than_the_gpus_are_replicated_not_split():
    """Gemma 2B has one KV head: vLLM gives each GPU a copy, so the KV cache does not shrink."""
    entry = catalog.get("gemma-2b")
    one, two = (serving_memory.plan(entry, "L4-24GB", n, 2048, 8) for n in (1, 2))
    assert two.kv_cache == one.kv_cache
    assert serving_memory.tensor_parallel_obstacle(entry, 2) is None
    assert serving_memory.tensor_parallel_obstacle(catalog.get("qwen2-0.5b"), 4) == (
        "its 14 attention heads do not split evenly over 4 GPUs"
    )


# --- the run's arguments read from the finished job (issue 41, item 4) -------------------------
def _finished_local_job(
    jobs: Path, name: str, args: list[str], status: str = "Complete", message: str | None = None
) -> Path:
    """A local job's record as the backend leaves it: its TrainJob, its state and, once
    Complete, the trainer's result.json (its run's arguments as given)."""
    from tunepack.backends.local.job import JobRecord
    from tunepack.jobs.trainjob import TrainJobSpec, build_trainjob

    spec = TrainJobSpec(
        name=name,
        runtime=RUNTIME,
        dataset_uri="hf://org/data",
        model_uri="hf://meta-llama/Llama-3.1-8B-Instruct",
        trainer_args=args,
        local=True,
    )
    record = JobRecord(jobs / name)
    record.create(build_trainjob(spec), None, None)
    record.update(status=status, **({"message": message} if message else {}))
    if status == "Complete":
        pairs = dict(a.split("=", 1) for a in args)
        record.workspace.joinpath("output").mkdir(parents=True)
        result = {"model": "llama3.1-8b", "method": "lora", "trainer_args": pairs}
        record.workspace.joinpath("output", "result.json").write_text(json.dumps(result))
    return record.workspace


def test_a_finished_local_job_is_served_as_it_was_trained(capsys, tmp_path):
    """Before: --runtime, --name and every key=value had to be typed again."""
    _finished_local_job(tmp_path, "my-run", ["lora_rank=48", "max_seq_len=4096"])
    code = main(["render", "serving", "--job", "my-run", "--local", "--jobs-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    objects = [o for o in yaml.safe_load_all(out) if o]
    args = _args(objects)
    assert "--max-lora-rank=64" in args and "--max-model-len=4096" in args
    pod = objects[0]["spec"]["template"]["spec"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "initializer-my-run"


def test_a_result_json_is_served_as_it_was_trained_and_explicit_arguments_win(capsys, tmp_path):
    workspace = _finished_local_job(tmp_path, "my-run", ["lora_rank=48", "max_seq_len=4096"])
    for where in (workspace, workspace / "output", workspace / "output" / "result.json"):
        code = main(["render", "serving", "--result", str(where), "--name", "my-job"])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert "--max-lora-rank=64" in _args([o for o in yaml.safe_load_all(out) if o])
    argv = ["--result", str(workspace), "--name", "my-job", "lora_rank=100", "--max-model-len=512"]
    assert main(["render", "serving", *argv]) == 0
    args = _args([o for o in yaml.safe_load_all(capsys.readouterr().out) if o])
    assert "--max-lora-rank=128" in args and "--max-model-len=512" in args


def test_a_job_without_a_result_is_refused_in_one_line(capsys, tmp_path):
    _finished_local_job(tmp_path, "my-run", ["lora_rank=48"], status="Running")
    _finished_local_job(tmp_path, "bad-run", [], status="Failed", message="node exited 65")
    local = ["--local", "--jobs-dir", str(tmp_path)]
    cases = [
        (
            ["--job", "my-run", *local],
            "tunepack: error: TrainJob my-run is Running, not Complete; it has no result to serve "
            "yet (tunepack status)\n",
        ),
        (
            ["--job", "bad-run", *local],
            "tunepack: error: TrainJob bad-run is Failed, not Complete: node exited 65; it has no "
            "result to serve\n",
        ),
        (
            ["--result", str(tmp_path / "my-run"), "--name", "my-run"],
            f"tunepack: error: --result {tmp_path / 'my-run'}: no result.json there; give a "
            "finished run's result.json, or the workspace whose output/result.json the trainer "
            "wrote when it finished\n",
        ),
        (
            [],
            "tunepack: error: --name is missing: give the TrainJob whose workspace PVC is served "
            "(or --job NAME)\n",
        ),
        (
            ["--name", "my-job"],
            "tunepack: error: --runtime is missing: give the runtime the TrainJob ran, or --job "
            "NAME (or --result PATH) to read it from the finished run\n",
        ),
    ]
    (tmp_path / "not-a-result.json").write_text('{"steps": 3}')
    cases.append(
        (
            ["--result", str(tmp_path / "not-a-result.json"), "--name", "my-job"],
            f"tunepack: error: --result {tmp_path / 'not-a-result.json'}: not a tunepack "
            "result.json (it has no 'model' and 'trainer_args')\n",
        )
    )
    for argv, message in cases:
        code = main(["render", "serving", *argv])
        out, err = capsys.readouterr()
        assert (code, out, err) == (65, "", message)
