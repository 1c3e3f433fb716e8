"""The Kubeflow SDK's private names: tunepack overrides none and calls one, written down with its
reason in ``tunepack.backends.kubernetes`` (``SDK_TRAINJOB_FROM_CR``). An override of a private
method breaks silently on an SDK release that renames it (the SDK stops calling it); a call
breaks loudly, and these tests say so before a user does."""

from __future__ import annotations

import ast
import inspect
import re

from kubeflow.trainer.backends.kubernetes.backend import KubernetesBackend as SdkBackend

from tests import REPO
from tunepack.backends import kubernetes
from tunepack.backends.local import LocalBackend
from tunepack.client import TrainingClient

# A name Python mangled for a class: ``self.__x`` inside class ``C`` is ``_C__x``.
MANGLED = re.compile(r"^_[A-Za-z]\w*?__\w+$")
DUNDER = re.compile(r"^__\w+__$")  # Python's own names (``__all__``): public


def test_no_private_method_of_the_sdk_is_overridden():
    """A class of tunepack's that subclasses the SDK's defines no ``_<SdkClass>__name``: the SDK
    would call it only while its own method keeps that name. (tunepack's KubernetesBackend shares
    the SDK's class name, so its own ``self.__x`` would land there too.)"""
    for cls in (kubernetes.KubernetesBackend, LocalBackend, TrainingClient):
        sdk_classes = [c.__name__ for c in cls.__mro__ if c.__module__.startswith("kubeflow.")]
        overrides = [
            name for name in vars(cls) if any(name.startswith(f"_{sdk}__") for sdk in sdk_classes)
        ]
        assert overrides == [], f"{cls.__qualname__} overrides the SDK's private {overrides}"


def test_the_sdk_trainjob_converter_is_where_tunepack_calls_it():
    """``_from_object`` calls the SDK's converter with one TrainJob model; an SDK release that
    renames it or changes its arguments fails here (pyproject pins kubeflow>=0.5,<0.6)."""
    convert = getattr(SdkBackend, kubernetes.SDK_TRAINJOB_FROM_CR, None)
    assert callable(convert), (
        f"the SDK's KubernetesBackend has no {kubernetes.SDK_TRAINJOB_FROM_CR}"
    )
    assert list(inspect.signature(convert).parameters) == ["self", "trainjob_cr"]


def test_the_source_names_no_other_private_name_of_the_sdk():
    """Every mangled name in the SDK's part of tunepack (an attribute, a definition or a string)
    is the one documented in ``tunepack.backends.kubernetes``, and nothing private is imported
    from ``kubeflow``."""
    found = []
    for path in sorted((REPO / "sdk_ext").rglob("*.py")):
        where = path.relative_to(REPO)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names = [node.name]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]
            found += [(str(where), n) for n in names if MANGLED.match(n)]
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kubeflow"):
                imported = [a.name for a in node.names] + node.module.split(".")
                private = [n for n in imported if n.startswith("_") and not DUNDER.match(n)]
                found += [(str(where), n) for n in private]
    assert found == [("sdk_ext/backends/kubernetes.py", kubernetes.SDK_TRAINJOB_FROM_CR)]
