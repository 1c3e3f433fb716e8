"""The side-by-side benchmark's pure parts (benchmarks/sbs_workload.py, side_by_side.py): its
tokenizer learner matches tunepack's, its workloads are the issue's, and its steady window and the
trainer's fill metric count what they should. Its runs: tests/integration/test_benchmarks.py."""

from __future__ import annotations

import sys

import pytest
import torch

from tests import REPO
from tunepack.core.errors import BadValueError
from tunepack.tiny import tiny_corpus, train_bpe
from tunepack.tiny.bpe import TiktokenFormat
from tunepack.trainers.recipe import real_positions

sys.path.insert(0, str(REPO / "benchmarks"))

import sbs_workload  # noqa: E402
import side_by_side  # noqa: E402


def test_incremental_bpe_learns_the_same_merges_as_train_bpe():
    text = tiny_corpus()
    assert sbs_workload.learn_merges(text, 300) == train_bpe(text, 300)
    # And on the benchmark's own corpus, past the point where frequent pairs run out.
    smoke = sbs_workload.corpus(sbs_workload.SMOKE)
    assert sbs_workload.learn_merges(smoke, 900) == train_bpe(smoke, 900)


def test_tiktoken_format_refuses_merges_that_do_not_fill_the_vocabulary():
    entry = sbs_workload.SMOKE.entry()
    with pytest.raises(BadValueError) as err:
        TiktokenFormat(merges=((b"a", b"b"), (b"c", b"d"), (b"e", b"f"))).write(entry)
    assert str(err.value) == "3 merges do not fill vocab_size 1024: it needs 758"


def test_issue_workload_is_the_issue_model():
    entry = sbs_workload.ISSUE.entry()
    assert round(entry.parameter_count / 1e6, 1) == 58.7
    assert (entry.shape.num_layers, entry.shape.embed_dim, entry.shape.vocab_size) == (
        8,
        512,
        32768,
    )


def test_real_positions_counts_each_row_up_to_its_last_label():
    ignore = -100
    labels = torch.tensor(
        [
            [5, 6, 7, ignore, ignore],  # padded after 3 tokens
            [ignore, ignore, 8, 9, 10],  # prompt unlabelled, no padding
            [ignore, 4, ignore, 3, ignore],  # a pack: two examples, one position of padding
            [ignore] * 5,  # nothing labelled: nothing counted
        ]
    )
    assert real_positions(labels) == 3 + 5 + 4 + 0


def test_steady_window_skips_warmup_and_follows_prefetch():
    def stamps(cpu, real):
        return [
            {"cpu_s": c, "wall_s": c, "real": r, "positions": 8}
            for c, r in zip(cpu, real, strict=True)
        ]

    # Record k is stamped before step k: steps 1..2 run from stamp 1 to stamp 3.
    window = side_by_side.steady(stamps([0, 1, 3, 6], [5, 6, 7, 8]), warmup=1, prefetch=0)
    assert window == {"steps": 2, "cpu_s": 5, "wall_s": 5, "real": 6 + 7}
    # A loader one batch ahead stamps record k + 1 before step k.
    window = side_by_side.steady(stamps([0, 0, 1, 3, 6], [5, 6, 7, 8, 9]), warmup=1, prefetch=1)
    assert window == {"steps": 2, "cpu_s": 5, "wall_s": 5, "real": 6 + 7}


def test_profile_breakdown_sorts_operators_into_parts_and_counts_their_flops():
    def op(name, shapes, us=1_000_000, calls=1):
        return {"name": name, "shapes": shapes, "self_cpu_us": us, "calls": calls}

    ops = [
        op("aten::mm", [[2048, 512], [512, 1536]], calls=2),  # a frozen projection, twice
        op("aten::addmm_", [[2048, 1536], [2048, 8], [8, 1536]]),  # LoRA's rank-8 update
        op("aten::mm", [[256, 512], [512, 32768]]),  # the vocabulary projection
        op("aten::_scaled_dot_product_flash_attention_for_cpu", [[4, 8, 512, 64]] * 3),
        op("aten::mul", [[4, 512, 1536], [4, 512, 1536]], us=500_000),
    ]
    parts = {p["part"]: p for p in side_by_side.breakdown(ops, 32768, 8, peak_flops=1e10)}
    assert list(parts) == list(side_by_side.PARTS)
    frozen = parts["frozen projections"]
    assert frozen["flops"] == 2 * (2 * 2048 * 512 * 1536) and frozen["s"] == 1.0
    assert frozen["of_peak"] == pytest.approx(frozen["flops"] / 1e10)
    assert parts["LoRA's rank-wide products"]["flops"] == 2 * 2048 * 8 * 1536
    assert parts["vocabulary projection"]["flops"] == 2 * 256 * 512 * 32768
    # causal attention: QK^T and PV over half the query-key pairs
    assert parts["attention"]["flops"] == 2 * 4 * 8 * 512 * 512 * 64
    rest = parts["elementwise, norms, optimizer and the rest"]
    assert rest["flops"] == 0 and rest["gflop_per_s"] is None
    assert rest["share"] == pytest.approx(0.5 / 4.5)
