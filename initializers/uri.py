"""``STORAGE_URI``: parsing, redaction and the table of source handlers.

A source handler turns a parsed URI into a local path the initializer reads from. Only local
files exist in this version; ``hf://``, ``s3://`` and ``https://`` are reserved in the table so a
user gets a precise "not supported yet" instead of "unknown scheme", and so adding one later is
a new entry here rather than a change to the initializers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from tunepack.errors import BadInputError
from tunepack.workspace import STORAGE_URI_ENV

# "scheme://..." per RFC 3986; anything else is a plain local path.
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# Query keys that never carry secrets, kept readable in messages; every other value is hidden.
_PUBLIC_QUERY_KEYS = frozenset({"revision", "ref", "branch", "split", "subset"})
_HIDDEN = "***"


@dataclass(frozen=True)
class StorageUri:
    """A parsed ``STORAGE_URI``.

    ``location`` is the absolute filesystem path for ``file``, and the part after ``scheme://``
    otherwise. ``revision`` is for versioned sources (hub revisions) and unused by ``file``.
    """

    raw: str
    scheme: str
    location: str
    revision: str | None = None

    @property
    def display(self) -> str:
        """The URI as the user wrote it, safe to print."""
        return redact(self.raw)

    @property
    def canonical(self) -> str:
        """The identity recorded in manifests: the same source always gives the same string."""
        if self.scheme == "file":
            return Path(self.location).as_uri()
        return redact(self.raw)


def redact(uri: str) -> str:
    """Hide userinfo (``user:password@``) and credential-bearing query values in ``uri``."""
    try:
        parts = urlsplit(uri)
        netloc = parts.netloc
        if "@" in netloc:
            netloc = _HIDDEN + "@" + netloc.rpartition("@")[2]
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode(
                [(k, v if k.lower() in _PUBLIC_QUERY_KEYS else _HIDDEN) for k, v in pairs],
                safe="*",
            )
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        # Malformed beyond urlsplit (e.g. a broken IPv6 host): hide everything that could hold a
        # secret rather than risk printing it.
        head, sep, rest = uri.partition("://")
        if sep:
            rest = rest.rpartition("@")[2]
        return head + sep + rest.partition("?")[0] + ("?" + _HIDDEN if "?" in rest else "")


def parse(raw: str | None) -> StorageUri:
    """Parse and validate a storage URI; raise BadInputError naming it when it is unusable."""
    raw = (raw or "").strip()
    if not raw:
        raise BadInputError(
            f"{STORAGE_URI_ENV} is not set; set it to where the initializer reads from: "
            f"file:///absolute/path or a plain path"
        )
    match = _SCHEME_RE.match(raw)
    if match is None:
        # "file:/abs" (one slash) is a valid file URI too; everything else is a path.
        path = raw.removeprefix("file:") if raw.startswith("file:/") else raw
        return StorageUri(raw=raw, scheme="file", location=_absolute(path))

    scheme = match.group(1).lower()
    if scheme not in _HANDLERS:
        raise BadInputError(
            f"unsupported storage URI {redact(raw)!r}: expected one of {_supported_text()}"
        )
    if _HANDLERS[scheme] is None:
        raise BadInputError(
            f"storage URI {redact(raw)!r} uses {scheme}://, which this version of tunepack does "
            f"not support yet; supported: {_supported_text()}. Download the files and point "
            f"{STORAGE_URI_ENV} at them."
        )
    if scheme == "file":
        return _parse_file_uri(raw)
    return StorageUri(raw=raw, scheme=scheme, location=raw[match.end() :])


def from_env() -> StorageUri:
    """The URI this initializer was started with (``STORAGE_URI``)."""
    return parse(os.environ.get(STORAGE_URI_ENV))


def resolve(uri: StorageUri) -> Path:
    """A local path holding the source's content, through the scheme's handler."""
    handler = _HANDLERS.get(uri.scheme)
    if handler is None:  # parse() refuses these; guard against hand-built StorageUri values
        raise BadInputError(
            f"unsupported storage URI {uri.display!r}: expected one of {_supported_text()}"
        )
    return handler(uri)


def _parse_file_uri(raw: str) -> StorageUri:
    parts = urlsplit(raw)
    if parts.netloc not in ("", "localhost"):
        raise BadInputError(
            f"file URI {redact(raw)!r} has a host part ({parts.netloc!r}); write "
            f"file:///absolute/path (three slashes) or a plain path"
        )
    path = unquote(parts.path)
    if not path:
        raise BadInputError(f"file URI {redact(raw)!r} has no path; write file:///absolute/path")
    return StorageUri(raw=raw, scheme="file", location=_absolute(path))


def _absolute(path: str) -> str:
    # Normalized, so "./d/x.jsonl" and "file:///cwd/d/x.jsonl" record the same source.
    return os.path.abspath(os.path.expanduser(path))


def _local_path(uri: StorageUri) -> Path:
    path = Path(uri.location)
    if not path.exists():
        raise BadInputError(
            f"storage URI {uri.display!r} points to {path}, which does not exist "
            f"(file:// paths are read on the machine that runs the initializer)"
        )
    return path


def _supported_text() -> str:
    schemes = [f"{scheme}://" for scheme, handler in _HANDLERS.items() if handler is not None]
    return ", ".join([*schemes, "<path>"])


# scheme -> handler. None marks a scheme of tunepack's vocabulary this version cannot read yet.
_HANDLERS: dict[str, Callable[[StorageUri], Path] | None] = {
    "file": _local_path,
    "hf": None,
    "s3": None,
    "https": None,
}
