"""The images the runtimes run: `make images` builds exactly those, and a user's registry reaches
every runtime through kustomize's `images` (the README's "Images" step), and the trainer image's
pinned dependencies are the project's. The builds themselves, and the programs run inside them,
are the cluster tier's (`make images-local`, tests/cluster/test_image_programs.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.integration.test_manifests import (
    MANIFESTS,
    ROOT,
    RUNTIME_KINDS,
    render,
    write_kustomization,
)
from tunepack import __version__
from tunepack.runtimes.contract import containers, replicated_jobs

REGISTRY = "registry.example.internal/ml"


def _runtime_images(objects: list[dict]) -> set[str]:
    images = set()
    for obj in objects:
        if obj["kind"] not in RUNTIME_KINDS:  # the admission policy beside them has no image
            continue
        for job in replicated_jobs(obj):
            for c in containers(job):
                images.add(c["image"])
    return images


def _make_n(*args: str) -> str:
    done = subprocess.run(
        ["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.replace("\\\n", " ")


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_make_images_builds_the_images_the_runtimes_run():
    built = re.findall(r"-t (\S+)", _make_n("images"))
    assert sorted(built) == sorted(_runtime_images(render(MANIFESTS / "base")))
    assert all(image.endswith(f":{__version__}") for image in built)


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_make_push_images_pushes_to_the_given_registry():
    out = _make_n("push-images", f"REGISTRY={REGISTRY}", "CONTAINER=podman")
    assert "podman build" in out and "docker" not in out
    assert f"podman push {REGISTRY}/$image:{__version__}" in out
    assert set(re.findall(r"-t (\S+)", out)) == {
        f"{REGISTRY}/{name}:{__version__}"
        for name in ("dataset-initializer", "model-initializer", "trainer")
    }


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_make_push_images_pushes_what_tunepack_install_registry_installs():
    """The README's two steps agree: `make push-images REGISTRY=R TAG=T` pushes each image the
    runtimes of `tunepack install --registry R --tag T` run, under the same names."""
    from tunepack.tools.images import ImageSource, runtime_images
    from tunepack.tools.install import runtime_objects

    out = _make_n("push-images", f"REGISTRY={REGISTRY}", "TAG=rc1", "CONTAINER=podman")
    (loop,) = re.findall(r"for image in ([^;]+); do podman push (\S+) ", out)
    pushed = {loop[1].replace("$image", name) for name in loop[0].split()}
    installed = runtime_images(runtime_objects(images=ImageSource.parse(REGISTRY, "rc1")))
    assert pushed == set(installed) == set(re.findall(r"-t (\S+)", out))
    assert f"tunepack install --registry {REGISTRY} --tag rc1" in out


def test_a_kustomization_points_every_runtime_at_the_users_registry(tmp_path):
    """The README's step: the base plus an `images` list naming the user's registry."""
    write_kustomization(tmp_path, ())
    kustomization = yaml.safe_load((tmp_path / "kustomization.yaml").read_text())
    kustomization["images"] = [
        {"name": f"ghcr.io/tunepack/{name}", "newName": f"{REGISTRY}/{name}"}
        for name in ("dataset-initializer", "model-initializer", "trainer")
    ]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    assert _runtime_images(render(tmp_path)) == {
        f"{REGISTRY}/{name}:{__version__}"
        for name in ("dataset-initializer", "model-initializer", "trainer")
    }


def _pins(path) -> dict[str, str]:
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (ROOT / path).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path}: {line!r} is not pinned"
            pins[canonicalize_name(name)] = version
    return pins


def test_the_trainer_image_pins_every_dependency_inside_the_projects_ranges():
    """The image installs trainers/requirements.txt, then the wheel without dependencies: each
    dependency of the wheel (and the tracking and vision extras) must be pinned there, inside its
    range."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins("trainers/requirements.txt")
    wanted = [
        Requirement(r)
        for r in project["dependencies"]
        + project["optional-dependencies"]["tracking"]
        + project["optional-dependencies"]["vision"]
    ]
    for req in wanted:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in trainers/requirements.txt"
        assert req.specifier.contains(pins[name]), f"{name}=={pins[name]} is outside {req}"
    assert set(pins) == {canonicalize_name(r.name) for r in wanted}
    assert pins["torch"] == "2.13.0"  # the torch every test runs (Makefile's TORCH_SPEC)


def test_what_the_trainer_image_prunes_nothing_it_runs_can_load():
    """trainers/image-prune.txt's files are named by no library of torch, triton, torchvision,
    torchao, cuda-bindings or the NVIDIA wheels (so neither linked nor dlopen'd by name) and by
    none of their Python files: checked against this venv's packages, the versions the image
    pins (test_the_trainer_image_pins_every_dependency_inside_the_projects_ranges)."""
    import site

    site_packages = Path(site.getsitepackages()[0])
    if not (site_packages / "nvidia").is_dir():
        pytest.skip("this venv has torch's CPU build: no NVIDIA libraries to check against")
    patterns = [
        line.split("#")[0].strip()
        for line in (ROOT / "trainers" / "image-prune.txt").read_text().splitlines()
    ]
    pruned = {path for p in patterns if p for path in site_packages.glob(p)}
    assert all(any(site_packages.glob(p)) for p in patterns if p), "a pattern matches nothing"
    # What a loader would look for: the file name without its version suffix.
    names = {re.sub(r"\.so(\.[0-9.]*)?$|\.a$", "", path.name).encode() for path in pruned}
    users = {}
    for package in ("torch", "triton", "torchvision", "torchao", "cuda", "nvidia"):
        for path in (site_packages / package).rglob("*"):
            if path in pruned or not path.is_file():
                continue
            if not (".so" in path.name or path.suffix == ".py"):
                continue
            data = path.read_bytes()
            for name in names:
                if name in data:
                    users.setdefault(name.decode(), []).append(str(path.relative_to(site_packages)))
    # cuda-bindings' catalog of every CUDA library it could load on request (cuda.pathfinder)
    # names them all; torch and triton never ask it for these.
    users = {
        name: found for name, found in users.items() if any("pathfinder" not in f for f in found)
    }
    assert users == {}
