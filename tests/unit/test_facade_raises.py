"""The public facade says what it raises (issue 50, 4), as the Kubeflow SDK's ``TrainerClient``
does: every public method of ``TrainingClient`` and ``OptimizerClient`` (and the constructor, in
the class's docstring), and ``Result``'s methods that can fail, have a Google-style ``Raises:``
section, and each exception it names is one of ``tunepack.core.errors`` or a builtin, so a
renamed or removed type cannot stay in the docs.
"""

from __future__ import annotations

import builtins
import inspect
import re

import pytest

from tunepack.client import TrainingClient
from tunepack.core import errors
from tunepack.optimizer.client import OptimizerClient
from tunepack.types import Result

CLIENTS = (TrainingClient, OptimizerClient)
RESULT_METHODS = ("load", "generate", "prompt_ids", "download")
ENTRY = re.compile(r"^(\w+): \S")


def _public_methods(cls) -> list[str]:
    return sorted(
        name
        for name, member in inspect.getmembers(cls, callable)
        if not name.startswith("_") and not inspect.isclass(member)
    )


def raised(doc: str | None) -> list[str]:
    """The exception names of ``doc``'s ``Raises:`` section, in order ([]: no section)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    if "Raises:" not in lines:
        return []
    names = []
    for line in lines[lines.index("Raises:") + 1 :]:
        if line and not line.startswith(" "):
            break  # the next section, or the text after the section
        if line.startswith("    ") and not line.startswith("     "):
            match = ENTRY.match(line.strip())
            assert match, f"not an entry of Raises: {line!r}"
            names.append(match.group(1))
    return names


def _known(name: str) -> bool:
    kind = getattr(errors, name, None) or getattr(builtins, name, None)
    return isinstance(kind, type) and issubclass(kind, BaseException)


FACADE = [
    *((cls, name) for cls in CLIENTS for name in _public_methods(cls)),
    *((Result, name) for name in RESULT_METHODS),
]


@pytest.mark.parametrize(("owner", "name"), FACADE, ids=[f"{c.__name__}.{n}" for c, n in FACADE])
def test_each_public_method_says_what_it_raises(owner, name):
    method = getattr(owner, name)
    # Defined by tunepack, not inherited with the SDK's words (which name none of its errors).
    assert method.__module__.startswith("tunepack."), f"{owner.__name__}.{name} is the SDK's"
    names = raised(method.__doc__)
    assert names, f"{owner.__name__}.{name} has no Raises: section"
    assert [n for n in names if not _known(n)] == []


@pytest.mark.parametrize("cls", CLIENTS, ids=lambda c: c.__name__)
def test_each_client_says_what_its_constructor_raises(cls):
    names = raised(cls.__doc__)
    assert names and [n for n in names if not _known(n)] == []


def test_the_sections_are_read_as_written():
    doc = """Summary.

    Raises:
        NotFoundError: If there is no such job, or no
            step of that name.
        TimeoutError: If time ran out.

    Examples:
        >>> x
    """
    assert raised(doc) == ["NotFoundError", "TimeoutError"]
    assert raised("Summary only.") == []
    assert not _known("NoSuchError") and _known("UnknownKeyError") and _known("ValueError")
