"""The wheel: built from the source tree, installed into a fresh venv, run from outside the repo.

Everywhere else the suite runs against the editable install, which finds any module of the
source tree whether or not the wheel would carry it. Here a wheel is built from a copy of what
the images' wheel stage copies from the source tree (so the Dockerfiles build it the same way;
and setuptools' build/ directory keeps files across builds, so building in place could pass on a
stale copy), installed with ``--no-deps --no-index`` into a new venv that sees the dev
venv's third-party packages but not the source tree, and its programs are run the way a user and
the runtimes' containers run them: the ``tunepack`` script, then each step of the tiny runtime
with the command the generated runtime gives its container.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from tests import REPO
from tunepack.core.workspace import MANIFEST_FILE
from tunepack.runtimes.contract import containers, replicated_jobs
from tunepack.runtimes.contract import env as env_of

# The repository's top-level directories and the import package each one is (setup.py maps them).
ROOTS = {
    "sdk_ext": "tunepack",
    "runtimes": "tunepack/runtimes",
    "initializers": "tunepack/initializers",
    "trainers": "tunepack/trainers",
}
# Files other than modules that the code reads at run time (runtimes/store.py: load_runtime).
DATA = ["runtimes/generated/*.yaml"]
DOCKERFILES = [REPO / "initializers" / "Dockerfile", REPO / "trainers" / "Dockerfile"]
TINY_RUNTIME = "tunepack-tiny-llama3"


def _in_wheel(source: Path) -> str:
    """The path a source file has inside the wheel."""
    root, *rest = source.relative_to(REPO).parts
    return "/".join([ROOTS[root], *rest])


def _source_modules() -> list[Path]:
    return sorted(
        path
        for root in ROOTS
        for path in (REPO / root).rglob("*.py")
        if "__pycache__" not in path.parts
    )


def _stages(dockerfile: Path) -> dict[str, list[str]]:
    """A Dockerfile's instructions (continuation lines joined), by stage name or number."""
    stages: dict[str, list[str]] = {}
    for line in re.sub(r"\\\n", " ", dockerfile.read_text(encoding="utf-8")).splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "FROM":
            name = words[3] if len(words) == 4 and words[2] == "AS" else str(len(stages))
            stages[name] = []
        elif stages:
            stages[list(stages)[-1]].append(" ".join(words))
    return stages


def _copies(instructions: list[str]) -> list[list[str]]:
    """The COPY instructions' arguments (the last one is the destination)."""
    return [line.split()[1:] for line in instructions if line.startswith("COPY ")]


def _wheel_inputs() -> list[str]:
    """What the images' wheel stage copies into its build context: what a wheel is built from."""
    return [src for *sources, _ in _copies(_stages(DOCKERFILES[0])["wheel"]) for src in sources]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    for name in _wheel_inputs():
        source, target = REPO / name, tmp / "src" / name
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    # The dev venv holds the build backend; nothing may come from the network.
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(tmp / "dist"), str(tmp / "src")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = (tmp / "dist").glob("tunepack-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A new venv with the wheel installed; the dev venv's site-packages are visible after its own.

    The dev site-packages come in through a .pth file, and site.py does not process .pth files in
    a directory that a .pth file added: the editable install's finder stays inactive there.
    """
    root = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    # Installed before the .pth is written: pip would otherwise see the editable tunepack of the
    # dev venv as the installed copy and try to uninstall it.
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--no-compile", "--disable-pip-version-check", str(wheel)],
        capture_output=True, text=True, timeout=300, env=_clean_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, env=_clean_env(),
    ).stdout.strip()  # fmt: skip
    dev_site = sysconfig.get_paths()["purelib"]
    Path(site, "tunepack-test-dev-deps.pth").write_text(dev_site + "\n", encoding="utf-8")
    return root


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "PIP_", "TUNEPACK_", "PET_")) and k != "VIRTUAL_ENV"
    }
    env["OMP_NUM_THREADS"] = "1"  # a shared 2-core machine: no spinning thread pools
    return {**env, **extra}


def _run(command: list[str], cwd: Path, timeout: int = 120, **env: str):
    return subprocess.run(
        command, cwd=cwd, env=_clean_env(**env), capture_output=True, text=True, timeout=timeout
    )


def test_wheel_carries_every_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = _source_modules()
    # A directory of modules without __init__.py is a namespace package: package discovery skips
    # it, and so would the wheel.
    missing_init = sorted(
        {
            str(p.parent.relative_to(REPO))
            for p in sources
            if not (p.parent / "__init__.py").exists()
        }
    )
    assert missing_init == [], "module directories without __init__.py"
    missing = [str(p.relative_to(REPO)) for p in sources if _in_wheel(p) not in names]
    assert missing == [], f"source modules missing from {wheel.name}"
    data = sorted(p for pattern in DATA for p in REPO.glob(pattern))
    assert len(data) > 30
    missing_data = [str(p.relative_to(REPO)) for p in data if _in_wheel(p) not in names]
    assert missing_data == [], f"data files missing from {wheel.name}"
    # Nothing outside the one import package (and its metadata), no tests, no caches.
    strays = sorted(
        n for n in names if not n.startswith(("tunepack/", "tunepack-")) or "__pycache__" in n
    )
    assert strays == []
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "tunepack = tunepack.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_dockerfiles_build_the_wheel_and_install_it():
    """Both images build the wheel the same way, with a build backend pyproject.toml accepts, from
    the files the build reads, and install it instead of copying source directories."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    wheel_stages = [_stages(path)["wheel"] for path in DOCKERFILES]
    assert wheel_stages[0] == wheel_stages[1]
    inputs = _wheel_inputs()
    assert {"pyproject.toml", "setup.py", pyproject["project"]["readme"], *ROOTS} <= set(inputs)
    (pin,) = [w for line in wheel_stages[0] for w in line.split() if w.startswith("setuptools==")]
    (version,) = [spec.version for spec in Requirement(pin).specifier]
    for requirement in map(Requirement, pyproject["build-system"]["requires"]):
        assert requirement.name == "setuptools" and version in requirement.specifier, requirement
    assert any(
        line.startswith("RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation")
        for line in wheel_stages[0]
    )
    for path in DOCKERFILES:
        stages = _stages(path)
        installs = [line for name, lines in stages.items() if name != "wheel" for line in lines]
        assert any(
            "pip install" in line and "/tmp/dist/tunepack-*.whl" in line for line in installs
        )
        for args in _copies(installs):
            if args[0] == "--from=wheel":
                continue
            for source in args[:-1]:  # no source copied by hand: data files only
                assert (REPO / source).is_file() and not source.endswith(".py"), (path, source)
    base = _stages(DOCKERFILES[0])["base"]
    assert any("pip install" in line and "--no-deps" in line for line in base)  # no torch


def test_every_module_imports_from_the_installed_wheel(wheel, venv, tmp_path):
    modules = sorted(
        n.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for n in zipfile.ZipFile(wheel).namelist()
        if n.endswith(".py")
    )
    code = (
        "import importlib, json, sys\n"
        "print(json.dumps({m: importlib.import_module(m).__file__ for m in sys.argv[1:]}))\n"
    )
    done = _run([str(venv / "bin" / "python"), "-c", code, *modules], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    files = json.loads(done.stdout)
    site = venv / "lib" / "python3.11" / "site-packages"
    assert sorted(files) == modules and len(modules) > 50
    outside = {m: f for m, f in files.items() if not Path(f).is_relative_to(site)}
    assert outside == {}, "modules imported from somewhere other than the wheel"


def test_cli_and_runtime_steps_run_from_the_installed_wheel(
    venv, tmp_path, tiny_model_dir, tiny_dataset_file
):
    """`tunepack` and the tiny runtime's three containers, with PYTHONPATH unset, cwd outside."""
    bin_dir = venv / "bin"
    help_ = _run([str(bin_dir / "tunepack"), "--help"], cwd=tmp_path)
    assert help_.returncode == 0, help_.stderr
    for command in ("tiny-model", "tiny-dataset", "train", "render"):
        assert command in help_.stdout

    model, data = tmp_path / "tiny-llama3", tmp_path / "instructions.jsonl"
    done = _run([str(bin_dir / "tunepack"), "tiny-model", str(model)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"tiny model ready at {model}" in done.stdout
    # The same seed gives the same bytes as the source tree's writer.
    assert _tree(model) == _tree(tiny_model_dir)
    done = _run([str(bin_dir / "tunepack"), "tiny-dataset", str(data)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert data.read_bytes() == tiny_dataset_file.read_bytes()

    # Each container's command and environment, as the installed runtime (package data) has them.
    runtime = _installed_runtime(venv, tmp_path)
    workspace = tmp_path / "workspace"
    steps = {}
    for job in replicated_jobs(runtime):
        (container,) = containers(job)
        env = env_of(container)
        env["TUNEPACK_WORKSPACE"] = str(workspace)  # /workspace in a Pod
        python, *args = container["command"]
        assert python == "python"
        steps[job["name"]] = ([str(bin_dir / "python"), *args], env)
    assert list(steps) == ["dataset-initializer", "model-initializer", "node", "exporter"]

    command, env = steps["dataset-initializer"]
    done = _run(command, cwd=tmp_path, STORAGE_URI=data.as_uri(), **env)
    assert done.returncode == 0, done.stderr
    rows = len(data.read_text().splitlines())
    assert f"dataset-initializer: read {rows} rows" in done.stdout
    train = workspace / "dataset" / "train.jsonl"
    assert len(train.read_text().splitlines()) == rows
    assert json.loads((workspace / "dataset" / MANIFEST_FILE).read_text())["rows"] == rows

    command, env = steps["model-initializer"]
    done = _run(command, cwd=tmp_path, STORAGE_URI=model.as_uri(), **env)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((workspace / "model" / MANIFEST_FILE).read_text())
    assert (manifest["kind"], manifest["model"]) == ("model", "tiny-llama3")
    for name in manifest["files"]:
        assert (workspace / "model" / name).read_bytes() == (model / name).read_bytes()

    command, env = steps["node"]
    done = _run([*command, "method=lora", "max_steps=2"], cwd=tmp_path, timeout=300, **env)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((workspace / "output" / "result.json").read_text())
    assert (result["method"], result["steps"]) == ("lora", 2)
    adapter = workspace / "output" / "adapter"
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").stat().st_size > 0


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _installed_runtime(venv: Path, cwd: Path) -> dict:
    code = (
        "import json\n"
        "from importlib import resources\n"
        "from tunepack.runtimes.store import load_runtime\n"
        "print(resources.files('tunepack.runtimes'))\n"
        f"print(json.dumps(load_runtime({TINY_RUNTIME!r})))\n"
    )
    done = _run([str(venv / "bin" / "python"), "-c", code], cwd=cwd)
    assert done.returncode == 0, done.stderr
    package, loaded = done.stdout.splitlines()
    assert Path(package).is_relative_to(venv)  # the copy the wheel installed
    runtime = json.loads(loaded)
    assert runtime["metadata"]["name"] == TINY_RUNTIME
    source = REPO / "runtimes" / "generated" / f"{TINY_RUNTIME}.yaml"
    assert runtime == yaml.safe_load(source.read_text(encoding="utf-8"))
    return runtime
