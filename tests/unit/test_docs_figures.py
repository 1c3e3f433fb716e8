"""Figures the examples and docs quote, held to the code that computes them.

In an example's comments every GiB or Gi figure is one of these, and is checked against the code:
  - ``N.N GiB per GPU for the job below``: the memory planner's peak for the example's own job,
    as ``tunepack render trainjob`` plans it (runtimes/planner.py);
  - ``N.N GiB per GPU with key=value ...``: the same job with those trainer arguments changed;
  - ``NGi ... workspace volume``: the size of the workspace PVC the runtime claims;
  - the trainer Pod's requests and the host memory per process (runtimes/host.py).
A figure in none of these forms fails the test: it would be one no test keeps true.

In docs/*.md and README.md, a figure written after the command that prints it, ``(`tunepack plan
...`: N.NN GiB)`` (``, recomputing R of L layers`` after it where said), is what that command
plans now. docs/planner.md's tables (the step chosen on each card; the measured H100 jobs against
their plans) are what the planner and the measurement reports say; docs/trainer.md's Llama 3.2
Vision section names the methods the vision runtimes train with and refuse.
"""

from __future__ import annotations

import re

import pytest

from tests import REPO
from tests.unit.test_examples import EXAMPLES, EXAMPLES_DIR, _load
from tests.unit.test_planner import measured_jobs, plan_now
from tunepack import cli
from tunepack.core.errors import UnsupportedError
from tunepack.jobs import submit
from tunepack.runtimes import catalog, host, methods
from tunepack.runtimes.args import parse_trainer_args
from tunepack.runtimes.planner import plan
from tunepack.runtimes.store import load_runtime

# "11.9 GiB per GPU for the job below", "18.6 GiB per GPU with max_seq_len=2048 batch_size=2"
PLANNED = re.compile(r"(\d+\.\d) GiB per GPU (?:for the job below|with ((?:\w+=[\w.-]+ ?)+))")
# "the 30Gi ReadWriteOnce workspace volume", "the runtime's 60Gi workspace volume"
WORKSPACE = re.compile(r"(\d+(?:Gi|Ti)) (?:ReadWriteOnce |ReadWriteMany )?workspace volume")
# "trainer Pod requests 1 GPU, 2 CPUs, 8Gi memory": runtimes/host.py's NodeShape.describe()
POD_REQUESTS = re.compile(r"trainer Pod requests (\d+ GPUs?, \d+ CPUs, \d+Gi memory)")
# "a node of 4 vCPUs and 16 GiB holds it": a cloud instance, held to be at least the requests
NODE = re.compile(r"a node of (\d+) vCPUs and (\d+) GiB holds it")
# "sized for its own 1 GPU (2 CPUs, 20Gi" and "want 2 CPUs and 3 GiB more each"
SIZED_FOR = re.compile(r"sized for its own (\d+) GPUs? \((\d+) CPUs, (\d+Gi)")
PER_PROCESS = re.compile(r"want (\d+) CPUs and (\d+) GiB more each")
HELD = (PLANNED, WORKSPACE, POD_REQUESTS, NODE, SIZED_FOR, PER_PROCESS)
FIGURE = re.compile(r"\b\d+(?:\.\d+)? ?(?:GiB|Gi|Ti)\b")


def _comment_text(name: str) -> str:
    """The example's comments as one line of text (a figure's words may span two lines)."""
    lines = (EXAMPLES_DIR / name).read_text().splitlines()
    return " ".join(
        line.strip().lstrip("#").strip() for line in lines if line.strip().startswith("#")
    )


def _args_with(args: list[str], changes: str) -> list[str]:
    """The trainer arguments, each ``key=value`` of ``changes`` replacing (or adding) its key."""
    given = dict(a.partition("=")[::2] for a in args)
    given.update(c.partition("=")[::2] for c in changes.split())
    return [f"{k}={v}" for k, v in given.items()]


def _planned_peak(name: str, changes: str | None) -> float:
    """The planner's peak GiB per GPU for the example's job (with ``changes``), as job building
    (render trainjob, train) plans it on the GPU the example is sized for."""
    obj = _load(name)
    entry = catalog.get(obj["spec"]["runtimeRef"]["name"])
    trainer = obj["spec"]["trainer"]
    args = trainer["args"] if changes is None else _args_with(trainer["args"], changes)
    plan = submit.check_memory(
        entry,
        parse_trainer_args(args, entry),
        trainer.get("numNodes", 1),
        trainer["numProcPerNode"],
        EXAMPLES[name],
        "warn",
    )
    return plan.peak_gib


def test_the_planned_figure_pattern_reads_both_forms():
    text = "11.9 GiB per GPU for the job below, 18.6 GiB per GPU with max_seq_len=2048 lr=2e-5;"
    found = [(m.group(1), m.group(2)) for m in PLANNED.finditer(text)]
    assert found == [("11.9", None), ("18.6", "max_seq_len=2048 lr=2e-5")]
    assert _args_with(["method=lora", "max_seq_len=1024"], "max_seq_len=2048 lr=1") == [
        "method=lora", "max_seq_len=2048", "lr=1"
    ]  # fmt: skip


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_figure_in_an_example_is_one_the_test_holds(name):
    text = _comment_text(name)
    spans = [(m.start(), m.end()) for pattern in HELD for m in pattern.finditer(text)]
    loose = [
        f.group(0)
        for f in FIGURE.finditer(text)
        if not any(start <= f.start() < end for start, end in spans)
    ]
    assert not loose, f"{name}: figures no test holds (write them in a form above): {loose}"


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_memory_figures_are_the_planners_for_the_examples_job(name):
    text = _comment_text(name)
    quoted = [(m.group(1), m.group(2)) for m in PLANNED.finditer(text)]
    assert any(changes is None for _, changes in quoted), (
        f"{name}: no 'N.N GiB per GPU for the job below' figure"
    )
    for figure, changes in quoted:
        planned = f"{_planned_peak(name, changes):.1f}"
        where = "for the job below" if changes is None else f"with {changes}"
        assert figure == planned, f"{name}: says {figure} GiB per GPU {where}; planned {planned}"


@pytest.mark.parametrize("name", EXAMPLES)
def test_a_plan_command_in_an_example_plans_its_job(name, capsys):
    """A `tunepack plan ...` line in the comments plans the job below, one micro-batch a step
    (plan takes no grad_accum)."""
    for command in re.findall(r"`tunepack plan ([^`]+)`", _comment_text(name)):
        assert cli.main(["plan", *command.split()]) == 0
        peak = re.search(r"peak +(\d+\.\d+) GiB", capsys.readouterr().out).group(1)
        job = _planned_peak(name, "grad_accum=1")
        assert peak == f"{job:.2f}", f"{name}: `tunepack plan {command}` is not the job below"


def _claimed_storage(runtime: dict) -> str:
    (policy,) = runtime["spec"]["template"]["spec"]["volumeClaimPolicies"]
    (claim,) = policy["templates"]
    return claim["spec"]["resources"]["requests"]["storage"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_workspace_size_is_the_runtimes_claim(name):
    ref = _load(name)["spec"]["runtimeRef"]["name"]
    claimed = _claimed_storage(load_runtime(ref))
    assert claimed == catalog.get(ref).resources.workspace_storage
    sizes = WORKSPACE.findall(_comment_text(name))
    assert sizes, f"{name}: says nothing of its workspace volume's size"
    assert set(sizes) == {claimed}, f"{name}: says {sizes}; {ref} claims {claimed}"


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_trainer_node_figures_are_the_runtimes(name):
    text = _comment_text(name)
    entry = catalog.get(_load(name)["spec"]["runtimeRef"]["name"])
    own = host.node_shape(entry)
    for said in POD_REQUESTS.findall(text):
        assert said == own.describe(), f"{name}: says the Pod requests {said}"
    for cpus, gib in NODE.findall(text):
        assert int(cpus) >= int(own.cpu) and int(gib) >= int(own.memory.removesuffix("Gi"))
    for gpus, cpus, memory in SIZED_FOR.findall(text):
        assert (int(gpus), cpus, memory) == (own.gpus, own.cpu, own.memory), name
    for cpus, gib in PER_PROCESS.findall(text):
        assert (int(cpus), int(gib)) == (host.CPUS_PER_PROCESS, host.PROCESS_GIB), name


def _section(doc: str, heading: str) -> str:
    """The text under ``heading`` in ``docs/<doc>`` up to the next heading, on one line."""
    text = (REPO / "docs" / doc).read_text()
    start = text.index(f"\n{heading}\n")
    ends = [i for i in (text.find("\n## ", start + 1), text.find("\n### ", start + 1)) if i > 0]
    end = min(ends, default=len(text))
    return " ".join(text[start:end].split())


VISION = ("llama3.2-vision-11b", "llama3.2-vision-90b")


@pytest.mark.parametrize("model", VISION)
def test_trainer_md_vision_names_the_methods_it_trains_and_those_it_refuses(model):
    """docs/trainer.md's Llama 3.2 Vision section: the methods it trains with are the runtime's;
    the ones it says are refused are every other method, and each is refused in one line."""
    section = _section("trainer.md", "### Llama 3.2 Vision: image-text chats")
    entry = catalog.get(model)
    trained = set(re.findall(r"`method=(\w+)`", section))
    assert trained == set(entry.methods), f"says it trains with {sorted(trained)}"
    (sentence,) = [s for s in section.split(". ") if "`packed=true` is refused" in s]
    refused = set(re.findall(r"`(\w+)`", sentence))
    assert refused == set(methods.METHODS) - set(entry.methods), f"says {sorted(refused)} refused"
    for method in sorted(refused) + ["packed"]:
        given = "packed=true" if method == "packed" else f"method={method}"
        with pytest.raises(UnsupportedError) as caught:
            parse_trainer_args([given], entry)
        assert "\n" not in str(caught.value)
        if method != "packed":  # "in one line naming the methods above"
            assert all(m in str(caught.value) for m in trained), str(caught.value)


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# "(`tunepack plan --model gemma-7b --method full`: 79.52 GiB)", ", recomputing 30 of 32 layers"
PLAN_FIGURE = re.compile(
    r"`tunepack plan ([^`]+)`: (\d+\.\d+) GiB(?:[^;)]*?, recomputing (\d+) of (\d+) layers)?"
)


def _plan_figures() -> list[tuple[str, str, str, tuple]]:
    found = []
    for path in DOCS:
        text = " ".join(path.read_text().split())
        for m in PLAN_FIGURE.finditer(text):
            found.append((path.name, m.group(1), m.group(2), m.group(3, 4)))
    return found


def test_docs_quote_plan_figures_in_the_form_this_test_reads():
    assert len([f for f in _plan_figures() if f[0] == "planner.md"]) >= 4, _plan_figures()


@pytest.mark.parametrize(
    ("doc", "command", "figure", "recompute"),
    [pytest.param(*f, id=f"{f[0]}: {f[1]}") for f in _plan_figures()],
)
def test_a_plan_figure_in_the_docs_is_what_the_command_prints(
    doc, command, figure, recompute, capsys
):
    code = cli.main(["plan", *command.split()])
    out = capsys.readouterr().out
    assert code in (0, 1), out  # fits, or does not
    decimals = len(figure.partition(".")[2])
    peak = float(re.search(r"peak +(\d+\.\d+) GiB", out).group(1))
    assert figure == f"{peak:.{decimals}f}", f"{doc}: `tunepack plan {command}` plans {peak}"
    if recompute[0] is not None:
        step = re.search(r"recompute (\d+) of (\d+) layers", out).group(1, 2)
        assert step == recompute, f"{doc}: `tunepack plan {command}`: recompute {step}"


def _table_after(text: str, marker: str) -> list[list[str]]:
    """The rows (cells) of the first Markdown table after ``marker``, its header left out."""
    rows = []
    for line in text[text.index(marker) :].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return [r for r in rows[1:] if not set("".join(r)) <= set("-: ")]


def test_planner_md_step_table_is_the_step_chosen_on_each_card():
    text = (REPO / "docs" / "planner.md").read_text()
    rows = _table_after(text, "For example Llama 3.1 8B LoRA at 2048 tokens x 4:")
    cards = []
    for cell, recompute, loss in rows:
        for card in cell.split(", "):
            cards.append(card)
            p = plan("llama3.1-8b", "lora", 2048, 4, gpu=card)
            assert recompute == f"{p.step.recompute_layers} of {p.step.layers}", card
            rows_at_once = p.step.loss_chunk_rows
            said = (
                f"the whole logits ({p.tokens} rows)"
                if rows_at_once >= p.tokens
                else f"{rows_at_once} rows at a time"
            )
            assert loss == said, card
    assert len(cards) >= 5, rows
    h100 = plan("llama3.1-8b", "lora", 2048, 4, gpu="H100-80GB")
    assert f"planned peak {h100.peak_gib:.2f} GiB" in " ".join(text.split())


# docs/planner.md's "Checked on a GPU" table: its first column -> the measured workload
MEASURED_ROWS = {
    "LoRA": "lora/tunepack",
    "QLoRA": "qlora/tunepack",
    "DoRA": "dora/tunepack",
    "full": "full/tunepack",
    "LoRA, plain loss (`fused_loss=False`)": "lora/tunepack-plain-loss",
    "LoRA, `compile=true`": "lora/tunepack-compiled",
}


def test_planner_md_measured_table_is_the_reports_and_the_plans_of_today():
    text = (REPO / "docs" / "planner.md").read_text()
    rows = _table_after(text, "## Checked on a GPU")
    jobs = {job["name"]: (report, job) for report, job in measured_jobs()}
    named = []
    for label, measured, then, ratio_then, now, ratio_now in rows:
        size, _, kind = label.partition(" ")
        assert kind in MEASURED_ROWS, f"row {label!r}: the shape (1B, 8B), then a MEASURED_ROWS job"
        name = f"{size.lower()}/{MEASURED_ROWS[kind]}"
        named.append(name)
        report, job = jobs[name]
        p = plan_now(report, job)
        peak, planned = job["peak_memory_gib"], job["plan"]["peak_gib"]
        assert measured == f"{peak:.3f}" and then == f"{planned:.3f}", label
        assert ratio_then == f"{peak / planned:.2f}", label
        assert now == f"{p.peak_gib:.3f} ({p.peak_moment})", label
        assert ratio_now == f"{peak / p.peak_gib:.3f}", label
    assert sorted(named) == sorted(jobs), "the table lists every measured tunepack job"
