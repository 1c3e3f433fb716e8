"""Storage sources: where an initializer's files come from.

``files`` reads local paths in place. The remote sources (``hf``, ``s3``, ``https``) implement
``RemoteSource``: they list what they hold (with sizes and checksums where the service publishes
them) and open a byte stream at an offset; ``tunepack.initializers.transport.download`` does the
rest (parallel, resumable, verified transfers into the workspace's download cache).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from tunepack.initializers.transport.uri import StorageUri


@dataclass(frozen=True)
class RemoteFile:
    """One file of a remote source and what the source says it must be."""

    path: str  # relative path, as delivered into the workspace
    size: int | None
    ref: str  # the source's locator: a URL, an object key, a repo path
    # Identity of this version of the file (commit, ETag): a partial download is resumed only
    # when the identity is unchanged, so two versions are never spliced together.
    version: str = ""
    sha256: str | None = None
    git_sha1: str | None = None  # git blob id, which the hub publishes for non-LFS files
    md5: str | None = None  # an S3 single-part ETag


@dataclass
class Listing:
    files: list[RemoteFile]
    # Facts for the manifest, e.g. {"commit": "..."}; never credentials.
    facts: dict[str, object] = field(default_factory=dict)


@dataclass
class Body:
    """An open byte stream. ``offset`` is where it starts: the requested offset when the server
    honoured the range, 0 when it sent the whole file."""

    offset: int
    chunks: Iterator[bytes]
    total: int | None = None


class RemoteSource(ABC):
    """A storage service tunepack downloads from."""

    #: How many files are transferred at once.
    concurrency = 8

    def __init__(self, uri: StorageUri, kind: str):
        self.uri = uri
        self.kind = kind  # "dataset" or "model": what the initializer using this source fetches

    @abstractmethod
    def list(self) -> Listing:
        """Every file the URI names; raise BadInputError or Retryable."""

    @abstractmethod
    def open(self, file: RemoteFile, offset: int) -> AbstractContextManager[Body]:
        """Stream ``file`` from ``offset``; raise BadInputError or Retryable."""
