"""The TrainJob examples in examples/: valid, runnable, documented, and free of secrets.

Each example must be a TrainJob the v2.3 API keeps whole (strict validation), referencing a
catalog runtime, with trainer arguments from the vocabulary, storage URIs the initializers parse,
a name JobSet can derive pod names from, and a shape the memory planner fits on the GPU its
comments name. What it needs from the cluster (Secrets, PVCs, RWX storage) must be in its comments.

Some examples use what other branches add (hf:// and s3:// sources, method=qlora). Those checks
are strict xfails that fail only for that "not supported yet" reason; once the branch is merged
they pass, strict turns the XPASS into a failure, and the entry in PENDING below must go.
"""

from __future__ import annotations

import re

import pytest
import yaml

from tests import REPO
from tunepack.core.errors import BadInputError
from tunepack.initializers.transport import uri as storage_uri
from tunepack.jobs import submit, trainjob
from tunepack.jobs.naming import max_name_length
from tunepack.runtimes import catalog, contract, host
from tunepack.runtimes.args import parse_trainer_args
from tunepack.runtimes.store import load_runtime
from tunepack.runtimes.validate import validate_trainjob

EXAMPLES_DIR = REPO / "examples"

# Example -> the GPU type its comments size it for (tunepack.runtimes.planner.GPUS).
EXAMPLES = {
    "lora-single-gpu.yaml": "L4-24GB",
    "qlora-8b.yaml": "L4-24GB",
    "multinode-lora.yaml": "A100-40GB",
    "full-finetune.yaml": "A100-40GB",
    "local-dataset-pvc.yaml": "L4-24GB",
    "dpo-lora.yaml": "L4-24GB",
}

# Features other branches bring: (what is pending) -> reason. Remove an entry when it merges.
PENDING = {}


class Pending(Exception):
    """A check failed only because a feature from another branch is not here yet."""


def _load(name: str) -> dict:
    docs = list(yaml.safe_load_all((EXAMPLES_DIR / name).read_text()))
    assert len(docs) == 1, f"{name}: expected one YAML document, found {len(docs)}"
    return docs[0]


def _trainer_args(name: str) -> list[str]:
    return _load(name)["spec"]["trainer"]["args"]


def _method(name: str) -> str:
    pairs = dict(a.partition("=")[::2] for a in _trainer_args(name))
    return pairs.get("method", "lora")


def _uris(name: str) -> dict[str, str]:
    init = _load(name)["spec"]["initializer"]
    return {what: init[what]["storageUri"] for what in ("dataset", "model")}


def _scheme(raw: str) -> str:
    return raw.partition("://")[0] if "://" in raw else "file"


def _pending(key: str, *params, id: str):
    reason = PENDING.get(key)
    marks = [pytest.mark.xfail(raises=Pending, strict=True, reason=reason)] if reason else []
    return pytest.param(*params, id=id, marks=marks)


def _resolved(name: str):
    """The example's trainer arguments with defaults, or Pending when its method is not here."""
    entry = catalog.get(_load(name)["spec"]["runtimeRef"]["name"])
    method = _method(name)
    try:
        return entry, parse_trainer_args(_trainer_args(name), entry)
    except BadInputError as err:
        if f"method:{method}" in PENDING and f"method={method!r} is not" in str(err):
            raise Pending(str(err)) from err
        raise


ARG_CASES = [_pending(f"method:{_method(n)}", n, id=n) for n in EXAMPLES]
URI_CASES = [
    _pending(f"scheme:{_scheme(raw)}", n, what, raw, id=f"{n}-{what}")
    for n in EXAMPLES
    for what, raw in _uris(n).items()
]


def test_the_examples_are_all_listed_and_indexed():
    files = {p.name for p in EXAMPLES_DIR.glob("*.yaml")}
    assert files == set(EXAMPLES), "add new examples to EXAMPLES (and examples/README.md)"
    readme = (EXAMPLES_DIR / "README.md").read_text()
    linked = set(re.findall(r"\]\(([\w.-]+\.(?:yaml|ipynb))\)", readme))
    assert linked == files | {"quickstart.ipynb"}, f"README links {sorted(linked)}"


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_is_a_strictly_valid_trainjob(name):
    obj = _load(name)
    assert obj["kind"] == "TrainJob" and obj["apiVersion"] == contract.API_VERSION
    validate_trainjob(obj)  # BadInputError naming every field the API would drop


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_references_a_catalog_runtime(name):
    ref = _load(name)["spec"]["runtimeRef"]
    assert (ref.get("apiGroup"), ref.get("kind")) == (contract.API_GROUP, contract.KIND)
    entry = catalog.get(ref["name"])
    assert ref["name"] == entry.runtime_name  # the runtime's name, not the model's
    assert load_runtime(ref["name"])["metadata"]["name"] == ref["name"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_name_fits_the_pod_names_jobset_derives(name):
    obj = _load(name)
    job, nodes = obj["metadata"]["name"], obj["spec"]["trainer"].get("numNodes", 1)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", job), job
    assert len(job) <= max_name_length(nodes), f"{job!r} is longer than {max_name_length(nodes)}"


@pytest.mark.parametrize("name", ARG_CASES)
def test_example_trainer_args_parse(name):
    entry, args = _resolved(name)
    assert args.method == _method(name) and args.method in entry.methods


@pytest.mark.parametrize("name, what, raw", URI_CASES)
def test_example_storage_uri_parses(name, what, raw):
    try:
        parsed = storage_uri.parse(raw)
    except BadInputError as err:
        if "not support yet" in str(err):
            raise Pending(str(err)) from err
        raise
    assert parsed.scheme == _scheme(raw)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_sets_num_proc_per_node(name):
    """Left out, the Trainer writes `auto` into PET_NPROC_PER_NODE, and on a node without a GPU
    limit it writes the CPU request instead: every example says how many processes it wants."""
    trainer = _load(name)["spec"]["trainer"]
    assert isinstance(trainer.get("numProcPerNode"), int) and trainer["numProcPerNode"] >= 1


# The TrainJob CRD's CEL rule for every initializer storageUri.
STORAGE_URI_CEL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://.+$")


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_storage_uris_pass_the_crd_rule(name):
    for what, raw in _uris(name).items():
        assert STORAGE_URI_CEL.match(raw), f"{name}: {what} storageUri {raw!r} has no scheme://"


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_names_the_workspace_pvc_jobset_creates(name):
    """The result is on initializer-<trainjob>, kept when the TrainJob is deleted."""
    comments = _comments(name)
    assert "workspace-<" not in comments and "workspace-" + _load(name)["metadata"]["name"] not in (
        comments
    )
    assert contract.workspace_pvc("<name>") in comments


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_points_only_to_paths_that_exist(name):
    root = EXAMPLES_DIR.parent
    for path in re.findall(r"\b((?:manifests|docs|examples)/[\w./-]*[\w-])", _comments(name)):
        assert (root / path).exists(), f"{name} mentions {path}, which does not exist"


@pytest.mark.parametrize("name", ARG_CASES)
def test_example_fits_the_gpu_its_comments_name(name):
    entry, args = _resolved(name)
    trainer = _load(name)["spec"]["trainer"]
    gpus = trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"]
    per_node = trainer["numProcPerNode"]
    assert per_node == gpus, "one trainer process per GPU"
    # BadInputError with the planner's breakdown when it does not fit.
    plan = submit.check_memory(
        entry, args, trainer.get("numNodes", 1), per_node, EXAMPLES[name], "refuse"
    )
    assert plan is not None and plan.fits


_QUANTITY = {"Gi": 1, "Ti": 1024}


def _gib(quantity) -> float:
    return float(quantity[:-2]) * _QUANTITY[quantity[-2:]]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_requests_the_cpu_and_memory_of_its_processes(name):
    """The pod the Trainer makes (resourcesPerNode merged into the runtime's requests) asks for
    what its trainer processes need (runtimes/host.py), not only the runtime's default GPUs'."""
    entry = catalog.get(_load(name)["spec"]["runtimeRef"]["name"])
    resources = _load(name)["spec"]["trainer"]["resourcesPerNode"]
    pod = trainjob.pod_resources(resources, entry)["requests"]
    need = host.node_shape(entry, trainjob.gpus_per_node(resources, entry))
    assert float(pod["cpu"]) >= float(need.cpu), pod
    assert _gib(pod["memory"]) >= _gib(need.memory), pod


def _secret_refs(obj) -> list[tuple[str, str | None]]:
    """(Secret name, key or None) for every secretRef and secretKeyRef in ``obj``."""
    found = []
    if isinstance(obj, dict):
        if "secretRef" in obj:
            found.append((obj["secretRef"]["name"], None))
        if "secretKeyRef" in obj:
            found.append((obj["secretKeyRef"]["name"], obj["secretKeyRef"]["key"]))
        for value in obj.values():
            found += _secret_refs(value)
    elif isinstance(obj, list):
        for value in obj:
            found += _secret_refs(value)
    return found


def _comments(name: str) -> str:
    lines = (EXAMPLES_DIR / name).read_text().splitlines()
    return "\n".join(line.strip() for line in lines if line.strip().startswith("#"))


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_comments_say_what_must_exist(name):
    obj, comments = _load(name), _comments(name)
    for heading in ("What it does", "What must exist", "What to edit", "Run:"):
        assert heading in comments, f"{name}: no {heading!r} in its comments"
    memory = EXAMPLES[name].rpartition("-")[2].removesuffix("GB")
    assert f"{memory} GB" in comments, f"{name}: its comments do not name the {memory} GB GPU"
    for secret, key in _secret_refs(obj):
        assert f"kubectl create secret generic {secret}" in comments, (name, secret)
        if key:
            assert f"--from-literal={key}=" in comments, (name, secret, key)
    claims = re.findall(r"claimName: (\S+)", (EXAMPLES_DIR / name).read_text())
    for claim in claims:
        assert f"PVC named `{claim}`" in comments, (name, claim)
    if obj["spec"]["trainer"].get("numNodes", 1) > 1:
        assert "manifests/overlays/storage-rwx" in comments and "ReadWriteMany" in comments
    if any(_scheme(raw) == "file" for raw in _uris(name).values()):
        assert "runtimePatches" in comments, f"{name}: say how the file:// path gets mounted"


@pytest.mark.parametrize("name", [n for n in EXAMPLES if "runtimePatches" in _load(n)["spec"]])
def test_runtime_patches_target_what_the_runtime_has(name):
    """The API only patches existing jobs and containers; mounts must name declared volumes."""
    obj = _load(name)
    runtime = load_runtime(obj["spec"]["runtimeRef"]["name"])
    jobs = {j["name"]: j for j in contract.replicated_jobs(runtime)}
    file_uris = {
        storage_uri.parse(r).location for r in _uris(name).values() if _scheme(r) == "file"
    }
    mounted = []
    for patch in obj["spec"]["runtimePatches"]:
        assert patch["manager"], "each runtime patch names its manager"
        for job_patch in contract.replicated_jobs(patch):
            assert job_patch["name"] in jobs, f"no job {job_patch['name']!r} in the runtime"
            pod = contract.pod_spec(jobs[job_patch["name"]])
            pod_patch = contract.pod_spec(job_patch)
            # The runtime's pod volumes, plus the workspace JobSet adds from its claim template.
            runtime_volumes = {v["name"] for v in pod.get("volumes", [])} | {
                contract.INITIALIZER_VOLUME
            }
            patch_volumes = {v["name"] for v in pod_patch.get("volumes", [])}
            assert not patch_volumes & runtime_volumes, "a patched volume shadows the runtime's"
            containers = {c["name"] for c in pod["containers"]}
            for container in pod_patch.get("containers", []):
                assert container["name"] in containers, container["name"]
                # Env of the initializer and node containers is set through the TrainJob API.
                assert "env" not in container, "set env via spec.initializer / spec.trainer"
                for mount in container.get("volumeMounts", []):
                    assert mount["name"] in patch_volumes, mount["name"]
                    assert not mount["mountPath"].startswith("/workspace")
                    mounted.append(mount["mountPath"].rstrip("/") + "/")
    for location in file_uris:
        assert any(location.startswith(m) for m in mounted), f"{location} is on no mounted PVC"


# Token shapes of common providers, and credential-named variables given a literal value.
_TOKEN_PATTERNS = (
    re.compile(r"\bhf_[A-Za-z0-9]{20,}"),  # Hugging Face
    re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),  # AWS access key id
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{30,}"),  # GitHub
    re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"),  # OpenAI-style keys
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"(?i)(token|secret|password|access_key)[\"']?\s*[:=]\s*[\"']?[A-Za-z0-9/+_-]{16,}"),
)


def secret_literals(text: str) -> list[str]:
    """Every token-like literal in ``text``; placeholders like <your token> do not match."""
    return [m.group(0) for pattern in _TOKEN_PATTERNS for m in pattern.finditer(text)]


def _literal_credential_env(obj) -> list[str]:
    """Names of credential-like env vars that carry a `value:` instead of `valueFrom:`."""
    found = []
    if isinstance(obj, dict):
        name = obj.get("name")
        if (
            isinstance(name, str)
            and "value" in obj
            and re.search(r"(?i)TOKEN|SECRET|PASSWORD|ACCESS_KEY", name)
        ):
            found.append(name)
        for value in obj.values():
            found += _literal_credential_env(value)
    elif isinstance(obj, list):
        for value in obj:
            found += _literal_credential_env(value)
    return found


def test_the_secret_detector_catches_planted_literals():
    planted = [
        "--from-literal=HF_TOKEN=hf_" + "aB3" * 10,
        "AKIA" + "ABCDEFGHIJKLMNOP",
        "access_token: " + "x9" * 12,
        "-----BEGIN RSA PRIVATE KEY-----",
    ]
    for text in planted:
        assert secret_literals(text), f"missed {text!r}"
    assert not secret_literals("kubectl create secret generic hf-token --from-literal=HF_TOKEN=<t>")
    env = {"env": [{"name": "HF_TOKEN", "value": "hf_x"}, {"name": "MODE", "value": "a"}]}
    assert _literal_credential_env(env) == ["HF_TOKEN"]


@pytest.mark.parametrize(
    "path", sorted(p.name for p in EXAMPLES_DIR.iterdir() if p.is_file()), ids=str
)
def test_no_secret_literal_in_examples(path):
    text = (EXAMPLES_DIR / path).read_text()
    assert not secret_literals(text), f"{path} holds a token-like literal"
    if path.endswith(".yaml"):
        assert not _literal_credential_env(_load(path)), f"{path} sets a credential by value"
