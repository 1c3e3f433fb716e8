"""The dependency direction between tunepack's packages, written once and checked on the source.

    tunepack.core          the contract between the steps: imports only the standard library
    tunepack.runtimes      the catalog, the methods, the trainer argument vocabulary and the
                           runtimes: core
    tunepack.initializers  the dataset/model initializer programs: core, runtimes (they check a
                           job's trainer arguments with the vocabulary, tunepack.runtimes.args,
                           before they download anything)
    tunepack.trainers      the trainer program: core, runtimes
    tunepack (the SDK)     everything else: the client, backends, job building, CLI, tools: all

Every import in the source tree is read with ``ast`` (module level and inside functions, since
a function-level import is still a dependency), resolved to the package it names, and checked
against ``MAY_IMPORT``. On top of the table: the initializer programs import neither torch nor
the Kubeflow SDK or the Kubernetes client (their images do not carry them), and neither do the
runtimes; there are no cycles between packages (the table has none, and the graph actually found
is checked too, so a loosened table cannot hide one).

Between modules: no module outside the command line (``tunepack.cli``) imports it, inside a
function or not (the CLI is built on the SDK facade, never under it); and no module imports
itself round a circle through what runs when it is imported (module level, class bodies, ``try``
and ``if`` blocks; not function bodies, nor ``if TYPE_CHECKING:``). A circle held apart by an
import inside a function is a shared piece in the wrong module: it moves to the lower one.

Inside tunepack.trainers, the same for its parts (``TRAINER_PARTS``): the rooms (models/, data/,
objectives/, outputs/, process/) and the modules at its top (the program: launch, worker, recipe;
the run's description: config). Inside tunepack.initializers too (``INITIALIZER_PARTS``): the rooms
(transport/, data/, sinks/) and the modules at its top (the programs: dataset, model, export; what
they share: _entry and its redaction, trainer_args, atomic).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

from tests import REPO


def _package_dirs() -> dict[str, str]:
    """setup.py's ``ROOTS`` (import package -> directory), read without running setup.py."""
    for node in ast.parse((REPO / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["ROOTS"]:
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no ROOTS")


# The repository's directories and the import package each one is.
SOURCES = {directory: package for package, directory in _package_dirs().items()}
CORE, RUNTIMES, INITIALIZERS, TRAINERS, SDK = (
    "tunepack.core",
    "tunepack.runtimes",
    "tunepack.initializers",
    "tunepack.trainers",
    "tunepack",  # the SDK: every module of tunepack outside the four packages above
)
# package -> the tunepack packages it may import (besides its own modules)
MAY_IMPORT = {
    CORE: set(),
    RUNTIMES: {CORE},
    INITIALIZERS: {CORE, RUNTIMES},
    TRAINERS: {CORE, RUNTIMES},
    SDK: {CORE, RUNTIMES, INITIALIZERS, TRAINERS},
}
# Third-party top-level modules a package must not import. Core: anything outside the standard
# library (checked separately).
HEAVY = {"torch", "torchtune", "torchao", "peft", "transformers"}
CLUSTER_CLIENTS = {"kubeflow", "kubernetes"}
MUST_NOT_IMPORT = {
    INITIALIZERS: HEAVY | CLUSTER_CLIENTS,
    RUNTIMES: HEAVY | CLUSTER_CLIENTS,
}
# The programs an initializer image runs (its container commands).
INITIALIZER_PROGRAMS = [
    "tunepack.initializers.dataset",
    "tunepack.initializers.model",
    "tunepack.initializers.export",
]


def package_of(module: str) -> str | None:
    """The package of the table that ``module`` belongs to; None outside tunepack."""
    if module != SDK and not module.startswith(SDK + "."):
        return None
    for package in (CORE, RUNTIMES, INITIALIZERS, TRAINERS):
        if module == package or module.startswith(package + "."):
            return package
    return SDK


def source_modules(repo: Path = REPO) -> dict[str, Path]:
    """Every module of the source tree by its import name (``__init__`` as the package)."""
    modules = {}
    for directory, package in SOURCES.items():
        for path in sorted((repo / directory).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(repo / directory).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _imported(node: ast.stmt, module: str, is_package: bool, known: set[str]):
    """(line, imported module) for each name of an import statement of ``module``, relative
    ones resolved; for ``from package import name`` the submodule ``package.name`` where there
    is one."""
    if isinstance(node, ast.Import):
        return [(node.lineno, alias.name) for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".")
        anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
        base = ".".join([*anchor, *([base] if base else [])])
    found = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        found.append((node.lineno, sub if sub in known else base))
    return found


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module) for every import in ``path`` (``_imported``)."""
    is_package = path.name == "__init__.py"
    return [
        found
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for found in _imported(node, module, is_package, known)
    ]


def _type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _run_at_import(nodes):
    """The nodes among ``nodes`` and below them that run when the module is imported: into
    ``if`` (an ``if TYPE_CHECKING:`` only its ``else``), ``try``, ``with``, loops and class
    bodies; never into a function's body."""
    for node in nodes:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.If) and _type_checking(node.test):
            yield from _run_at_import(node.orelse)
            continue
        yield node
        yield from _run_at_import(ast.iter_child_nodes(node))


def top_level_imports(module: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module) for every import that runs when ``path`` is imported."""
    is_package = path.name == "__init__.py"
    return [
        found
        for node in _run_at_import(ast.parse(path.read_text(), str(path)).body)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for found in _imported(node, module, is_package, known)
    ]


def module_graph(repo: Path = REPO) -> dict[str, set[str]]:
    """module -> the source modules importing it runs (``top_level_imports``). Importing
    ``a.b.c`` runs ``a`` and ``a.b`` first, so it leads to them too, except to the importer's own
    packages: those are already being imported when it runs."""
    modules = source_modules(repo)
    known = set(modules)
    graph = {module: set() for module in modules}
    for module, path in modules.items():
        for _, imported in top_level_imports(module, path, known):
            parts = imported.split(".")
            for end in range(1, len(parts) + 1):
                target = ".".join(parts[:end])
                if target in known and target != module and not module.startswith(target + "."):
                    graph[module].add(target)
    return graph


def import_cycles(repo: Path = REPO) -> list[list[str]]:
    """The strongly connected components of ``module_graph`` with more than one module: each a
    set of modules every one of which imports, through the others, every other (sorted)."""
    graph = module_graph(repo)
    reach = {}
    for start in graph:  # the modules reachable from ``start`` through one import or more
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo += graph[module]
        reach[start] = seen
    cycles = {
        frozenset(other for other in reach[module] if module in reach[other])
        for module in graph
        if module in reach[module]
    }
    return sorted(sorted(cycle) for cycle in cycles)


CLI = "tunepack.cli"


def cli_imports(repo: Path = REPO) -> list[str]:
    """Every import of the command line (``tunepack.cli``) by a module outside it, as
    ``path:line: what`` (inside functions too)."""
    modules = source_modules(repo)
    problems = []
    for module, path in modules.items():
        if module == CLI or module.startswith(CLI + "."):
            continue
        for line, imported in imports_of(module, path, set(modules)):
            if imported == CLI or imported.startswith(CLI + "."):
                problems.append(f"{path.relative_to(repo)}:{line}: {module} imports {imported}")
    return problems


def violations(repo: Path = REPO) -> list[str]:
    """Every import that breaks a rule, as ``path:line: what``."""
    modules = source_modules(repo)
    known = set(modules)
    problems = []
    for module, path in modules.items():
        package = package_of(module)
        where = path.relative_to(repo)
        for line, imported in imports_of(module, path, known):
            target = package_of(imported)
            top = imported.split(".")[0]
            if target is not None:
                if target != package and target not in MAY_IMPORT[package]:
                    problems.append(f"{where}:{line}: {package} imports {imported} ({target})")
            elif package == CORE and top not in sys.stdlib_module_names:
                problems.append(f"{where}:{line}: {CORE} imports {imported} (not the stdlib)")
            elif top in MUST_NOT_IMPORT.get(package, ()):
                problems.append(f"{where}:{line}: {package} imports {imported}")
    return problems


def package_graph(repo: Path = REPO) -> dict[str, set[str]]:
    """package -> the other packages its modules actually import."""
    modules = source_modules(repo)
    graph = {package: set() for package in MAY_IMPORT}
    for module, path in modules.items():
        package = package_of(module)
        for _, imported in imports_of(module, path, set(modules)):
            target = package_of(imported)
            if target is not None and target != package:
                graph[package].add(target)
    return graph


# tunepack.trainers' parts: a room (subpackage) or a module at its top -> the parts it may import
# besides its own modules. The building blocks (models, data, process) import no other part; the
# losses may ask the process group; the run's description (config) reads the chat formats and the
# losses' table; outputs read the description and the models' layouts; only the recipe puts them
# together, and only the program's two entry points (launch, worker) import it. The argument
# vocabulary they all read is tunepack.runtimes.args.
TRAINER_PARTS = {
    "process": set(),  # torchrun, the process group, threads, compilation, log noise
    "models": set(),  # the families tunepack builds, their checkpoints' layouts
    "data": set(),  # tokenization in the chat formats, image rows, batch order
    "objectives": {"process"},  # the losses, GRPO's sampling and rewards
    "config": {"data", "objectives"},  # the run's torchtune config and identity
    "outputs": {"config", "models", "process"},  # checkpoints, result files, reporting
    "recipe": {"config", "data", "models", "objectives", "outputs", "process"},
    "worker": {"process", "recipe"},  # torchrun's entry
    "launch": {"config", "process", "recipe"},  # the image's ENTRYPOINT
}


def trainer_part(module: str) -> str | None:
    """The part of ``TRAINER_PARTS`` a module of tunepack.trainers is in (None: the package)."""
    rest = module.removeprefix(TRAINERS + ".")
    return None if rest == module else rest.split(".")[0]


def trainer_violations(repo: Path = REPO) -> list[str]:
    """Every import between the trainer's parts that ``TRAINER_PARTS`` does not allow."""
    return _part_violations(TRAINERS, TRAINER_PARTS, repo)


def _part_violations(package: str, parts: dict[str, set[str]], repo: Path) -> list[str]:
    """Every import between the parts of ``package`` (a room or a module at its top: the first
    name below it) that ``parts`` does not allow, as ``path:line: what``."""
    modules = source_modules(repo)
    directory = {p: d for d, p in SOURCES.items()}[package]
    problems = []
    for module, path in modules.items():
        part = _part(package, module)
        if part is None:
            continue
        for line, imported in imports_of(module, path, set(modules)):
            target = _part(package, imported)
            if target is not None and target != part and target not in parts[part]:
                where = path.relative_to(repo)
                problems.append(f"{where}:{line}: {directory}/{part} imports {imported} ({target})")
    return problems


def _part(package: str, module: str) -> str | None:
    rest = module.removeprefix(package + ".")
    return None if rest == module else rest.split(".")[0]


# tunepack.initializers' parts, as TRAINER_PARTS: transport/ (a storage URI and the sources it
# names, retries, downloads, progress, the S3 client, archives) and the module that scrubs what
# the programs print import no other part; data/ (dataset files, schemas, splits, images) fetches
# images through transport; sinks/ (export destinations) send and fetch through it into
# atomic's staged directories; the three programs put them together, and nothing imports a
# program.
INITIALIZER_PARTS = {
    "transport": set(),  # uri, sources/, retry, download, transfer_progress, s3, archives
    "data": {"transport"},  # formats, schemas, splits, images
    "atomic": set(),  # workspace directories published whole, their manifests
    "sinks": {"atomic", "transport"},  # export destinations, fetching an export back
    "redaction": set(),  # no credential in what is printed
    "_entry": {"redaction"},  # the programs' entry and exit contract
    "trainer_args": set(),  # the job's trainer arguments, checked before any download
    "dataset": {"_entry", "atomic", "data", "trainer_args", "transport"},
    "model": {"_entry", "atomic", "data", "trainer_args", "transport"},
    "export": {"_entry", "atomic", "sinks", "transport"},
}


def initializer_violations(repo: Path = REPO) -> list[str]:
    """Every import between the initializers' parts that ``INITIALIZER_PARTS`` does not allow."""
    return _part_violations(INITIALIZERS, INITIALIZER_PARTS, repo)


def test_every_package_imports_only_what_the_table_allows():
    assert violations() == []


def test_the_table_and_the_imports_found_have_no_cycle():
    for graph in (MAY_IMPORT, package_graph()):
        order = list(TopologicalSorter(graph).static_order())
        assert order[0] == CORE and order[-1] == SDK, order


def test_only_the_command_line_imports_the_command_line():
    assert cli_imports() == []


def test_no_module_imports_itself_round_a_circle():
    assert import_cycles() == []


def test_every_source_module_is_in_a_package_of_the_table():
    modules = source_modules()
    assert {package_of(m) for m in modules} == set(MAY_IMPORT)
    assert f"{CORE}.errors" in modules and f"{CORE}.workspace" in modules


def test_the_trainers_parts_import_only_what_their_table_allows():
    assert trainer_violations() == []


def test_every_trainer_module_is_in_a_part_of_the_table_which_has_no_cycle():
    parts = {trainer_part(m) for m in source_modules() if m.startswith(TRAINERS + ".")}
    assert parts == set(TRAINER_PARTS)
    order = list(TopologicalSorter(TRAINER_PARTS).static_order())
    assert order.index("recipe") > max(order.index(p) for p in ("models", "objectives", "outputs"))


def test_the_initializers_parts_import_only_what_their_table_allows():
    assert initializer_violations() == []


def test_every_initializer_module_is_in_a_part_of_the_table_which_has_no_cycle():
    modules = [m for m in source_modules() if m.startswith(INITIALIZERS + ".")]
    assert {_part(INITIALIZERS, m) for m in modules} == set(INITIALIZER_PARTS)
    list(TopologicalSorter(INITIALIZER_PARTS).static_order())  # a CycleError if there is one
    programs = {p.removeprefix(INITIALIZERS + ".") for p in INITIALIZER_PROGRAMS}
    assert not any(programs & needs for needs in INITIALIZER_PARTS.values())  # none imports one


def test_initializer_programs_load_without_torch_or_the_sdk():
    # What the static check cannot see: what importing tunepack itself pulls in at run time.
    # The programs and the vocabulary they check a job's arguments with: nothing of the
    # trainer's package, nor of the SDK.
    code = (
        "import sys\n"
        f"for name in {INITIALIZER_PROGRAMS + ['tunepack.runtimes.args']!r}: __import__(name)\n"
        "heavy = {m.split('.')[0] for m in sys.modules}"
        f" & {set(HEAVY | CLUSTER_CLIENTS)!r}\n"
        "sdk = sorted(m for m in sys.modules if m.startswith('tunepack.') and not"
        " m.startswith(('tunepack.core', 'tunepack.runtimes', 'tunepack.initializers')))\n"
        "print(sorted(heavy), sdk)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True
    )
    assert done.stdout == "[] []\n", done.stdout


# --- the rules fail when broken --------------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for directory in SOURCES:
        (tmp_path / directory).mkdir(exist_ok=True)
        (tmp_path / directory / "__init__.py").touch()
    return tmp_path


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (
            {
                "sdk_ext/client.py": "",
                "sdk_ext/core/errors.py": "def f():\n    from tunepack import client\n",
            },
            "sdk_ext/core/errors.py:2: tunepack.core imports tunepack.client (tunepack)",
        ),
        (
            {"sdk_ext/core/durable.py": "import yaml\n"},
            "sdk_ext/core/durable.py:1: tunepack.core imports yaml (not the stdlib)",
        ),
        (
            {"initializers/model.py": "import torch\n"},
            "initializers/model.py:1: tunepack.initializers imports torch",
        ),
        (
            {"initializers/model.py": "from ..trainers import recipe\n"},
            "initializers/model.py:1: tunepack.initializers imports tunepack.trainers "
            "(tunepack.trainers)",
        ),
        (  # the vocabulary is the runtimes': the trainer's modules stay the trainer's
            {
                "runtimes/args.py": "",
                "trainers/recipe.py": "",
                "initializers/model.py": (
                    "from tunepack.runtimes import args\nfrom tunepack.trainers import recipe\n"
                ),
            },
            "initializers/model.py:2: tunepack.initializers imports tunepack.trainers.recipe "
            "(tunepack.trainers)",
        ),
        (
            {"runtimes/catalog.py": "from tunepack import __version__\n"},
            "runtimes/catalog.py:1: tunepack.runtimes imports tunepack (tunepack)",
        ),
        (
            {"trainers/x.py": "import tunepack.initializers.transport.uri\n"},
            "trainers/x.py:1: tunepack.trainers imports tunepack.initializers.transport.uri "
            "(tunepack.initializers)",
        ),
    ],
)
def test_a_broken_rule_is_reported(tmp_path, files, expected):
    assert violations(_tree(tmp_path, files)) == [expected]


def test_a_cycle_between_packages_is_found(tmp_path):
    repo = _tree(
        tmp_path,
        {
            "runtimes/a.py": "from tunepack.trainers import b\n",
            "trainers/b.py": "from tunepack.runtimes import a\n",
        },
    )
    with pytest.raises(CycleError):
        list(TopologicalSorter(package_graph(repo)).static_order())


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (
            {
                "trainers/outputs/checkpoint.py": "",
                "trainers/models/qwen3.py": "def f():\n    from ..outputs import checkpoint\n",
            },
            "trainers/models/qwen3.py:2: trainers/models imports "
            "tunepack.trainers.outputs.checkpoint (outputs)",
        ),
        (
            {
                "trainers/objectives/dpo.py": "",
                "trainers/data/batching.py": "from tunepack.trainers.objectives import dpo\n",
            },
            "trainers/data/batching.py:1: trainers/data imports "
            "tunepack.trainers.objectives.dpo (objectives)",
        ),
        (
            {
                "trainers/recipe.py": "",
                "trainers/outputs/artifacts.py": "from tunepack.trainers import recipe\n",
            },
            "trainers/outputs/artifacts.py:1: trainers/outputs imports "
            "tunepack.trainers.recipe (recipe)",
        ),
    ],
)
def test_a_broken_trainer_rule_is_reported(tmp_path, files, expected):
    assert trainer_violations(_tree(tmp_path, files)) == [expected]


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (  # inside a function too
            {
                "initializers/data/__init__.py": "",
                "initializers/data/schemas.py": "",
                "initializers/transport/__init__.py": "",
                "initializers/transport/uri.py": (
                    "def f():\n    from tunepack.initializers.data import schemas\n"
                ),
            },
            "initializers/transport/uri.py:2: initializers/transport imports "
            "tunepack.initializers.data.schemas (data)",
        ),
        (
            {
                "initializers/model.py": "",
                "initializers/sinks/__init__.py": "from tunepack.initializers import model\n",
            },
            "initializers/sinks/__init__.py:1: initializers/sinks imports "
            "tunepack.initializers.model (model)",
        ),
    ],
)
def test_a_broken_initializer_rule_is_reported(tmp_path, files, expected):
    assert initializer_violations(_tree(tmp_path, files)) == [expected]


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (  # inside a function too
            {
                "sdk_ext/cli/__init__.py": "from tunepack.cli import cluster\n",
                "sdk_ext/cli/cluster.py": "from tunepack.backends import kubeconfig\n",
                "sdk_ext/backends/__init__.py": "",
                "sdk_ext/backends/kubeconfig.py": "",
                "sdk_ext/client.py": "def f():\n    from tunepack.cli.cluster import problem\n",
            },
            ["sdk_ext/client.py:2: tunepack.client imports tunepack.cli.cluster"],
        ),
        (
            {"sdk_ext/cli/__init__.py": "", "sdk_ext/types.py": "from tunepack import cli\n"},
            ["sdk_ext/types.py:1: tunepack.types imports tunepack.cli"],
        ),
        (
            {"sdk_ext/cli/__init__.py": "", "runtimes/store.py": "import tunepack.cli\n"},
            ["runtimes/store.py:1: tunepack.runtimes.store imports tunepack.cli"],
        ),
    ],
)
def test_an_import_of_the_command_line_is_reported(tmp_path, files, expected):
    assert cli_imports(_tree(tmp_path, files)) == expected


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (  # two modules, at their tops (the exporter and its sinks before they were parted)
            {
                "initializers/export.py": "from tunepack.initializers import sinks\n",
                "initializers/sinks/__init__.py": "from tunepack.initializers.export import X\n",
            },
            [["tunepack.initializers.export", "tunepack.initializers.sinks"]],
        ),
        (  # three, relative imports, in a try and a class body; a fourth outside the circle
            {
                "runtimes/a.py": "try:\n    from . import b\nexcept ImportError:\n    b = None\n",
                "runtimes/b.py": "from .c import f\n",
                "runtimes/c.py": "class C:\n    from tunepack.runtimes import a\n",
                "runtimes/d.py": "from tunepack.runtimes import a\n",
            },
            [["tunepack.runtimes.a", "tunepack.runtimes.b", "tunepack.runtimes.c"]],
        ),
        (  # importing a submodule runs its package first
            {
                "runtimes/__init__.py": "from tunepack.trainers import x\n",
                "runtimes/catalog.py": "",
                "trainers/x.py": "import tunepack.runtimes.catalog\n",
            },
            [["tunepack.runtimes", "tunepack.trainers.x"]],
        ),
        (  # inside a function, or only for the type checker: no circle
            {
                "runtimes/catalog.py": "def f():\n    from tunepack.runtimes import custom\n",
                "runtimes/custom.py": (
                    "from typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n    from tunepack.runtimes import catalog\n"
                ),
            },
            [],
        ),
        (  # ...but what an `if TYPE_CHECKING:` runs otherwise counts
            {
                "runtimes/catalog.py": "from tunepack.runtimes import custom\n",
                "runtimes/custom.py": (
                    "import typing\nif typing.TYPE_CHECKING:\n    pass\n"
                    "else:\n    from tunepack.runtimes import catalog\n"
                ),
            },
            [["tunepack.runtimes.catalog", "tunepack.runtimes.custom"]],
        ),
        (  # a package's module importing a sibling: the package is already being imported
            {
                "initializers/sinks/__init__.py": "from . import files\n",
                "initializers/sinks/files.py": "from tunepack.initializers.sinks import s3\n",
                "initializers/sinks/s3.py": "",
            },
            [],
        ),
    ],
)
def test_a_circle_of_imports_is_found(tmp_path, files, expected):
    assert import_cycles(_tree(tmp_path, files)) == expected
