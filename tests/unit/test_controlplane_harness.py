"""The cluster tier's own machinery (tests/controlplane) where it needs no control plane."""

from tests.controlplane.__main__ import main


def test_up_refuses_a_directory_that_holds_no_tier(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["up", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--dir {tmp_path}: not empty and not a tier's directory" in err
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
