"""``STORAGE_URI``: parsing, redaction and the table of sources.

Each scheme maps to a module under ``tunepack.initializers.transport.sources`` that validates the
URI's form (``parse``) and builds the source that lists and streams its files (``Source``).
Modules are imported on first use: a re-run on a complete workspace, or a file:// run, never pays
for boto3.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from tunepack.core.errors import BadValueError, NotFoundError, UnknownKeyError, UnsupportedError
from tunepack.core.workspace import STORAGE_URI_ENV

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
    # Options carried in the URI's query (``?split=test``) or fragment (``#sha256=...``).
    options: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

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


# Where an https:// source takes a user name and password from, instead of the URL: the
# environment (on a cluster, a Secret the initializer gets by reference).
HTTPS_USERNAME_ENV = "HTTPS_USERNAME"
HTTPS_PASSWORD_ENV = "HTTPS_PASSWORD"


def credentials_in(uri: str) -> str | None:
    """What in ``uri`` may be a credential, said without its value: its userinfo
    (``user:password@``) or a query parameter ``redact`` hides (a presigned URL's signature, a
    token). None when it holds none."""
    try:
        parts = urlsplit(uri)
        keys = [k for k, _ in parse_qsl(parts.query, keep_blank_values=True)]
    except ValueError:
        return "a part that cannot be parsed"  # redact hides it whole: so may it be a secret
    if "@" in parts.netloc:
        return "a user name or password (user:password@)"
    hidden = [k for k in keys if k.lower() not in _PUBLIC_QUERY_KEYS]
    if hidden or (parts.query and not keys):
        named = f"query parameter {hidden[0]!r}" if hidden else f"a query ({_HIDDEN})"
        return f"{named} (a presigned URL's signature or a token, maybe)"
    return None


def refuse_credentials(uri: str, what: str, secret_by: str) -> None:
    """Refuse a storage URI ``uri`` of ``what`` (dataset, model, export) with credentials in it
    (``credentials_in``): a TrainJob, a job record or a manifest would keep them in clear, for
    anyone who can read it. The message names the part, never its value, and the Secret-based
    way (``secret_by``: how a Secret is named for it). Raises ``BadInputError``."""
    found = credentials_in(uri)
    if found is None:
        return
    raise UnsupportedError(
        f"{what} storage URI {redact(uri)!r} carries {found}: tunepack never writes a credential "
        f"into a TrainJob or a job record; give the URI without it and the credential in the "
        f"environment ({HTTPS_USERNAME_ENV} and {HTTPS_PASSWORD_ENV} for https://, the AWS_* keys "
        f"for s3://, HF_TOKEN for hf://), on a cluster from a Secret ({secret_by}); see "
        "docs/initializers.md, 'Credentials'"
    )


def parse(raw: str | None) -> StorageUri:
    """Parse and validate a storage URI; raise BadInputError naming it when it is unusable."""
    raw = (raw or "").strip()
    if not raw:
        raise BadValueError(
            f"{STORAGE_URI_ENV} is not set; set it to where the initializer reads from: "
            f"hf://org/name, s3://bucket/prefix, https://host/file, file:///absolute/path or a "
            f"plain path"
        )
    match = _SCHEME_RE.match(raw)
    if match is None:
        _refuse_near_uri(raw)
        # "file:/abs" (one slash) is a valid file URI too; everything else is a path.
        path = raw.removeprefix("file:") if raw.startswith("file:/") else raw
        return StorageUri(raw=raw, scheme="file", location=_absolute(path))

    scheme = match.group(1).lower()
    if scheme not in _SOURCES:
        raise BadValueError(
            f"unsupported storage URI {redact(raw)!r}: expected one of {_supported_text()}"
        )
    if scheme == "file":
        return _parse_file_uri(raw)
    return _module(scheme).parse(raw, scheme, raw[match.end() :])


# "hf:/org/x", "s3:bucket/x": a remote scheme short of its two slashes, which would otherwise be
# read as a relative path (and fail later, as a missing file, or never).
_NEAR_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/?)")


def _refuse_near_uri(raw: str) -> None:
    """Refuse ``raw`` when it is a remote scheme (``hf:``, ``s3:``, ``https:``) without the two
    slashes after it, saying the URI meant; ``./hf:...`` stays a path."""
    near = _NEAR_SCHEME_RE.match(raw)
    if near is None or near.group(1).lower() not in _SOURCES or near.group(1).lower() == "file":
        return
    scheme, slash = near.groups()
    # Redacted as the URI meant (urlsplit reads the one-slash form as a path: it would show a
    # password), and shown as written.
    meant = redact(f"{scheme}://{raw[near.end() :]}").partition("://")[2]
    given = f"{scheme}:{slash}{meant}"
    raise BadValueError(
        f"storage URI {given!r} has {'one slash' if slash else 'no slashes'} after '{scheme}:': "
        f"did you mean {scheme}://{meant}? (a local path that begins with '{scheme}:' is "
        f"written ./{given})"
    )


def from_env() -> StorageUri:
    """The URI this initializer was started with (``STORAGE_URI``)."""
    return parse(os.environ.get(STORAGE_URI_ENV))


def resolve(uri: StorageUri) -> Path:
    """The local path a file:// URI names; it must exist."""
    if not uri.is_local:
        raise AssertionError(f"{uri.scheme}:// is remote; use remote_source()")
    return _local_path(uri)


def remote_source(uri: StorageUri, kind: str):
    """The ``RemoteSource`` that lists and streams a remote URI's files.

    ``kind`` ("dataset" or "model") is what the calling initializer fetches; sources whose URIs
    are ambiguous about it (``hf://org/name``) use it as the default.
    """
    return _module(uri.scheme).Source(uri, kind)


def _module(scheme: str):
    return importlib.import_module(f"tunepack.initializers.transport.sources.{_SOURCES[scheme]}")


def _parse_file_uri(raw: str) -> StorageUri:
    parts = urlsplit(raw)
    if parts.netloc not in ("", "localhost"):
        raise BadValueError(
            f"file URI {redact(raw)!r} has a host part ({parts.netloc!r}); write "
            f"file:///absolute/path (three slashes) or a plain path"
        )
    path = unquote(parts.path)
    if not path:
        raise BadValueError(f"file URI {redact(raw)!r} has no path; write file:///absolute/path")
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(options) - _FILE_OPTIONS)
    if unknown or (parts.query and not options):
        what = f"unknown option {unknown[0]!r}" if unknown else f"a query {parts.query!r}"
        raise UnknownKeyError(
            f"file URI {redact(raw)!r} has {what}; the only option is ?split=<name> for a "
            "dataset directory (write a '?' in a file name as %3F)",
            key=unknown[0] if unknown else parts.query,
            suggestions=("split",),
        )
    return StorageUri(raw=raw, scheme="file", location=_absolute(path), options=options)


# What a file:// URI's query may say: the split of a dataset directory (train/, test/ files).
_FILE_OPTIONS = frozenset({"split"})


def _absolute(path: str) -> str:
    # Normalized, so "./d/x.jsonl" and "file:///cwd/d/x.jsonl" record the same source.
    return os.path.abspath(os.path.expanduser(path))


def _local_path(uri: StorageUri) -> Path:
    path = Path(uri.location)
    if not path.exists():
        raise NotFoundError(
            f"storage URI {uri.display!r} points to {path}, which does not exist "
            f"(file:// paths are read on the machine that runs the initializer)",
            what="path",
            name=str(path),
        )
    return path


def _supported_text() -> str:
    return "file://, hf://, s3://, https://, <path>"


# scheme -> module under tunepack.initializers.transport.sources. http:// shares the https module,
# which accepts it only for loopback hosts (test servers): anything else must be encrypted.
_SOURCES: dict[str, str] = {
    "file": "files",
    "hf": "hf",
    "s3": "s3",
    "https": "https",
    "http": "https",
}
