"""examples/quickstart.ipynb runs top to bottom on the local backend, in this environment.

The kernel is this test's own Python: a kernelspec written into a temporary JUPYTER_PATH, so
nothing is installed into the user's Jupyter and the notebook cannot silently run in another
environment (the test checks which interpreter the kernel ran).
"""

from __future__ import annotations

import json
import sys

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell

from tests import REPO

NOTEBOOK = REPO / "examples" / "quickstart.ipynb"
KERNEL = "tunepack-test"


def _read():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    return nb


def test_notebook_is_stored_without_outputs():
    nb = _read()
    dirty = [
        index
        for index, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, f"cells {dirty} carry outputs: clear them before committing"
    # What a user's Jupyter opens it with; the test below runs it on its own kernelspec.
    assert nb.metadata.kernelspec.name == "python3"


@pytest.mark.slow
def test_quickstart_runs_top_to_bottom(tmp_path, monkeypatch):
    jupyter = tmp_path / "jupyter"
    spec_dir = jupyter / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "tunepack test kernel",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("TUNEPACK_QUICKSTART_DIR", str(tmp_path / "work"))

    nb = _read()
    last_code = max(i for i, cell in enumerate(nb.cells) if cell.cell_type == "code")
    nb.cells.append(new_code_cell("import sys\nprint(sys.executable)"))
    client = NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=300,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # CellExecutionError (with the cell and its traceback) when a cell fails

    ran_with = nb.cells[-1].outputs[0]["text"].strip()
    # From a `make dev` venv the notebook shows no warnings (tqdm's "IProgress not found"
    # without ipywidgets, ...): what a user sees is the notebook's own output.
    warned = [
        output.get("text", "")
        for cell in nb.cells
        for output in cell.get("outputs", [])
        if output.get("name") == "stderr" and "warning" in output.get("text", "").lower()
    ]
    assert not warned, warned
    assert ran_with == sys.executable, f"the kernel ran {ran_with}, not {sys.executable}"
    # The notebook's own final cell asserts the loss fell and the adapter exists; that it
    # printed its verdict shows the cell ran to its end.
    checks = "".join(o.get("text", "") for o in nb.cells[last_code].outputs)
    assert "ok: mean loss" in checks, checks
    adapters = list((tmp_path / "work" / "jobs").glob("*/workspace/output/adapter"))
    assert len(adapters) == 1 and (adapters[0] / "adapter_config.json").is_file()


def test_plot_loss_shows_validation_next_to_training(tmp_path):
    """The notebook's loss plot reads metrics.jsonl as the trainer writes it: step lines and
    "eval" lines; the validation loss is its own curve, the best evaluation marked."""
    import matplotlib

    matplotlib.use("Agg")
    from tunepack.notebook_progress import plot_loss, read_metrics

    metrics = tmp_path / "metrics.jsonl"
    lines = [{"event": "step", "step": s, "total_steps": 4, "loss": 6.0 - s / 2} for s in (1, 2)]
    lines.append({"event": "eval", "step": 2, "total_steps": 4, "val_loss": 5.4})
    lines += [{"event": "step", "step": s, "total_steps": 4, "loss": 6.0 - s / 2} for s in (3, 4)]
    lines.append({"event": "eval", "step": 4, "total_steps": 4, "val_loss": 5.1})
    lines.append({"event": "checkpoint", "step": 4, "path": "/x"})
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 5, "lo')
    rows = read_metrics(metrics)
    assert len(rows) == 6  # the checkpoint event and the cut line are not metrics
    fig = plot_loss(rows, title="job")
    (ax,) = fig.axes
    curves = {line.get_label(): line for line in ax.get_lines()}
    assert set(curves) == {"training loss", "validation loss"}
    assert list(curves["training loss"].get_xdata()) == [1, 2, 3, 4]
    assert list(curves["validation loss"].get_xdata()) == [2, 4]
    assert list(curves["validation loss"].get_ydata()) == [5.4, 5.1]
    assert [t.get_text() for t in ax.texts] == ["best 5.100"]


def test_progress_bar_counts_steps_and_shows_both_losses(tmp_path, capsys):
    """The bar follows the job's optimizer steps (n/total) with the latest training and
    validation loss, as the local backend reads them from metrics.jsonl; a job that reports
    only a percentage (a cluster's trainerStatus) counts percent."""
    from tunepack.backends.local import read_progress
    from tunepack.notebook_progress import ProgressBar
    from tunepack.types import Progress, TrainJob

    metrics = tmp_path / "metrics.jsonl"
    lines = [{"event": "step", "step": s, "total_steps": 40, "loss": 6.0 - s / 10} for s in (1, 2)]
    lines.append({"event": "eval", "step": 2, "total_steps": 40, "val_loss": 5.75})
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))

    def job(status, progress):
        return TrainJob(name="j", runtime=None, steps=[], num_nodes=1, status=status,
                        creation_timestamp=None, progress=progress)  # fmt: skip

    bar = ProgressBar("j")
    bar.update(job("Running", read_progress(metrics)))
    assert str(bar.bar).startswith("j:   5%|")
    assert " 2/40 [" in str(bar.bar) and "val_loss=5.7500" in str(bar.bar)
    assert "loss=5.8000" in str(bar.bar) and "%/s" not in str(bar.bar) and "s/%" not in str(bar.bar)
    bar.update(job("Complete", read_progress(metrics)))
    assert " 40/40 [" in str(bar.bar) and "status=Complete" in str(bar.bar)
    bar.close()

    cluster = ProgressBar("c")
    cluster.update(job("Running", Progress(percent=30, loss=2.5)))
    assert " 30/100 [" in str(cluster.bar) and "loss=2.5000" in str(cluster.bar)
    cluster.close()
    capsys.readouterr()
