"""`ElasticSampler`: an epoch's samples split over whatever world there is, each sample
processed in exactly one committed step however often the world changes.

The samples of an epoch not yet processed (the dataset less the recorded ones), shuffled by
`seed + epoch`, are the *remaining* list. Rank r of n takes every n-th: `remaining[r::n]`. Its
b-th batch of B samples is therefore part of the *global* batch b, `remaining[b*n*B:(b+1)*n*B]`,
which every rank can name. `record_batch(b, B)` records that whole global batch on every rank
(Horovod records each rank's own and unites them at `sync`, which loses or repeats samples when
ranks committed different steps), so the recorded set is the same everywhere and rank 0's copy,
synchronized after a failure, is exact. After the world changes, the remaining list is made anew
from what was recorded, so nothing is padded and nothing repeats.

The last step of an epoch: with m samples remaining, rank r holds ceil((m - r) / n) of them, so
the ranks' shares differ by one at most and the last global batch is split as evenly as it can
be. When fewer than n samples are left for it, the ranks past them have no last batch: loop over
`steps(B)` global steps with `get_indices` (an empty batch contributes nothing) to keep every
rank in every step, or give such ranks a step of their own (`dp.join`). Horovod pads instead, and
repeats samples.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sized
from typing import Any, SupportsInt

from dataparallel import world

__all__ = ["ElasticSampler"]


class ElasticSampler:
    """Horovod's `ElasticSampler(dataset, shuffle=True, seed=0)`, exactly once.

    A `torch.utils.data.Sampler` in all but name (it needs no torch): pass it as a `DataLoader`'s
    `sampler`. Keep it in the elastic state (`TorchState(..., sampler=s)`) so that it is saved at
    each commit and synchronized after a failure.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []
        self.num_replicas, self.rank = 1, 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` (nothing processed yet, a new order), or, when `epoch` is the one
        in progress, go on with it: its record is kept.

        So both habits are exactly once: `set_epoch(e + 1)` at the end of epoch `e` (Horovod's),
        and `set_epoch(e)` at the start of every epoch (torch's `DistributedSampler`), which an
        elastic run calls again, on re-entry after a re-form, for the epoch it rolled back into.
        To go over an epoch's samples once more, give it another number.
        """
        if epoch != self.epoch:
            self.processed_indices = set()
        self.epoch = epoch
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record global batch `batch_idx` (every rank's `batch_size` samples) as processed."""
        self.record_indices(self.global_indices(batch_idx, batch_size))

    def record_indices(self, indices: Iterable[SupportsInt]) -> None:
        """Record `indices` as processed (give every rank's, the same on every rank)."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """Return this rank's samples of its batch `batch_idx` (empty past its last one)."""
        return self.indices[batch_idx * batch_size : (batch_idx + 1) * batch_size]

    def global_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """Return every rank's samples of global batch `batch_idx`."""
        width = batch_size * self.num_replicas
        return self.remaining_indices[batch_idx * width : (batch_idx + 1) * width]

    def steps(self, batch_size: int) -> int:
        """Return the number of global batches left in this epoch (the same on every rank)."""
        return math.ceil(len(self.remaining_indices) / (batch_size * self.num_replicas))

    def state_dict(self) -> dict[str, int | set[int]]:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Split what remains of the epoch over the current world (called after it changes)."""
        if world.initialized():
            self.resplit(world.size(), world.rank())
        else:
            self.resplit(1, 0)

    def resplit(self, num_replicas: int, rank: int) -> None:
        """Split what remains of the epoch as rank `rank` of `num_replicas` takes it."""
        self.num_replicas, self.rank = num_replicas, rank
        remaining = [i for i in range(len(self.dataset)) if i not in self.processed_indices]
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(remaining)
        self.remaining_indices = remaining
        self.indices = remaining[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
