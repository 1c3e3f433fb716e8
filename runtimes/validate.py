"""Strict validation of Kubernetes objects against the ``kubeflow-trainer-api`` models.

The models' ``from_dict`` silently drops unknown fields, so a typo (``volumeMount``) would vanish
when applied; strict validation round-trips the object (``to_dict``) and reports every input path
that did not survive. Accepted, because nothing is lost: ``null`` values dropped, integer
quantities as floats, ``metav1.Time`` as ``datetime``, defaults added (found by trying it)."""

from __future__ import annotations

import difflib
import functools
import re
from datetime import datetime
from typing import Any, TypeVar

import kubeflow_trainer_api.models as api
from pydantic import BaseModel, ValidationError

from tunepack.core.errors import BadValueError

Model = TypeVar("Model", bound=BaseModel)

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_INPUT_VALUE = re.compile(r"input_value=(.*?), input_type")


def validate_strict(obj: dict, model_cls: type[Model]) -> Model:
    """Parse ``obj`` with ``model_cls`` and fail unless every field of it is understood.

    Raises ``BadInputError`` naming each offending JSON path (``spec.template...volumeMount``).
    """
    kind = _describe(obj, model_cls)
    if not isinstance(obj, dict):
        raise BadValueError(f"{kind} must be a mapping, got {type(obj).__name__}")
    try:
        model = model_cls.from_dict(obj)
    except (ValidationError, ValueError, TypeError) as err:
        # ValidationError is a ValueError; the oneOf models (quantities) raise plain ValueErrors.
        lines = _type_errors(err, obj)
        raise BadValueError(f"{kind} is invalid:\n  " + "\n  ".join(lines)) from None
    problems = list(_diff(obj, model.to_dict(), ""))
    if problems:
        raise BadValueError(
            f"{kind} has fields the Kubeflow Trainer API does not know or cannot keep "
            "(they would be silently dropped):\n  " + "\n  ".join(problems)
        )
    return model


def validate_runtime(obj: dict) -> api.TrainerV1alpha1ClusterTrainingRuntime:
    return validate_strict(obj, api.TrainerV1alpha1ClusterTrainingRuntime)


def validate_trainjob(obj: dict) -> api.TrainerV1alpha1TrainJob:
    return validate_strict(obj, api.TrainerV1alpha1TrainJob)


def _describe(obj: Any, model_cls: type) -> str:
    if isinstance(obj, dict):
        kind = obj.get("kind") or model_cls.__name__
        name = (obj.get("metadata") or {}).get("name")
        return f"{kind} {name!r}" if name else str(kind)
    return model_cls.__name__


def _diff(given: Any, kept: Any, path: str):
    """Yield a message for each path of ``given`` that is missing or different in ``kept``."""
    if given is None:
        return  # null means absent; the round trip drops it and nothing is lost
    if isinstance(given, dict):
        if not isinstance(kept, dict):
            yield f"{path or '<root>'}: a mapping became {kept!r}"
            return
        for key, value in given.items():
            child = _join(path, key)
            if value is None:
                continue
            if key not in kept:
                yield f"{child}: {_unknown(key)}"
            else:
                yield from _diff(value, kept[key], child)
    elif isinstance(given, list):
        if not isinstance(kept, list) or len(kept) != len(given):
            yield f"{path}: list of {len(given)} items came back as {kept!r}"
            return
        for index, (item, kept_item) in enumerate(zip(given, kept, strict=True)):
            yield from _diff(item, kept_item, f"{path}[{index}]")
    elif not _same_scalar(given, kept):
        yield f"{path}: {given!r} came back as {kept!r}"


def _same_scalar(given: Any, kept: Any) -> bool:
    # bool is an int in Python: compare it strictly, or `true` would equal `1`.
    if isinstance(given, bool) or isinstance(kept, bool):
        return type(given) is type(kept) and given == kept
    if isinstance(given, int | float) and isinstance(kept, int | float):
        return given == kept  # quantities: 1 -> 1.0
    if isinstance(given, str) and isinstance(kept, datetime):
        try:
            return datetime.fromisoformat(given) == kept
        except ValueError:
            return False
    return type(given) is type(kept) and given == kept


def _join(path: str, key: Any) -> str:
    if isinstance(key, str) and _IDENTIFIER.match(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"  # label keys such as "trainer.kubeflow.org/framework"


@functools.cache
def _known_fields() -> tuple[str, ...]:
    """Every JSON field name of every model: the vocabulary for "did you mean" hints."""
    names = set()
    for value in vars(api).values():
        if isinstance(value, type) and issubclass(value, BaseModel):
            for name, info in value.model_fields.items():
                names.add(info.alias or name)
    # Python-only helper attributes (actual_instance, oneof_schema_1_validator) are not JSON.
    return tuple(sorted(name for name in names if "_" not in name))


def _unknown(key: Any) -> str:
    if not isinstance(key, str):
        return "unknown field"
    if key in _known_fields():
        return "unknown field here (the API has it on another object: misplaced?)"
    close = difflib.get_close_matches(key, _known_fields(), n=1, cutoff=0.8)
    return f"unknown field (did you mean {close[0]!r}?)" if close else "unknown field"


def _type_errors(err: Exception, obj: dict) -> list[str]:
    """Readable lines for a parse failure, with the JSON path where it can be found.

    ``from_dict`` validates each nested model separately, so pydantic's locations are relative to
    the innermost model; the full path is recovered by finding that location and value in the input.
    """
    if not isinstance(err, ValidationError):
        # oneOf models (quantities, int-or-string) raise a ValueError with pydantic's details,
        # and no location, after "Details:"; keep the summary and the offending value.
        summary, _, details = str(err).partition(" Details:")
        got = _INPUT_VALUE.search(details)
        return [summary + (f" (got {got.group(1)})" if got else "")]
    lines = []
    for item in err.errors():
        loc = tuple(item["loc"])
        paths = _find(obj, loc, item.get("input"), "") if loc else []
        where = ", ".join(paths) if paths else f"{err.title}.{'.'.join(map(str, loc))}"
        lines.append(f"{where}: {item['msg']} (got {item.get('input')!r})")
    return lines


def _find(node: Any, loc: tuple, value: Any, path: str) -> list[str]:
    """Paths under ``node`` from which following ``loc`` reaches ``value``."""
    found = []
    target, target_path = node, path
    for step in loc:
        child = dict(_children(target, target_path)).get(step)
        if child is None:
            break
        target_path, target = child
    else:
        if target is value or (type(target) is type(value) and target == value):
            found.append(target_path)
    for child_path, child in dict(_children(node, path)).values():
        found.extend(_find(child, loc, value, child_path))
    return found


def _children(node: Any, path: str):
    """(key, (path, child)) for each child of a mapping or list."""
    if isinstance(node, dict):
        for key, child in node.items():
            yield key, (_join(path, key), child)
    elif isinstance(node, list):
        for index, child in enumerate(node):
            yield index, (f"{path}[{index}]", child)
