"""Which examples go into each batch: the epoch orders and the packs, all of them resumable.

Every order here is a pure function of (dataset, seed, epoch): the same on every rank and every
restart, so a resumed run skips exactly the examples the interrupted one had consumed and goes on
bit for bit (``start`` counts examples of the global order, as ``set_epoch`` receives it). What
the orders and packs are for: docs/trainer.md, "Throughput".
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Sampler, Subset
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX

from tunepack.core.errors import ConflictError

log = logging.getLogger("tunepack.trainer")

# The held-out rows are drawn with this fixed seed, not the run's: the same rows whatever
# seed= says, on every rank and every restart.
VALIDATION_SEED = 0x5EED
# Batches per window of the length-grouped order: large enough that most batches hold examples
# of nearly one length, small enough that the epoch's order stays shuffled at its scale.
WINDOW_BATCHES = 64


class ShuffledSampler(Sampler[int]):
    """Each epoch's shuffled order, split across ranks, able to start part-way through.

    The order of epoch ``e`` is ``randperm(len, seed + e)``, padded to a multiple of the world
    size and dealt out round-robin. ``set_epoch(e, start)`` skips the first ``start`` examples of
    the global order, which is exactly the batches every rank had consumed when a checkpoint was
    written: no batch is loaded only to be thrown away.
    """

    def __init__(self, size: int, *, rank: int, world_size: int, seed: int) -> None:
        self.size, self.rank, self.world_size, self.seed = size, rank, world_size, seed
        self.epoch, self.start = 0, 0
        self.total = math.ceil(size / world_size) * world_size

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def global_order(self) -> list[int]:
        """Every rank's examples of this epoch, interleaved: rank r takes r, r + world, ..."""
        order = torch.randperm(self.size, generator=self._generator())
        return torch.cat([order, order[: self.total - self.size]]).tolist()  # equal shares

    def _generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed + self.epoch)

    def __iter__(self):
        return iter(self.global_order()[self.start :][self.rank :: self.world_size])

    def __len__(self) -> int:
        return (self.total - self.start) // self.world_size


class LengthGroupedSampler(ShuffledSampler):
    """The shuffled order regrouped so each batch holds examples of similar length.

    The epoch's permutation is cut into windows of ``WINDOW_BATCHES`` global batches (a global
    batch is ``batch_size`` examples for each rank); each window is sorted by length, longest
    first, cut into global batches, and those are shuffled. Dealt round-robin, each rank's share
    of a global batch is ``batch_size`` neighbours in length. The epoch's longest global batch
    goes first, so a batch that does not fit in memory fails at the first step, not hours in.
    """

    def __init__(
        self, lengths: Sequence[int], *, batch_size: int, rank: int, world_size: int, seed: int
    ) -> None:
        super().__init__(len(lengths), rank=rank, world_size=world_size, seed=seed)
        self.lengths = list(lengths)
        self.global_batch = batch_size * world_size

    def global_order(self) -> list[int]:
        order = super().global_order()
        generator = self._generator()
        window = self.global_batch * WINDOW_BATCHES
        batches: list[list[int]] = []
        for begin in range(0, len(order), window):
            # Stable sort: equal lengths keep their random order.
            part = sorted(order[begin : begin + window], key=lambda i: -self.lengths[i])
            cut = [part[i : i + self.global_batch] for i in range(0, len(part), self.global_batch)]
            shuffled = torch.randperm(len(cut), generator=generator).tolist()
            batches.extend(cut[i] for i in shuffled)
        longest = max(range(len(batches)), key=lambda b: max(self.lengths[i] for i in batches[b]))
        batches.insert(0, batches.pop(longest))
        # A ragged last batch (fewer examples than a global batch) stays last: the loop leaves a
        # ragged remainder of the epoch out, as it would in the shuffled order.
        ragged = [b for b in batches if len(b) < self.global_batch]
        return [i for b in [b for b in batches if len(b) == self.global_batch] + ragged for i in b]


def example_length(sample: dict) -> int:
    """An example's length in tokens (the longest sequence of a preference pair)."""
    return max(len(v) for v in sample.values() if isinstance(v, list | torch.Tensor))


def example_lengths(dataset: Dataset, what: str) -> list[int]:
    """Each example's length in tokens (the longest sequence of a preference pair), by
    tokenizing the dataset once, before training; progress is logged for large datasets."""
    lengths, began, said = [], time.monotonic(), time.monotonic()
    for index in range(len(dataset)):
        lengths.append(example_length(dataset[index]))
        if time.monotonic() - said > 30:
            log.info("measuring %s: %d of %d examples", what, index + 1, len(dataset))
            said = time.monotonic()
    log.info("%s: %d examples measured in %.1f s", what, len(dataset), time.monotonic() - began)
    return lengths


class Packs(Dataset):
    """Examples packed into sequences of ``max_seq_len`` tokens, in the layout torchtune's
    ``padded_collate_packed`` reads: tokens, labels, input_pos (restarting at each example) and
    seq_lens (each example's length, then the padding's)."""

    def __init__(
        self, dataset: Dataset, packs: list[list[int]], max_seq_len: int, padding_idx: int
    ) -> None:
        self.packs = [_pack([dataset[i] for i in pack], max_seq_len, padding_idx) for pack in packs]

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.packs[index]


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of example indices, each summing to at most ``capacity``: examples taken longest
    first (ties by index), each into the fullest bin it still fits, else a new bin. Deterministic;
    an example never spans two bins (examples are at most ``capacity`` long, as tokenized)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, bin number), sorted
    for i in order:
        need = min(lengths[i], capacity)
        at = bisect.bisect_left(free, (need, -1))
        if at == len(free):
            bins.append([i])
            bisect.insort(free, (capacity - need, len(bins) - 1))
            continue
        space, number = free.pop(at)
        bins[number].append(i)
        bisect.insort(free, (space - need, number))
    return bins


def best_fit_packs(dataset: Dataset, max_seq_len: int, padding_idx: int) -> Packs:
    lengths = example_lengths(dataset, "packing")
    packs = best_fit_decreasing(lengths, max_seq_len)
    filled = sum(lengths) / (len(packs) * max_seq_len) if packs else 0.0
    log.info(
        "packed %d examples into %d packs (%.1f%% full)", len(lengths), len(packs), 100 * filled
    )
    return Packs(dataset, packs, max_seq_len, padding_idx)


def _pack(samples: list[dict], max_seq_len: int, padding_idx: int) -> dict[str, torch.Tensor]:
    tokens = torch.cat([torch.as_tensor(s["tokens"][:max_seq_len]) for s in samples])
    labels = torch.cat([torch.as_tensor(s["labels"][:max_seq_len]) for s in samples])
    seq_lens = [min(len(s["tokens"]), max_seq_len) for s in samples]
    input_pos = torch.cat([torch.arange(n) for n in seq_lens])
    pad = max_seq_len - len(tokens)
    if pad:
        # The padding is one more "example" of its own, so no real token attends to it; its
        # positions continue the last example's, clamped to the table of positions.
        last = int(input_pos[-1])
        input_pos = torch.cat(
            [input_pos, torch.arange(last + 1, last + 1 + pad).clamp(max=max_seq_len - 1)]
        )
        seq_lens.append(pad)
    return {
        "tokens": F.pad(tokens, (0, pad), value=padding_idx),
        "labels": F.pad(labels, (0, pad), value=CROSS_ENTROPY_IGNORE_IDX),
        "input_pos": input_pos,
        "seq_lens": torch.tensor(seq_lens),
    }


def real_positions(labels: torch.Tensor) -> int:
    """The positions of a batch that hold example tokens: each row up to its last labelled one
    (padding, and a pack's unused tail, is unlabelled and comes last; an example ends with its
    labelled end-of-turn token). ``labels`` as collated, before the shift."""
    labelled = labels != CROSS_ENTROPY_IGNORE_IDX
    from_end = labelled.flip(1).int().argmax(dim=1)  # unlabelled positions after the last label
    return int(torch.where(labelled.any(dim=1), labels.size(1) - from_end, 0).sum())


def cut_rows_line(lengths: list[int], kept: int, max_seq_len: int) -> str | None:
    """The line that says how many rows (of ``lengths``, each in tokens before any cut) are
    longer than the ``kept`` tokens a row keeps under ``max_seq_len``; None when none is."""
    cut = [n for n in lengths if n > kept]
    if not cut:
        return None
    return (
        f"{len(cut)} of {len(lengths)} rows are longer than max_seq_len={max_seq_len} tokens and "
        f"were cut to it (longest {max(cut):,} tokens, {sum(cut) - kept * len(cut):,} tokens "
        "not trained on); raise max_seq_len or split those rows to train on all of them"
    )


def hold_out(dataset: Dataset, fraction: float) -> tuple[Subset, list[int]]:
    """The training rows and the indices of the rows set aside for validation (``fraction``).

    The held-out rows are a fixed-seed random draw over the row count: the same on every
    rank, every restart and whatever ``seed`` is, so validation losses compare across runs.
    """
    size = len(dataset)
    n_val = max(1, round(size * fraction))
    if size - n_val < 1:
        raise ConflictError(
            f"val_fraction={fraction} leaves no training rows of the dataset's {size}: "
            "lower val_fraction or add data"
        )
    order = torch.randperm(size, generator=torch.Generator().manual_seed(VALIDATION_SEED))
    return Subset(dataset, sorted(order[n_val:].tolist())), sorted(order[:n_val].tolist())


def arrange(
    dataset: Dataset,
    how: str,
    *,
    lengths: Sequence[int],
    batch_size: int,
    max_seq_len: int,
    padding_idx: int,
    rank: int,
    world_size: int,
    seed: int,
) -> tuple[Dataset, ShuffledSampler]:
    """The dataset as batches draw from it (``packed``: its packs) and the sampler of each
    epoch's order (``batching=``); ``lengths``: every row's, as the dataset cuts them."""
    order = dict(rank=rank, world_size=world_size, seed=seed)
    match how:
        case "packed":
            packs = best_fit_packs(dataset, max_seq_len, padding_idx)
            return packs, ShuffledSampler(len(packs), **order)
        case "length_grouped":
            rows = dataset.indices if isinstance(dataset, Subset) else range(len(dataset))
            mine = [lengths[i] for i in rows]
            return dataset, LengthGroupedSampler(mine, batch_size=batch_size, **order)
        case _:
            return dataset, ShuffledSampler(len(dataset), **order)
