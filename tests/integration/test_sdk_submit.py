"""What the SDK submits: FineTune and translated TorchTuneConfig, checked field by field."""

from __future__ import annotations

import dataclasses
import json

import pytest
from kubeflow.trainer import (
    BuiltinTrainer,
    CustomTrainer,
    DataFormat,
    DataType,
    HuggingFaceDatasetInitializer,
    HuggingFaceModelInitializer,
    LoraConfig,
    S3ModelInitializer,
    TorchTuneConfig,
    TorchTuneInstructDataset,
)
from kubeflow.trainer import Initializer as KfInitializer

from tunepack.core.errors import (
    BadValueError,
    ConflictError,
    DoesNotFitError,
    UnknownKeyError,
    UnknownRuntimeError,
    UnsupportedError,
)
from tunepack.core.workspace import TRAINER_ARGS_ENV
from tunepack.finetune import FineTune
from tunepack.jobs import submit
from tunepack.jobs.translate import Initializer, from_torchtune_config, storage_uri
from tunepack.runtimes.args import VOCABULARY, parse_trainer_args
from tunepack.runtimes.catalog import CATALOG
from tunepack.runtimes.validate import validate_trainjob

INIT = Initializer(dataset="file:///data/train.jsonl", model="file:///models/llama")


def _build(trainer, initializer=INIT, runtime="tunepack-llama3.1-8b", **kw) -> dict:
    job = submit.build(runtime, initializer, trainer, name="job-1", namespace="team-a", **kw)
    validate_trainjob(job)  # strict: nothing the API would drop
    return job


def test_finetune_fields_are_the_vocabulary_plus_placement():
    names = [f.name for f in dataclasses.fields(FineTune)]
    assert names == [a.name for a in VOCABULARY] + [
        "num_nodes",
        "num_proc_per_node",
        "resources_per_node",
        "env",
        "export",  # where the result goes (docs/export.md)
        "export_secret",
    ]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"epochs": 0},
            "FineTune.epochs: epochs='0' is not valid: expected an integer from 1 to 1000",
        ),
        (
            {"lora_rank": 2.5},
            "FineTune.lora_rank: lora_rank=2.5 is not valid: expected an integer (LoRA rank r "
            "(default: catalog))",
        ),
        ({"lr": 1.5}, "FineTune.lr: lr='1.5' is not valid: expected a number > 0.0 and < 1.0"),
        (
            {"lora_mlp": "yes"},
            "FineTune.lora_mlp: lora_mlp='yes' is not valid: expected True or False (also apply "
            "LoRA to the MLP projections (a mixture of experts: every expert))",
        ),
        (
            {"lora_attn_modules": ["q_proj", "x"]},
            "FineTune.lora_attn_modules: lora_attn_modules='q_proj,x' is not valid: expected a "
            "comma-separated subset of q_proj,k_proj,v_proj,output_proj",
        ),
        ({"num_nodes": 0}, "FineTune.num_nodes=0 is not valid: expected an integer >= 1"),
    ],
)
def test_finetune_refuses_bad_values_naming_field_and_range(kwargs, message):
    with pytest.raises(BadValueError) as err:
        FineTune(**kwargs)
    assert str(err.value) == message
    ((name, value),) = kwargs.items()
    assert (err.value.name, err.value.value) == (name, value)


def test_finetune_is_also_a_value_error_like_the_sdk_raises():
    with pytest.raises(ValueError):
        FineTune(batch_size=-1)


def test_finetune_trainjob_field_by_field():
    job = _build(
        FineTune(
            method="lora",
            lora_rank=16,
            epochs=3,
            lora_mlp=False,
            num_nodes=2,
            resources_per_node={"gpu": 4, "memory": "200Gi"},
            env={"NCCL_SOCKET_IFNAME": "eth0"},
        ),
        Initializer(
            dataset="file:///data/train.jsonl",
            model="file:///models/llama",
            model_secret="hf-token",
        ),
    )
    assert job["metadata"] == {"name": "job-1", "namespace": "team-a"}
    spec = job["spec"]
    assert spec["runtimeRef"] == {
        "name": "tunepack-llama3.1-8b",
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
    }
    # The trainer's arguments, for the initializers to check first (initializers/trainer_args.py).
    env = [{"name": TRAINER_ARGS_ENV, "value": json.dumps(spec["trainer"]["args"])}]
    assert spec["initializer"] == {
        "dataset": {"storageUri": "file:///data/train.jsonl", "env": env},
        "model": {
            "storageUri": "file:///models/llama",
            "secretRef": {"name": "hf-token"},
            "env": env,
        },
    }
    trainer = spec["trainer"]
    assert trainer["numNodes"] == 2
    assert trainer["numProcPerNode"] == 4  # one process per requested GPU
    assert trainer["resourcesPerNode"] == {
        "limits": {"nvidia.com/gpu": 4, "memory": "200Gi"},
        "requests": {"nvidia.com/gpu": 4, "memory": "200Gi"},
    }
    assert trainer["env"] == [{"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}]
    assert trainer["args"] == ["method=lora", "epochs=3", "lora_rank=16", "lora_mlp=false"]
    parsed = parse_trainer_args(trainer["args"], CATALOG["llama3.1-8b"])
    assert (parsed.method, parsed.epochs, parsed.lora_rank, parsed.lora_mlp) == (
        "lora",
        3,
        16,
        False,
    )


def test_translated_torchtune_config_field_by_field():
    config = TorchTuneConfig(
        dtype=DataType.BF16,
        batch_size=2,
        epochs=2,
        num_nodes=2,
        resources_per_node={"gpu": 2},
        peft_config=LoraConfig(
            lora_rank=8, lora_alpha=16, lora_dropout=0.05, apply_lora_to_mlp=True
        ),
        dataset_preprocess_config=TorchTuneInstructDataset(
            source=DataFormat.JSON, split="train", train_on_input=True
        ),
    )
    upstream_init = KfInitializer(
        dataset=HuggingFaceDatasetInitializer(storage_uri="file:///data/train.jsonl"),
        model=HuggingFaceModelInitializer(storage_uri="file:///models/llama"),
    )
    job = _build(BuiltinTrainer(config=config), upstream_init)
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 2
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": 2}
    assert trainer["args"] == [
        "method=lora",
        "epochs=2",
        "batch_size=2",
        "lora_rank=8",
        "lora_alpha=16.0",
        "lora_dropout=0.05",
        "lora_attn_modules=q_proj,v_proj,output_proj",  # the SDK's LoraConfig default
        "lora_mlp=true",
        "train_on_input=true",
        "dtype=bf16",
    ]
    parse_trainer_args(trainer["args"], CATALOG["llama3.1-8b"])
    # An upstream HF initializer keeps a file:// URI as given; a bare hub id gains hf://.
    env = [{"name": TRAINER_ARGS_ENV, "value": json.dumps(trainer["args"])}]
    assert job["spec"]["initializer"]["model"] == {"storageUri": "file:///models/llama", "env": env}
    assert storage_uri(HuggingFaceModelInitializer("meta-llama/X"), "model") == "hf://meta-llama/X"
    assert storage_uri(S3ModelInitializer("s3://b/m"), "model") == "s3://b/m"


def test_torchtune_config_without_peft_is_a_full_fine_tune_as_upstream():
    """Issue 29, 2: upstream's BuiltinTrainer(TorchTuneConfig(...)) without peft_config runs
    full_finetune_*; on a tunepack runtime it must not silently become LoRA."""
    job = _build(
        BuiltinTrainer(config=TorchTuneConfig(epochs=1, batch_size=1)),
        runtime="tunepack-llama3.2-1b",
    )
    assert job["spec"]["trainer"]["args"] == ["method=full", "epochs=1", "batch_size=1"]
    # With a PEFT config it stays LoRA.
    lora = BuiltinTrainer(config=TorchTuneConfig(epochs=1, peft_config=LoraConfig()))
    assert _build(lora, runtime="tunepack-llama3.2-1b")["spec"]["trainer"]["args"][0] == (
        "method=lora"
    )
    # A full fine-tune the planner says cannot fit is refused as FineTune(method='full') is.
    with pytest.raises(DoesNotFitError, match="llama3.1-8b full, seq_len"):
        _build(BuiltinTrainer(config=TorchTuneConfig(batch_size=32)))


def test_torchtune_config_without_peft_on_a_runtime_without_full_says_why(monkeypatch):
    entry = CATALOG["llama3.2-1b"]
    builders = {k: v for k, v in entry.builders.items() if k != "full"}
    monkeypatch.setitem(CATALOG, "llama3.2-1b", dataclasses.replace(entry, builders=builders))
    assert "full" not in CATALOG["llama3.2-1b"].methods
    with pytest.raises(UnsupportedError) as refused:
        _build(BuiltinTrainer(config=TorchTuneConfig(epochs=1)), runtime="tunepack-llama3.2-1b")
    assert str(refused.value) == (
        "TorchTuneConfig without peft_config means a full fine-tune (as upstream's runtimes "
        "run it), but method='full' is not available for llama3.2-1b: expected one of lora, "
        "qlora, dora, dpo, orpo, kto, grpo; pass peft_config=LoraConfig(...) for LoRA"
    )


@pytest.mark.parametrize(
    "config, kind, field",
    [
        (
            TorchTuneConfig(peft_config=LoraConfig(apply_lora_to_output=True)),
            UnsupportedError,
            "LoraConfig.apply_lora_to_output=True cannot be translated: tunepack applies LoRA to "
            "attention (lora_attn_modules) and optionally the MLP (apply_lora_to_mlp)",
        ),
        (
            TorchTuneConfig(
                dataset_preprocess_config=TorchTuneInstructDataset(column_map={"a": "b"})
            ),
            BadValueError,
            "TorchTuneInstructDataset.column_map={'a': 'b'} is not valid: key 'a' is not one of "
            "torchtune's instruction fields; its keys are 'input' (the prompt) and 'output' (the "
            "answer), each mapped to the dataset's column, e.g. {'input': 'question', 'output': "
            "'answer'}",
        ),
        (
            TorchTuneConfig(
                dataset_preprocess_config=TorchTuneInstructDataset(source=DataFormat.XML)
            ),
            UnsupportedError,
            "TorchTuneInstructDataset.source='xml' cannot be translated: tunepack's dataset "
            "initializer reads JSON (.json, .jsonl), CSV, Parquet and Arrow files; convert the "
            "data to one of them",
        ),
    ],
)
def test_untranslatable_torchtune_fields_are_refused_by_name(config, kind, field):
    with pytest.raises(kind) as err:
        from_torchtune_config(config)
    assert type(err.value) is kind
    assert str(err.value) == field


def test_qlora_via_quantize_base_maps_to_method_qlora():
    config = TorchTuneConfig(peft_config=LoraConfig(quantize_base=True))
    assert from_torchtune_config(config).method == "qlora"


def test_plain_tokens_are_refused_and_secrets_go_by_reference():
    init = KfInitializer(
        dataset=HuggingFaceDatasetInitializer(storage_uri="org/ds", access_token="hf_abc"),
        model=HuggingFaceModelInitializer(storage_uri="org/m"),
    )
    with pytest.raises(UnsupportedError) as err:
        _build(FineTune(), init)
    assert str(err.value) == (
        "HuggingFaceDatasetInitializer.access_token: tunepack does not put tokens into the "
        "TrainJob, where anyone who can read TrainJobs would see them. Create a Secret (kubectl "
        "create secret generic hf-token --from-literal=HF_TOKEN=<token>) and pass it by "
        "reference: tunepack.Initializer(dataset=HuggingFaceDatasetInitializer(storage_uri=...) "
        "without access_token, dataset_secret='hf-token'); on the local backend, export HF_TOKEN "
        "instead"
    )
    with pytest.raises(UnsupportedError) as err:
        _build(FineTune(env={"HF_TOKEN": "hf_abc"}))
    assert str(err.value) == (
        "environment variable HF_TOKEN looks like a credential: tunepack does not put secrets "
        "into the TrainJob in plain text. Store it in a Secret and pass dataset_secret="
        "/model_secret= (initializers) instead"
    )


def test_custom_trainer_is_refused_on_tunepack_runtimes():
    with pytest.raises(UnsupportedError) as err:
        _build(CustomTrainer(func=print))
    assert str(err.value) == (
        "CustomTrainer cannot run on a tunepack runtime, whose trainer is tunepack's fine-tuning "
        "program: pass trainer=FineTune(...) (or BuiltinTrainer(config=TorchTuneConfig(...))), or "
        "use a torch-distributed runtime for your own training function"
    )


def test_method_must_exist_for_the_model_and_missing_initializer_is_named():
    with pytest.raises(BadValueError) as err:
        _build(FineTune(), Initializer(dataset="file:///d.jsonl"))
    assert str(err.value) == (
        "Initializer.model is missing: tunepack runtimes need both a dataset and a model (e.g. "
        "model='file:///abs/path' or 'hf://org/name')"
    )
    with pytest.raises(UnknownRuntimeError) as err:
        _build(FineTune(), runtime="tunepack-nope")
    known = ", ".join(entry.runtime_name for entry in CATALOG.values())
    assert (
        str(err.value)
        == f"unknown runtime or model 'tunepack-nope'; tunepack runtimes are: {known}"
    )
    assert err.value.runtime == "tunepack-nope"


def test_hub_uris_pass_through_to_the_initializers():
    init = Initializer(dataset="hf://tatsu-lab/alpaca", model="hf://meta-llama/Llama-3.1-8B")
    job = _build(FineTune(), init)
    assert job["spec"]["initializer"]["dataset"]["storageUri"] == "hf://tatsu-lab/alpaca"
    assert job["spec"]["initializer"]["model"]["storageUri"] == "hf://meta-llama/Llama-3.1-8B"


def test_planner_refuses_a_shape_that_cannot_fit_with_the_numbers():
    big = FineTune(method="full", max_seq_len=8192, batch_size=8)
    with pytest.raises(DoesNotFitError) as err:
        _build(big)
    assert str(err.value).splitlines()[:2] == [
        "this fine-tune is estimated not to fit in GPU memory:",
        "llama3.1-8b full, seq_len 8192, batch 8/device, 1 node(s) x 1 H100-80GB",
    ]
    assert "  peak           91.89 GiB in the backward: weights + gradients + optimizer + " in (
        str(err.value)
    )
    facts = (round(err.value.need_gib, 2), round(err.value.have_gib, 1), err.value.gpu)
    assert facts == (91.89, 77.2, "H100-80GB")
    job = _build(big, memory_check="warn")  # submitted anyway, with a warning
    assert job["spec"]["trainer"]["args"][:1] == ["method=full"]


def test_finetune_from_args_reads_the_cli_spelling():
    finetune = FineTune.from_args(
        ["method=dora", "lr=1e-4", "lora_attn_modules=q_proj,v_proj", "lora_mlp=false"],
        num_nodes=2,
    )
    assert (finetune.method, finetune.lr, finetune.lora_attn_modules) == (
        "dora",
        1e-4,
        ("q_proj", "v_proj"),
    )
    assert finetune.lora_mlp is False and finetune.num_nodes == 2
    assert finetune.to_args() == [
        "method=dora",
        "lr=0.0001",
        "lora_attn_modules=q_proj,v_proj",
        "lora_mlp=false",
    ]
    assert FineTune.from_args(["activation_checkpointing=auto"]).activation_checkpointing == "auto"


@pytest.mark.parametrize(
    ("args", "kind", "message"),
    [
        (
            ["lora_rnk=8"],
            UnknownKeyError,
            "unknown trainer argument 'lora_rnk'; did you mean 'lora_rank'?",
        ),
        (["epochs=1", "epochs=2"], UnknownKeyError, "trainer argument 'epochs' is given twice"),
        (["epochs"], BadValueError, "trainer argument 'epochs' is not of the form key=value"),
        (
            ["epochs=zero"],
            BadValueError,
            "epochs='zero' is not valid: expected an integer from 1 to 1000",
        ),
        (
            "epochs=1",
            BadValueError,
            "trainer arguments must be a list of 'key=value' strings, got 'epochs=1'",
        ),
    ],
)
def test_finetune_from_args_refuses_what_the_trainer_would(args, kind, message):
    with pytest.raises(kind) as err:
        FineTune.from_args(args)
    assert type(err.value) is kind
    assert str(err.value) == message


def test_cluster_trainjobs_need_absolute_paths_local_ones_do_not():
    relative = Initializer(dataset="data/train.jsonl", model="/models/llama")
    with pytest.raises(BadValueError) as err:
        _build(FineTune(), relative)
    assert str(err.value) == (
        "dataset storage URI 'data/train.jsonl' is a relative path: a TrainJob's storage URI is "
        "read inside the dataset initializer container on the cluster, so a path must be "
        "absolute (/abs/path or file:///abs/path), or use a URI such as hf://org/name or "
        "s3://bucket/key"
    )
    job = _build(FineTune(), Initializer(dataset="/data/train.jsonl", model="file:/models/l"))
    assert job["spec"]["initializer"]["dataset"]["storageUri"] == "file:///data/train.jsonl"
    assert job["spec"]["initializer"]["model"]["storageUri"] == "file:///models/l"
    local = submit.build("tunepack-tiny-llama3", relative, FineTune(), name="j", local=True)
    assert local["spec"]["initializer"]["dataset"]["storageUri"] == "data/train.jsonl"
    assert "numProcPerNode" not in local["spec"]["trainer"]


def test_processes_per_node_default_to_the_gpus_per_node():
    assert (
        _build(FineTune(), runtime="tunepack-llama3.1-70b")["spec"]["trainer"]["numProcPerNode"]
        == 8
    )
    job = _build(FineTune(resources_per_node={"gpu": 2}), runtime="tunepack-llama3.1-70b",
                 memory_check="off")  # fmt: skip
    assert job["spec"]["trainer"]["numProcPerNode"] == 2
    job = _build(FineTune(num_proc_per_node=2, resources_per_node={"gpu": 2}), memory_check="off")
    assert job["spec"]["trainer"]["numProcPerNode"] == 2
    job = _build(FineTune(num_proc_per_node=3, resources_per_node={"gpu": 0}))
    assert job["spec"]["trainer"]["numProcPerNode"] == 3  # no GPU: the processes are free


def test_processes_other_than_the_gpus_are_refused_before_the_memory_plan():
    """Issue 49, 2: 4 processes on a one-GPU runtime were planned as 4 GPUs (an 8B full
    fine-tune approved on an L4) and refused by the launcher on the node, after the downloads."""
    with pytest.raises(ConflictError) as err:
        _build(FineTune(method="full", num_proc_per_node=4), gpu="l4")
    assert str(err.value) == (
        "FineTune.num_proc_per_node=4 asks for 4 processes a node, but a trainer node holds 1 GPU "
        "(runtime tunepack-llama3.1-8b's) and runs one process per GPU: give "
        "resources_per_node={'gpu': 4} for 4 GPUs a node, or leave FineTune.num_proc_per_node out"
    )
    # The GPUs the job gets are what the memory check plans with: 4 L4s hold it, 1 does not.
    job = _build(FineTune(method="full", resources_per_node={"gpu": 4}), gpu="l4")
    assert job["spec"]["trainer"]["numProcPerNode"] == 4
    assert job["spec"]["trainer"]["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": 4}
    with pytest.raises(DoesNotFitError, match=r"1 node\(s\) x 1 L4-24GB"):
        _build(FineTune(method="full", num_proc_per_node=1), gpu="l4")


def test_the_local_backend_names_the_options_it_refuses(tmp_path):
    from kubeflow.trainer.options import Labels

    from tunepack.backends.local import LocalBackend, LocalBackendConfig

    backend = LocalBackend(LocalBackendConfig(root_dir=str(tmp_path)))
    with pytest.raises(UnsupportedError) as caught:
        backend.train("tunepack-tiny-llama3", INIT, FineTune(), options=[Labels({"team": "a"})])
    assert str(caught.value) == (
        "options (Labels) are not supported by tunepack's local backend: they set fields of a "
        "TrainJob on a cluster (use TrainingClient() with a cluster)"
    )
    assert not list(tmp_path.iterdir())


def test_a_notebook_imports_everything_from_tunepack():
    """One import line: tunepack's names and the SDK's types (the same classes), lazily."""
    import subprocess
    import sys

    code = (
        "import sys, tunepack\n"
        "assert 'kubeflow' not in sys.modules, 'import tunepack must stay light'\n"
        "from tunepack import (TrainingClient, FineTune, Initializer, BuiltinTrainer,\n"
        "    TorchTuneConfig, LoraConfig, KubernetesBackendConfig, LocalBackendConfig,\n"
        "    LocalProcessBackendConfig, CustomTrainer, HuggingFaceDatasetInitializer,\n"
        "    HuggingFaceModelInitializer, S3DatasetInitializer, S3ModelInitializer,\n"
        "    DataCacheInitializer, TorchTuneInstructDataset)\n"
        "from tunepack.options import Labels, RuntimePatch\n"
        "import kubeflow.trainer as kt, kubeflow.trainer.options as ko\n"
        "assert BuiltinTrainer is kt.BuiltinTrainer and LoraConfig is kt.LoraConfig\n"
        "assert KubernetesBackendConfig is kt.KubernetesBackendConfig and Labels is ko.Labels\n"
        "assert issubclass(TrainingClient, kt.TrainerClient)\n"
        "assert set(tunepack.__all__) <= set(dir(tunepack))\n"
        "for name in tunepack.__all__: getattr(tunepack, name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("wrap", [Initializer, KfInitializer])
def test_upstream_initializer_objects_give_the_trainjob_of_the_equivalent_uris(wrap):
    """tunepack.Initializer (or the SDK's) takes URIs or the SDK's initializer objects alike."""
    import tunepack

    by_uri = _build(
        FineTune(),
        tunepack.Initializer(
            dataset="hf://tatsu-lab/alpaca", model="hf://meta-llama/Llama-3.1-8B-Instruct"
        ),
    )
    by_object = _build(
        FineTune(),
        wrap(
            dataset=tunepack.HuggingFaceDatasetInitializer(storage_uri="tatsu-lab/alpaca"),
            model=tunepack.HuggingFaceModelInitializer(
                storage_uri="hf://meta-llama/Llama-3.1-8B-Instruct"
            ),
        ),
    )
    assert by_object == by_uri
    assert by_uri["spec"]["initializer"]["model"] == {
        "storageUri": "hf://meta-llama/Llama-3.1-8B-Instruct"
    }
    s3 = _build(
        FineTune(), Initializer(dataset="s3://bkt/d.jsonl", model=S3ModelInitializer("s3://bkt/m"))
    )
    assert s3 == _build(FineTune(), Initializer(dataset="s3://bkt/d.jsonl", model="s3://bkt/m"))


def test_a_request_naming_no_gpu_is_checked_on_the_gpu_the_pod_keeps(caplog):
    # The Trainer merges resourcesPerNode into the runtime's resources: {"cpu": 8} keeps the
    # runtime's GPU, so the memory check holds the job to that one GPU (a full 8B at batch 8 of
    # 8192 tokens needs 92 GiB there: it does not fit).
    caplog.set_level("INFO", logger="tunepack.jobs.submit")
    big = {"method": "full", "batch_size": 8, "max_seq_len": 8192}
    with pytest.raises(DoesNotFitError):
        _build(FineTune(**big, resources_per_node={"cpu": 8}))
    assert (
        "resources_per_node={'cpu': 8} names no GPU, so the pods keep the runtime's 1 GPU(s) per "
        "node (the Trainer merges resourcesPerNode into the runtime's resources); give "
        "{'gpu': 0} for none"
    ) in caplog.text
    # Asked for none, the pod holds none: nothing to check GPU memory on, one process.
    trainer = _build(FineTune(**big, resources_per_node={"cpu": 8, "gpu": 0}))["spec"]["trainer"]
    assert trainer["resourcesPerNode"]["limits"] == {"cpu": 8, "nvidia.com/gpu": 0}
    assert trainer["numProcPerNode"] == 1


def test_a_method_the_named_dataset_schema_does_not_fit_is_refused_at_submission():
    """Issue 49, item 6: dpo with DATASET_SCHEMA=chat was found by the trainer, after both
    initializers ran (on a cluster: after a GPU pod was placed)."""
    init = Initializer(dataset="hf://org/chats", model="hf://org/m", env={"DATASET_SCHEMA": "chat"})
    with pytest.raises(ConflictError) as refused:
        submit.build("tunepack-tiny-llama3", init, FineTune(method="dpo"), name="j")
    assert refused.value.exit_code == 65
    assert str(refused.value) == (
        "method=dpo needs a preference dataset (rows with 'prompt', 'chosen' and 'rejected'), "
        "but the dataset's schema is 'chat'"
    )
    fits = Initializer(
        dataset="hf://org/p", model="hf://org/m", env={"DATASET_SCHEMA": "preference"}
    )
    assert submit.build("tunepack-tiny-llama3", fits, FineTune(method="dpo"), name="j")
