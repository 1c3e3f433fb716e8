"""Third-party noise: a default `tunepack train --local` shows tunepack's own lines only;
`--verbose` (TUNEPACK_VERBOSE=1 in the steps' environment, through the TrainJob's env) shows the
other packages' warnings and debug lines too."""

from __future__ import annotations

import re

import yaml

from tunepack.cli import main

RUNTIME = "tunepack-tiny-llama3"
# A warning or log record of another package, as the steps print them: Python's warnings
# ("...Warning: ...", "warnings.warn(") and logging records not of tunepack's own loggers.
THIRD_PARTY = re.compile(
    r"Warning:|warn\(|^\[[a-z0-9-]+\] (DEBUG|INFO|WARNING) (?!tunepack)", re.MULTILINE
)


def _train(capsys, tmp_path, model, data, *extra: str) -> tuple[str, str]:
    code = main(
        [
            "train", "--local", "--runtime", RUNTIME, "--dataset", str(data), "--model",
            str(model), "--jobs-dir", str(tmp_path / "jobs"), *extra, "max_steps=2",
        ]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err + out
    return out, err


def test_default_run_is_quiet_and_verbose_shows_the_rest(
    capsys, tmp_path, monkeypatch, tiny_model_dir, tiny_dataset_file
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TUNEPACK_VERBOSE", "0")  # restored after the test (--verbose sets it)
    out, err = _train(capsys, tmp_path, tiny_model_dir, tiny_dataset_file)
    assert THIRD_PARTY.findall(out + err) == [], out + err
    assert "[node] step 2/2" in out  # tunepack's own lines are all there
    assert "tunepack: training finished" in out

    # Another seed: a new job that trains (the same command again would have nothing to do).
    out, err = _train(
        capsys, tmp_path, tiny_model_dir, tiny_dataset_file, "--verbose", "--", "seed=1"
    )
    assert THIRD_PARTY.search(out + err), out + err
    assert "[node] step 2/2" in out
    name = out.splitlines()[0].split()[2].rstrip(":")
    trainjob = yaml.safe_load((tmp_path / "jobs" / name / "trainjob.yaml").read_text())
    verbose = {"name": "TUNEPACK_VERBOSE", "value": "1"}
    assert verbose in trainjob["spec"]["trainer"]["env"]
    assert verbose in trainjob["spec"]["initializer"]["model"]["env"]


def test_verbose_does_not_change_the_job(tiny_model_dir, tiny_dataset_file):
    """--verbose changes what is shown, not what is trained: the same default job."""
    from tunepack import FineTune
    from tunepack.jobs.naming import stable_job_name

    def name(**placement):
        trainer = FineTune.from_args(["max_steps=2"], **placement)
        return stable_job_name(RUNTIME, str(tiny_dataset_file), str(tiny_model_dir), trainer)

    assert name(env={"TUNEPACK_VERBOSE": "1"}) == name()
