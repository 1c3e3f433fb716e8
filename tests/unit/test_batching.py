"""Which examples make each batch (trainers/data/batching.py) and the loss fused with the output
projection (trainers/objectives/vocab_loss.py): orders that resume exactly, packs that hold every
example once, and a loss equal to the plain one, gradients included."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX
from torchtune.datasets import PackedDataset
from torchtune.models.llama3 import llama3
from torchtune.models.llama3_2 import llama3_2
from torchtune.modules.peft import LoRALinear

from tests.helpers import small_decoder
from tunepack.core.errors import ConflictError
from tunepack.trainers.data.batching import (
    LengthGroupedSampler,
    Packs,
    ShuffledSampler,
    arrange,
    best_fit_decreasing,
    hold_out,
)
from tunepack.trainers.objectives import vocab_loss


def _lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(20, 512) for _ in range(n)]


def _padded_positions(order: list[int], lengths: list[int], batch: int) -> int:
    return sum(
        len(order[i : i + batch]) * max(lengths[j] for j in order[i : i + batch])
        for i in range(0, len(order), batch)
    )


# ------------------------------------------------------------------ orders


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_length_grouped_order_resumes_mid_epoch_and_ranks_share_every_example(world_size):
    lengths = _lengths(301)
    ranks = [
        LengthGroupedSampler(lengths, batch_size=4, rank=r, world_size=world_size, seed=5)
        for r in range(world_size)
    ]
    for sampler in ranks:
        sampler.set_epoch(2)
    shares = [list(s) for s in ranks]
    assert sorted({i for share in shares for i in share}) == list(range(301))
    assert len({len(share) for share in shares}) == 1  # equal shares, padded like the shuffle

    resumed = LengthGroupedSampler(lengths, batch_size=4, rank=0, world_size=world_size, seed=5)
    consumed = 3 * 4 * world_size  # three batches on every rank
    resumed.set_epoch(2, start=consumed)
    assert list(resumed) == shares[0][3 * 4 :]


def test_length_grouped_batches_hold_far_less_padding_and_the_longest_comes_first():
    lengths = _lengths(1024)
    grouped = LengthGroupedSampler(lengths, batch_size=4, rank=0, world_size=1, seed=0)
    shuffled = ShuffledSampler(1024, rank=0, world_size=1, seed=0)
    fill_grouped = sum(lengths) / _padded_positions(list(grouped), lengths, 4)
    fill_shuffled = sum(lengths) / _padded_positions(list(shuffled), lengths, 4)
    assert fill_shuffled < 0.8 and fill_grouped > 0.95
    order = list(grouped)
    assert max(lengths[i] for i in order[:4]) == max(lengths)


def test_length_grouped_order_changes_with_the_epoch_and_the_seed_but_not_otherwise():
    lengths = _lengths(200)

    def order(seed, epoch):
        sampler = LengthGroupedSampler(lengths, batch_size=2, rank=0, world_size=1, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1)
    assert order(1, 0) != order(2, 0)


def test_a_ragged_last_batch_stays_last():
    lengths = _lengths(10)  # one window; batches of 4: two whole, then the two shortest
    order = list(LengthGroupedSampler(lengths, batch_size=4, rank=0, world_size=1, seed=3))
    assert sorted(order) == list(range(10))
    assert sorted(lengths[i] for i in order[8:]) == sorted(lengths)[:2]


# ------------------------------------------------------------------ packs


def test_held_out_rows_are_the_same_whatever_the_run_and_never_trained_on():
    rows = list(range(50))
    train, held = hold_out(rows, 0.1)
    assert len(held) == 5 and sorted(set(train.indices) | set(held)) == rows
    assert not set(train.indices) & set(held)
    assert hold_out(rows, 0.1)[1] == held  # a fixed seed: not the run's, not the rank's
    with pytest.raises(ConflictError) as err:
        hold_out(rows[:1], 0.99)
    assert str(err.value) == (
        "val_fraction=0.99 leaves no training rows of the dataset's 1: lower val_fraction or add "
        "data"
    )


def test_arrange_groups_the_training_rows_by_their_own_lengths():
    lengths = _lengths(40)
    train, _ = hold_out(list(range(40)), 0.25)
    kept, sampler = arrange(
        train, "length_grouped", lengths=lengths, batch_size=4, max_seq_len=512,
        padding_idx=0, rank=0, world_size=1, seed=0,
    )  # fmt: skip
    # The sampler indexes the kept rows; each carries its row's length in the whole dataset.
    assert kept is train and sampler.lengths == [lengths[i] for i in train.indices]
    _, shuffled = arrange(
        train, "shuffled", lengths=lengths, batch_size=4, max_seq_len=512,
        padding_idx=0, rank=0, world_size=1, seed=0,
    )  # fmt: skip
    assert type(shuffled) is ShuffledSampler and sorted(shuffled) == list(range(len(train)))


def test_best_fit_decreasing_places_every_example_once_within_capacity_and_fills_tighter():
    lengths = _lengths(500, seed=1)
    packs = best_fit_decreasing(lengths, 512)
    assert sorted(i for pack in packs for i in pack) == list(range(500))
    assert all(sum(lengths[i] for i in pack) <= 512 for pack in packs)
    assert best_fit_decreasing(lengths, 512) == packs  # deterministic
    # Greedy in dataset order (torchtune's PackedDataset) opens a new pack whenever the next
    # example does not fit the current one.
    greedy, room = 0, 0
    for n in lengths:
        if n > room:
            greedy, room = greedy + 1, 512
        room -= n
    assert len(packs) < greedy
    assert sum(lengths) / (len(packs) * 512) > 0.97


def test_packs_have_the_layout_of_torchtunes_packed_dataset():
    rows = [
        {"tokens": list(range(1, 6)), "labels": [-100, -100, 3, 4, 5]},
        {"tokens": [7, 8, 9], "labels": [-100, 8, 9]},
    ]
    ours = Packs(rows, [[0, 1]], max_seq_len=12, padding_idx=0)[0]
    theirs = PackedDataset(rows, max_seq_len=12, padding_idx=0)[0]
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


# ------------------------------------------------------------------ the fused loss


@pytest.mark.parametrize("rows", [10, 37, 64])  # several chunks, exactly one, one larger
@pytest.mark.parametrize("weight_trains", [False, True])
def test_chunked_linear_cross_entropy_equals_the_plain_loss_and_its_gradients(rows, weight_trains):
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(100, 16, requires_grad=weight_trains)
    targets = torch.randint(0, 100, (37,))
    plain = F.cross_entropy(hidden @ weight.T, targets, reduction="sum")
    (plain * 3).backward()
    expected = hidden.grad.clone(), weight.grad.clone() if weight_trains else None
    hidden.grad = weight.grad = None
    fused = vocab_loss.LinearCrossEntropy.apply(hidden, weight, targets, rows)
    (fused * 3).backward()
    torch.testing.assert_close(fused, plain)
    torch.testing.assert_close(hidden.grad, expected[0])
    if weight_trains:
        torch.testing.assert_close(weight.grad, expected[1])


@pytest.mark.parametrize("rows", [16, 300])  # the weight's gradient accumulated, or one chunk's
def test_the_bf16_loss_is_as_close_to_exact_as_the_plain_bf16_loss(rows):
    """In bf16 (a GPU's dtype) the matmuls run in bf16 and the log-sum-exp and softmax in fp32, as
    ``cross_entropy(logits.float(), ...)`` of the bf16 logits computes them: the loss agrees with
    that plain loss to fp32's precision, and each gradient is as close to the exact one (fp32
    throughout, from the same bf16 inputs) as the plain loss's: within bf16's rounding."""
    torch.manual_seed(0)
    hidden = (torch.randn(300, 64) / 4).bfloat16().requires_grad_()
    weight = (torch.randn(1000, 64) / 4).bfloat16().requires_grad_()
    targets = torch.randint(0, 1000, (300,))

    def grads(loss):
        loss.backward()
        out = hidden.grad.float(), weight.grad.float()
        hidden.grad = weight.grad = None
        return out

    h32, w32 = (t.detach().float().requires_grad_() for t in (hidden, weight))
    exact_loss = F.cross_entropy(h32 @ w32.T, targets, reduction="sum")
    exact_loss.backward()
    exact = h32.grad, w32.grad
    plain_loss = F.cross_entropy((hidden @ weight.T).float(), targets, reduction="sum")
    plain = grads(plain_loss)
    fused_loss = vocab_loss.LinearCrossEntropy.apply(hidden, weight, targets, rows)
    fused = grads(fused_loss)
    assert fused_loss.dtype == torch.float32
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-6, atol=0)
    for ours, theirs, truth in zip(fused, plain, exact, strict=True):
        error = ((ours - truth).norm() / truth.norm()).item()
        plain_error = ((theirs - truth).norm() / truth.norm()).item()
        assert error <= max(2 * plain_error, 2**-8), (error, plain_error)


@pytest.mark.parametrize("tied", [False, True])
def test_a_decoder_returns_the_loss_of_the_counted_positions_with_the_same_gradients(tied):
    torch.manual_seed(0)
    model = small_decoder(llama3_2 if tied else llama3, num_layers=2)
    assert vocab_loss.supports(model)
    tokens = torch.randint(0, 97, (2, 12))
    labels = tokens.clone()
    labels[0, :5] = CROSS_ENTROPY_IGNORE_IDX  # a prompt
    labels[1, 9:] = CROSS_ENTROPY_IGNORE_IDX  # padding
    flat = labels.reshape(-1)
    plain = F.cross_entropy(model(tokens).reshape(-1, 97), flat, reduction="sum")
    plain.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    rows = (flat != CROSS_ENTROPY_IGNORE_IDX).nonzero().squeeze(1)
    with vocab_loss.loss_instead_of_logits(model, rows, flat[rows], chunk_rows=5):
        fused = model(tokens)
    fused.backward()
    torch.testing.assert_close(fused, plain)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], msg=name)
    assert model(tokens).shape == (2, 12, 97)  # logits again outside the block


def test_lora_on_the_output_projection_keeps_the_plain_loss():
    model = small_decoder(llama3, num_layers=1)
    model.output = LoRALinear(32, 97, rank=4, alpha=8)
    assert not vocab_loss.supports(model)
