"""The step the trainer chooses for its device (runtimes/planner.py: choose_step): the fastest that
the calibrated memory plan fits in the device's memory less STEP_MARGIN, explicit settings kept.
Checked as rules over the cards and shapes users train on, plus the cases the docs name."""

from __future__ import annotations

import dataclasses

import pytest

from tunepack.core.errors import BadValueError
from tunepack.runtimes import planner
from tunepack.runtimes.planner import GIB, STEP_MARGIN, Step, estimate, plan

CARDS = ["H100-80GB", "H200-141GB", "A100-80GB", "A100-40GB", "L4-24GB"]
JOBS = [  # (model, method, batch size) at seq_len 2048
    ("llama3.2-1b", "lora", 4),
    ("llama3.2-1b", "full", 4),
    ("llama3.1-8b", "lora", 4),
    ("llama3.1-8b", "qlora", 4),
    ("llama3.1-8b", "dora", 2),
    ("llama3.1-8b", "full", 1),
    ("llama3.1-8b", "dpo", 2),
    ("llama3.1-70b", "qlora", 1),
    ("llama3.1-70b", "lora", 1),
]


def _peak(plan_: planner.Plan, step: Step) -> float:
    """The peak of the same job planned with another step."""
    return estimate(plan_.model, plan_.method, plan_.seq_len, plan_.batch_size, plan_.gpu,
                    step=step).peak_bytes  # fmt: skip


@pytest.mark.parametrize("gpu", CARDS)
@pytest.mark.parametrize(("model", "method", "batch"), JOBS)
def test_the_chosen_step_is_the_fastest_that_fits_with_the_margin(gpu, model, method, batch):
    p = estimate(model, method, 2048, batch, gpu)
    step, budget = p.step, p.capacity_gib * GIB * (1 - STEP_MARGIN)
    frugal = Step(step.layers, step.layers, _smallest_chunk(p))
    if _peak(p, frugal) > budget:  # nothing fits: the most frugal step, and the plan says so
        assert step == frugal
        return
    assert p.peak_bytes <= budget
    whole = p.tokens if step.loss_chunk_rows is not None else None
    # One layer fewer recomputed, with the whole logits, does not fit ...
    if step.recompute_layers:
        fewer = Step(step.layers, step.recompute_layers - 1, whole)
        assert _peak(p, fewer) > budget
    # ... and neither do the whole logits at the chosen recomputation.
    if step.loss_chunk_rows is not None and step.loss_chunk_rows < p.tokens:
        assert _peak(p, dataclasses.replace(step, loss_chunk_rows=p.tokens)) > budget


def _smallest_chunk(p: planner.Plan) -> int | None:
    if not estimate(p.model, p.method, p.seq_len, p.batch_size, p.gpu).step.loss_chunk_rows:
        return None
    vocab = planner.model_entry(p.model).shape.vocab_size
    return max(1, planner.LOSS_CHUNK_ELEMENTS // vocab)


def test_what_8b_lora_at_2048_by_4_gets_on_each_card():
    """An 80 GB card holds every layer's activations and the whole logits (8192 rows x 128k:
    6 GiB); a 40 GB card recomputes 22 of 32 layers with 4096-row chunks; a 24 GB L4 recomputes
    every layer with the CPU-sized chunks (65 rows)."""
    got = {gpu: estimate("llama3.1-8b", "lora", 2048, 4, gpu).step for gpu in CARDS}
    for gpu in ("H100-80GB", "H200-141GB", "A100-80GB"):
        assert (got[gpu].recompute_layers, got[gpu].loss_chunk_rows) == (0, 8192), gpu
    assert (got["A100-40GB"].recompute_layers, got["A100-40GB"].loss_chunk_rows) == (22, 4096)
    assert (got["L4-24GB"].recompute_layers, got["L4-24GB"].loss_chunk_rows) == (32, 65)
    line = got["H100-80GB"].describe(8192)
    assert line == "recompute 0 of 32 layers; loss: the whole logits at once (8192 rows)"


def test_explicit_settings_are_kept_and_auto_fills_in_the_other():
    on = estimate("llama3.2-1b", "lora", 2048, 4, activation_checkpointing=True)
    assert on.step.recompute_layers == 16 and on.step.loss_chunk_rows == 8192
    off = estimate("llama3.1-8b", "lora", 2048, 4, "L4-24GB", activation_checkpointing=False)
    assert off.step.recompute_layers == 0 and not off.fits  # as given, even where it cannot fit
    both = estimate("llama3.2-1b", "lora", 2048, 4, activation_checkpointing=False, loss_chunk=512)
    assert both.step == Step(16, 0, 512, chosen=False)
    assert "step (as given): recompute 0 of 16 layers; loss: 512 rows" in both.summary()
    with pytest.raises(BadValueError) as err:
        estimate("llama3.2-1b", "lora", 2048, 4, loss_chunk=0)
    assert str(err.value) == "loss_chunk=0 is not valid: expected 'auto' or an integer >= 1"


def test_the_device_memory_the_trainer_reads_replaces_the_table():
    """The trainer passes the memory its device reports: a smaller card than the table's
    recomputes more."""
    table = estimate("llama3.1-8b", "lora", 2048, 4, "H100-80GB")
    smaller = estimate("llama3.1-8b", "lora", 2048, 4, "H100-80GB", capacity_gib=40.0)
    assert smaller.step.recompute_layers > table.step.recompute_layers == 0


def test_a_model_that_takes_images_recomputes_every_layer_and_keeps_whole_logits():
    step = estimate("llama3.2-vision-11b", "lora", 2048, 2, "H200-141GB").step
    assert step.recompute_layers == step.layers and step.loss_chunk_rows is None


def test_steps_round_trip_through_a_checkpoints_record():
    step = Step(32, 7, 4096)
    assert Step.from_record(step.record()) == step


def test_plan_recommends_a_layout_with_the_step_it_would_choose():
    p = plan("llama3.1-70b", "lora", 2048, 1, gpu="H100-80GB")
    assert not p.fits and p.recommended == (1, 2)  # 70B in bf16 over two 80 GB cards
    n, g = p.recommended
    assert estimate("llama3.1-70b", "lora", 2048, 1, nodes=n, gpus_per_node=g).fits
