"""tunepack.core's pieces on their own: the error line's producer and parser agree, the program
wrapper maps errors to lines and codes, one directory stage-then-rename, one config digest.

The programs that use them (the initializers, the trainer, the CLI, the local backend) are
tested end to end elsewhere; these pin what the pieces promise each other.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from tunepack.core import durable, program
from tunepack.core.digest import json_digest
from tunepack.core.errors import EXIT_BAD_INPUT, EXIT_TRANSIENT, BadInputError


def test_the_parser_finds_the_last_error_line_the_producer_wrote_with_its_detail():
    lines = [
        "dataset-initializer: reading train.jsonl",
        program.error_line("dataset-initializer", "an older failure"),
        program.error_line("dataset-initializer", "3 rows are not valid instruction rows"),
        "  row 2: 'output' is missing",
        "  row 5: 'instruction' is empty",
        "  row 9: 'output' is missing",
        "dataset-initializer: exiting",
    ]
    assert program.last_error(lines, max_detail=2) == [
        "dataset-initializer: error: 3 rows are not valid instruction rows",
        "  row 2: 'output' is missing",
        "  row 5: 'instruction' is empty",
    ]
    assert program.last_error(["all good"], max_detail=5) == []


def test_the_parser_reads_a_log_file_and_a_missing_one_is_no_error(tmp_path):
    log = tmp_path / "node.log"
    log.write_text(program.error_line("trainer", "lr='x' is not valid") + "\n")
    assert program.last_error_in(log, 5) == ["trainer: error: lr='x' is not valid"]
    assert program.last_error_in(tmp_path / "absent.log", 5) == []


def test_run_turns_errors_into_one_line_and_their_exit_code(capsys):
    def bad():
        raise BadInputError("epochs='0' is not valid: expected an integer from 1 to 1000")

    assert program.run("trainer", bad) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err == "trainer: error: epochs='0' is not valid: expected an integer from 1 to 1000\n"
    assert program.run("trainer", lambda: 3) == 3
    assert program.run("trainer", lambda: None) == 0


def test_run_scrubs_what_it_prints_and_prints_a_bug_with_its_traceback(capsys):
    def bug():
        raise KeyError("token-123456")

    code = program.run("model-initializer", bug, scrub=lambda s: s.replace("123456", "***"))
    err = capsys.readouterr().err
    assert code == program.EXIT_BUG
    assert err.startswith("Traceback (most recent call last):") and "KeyError" in err
    assert "123456" not in err and "token-***" in err


def test_run_says_a_full_disk_in_one_line_naming_the_path(capsys, tmp_path, monkeypatch):
    def full():
        raise OSError(28, "No space left on device", str(tmp_path / "x"))

    monkeypatch.setattr(durable, "free_bytes", lambda _path: 3 << 10)
    assert program.run("trainer", full, disk_full_at=lambda: tmp_path) == EXIT_TRANSIENT
    assert capsys.readouterr().err == (
        f"trainer: error: no space left on the device (or quota) writing {tmp_path / 'x'} "
        "(3.0 KiB free): free space or enlarge the volume, then run again\n"
    )


def _tree(path, text):
    path.mkdir(parents=True)
    (path / "file.txt").write_text(text)
    return path


def test_rename_dir_replaces_the_destination_through_the_aside_name(tmp_path):
    dest = _tree(tmp_path / "out", "old")
    staging = _tree(tmp_path / ".out.partial", "new")
    durable.rename_dir(staging, dest, aside=tmp_path / ".out.old")
    assert (dest / "file.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # staging and aside gone


def test_rename_dir_without_aside_never_replaces_a_non_empty_directory(tmp_path):
    dest = _tree(tmp_path / "out", "theirs")
    staging = _tree(tmp_path / ".out.partial", "ours")
    with pytest.raises(OSError):
        durable.rename_dir(staging, dest)
    assert (dest / "file.txt").read_text() == "theirs"
    (tmp_path / "empty").mkdir()
    durable.rename_dir(staging, tmp_path / "empty")  # an empty one is replaced
    assert (tmp_path / "empty" / "file.txt").read_text() == "ours"


def test_write_bytes_is_world_readable_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        durable.write_bytes(tmp_path / "data.bin", b"\x00\x01")
    finally:
        os.umask(old)
    assert (tmp_path / "data.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "data.bin").stat().st_mode & 0o777 == durable.FILE_MODE
    assert [p.name for p in tmp_path.iterdir()] == ["data.bin"]


class _Killed(BaseException):
    """A SIGKILL at that instant: what the directory holds then is what the kill leaves."""


def _killed_at(directory, monkeypatch, target, name) -> list[str]:
    """Make a call of ``target.name`` the instant a writer is killed; the list it returns gets
    the names ``directory`` holds then."""
    seen = []

    def kill(*args, **kwargs):
        seen.extend(p.name for p in directory.iterdir())
        raise _Killed

    monkeypatch.setattr(target, name, kill)
    return seen


def test_the_start_of_run_cleanup_removes_every_name_a_killed_writer_leaves(tmp_path, monkeypatch):
    """Issue 49, item 13: the temporary names are each writer's own, killed in the middle (the
    trainer's final save of result.json left ``.result.json.tmp-<pid>``, kept after the re-run)."""
    out = tmp_path / "output"
    out.mkdir()
    durable.write_text(out / "result.json", "{}")
    durable.publish_dir(out / "adapter", lambda d: (d / "w").write_text("old"))
    left = set()

    seen = _killed_at(out, monkeypatch, durable.os, "replace")  # before the rename
    with pytest.raises(_Killed):
        durable.write_text(out / "result.json", '{"new": 1}')
    monkeypatch.undo()
    left |= set(seen)

    def write(staging):  # while the staging directory is written
        left.update(p.name for p in out.iterdir())
        raise _Killed

    with pytest.raises(_Killed):
        durable.publish_dir(out / "adapter", write)

    seen = _killed_at(out, monkeypatch, durable, "remove")  # the old one set aside
    with pytest.raises(_Killed):
        durable.publish_dir(out / "adapter", lambda d: (d / "w").write_text("new"))
    monkeypatch.undo()
    left |= set(seen)

    left -= {"result.json", "adapter"}
    marks = {mark for name in left for mark in durable.LEFTOVER_MARKS if mark in name}
    assert marks == set(durable.LEFTOVER_MARKS), left  # one leftover of each kind was seen
    for name in left:  # as the kills left them (a writer's finally does not run under SIGKILL)
        if ".tmp-" in name:
            (out / name).write_text("{")
        else:
            (out / name).mkdir(exist_ok=True)
    (out / ".keep").write_text("not a writer's")
    removed = durable.remove_staging_leftovers(out)
    assert sorted(p.name for p in removed) == sorted(left)
    assert sorted(p.name for p in out.iterdir()) == [".keep", "adapter", "result.json"]
    assert f".result.json.tmp-{os.getpid()}" in left


def test_json_digest_depends_on_content_not_on_key_order():
    a = {"lr": 0.0001, "model": {"rank": 8, "alpha": 16}}
    b = {"model": {"alpha": 16, "rank": 8}, "lr": 0.0001}
    assert json_digest(a) == json_digest(b)
    assert json_digest(a) != json_digest({**a, "lr": 0.0002})
    canonical = json.dumps(b, sort_keys=True).encode()
    assert json_digest(b) == hashlib.sha256(canonical).hexdigest()
