"""Safe extraction of tar and zip archives fetched over https://.

Only regular files and directories are extracted, each checked to land inside the extraction
directory: absolute names, ``..`` components, links and device files are refused, because an
archive from the internet must not be able to write over the workspace or the image.
"""

from __future__ import annotations

import shutil
import stat
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

from tunepack.core import durable
from tunepack.core.errors import BadInputError

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
ZIP_SUFFIXES = (".zip",)


def is_archive(name: str) -> bool:
    return name.lower().endswith(TAR_SUFFIXES + ZIP_SUFFIXES)


def extract(archive: Path, dest: Path, display: str) -> Path:
    """Extract ``archive`` into ``dest`` (created through a rename, so never half-extracted)."""
    if dest.is_dir():
        return dest
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        if archive.name.lower().endswith(ZIP_SUFFIXES):
            _extract_zip(archive, partial, display)
        else:
            _extract_tar(archive, partial, display)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    durable.rename_dir(partial, dest)
    return dest


def _checked_name(name: str, display: str) -> str:
    pure = PurePosixPath(name.replace("\\", "/"))
    if pure.is_absolute() or ".." in pure.parts or not pure.parts or "\0" in name:
        raise BadInputError(
            f"archive {display!r} contains {name!r}, which would be extracted outside its "
            f"directory; refusing to extract it. Repack the archive with relative paths"
        )
    return str(pure)


def _refuse_member(name: str, kind: str, display: str) -> BadInputError:
    return BadInputError(
        f"archive {display!r} contains {kind} {name!r}; tunepack extracts only regular files "
        f"and directories. Repack the archive without it"
    )


def _extract_zip(archive: Path, dest: Path, display: str) -> None:
    try:
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                name = _checked_name(info.filename, display)
                mode = info.external_attr >> 16
                if stat.S_ISLNK(mode):
                    raise _refuse_member(info.filename, "a symbolic link", display)
                target = dest / name
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as fin, open(target, "xb") as fout:
                    shutil.copyfileobj(fin, fout, 1 << 20)
    except zipfile.BadZipFile as error:
        raise BadInputError(
            f"{display!r} is not a valid zip archive ({error}); check the URL and the file"
        ) from None
    except FileExistsError as error:
        raise BadInputError(
            f"archive {display!r} holds {error.filename} twice; repack it with unique names"
        ) from None


def _extract_tar(archive: Path, dest: Path, display: str) -> None:
    try:
        with tarfile.open(archive, "r:*") as tf:
            members = []
            for member in tf:
                _checked_name(member.name, display)
                if member.issym() or member.islnk():
                    raise _refuse_member(member.name, "a link", display)
                if not (member.isfile() or member.isdir()):
                    raise _refuse_member(member.name, "a device or special file", display)
                members.append(member)
            # The "data" filter re-checks the same rules and drops permission bits that do not
            # belong in a workspace (setuid, group/other write).
            tf.extractall(dest, members=members, filter="data")
    except (tarfile.ReadError, tarfile.CompressionError, EOFError) as error:
        raise BadInputError(
            f"{display!r} is not a valid tar archive ({error}); check the URL and the file"
        ) from None
