"""The development install is one that static tools (jedi, pyright, mypy) can follow.

``tunepack`` is mapped onto the repository's directories (sdk_ext/ is ``tunepack``, runtimes/ is
``tunepack.runtimes``, ...; setup.py). setuptools' default ("lenient") editable install exposes
such a mapping through an import hook that runs only inside a live interpreter, so an IDE or a
type checker finds no ``tunepack`` at all. The Makefile installs with ``editable_mode=strict``
instead: a tree of links under ``build/__editable__.*`` laid out as the import package, put on
``sys.path`` by a plain ``.pth`` path entry, which every static tool reads (mypy and pyright do
not run import hooks; jedi happens to know setuptools' hook too, so it finds both). The price:
a module added later is not in the tree until the next install (``make dev`` re-installs when
the set of source files changes).

Here the strict install is made from a copy of the sources into a fresh venv, and jedi (a
static analyser: it reads files, it imports nothing) is asked where ``tunepack.core.errors`` is.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests import REPO

SOURCES = ["sdk_ext", "runtimes", "initializers", "trainers", "setup.py", "pyproject.toml"]
# What jedi is asked: where the name an import statement binds is defined.
QUERY = "import tunepack.core.errors\ntunepack.core.errors.BadInputError\n"
JEDI = (
    "import sys, jedi\n"
    "code = sys.argv[1]\n"
    "lines = code.splitlines()\n"
    "found = jedi.Script(code, environment=jedi.InterpreterEnvironment()).goto(\n"
    "    len(lines), len(lines[-1]) - 1, follow_imports=True)\n"
    "print('\\n'.join(str(d.module_path) for d in found))\n"
)


def _build_editable(tmp: Path, mode: str) -> subprocess.CompletedProcess:
    """An editable wheel (``mode``) built from a copy of the sources into ``tmp/dist``; its last
    line of output names it."""
    src = tmp / "src"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    (src / "README.md").write_text("tunepack\n")
    # The editable wheel is built by the dev venv's setuptools (nothing from the network).
    build = (
        "import sys; from setuptools import build_meta\n"
        "print(build_meta.build_editable(sys.argv[1], {'editable_mode': sys.argv[2]}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", build, str(tmp / "dist"), mode],
        cwd=src, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _editable_install(tmp: Path, mode: str) -> Path:
    """A new venv with tunepack installed editable (``mode``) from a copy of the sources; the
    dev venv's site-packages (jedi, setuptools) visible after its own."""
    done = _build_editable(tmp, mode)
    wheel = tmp / "dist" / done.stdout.strip().splitlines()[-1]
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--no-compile", "--disable-pip-version-check", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # Written after the install (pip would see the dev venv's tunepack as installed). site.py
    # processes no .pth file of a directory a .pth file added: the dev venv's hook stays off.
    Path(site, "dev-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def _jedi_finds(python: Path) -> list[str]:
    done = subprocess.run(
        [str(python), "-c", JEDI, QUERY], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_makefile_installs_strict_editable():
    makefile = (REPO / "Makefile").read_text()
    assert "EDITABLE := --config-settings editable_mode=strict\n" in makefile
    installs = re.findall(r"pip install .*-e .*", makefile)
    strict = re.compile(r" \$\(EDITABLE\)( \$\(NO_HF_TRANSFER_WARNING\))?$")
    assert installs and all(strict.search(line) for line in installs), installs


def test_the_strict_editable_build_prints_no_setuptools_notice(tmp_path):
    """setuptools tells, on every strict editable build, where its link tree is: a 13-line
    InformationOnly notice that pip prints at each `make install` and `make dev`, nothing to act
    on (the Makefile says what build/__editable__.* is). setup.py leaves that notice out."""
    done = _build_editable(tmp_path, "strict")
    assert "Editable installation" not in done.stderr, done.stderr
    assert "auxiliary directory" not in done.stderr, done.stderr


HF_TRANSFER = "WARNING: huggingface-hub 2.4.0 does not provide the extra 'hf-transfer'"
FAKE_PIP = f"""#!/bin/sh
echo "pip $*" >> "$(dirname "$0")/calls"
case "$*" in *" -e "*) echo "{HF_TRANSFER}" >&2 ;; esac
echo "WARNING: a warning of its own" >&2
echo "Successfully installed something"
exit ${{FAKE_PIP_RC:-0}}
"""


def _make_install(tmp: Path, rc: int) -> subprocess.CompletedProcess:
    """`make install dev` with a venv whose pip prints what the real one does around an editable
    install (torchtune's hf-transfer warning among others) and exits ``rc``."""
    bin_dir = tmp / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("python", "#!/bin/sh\n"), ("pip", FAKE_PIP)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return subprocess.run(
        ["make", "install", "dev", f"VENV={tmp / 'venv'}"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "FAKE_PIP_RC": str(rc)},
    )  # fmt: skip


def test_make_install_leaves_out_torchtunes_hf_transfer_warning_and_nothing_else(tmp_path):
    """torchtune 0.6.1's metadata asks for huggingface_hub[hf_transfer], an extra huggingface_hub
    2.x no longer has, and pip warns of it at every install: that one line is left out of what
    `make install`/`make dev` show; pip's other output and its exit status stand."""
    done = _make_install(tmp_path, 0)
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "venv" / "bin" / "calls").read_text().splitlines()
    assert len(calls) == 3 and sum(" -e " in c for c in calls) == 2, calls
    assert HF_TRANSFER not in (done.stdout + done.stderr).splitlines(), done.stderr
    assert done.stderr.count("WARNING: a warning of its own") == 3, done.stderr
    assert done.stdout.count("Successfully installed something") == 3, done.stdout
    failed = _make_install(tmp_path / "failing", 1)
    assert failed.returncode != 0, failed.stdout + failed.stderr
    assert not (tmp_path / "failing" / "venv" / ".installed").exists()


def _install_commands(*make_args: str) -> list[str]:
    """The pip commands `make install` would run (-W: as if pyproject.toml had changed)."""
    done = subprocess.run(
        ["make", "-n", "-W", "pyproject.toml", "install", *make_args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return [line.split()[1:] for line in done.stdout.splitlines() if " install " in line]


def test_torch_index_url_takes_torch_alone_from_that_index():
    """README's CPU-only install: PyTorch's CPU index for torch, PyPI for everything else."""
    cpu = "https://download.pytorch.org/whl/cpu"
    torch, *rest = _install_commands(f"TORCH_INDEX_URL={cpu}")
    assert torch == ["install", "-q", "--index-url", cpu, '"torch==2.13.0"']
    assert rest and all("--index-url" not in command for command in rest)
    torch, *_ = _install_commands()
    assert torch == ["install", "-q", '"torch==2.13.0"']  # PyPI's (on Linux the CUDA build)


def test_a_static_tool_finds_tunepack_core_in_sdk_ext_core(tmp_path):
    found = _jedi_finds(_editable_install(tmp_path, "strict"))
    assert len(found) == 1, found
    assert Path(found[0]).resolve() == tmp_path / "src" / "sdk_ext" / "core" / "errors.py"
