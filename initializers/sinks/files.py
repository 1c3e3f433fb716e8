"""``file:///abs/path`` or a plain path: a directory (a local disk, or a PVC mounted in the Pod).

The export is staged beside the destination and renamed into place whole, so a reader finds the
earlier export or the complete new one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tunepack.core import durable
from tunepack.core.errors import TransientError
from tunepack.core.workspace import MANIFEST_FILE
from tunepack.initializers import atomic
from tunepack.initializers.sinks import (
    MANIFEST_KIND,
    LocalFile,
    Log,
    manifest_bytes,
    same_export,
    summary,
)
from tunepack.initializers.transport import uri


class Sink:
    def __init__(self, parsed: uri.StorageUri, log: Log):
        self.dest = Path(parsed.location)
        self.display = parsed.canonical
        self.log = log

    def publish(self, files: list[LocalFile], manifest: dict) -> bool:
        """Send the export; False when the destination held it already (nothing sent)."""
        for stale in atomic.remove_stale_partials(self.dest):
            self.log(f"removed {stale.name} left by an interrupted export")
        existing = atomic.read_manifest(self.dest)
        hashed = frozenset(f.rel for f in files)
        if same_export(existing, manifest) and not atomic.why_incomplete(
            self.dest, {"kind": MANIFEST_KIND}, hashed
        ):
            self.log(f"{self.dest} already holds this export (every file verified)")
            return False
        with atomic.staged(self.dest) as partial:
            for f in files:
                target = partial / f.rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f.path, target)
                with open(target, "rb+") as out:
                    os.fsync(out.fileno())
                # Read back from the destination: what a reader will get.
                size, sha256 = target.stat().st_size, atomic.sha256_file(target)
                if (size, sha256) != (f.size, f.sha256):
                    raise TransientError(
                        f"{f.rel} read back from {self.dest} differs from the result ({size} "
                        f"bytes, sha256 {sha256}; expected {f.size}, {f.sha256}); the step "
                        "exits 75 so a retry writes it again"
                    )
            (partial / MANIFEST_FILE).write_bytes(manifest_bytes(manifest))
            durable.make_readable(partial)
        summary(
            self.log, self.display, len(files), 0, sum(f.size for f in files), "manifest written"
        )
        return True

    def read_manifest(self) -> dict | None:
        return atomic.read_manifest(self.dest)
