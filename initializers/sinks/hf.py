"""``hf://org/name[@branch]``: a Hugging Face Hub model repository (or any Hub-compatible
``HF_ENDPOINT``), written in one commit."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from urllib.parse import unquote

import httpx2
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, constants, hf_hub_url
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import (
    build_hf_headers,
    disable_progress_bars,
    get_session,
    hf_raise_for_status,
)

from tunepack.core.errors import (
    BadInputError,
    BadValueError,
    DeniedError,
    NotFoundError,
    TransientError,
)
from tunepack.core.workspace import MANIFEST_FILE
from tunepack.initializers.sinks import LocalFile, Log, RemoteCalls, manifest_bytes, same_export
from tunepack.initializers.transport import uri
from tunepack.initializers.transport.sources import _http
from tunepack.initializers.transport.sources import hf as hub_source
from tunepack.initializers.transport.transfer_progress import human_bytes

# The exporter's setting for a repository it creates: private unless "false" (docs/export.md).
PRIVATE_ENV = "EXPORT_PRIVATE"
_CHUNK = 1 << 20


def _private() -> bool:
    raw = os.environ.get(PRIVATE_ENV, "").strip().lower()
    if raw in ("", "true", "1", "yes"):
        return True
    if raw in ("false", "0", "no"):
        return False
    raise BadValueError(f"{PRIVATE_ENV}={raw!r} is not valid: expected true or false")


def hub_endpoint() -> str:
    """``HF_ENDPOINT`` as it is now: huggingface_hub reads it once, at import, which in a notebook
    may be before the user set it."""
    return os.environ.get("HF_ENDPOINT", "").strip().rstrip("/") or constants.ENDPOINT


def git_blob_id(path: Path) -> str:
    """The git blob id of a file: what the Hub publishes for files not stored in LFS/Xet."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())  # noqa: S324 - git's id
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class Sink(RemoteCalls):
    """A Hub model repository; every file and the manifest in one commit (atomic by nature).
    The repository is created private unless ``EXPORT_PRIVATE=false``; an existing one keeps its
    visibility. Files already uploaded by a killed run are not sent again: the Hub's LFS/Xet
    storage already has them, and the commit only refers to them."""

    def __init__(self, parsed: uri.StorageUri, log: Log):
        self.display = parsed.display
        self.log = log
        self.repo_id = parsed.location
        self.revision = unquote(parsed.revision) if parsed.revision else constants.DEFAULT_REVISION
        self.token = hub_source.token()
        self.endpoint = hub_endpoint()
        self.api = HfApi(endpoint=self.endpoint, token=self.token or False)

    @property
    def what(self) -> str:
        return f"hub model repository {self.repo_id!r}"

    @staticmethod
    def _is_missing(error: Exception) -> bool:
        return isinstance(error, EntryNotFoundError | RepositoryNotFoundError)

    def read_manifest(self, revision: str | None = None) -> dict | None:
        url = hf_hub_url(
            self.repo_id, MANIFEST_FILE, revision=revision or self.revision, endpoint=self.endpoint
        )

        def get():
            response = get_session().get(
                url, headers=build_hf_headers(token=self.token or False), follow_redirects=True
            )
            if response.status_code == 404:
                return None
            hf_raise_for_status(response)
            return response.content

        data = self._call(f"reading the manifest of {self.display!r}", get, missing_ok=True)
        if data is None:
            return None
        try:
            manifest = json.loads(data)
        except ValueError:
            return None
        return manifest if isinstance(manifest, dict) else None

    def publish(self, files: list[LocalFile], manifest: dict) -> bool:
        """Send the export; False when the destination held it already (nothing sent)."""
        disable_progress_bars()  # a Pod's log is a pipe, not a terminal
        if not self.token:
            raise DeniedError(
                f"exporting to {self.display!r} needs a hub token with write access; "
                f"{hub_source.TOKEN_HINT}"
            )
        private = _private()
        url = self._call(
            f"creating {self.what}",
            self.api.create_repo,
            self.repo_id,
            private=private,
            exist_ok=True,
            repo_type="model",
        )
        info = self._call(f"reading {self.what}", self.api.repo_info, self.repo_id)
        visibility = "private" if info.private else "public"
        self.log(f"{url} is {visibility}")
        if self.revision != "main":
            self._call(
                f"creating branch {self.revision!r}",
                self.api.create_branch,
                self.repo_id,
                branch=self.revision,
                exist_ok=True,
            )
        existing = self.read_manifest()
        if same_export(existing, manifest):
            head = self._call(
                f"reading {self.what}", self.api.repo_info, self.repo_id, revision=self.revision
            )
            try:
                self._verify(files, head.sha)
            except TransientError as error:  # changed since: commit the export again
                self.log(f"the export there no longer matches ({error}); committing it again")
            else:
                self.log(f"{self.display} already holds this export (commit {head.sha}, verified)")
                return False
        operations = [CommitOperationAdd(f.rel, str(f.path)) for f in files]
        operations.append(CommitOperationAdd(MANIFEST_FILE, manifest_bytes(manifest)))
        previous = set((existing or {}).get("files") or {}) if isinstance(existing, dict) else set()
        operations += [
            CommitOperationDelete(rel) for rel in sorted(previous - {f.rel for f in files})
        ]

        def commit():
            # Fresh operations each attempt: huggingface_hub marks them as used.
            ops = [
                CommitOperationAdd(op.path_in_repo, op.path_or_fileobj)
                if isinstance(op, CommitOperationAdd)
                else op
                for op in operations
            ]
            return self.api.create_commit(
                self.repo_id,
                ops,
                commit_message=f"tunepack export: {manifest.get('model')} "
                f"({manifest.get('method')})",
                revision=self.revision,
            )

        made = self._call(f"committing to {self.what}", commit)
        self._verify(files, made.oid)
        total = sum(f.size for f in files)
        self.log(
            f"exported to {self.display}: {len(files)} files ({human_bytes(total)}) and the "
            f"manifest in commit {made.oid} ({visibility}), verified"
        )
        return True

    def _verify(self, files: list[LocalFile], commit: str) -> None:
        """Every file of the export in the tree of ``commit``, with its size and checksum."""
        entries = self._call(
            f"reading the tree of commit {commit}",
            lambda: list(self.api.list_repo_tree(self.repo_id, revision=commit, recursive=True)),
        )
        tree = {e.path: e for e in entries if isinstance(e, RepoFile)}
        for f in files:
            entry = tree.get(f.rel)
            problem = None
            if entry is None:
                problem = "is missing"
            elif entry.size != f.size:
                problem = f"has {entry.size} bytes, not {f.size}"
            elif entry.lfs is not None and entry.lfs.sha256 != f.sha256:
                problem = f"has sha256 {entry.lfs.sha256}, not {f.sha256}"
            elif entry.lfs is None and entry.blob_id != git_blob_id(f.path):
                problem = f"has git blob id {entry.blob_id}, not {git_blob_id(f.path)}"
            if problem:
                raise TransientError(
                    f"{f.rel} in commit {commit} of {self.display!r} {problem}; the step exits "
                    "75 so a retry commits it again"
                )

    def _problem(self, error: Exception | None) -> Exception:
        # huggingface_hub wraps a failed LFS upload in a RuntimeError: the cause says what failed.
        cause = error
        while cause is not None and not isinstance(cause, httpx2.TransportError | HfHubHTTPError):
            cause = cause.__cause__ or cause.__context__
        error = cause if cause is not None else error
        if isinstance(error, httpx2.TransportError):
            return _http.transport_problem(error)
        if not isinstance(error, HfHubHTTPError):
            return error  # a bug or an unexpected library failure: keep its traceback
        status = error.response.status_code if error.response is not None else None
        hint = hub_source.TOKEN_HINT
        if status == 401:
            return DeniedError(
                f"the hub rejected the token given for {self.display!r} (401 Unauthorized); "
                f"create a token with write access and {hint}"
            )
        if status == 403:
            return DeniedError(
                f"the hub denied writing to {self.what} (403 Forbidden); give the token write "
                f"access to {self.repo_id.split('/')[0]!r} and {hint}"
            )
        if isinstance(error, RepositoryNotFoundError) or status == 404:
            return NotFoundError(
                f"{self.what} was not found and could not be created with the token given; "
                f"check the name in {self.display!r} and the token's permissions",
                what="repository",
                name=self.repo_id,
            )
        if status in _http.RETRYABLE_STATUS:
            return _http.status_problem(f"the hub answered HTTP {status}", error.response)
        return BadInputError(
            f"the hub answered HTTP {status} for {self.what}; check {self.display!r}"
        )
