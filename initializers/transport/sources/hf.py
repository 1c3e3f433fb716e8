"""``hf://``: models and datasets on the Hugging Face Hub (or any Hub-compatible ``HF_ENDPOINT``).

The URI forms: docs/initializers.md, "Storage URIs". huggingface_hub is used for the repository
and tree API, URLs, auth and errors; bytes come by tunepack's own ranged GET so a preempted
download resumes (docs/initializers.md, "Implementation notes")."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import parse_qsl, unquote

import httpx2
from huggingface_hub import HfApi, constants, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import (
    build_hf_headers,
    get_session,
    hf_raise_for_status,
    validate_repo_id,
)

from tunepack.core.errors import (
    BadInputError,
    BadValueError,
    ConflictError,
    DeniedError,
    NotFoundError,
    UnknownKeyError,
)
from tunepack.initializers.transport.sources import Body, Listing, RemoteFile, RemoteSource, _http
from tunepack.initializers.transport.uri import StorageUri, redact

TOKEN_ENVS = ("ACCESS_TOKEN", "HF_TOKEN")  # ACCESS_TOKEN: Kubeflow's per-job secretRef wins
TOKEN_HINT = "set HF_TOKEN (in a cluster: the Secret tunepack-hub-token, key token)"
_OPTIONS = {"split"}
_TYPE_PREFIXES = {"datasets": "dataset", "models": "model"}


def parse(raw: str, scheme: str, rest: str) -> StorageUri:
    shown = redact(raw)
    rest, _, query = rest.partition("?")
    if "#" in rest or "#" in query:
        raise BadValueError(f"hub URI {shown!r} has a '#' fragment, which hf:// does not use")
    body, at, revision = rest.partition("@")
    revision = unquote(revision)
    if at and not revision:
        raise BadValueError(
            f"hub URI {shown!r} ends with '@' but names no revision; write "
            f"hf://org/name@<branch, tag or commit> or leave out the '@'"
        )
    segments = [s for s in body.split("/") if s]
    prefix = _TYPE_PREFIXES.get(segments[0]) if segments else None
    if prefix:
        segments = segments[1:]
    if len(segments) < 2:
        raise BadValueError(
            f"hub URI {shown!r} does not name a repository; write hf://org/name for a model "
            f"or hf://datasets/org/name for a dataset"
        )
    repo_id = "/".join(segments[:2])
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise BadValueError(
            f"hub URI {shown!r} names {repo_id!r}, which is not a valid repository id "
            f"(letters, digits, '-', '_' and '.', at most 96 characters per part)"
        ) from None
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise UnknownKeyError(
            f"hub URI {shown!r} has unknown option {unknown[0]!r}; the only option is "
            f"?split=<name> for datasets",
            key=unknown[0],
            suggestions=("split",),
        )
    location = "/".join(([f"{prefix}s"] if prefix else []) + segments)
    return StorageUri(
        raw=raw, scheme=scheme, location=location, revision=revision or None, options=options
    )


def token() -> str | None:
    for name in TOKEN_ENVS:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


class Source(RemoteSource):
    def __init__(self, uri: StorageUri, kind: str):
        super().__init__(uri, kind)
        segments = uri.location.split("/")
        # hf://org/name names a dataset repo for the dataset initializer, a model repo for the
        # model initializer (as in Kubeflow's own initializers); a datasets/ or models/ prefix
        # says so explicitly.
        self.repo_type = "dataset" if kind == "dataset" else "model"
        if segments[0] in ("datasets", "models"):
            self.repo_type = _TYPE_PREFIXES[segments[0]]
            segments = segments[1:]
        self.repo_id = "/".join(segments[:2])
        self.subpath = "/".join(segments[2:])
        self.revision = uri.revision or constants.DEFAULT_REVISION
        self.token = token()
        self.endpoint = constants.ENDPOINT
        # token=False: never fall back to a token saved on the machine running the initializer;
        # in a cluster only the Secret counts, and locally the result must not depend on logins.
        self._auth: str | bool = self.token or False
        self.api = HfApi(endpoint=self.endpoint, token=self._auth)

    @property
    def what(self) -> str:
        kind = "dataset" if self.repo_type == "dataset" else "model"
        return f"hub {kind} repository {self.repo_id!r}"

    def list(self) -> Listing:
        try:
            info = self.api.repo_info(
                self.repo_id, repo_type=self.repo_type, revision=self.revision, timeout=30
            )
            commit = info.sha
            entries = self.api.list_repo_tree(
                self.repo_id,
                path_in_repo=self.subpath or None,
                repo_type=self.repo_type,
                revision=commit,
                recursive=True,
            )
            files = [e for e in entries if isinstance(e, RepoFile)]
        except Exception as error:  # noqa: BLE001 - mapped or re-raised below
            raise self._problem(error) from None
        if self.token is None and getattr(info, "gated", False):
            raise DeniedError(
                f"{self.what} is gated and no token was given: accept its terms on "
                f"{self.endpoint}/{self._web_path()} with your account, then {TOKEN_HINT}"
            )
        prefix = self.subpath + "/" if self.subpath else ""
        listed = [
            RemoteFile(
                path=entry.path.removeprefix(prefix),
                size=entry.size,
                ref=entry.path,
                version=commit,
                sha256=entry.lfs.sha256 if entry.lfs else None,
                git_sha1=None if entry.lfs else entry.blob_id,
            )
            for entry in files
        ]
        if not listed:
            where = f"under {self.subpath!r} " if self.subpath else ""
            raise NotFoundError(
                f"{self.what} has no files {where}at revision {self.revision!r}; check the "
                f"path in {self.uri.display!r}",
                what="files",
                name=self.uri.display,
            )
        return Listing(listed, facts={"revision": self.revision, "commit": commit})

    def probe(self, file: RemoteFile) -> None:
        """One HEAD request, so a missing permission fails before any large transfer."""
        try:
            response = get_session().head(
                self._url(file), headers=self._headers(0), timeout=_http.timeout()
            )
            hf_raise_for_status(response)
        except Exception as error:  # noqa: BLE001
            raise self._problem(error) from None

    @contextmanager
    def open(self, file: RemoteFile, offset: int) -> Iterator[Body]:
        try:
            with get_session().stream(
                "GET", self._url(file), headers=self._headers(offset), timeout=_http.timeout()
            ) as response:
                if response.is_error:
                    response.read()
                    hf_raise_for_status(response)
                start = _http.body_offset(response, offset)
                yield Body(start, _http.chunks(response), _http.total_size(response))
        except (httpx2.TransportError, HfHubHTTPError) as error:
            raise self._problem(error, file.path) from None

    def _url(self, file: RemoteFile) -> str:
        return hf_hub_url(
            self.repo_id,
            file.ref,
            repo_type=self.repo_type,
            revision=file.version,
            endpoint=self.endpoint,
        )

    def _headers(self, offset: int) -> dict[str, str]:
        headers = build_hf_headers(token=self._auth, library_name="tunepack")
        headers.update(_http.range_headers(offset))
        return headers

    def _web_path(self) -> str:
        return ("datasets/" if self.repo_type == "dataset" else "") + self.repo_id

    def _problem(self, error: Exception, path: str | None = None) -> Exception:
        """A user-facing BadInputError or a Retryable for a failure talking to the hub."""
        if isinstance(error, httpx2.TransportError):
            return _http.transport_problem(error)
        if isinstance(error, OfflineModeIsEnabled):
            return ConflictError(
                f"HF_HUB_OFFLINE is set, so {self.what} cannot be downloaded; unset it for the "
                f"model and dataset initializers"
            )
        if not isinstance(error, HfHubHTTPError):
            return error  # a bug or an unexpected library failure: keep its traceback
        status = error.response.status_code if error.response is not None else None
        with_token = "the token given" if self.token else "no token"
        if isinstance(error, GatedRepoError):
            return DeniedError(
                f"{self.what} is gated and {with_token} has access to it: accept its terms on "
                f"{self.endpoint}/{self._web_path()} with the token's account"
                + ("" if self.token else f", then {TOKEN_HINT}")
            )
        if isinstance(error, RevisionNotFoundError):
            return NotFoundError(
                f"revision {self.revision!r} of {self.what} does not exist; use one of its "
                f"branches, tags or commits in {self.uri.display!r}",
                what="revision",
                name=self.revision,
            )
        if isinstance(error, RemoteEntryNotFoundError):
            return NotFoundError(
                f"{path or 'a listed file'} disappeared from {self.what} during the download; "
                f"pin a commit with @<revision> in {self.uri.display!r}",
                what="file",
                name=path,
            )
        if isinstance(error, RepositoryNotFoundError) or status == 404:
            if self.token:
                return NotFoundError(
                    f"{self.what} was not found, or the token given cannot read it; check the "
                    f"name in {self.uri.display!r} and the token's permissions",
                    what="repository",
                    name=self.repo_id,
                )
            return NotFoundError(
                f"{self.what} was not found, or it is private and no token was given; check "
                f"the name in {self.uri.display!r}, or {TOKEN_HINT}",
                what="repository",
                name=self.repo_id,
            )
        if status == 401:
            return DeniedError(
                f"the hub rejected the token given for {self.what} (401 Unauthorized); "
                f"create a new read token and {TOKEN_HINT}"
            )
        if status == 403:
            return DeniedError(
                f"the hub denied access to {self.what} (403 Forbidden); give the token read "
                f"permission on it and {TOKEN_HINT}"
            )
        if status in _http.RETRYABLE_STATUS:
            return _http.status_problem(f"the hub answered HTTP {status}", error.response)
        return BadInputError(
            f"the hub answered HTTP {status} for {self.what}; check {self.uri.display!r}"
        )
