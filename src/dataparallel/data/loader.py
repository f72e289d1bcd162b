"""Split a dataset across ranks and batch each rank's share, with no communication at all.

Every rank computes the same global order of the samples (`0..n-1`, or a permutation drawn from
`numpy.random.default_rng((seed, epoch))`) and takes its own contiguous slice of it
(`shard_indices`). Shares are balanced: with `n` samples on `size` ranks, the first `n % size` ranks
hold one sample more than the others; no rank is ever out of range, even when `n < size` (unlike
FluxMPI's ceil chunking).

Note: the shuffled order is the same on every rank only when every rank runs the same NumPy version
(NumPy keeps `default_rng` streams stable across versions, but a mixed install is not tested).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import SupportsIndex

import numpy as np

from dataparallel import world
from dataparallel.data.sources import Index, source
from dataparallel.groups import Group
from dataparallel.types import Tree

__all__ = ["DistributedDataContainer", "DistributedDataLoader", "shard_indices"]


def shard_indices(
    n: int, rank: int, size: int, *, shuffle: bool = False, seed: int = 0, epoch: int = 0
) -> Index:
    """Return the global indices of `rank`'s share of `n` samples split over `size` ranks.

    Rank `r` gets `n // size` samples, plus one when `r < n % size`; the shares are disjoint and
    together cover `range(n)`. Without shuffling they are contiguous ranges in order; with it, they
    are contiguous slices of `numpy.random.default_rng((seed, epoch)).permutation(n)`, which every
    rank computes identically.

    Args:
        n: number of samples in the dataset (0 is allowed).
        rank: this rank, `0 <= rank < size`.
        size: number of ranks, at least 1.
        shuffle: permute the samples before splitting (default False).
        seed: non-negative seed of the permutation, the same on every rank (default 0).
        epoch: non-negative epoch; each epoch has its own permutation (default 0).

    Returns:
        A 1-D int64 array of the share's indices into the dataset.

    >>> shard_indices(10, 0, 3), shard_indices(10, 2, 3)
    (array([0, 1, 2, 3]), array([7, 8, 9]))
    >>> [len(shard_indices(2, r, 3)) for r in range(3)]
    [1, 1, 0]
    """
    n, size, rank = _count(n, "n"), _count(size, "size"), _count(rank, "rank")
    if size < 1:
        raise ValueError(f"size={size} must be at least 1: it is the number of ranks.")
    if rank >= size:
        raise ValueError(f"rank={rank} is out of range for size={size}: use 0 <= rank < size.")
    start, stop = _bounds(n, rank, size)
    if not shuffle:
        return np.arange(start, stop, dtype=np.int64)
    return _global_order(n, shuffle, seed, epoch)[start:stop]


def _bounds(n: int, rank: int, size: int) -> tuple[int, int]:
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def _global_order(n: int, shuffle: bool, seed: int, epoch: int) -> Index:
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    seed, epoch = _count(seed, "seed"), _count(epoch, "epoch")
    return np.random.default_rng((seed, epoch)).permutation(n).astype(np.int64, copy=False)


def _count(value: object, name: str) -> int:
    """Return `value` as a non-negative int, or raise a message that names it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        why = " (it must be the same on every rank, so no fresh entropy)" if value is None else ""
        raise TypeError(f"{name} must be an int{why}, got {type(value).__name__} {value!r}.")
    if value < 0:
        raise ValueError(f"{name}={value} must be non-negative.")
    return int(value)


def rank_and_size(group: Group | None = None) -> tuple[int, int]:
    """Return this process's rank and size in the world, or in `group`.

    Raises `NotInitializedError` before `dp.initialize()`.
    """
    return world.rank(group), world.size(group)


class _Sharded:
    """What the container and the loader share: the data, the world's shape, the shuffle state."""

    def __init__(
        self, data: Tree, shuffle: bool, seed: int, owner: str, group: Group | None
    ) -> None:
        if not isinstance(shuffle, (bool, np.bool_)):
            raise TypeError(f"shuffle must be a bool, got {type(shuffle).__name__} {shuffle!r}.")
        self._seed = _count(seed, "seed")
        self._shuffle = bool(shuffle)
        if isinstance(data, _Sharded):
            raise TypeError(
                f"{owner} got a {type(data).__name__}, which is already one rank's share: "
                f"splitting it again would drop samples. Fix: pass the whole dataset to {owner}."
            )
        self._source = source(data, owner)
        self._rank, self._size = rank_and_size() if group is None else rank_and_size(group)
        self._epoch = 0

    @property
    def shuffle(self) -> bool:
        """Whether the samples are permuted each epoch."""
        return self._shuffle

    @property
    def seed(self) -> int:
        """The seed of the permutation, the same on every rank."""
        return self._seed

    @property
    def epoch(self) -> int:
        """The epoch the order is drawn for (see `set_epoch`)."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Draw the order of `epoch` (with `shuffle=True`): call it on every rank each epoch."""
        self._epoch = _count(epoch, "epoch")

    def _where(self) -> str:
        return f"rank {self._rank} of {self._size}"


class DistributedDataContainer(_Sharded):
    """Give this rank its share of a dataset, balanced, disjoint and complete over the ranks.

    `data` may be an array (NumPy, PyTorch, JAX, CuPy; split on its first axis), a tuple or dict of
    arrays with equal first dimension (items come back as tuples or dicts; a namedtuple keeps its
    type), or anything with `__len__` and `__getitem__` (a list, a torch map-style `Dataset`). Rank
    `r` gets `n // size` samples, plus one when `r < n % size`, for any `n` including `n < size`
    (some ranks then hold nothing) and `n = 0`. See `shard_indices` for the exact split. A tuple
    that holds no array is taken as a sequence of samples, like a list.

    The container is itself a map-style dataset: `len`, integer indexing (negative too) and
    iteration over the share, so `torch.utils.data.DataLoader(container, ...)` works as is. A slice
    gives a batch of the data's own family for array data, a list of items otherwise.

    Note: unlike FluxMPI's `DistributedDataContainer` (ceil chunking, which leaves ranks out of
    range on small datasets), shares differ by at most one sample. For equal batch counts on every
    rank, use `DistributedDataLoader`.

    Args:
        data: the whole dataset, the same on every rank.
        shuffle: permute the samples before splitting; the permutation depends on `seed` and the
            epoch (`set_epoch`) only, so every rank draws the same one without communicating
            (default False).
        seed: non-negative int, the same on every rank (default 0).
        group: split among the ranks of this `dp.new_group` group (default: the world).

    Raises:
        NotInitializedError: before `dp.initialize()`.
        ValueError: for a tuple/dict of arrays whose first dimensions differ, or a 0-d array.
        TypeError: for data that is none of the above.

    >>> import dataparallel as dp, numpy as np
    >>> _ = dp.initialize()  # a world of one here; under `mpiexec -n 2`, rank 0 gets [0, 1]
    >>> share = dp.DistributedDataContainer(np.arange(4))
    >>> len(share), share[-1]
    (4, np.int64(3))
    """

    def __init__(
        self, data: Tree, *, shuffle: bool = False, seed: int = 0, group: Group | None = None
    ) -> None:
        super().__init__(data, shuffle, seed, "DistributedDataContainer", group)
        self._indices = self._compute_indices()

    def _compute_indices(self) -> Index:
        idx = shard_indices(
            self._source.n,
            self._rank,
            self._size,
            shuffle=self._shuffle,
            seed=self._seed,
            epoch=self._epoch,
        )
        idx.flags.writeable = False
        return idx

    @property
    def indices(self) -> Index:
        """The global indices of this rank's samples, in the order they are served (read-only)."""
        return self._indices

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for `epoch` (with `shuffle=True`); call it on every rank alike."""
        super().set_epoch(epoch)
        self._indices = self._compute_indices()

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index: SupportsIndex | slice) -> Tree:
        if isinstance(index, slice):
            return self._source.slice(self._indices[index])
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(
                f"DistributedDataContainer indices must be integers or slices, not "
                f"{type(index).__name__}."
            ) from None
        n = len(self._indices)
        if not -n <= i < n:
            raise IndexError(
                f"index {i} is out of range: {self._where()} holds {n} samples "
                f"(of {self._source.n} in the dataset)."
            )
        return self._source.item(int(self._indices[i]))

    def __iter__(self) -> Iterator[Tree]:
        for j in self._indices:
            yield self._source.item(int(j))

    def __repr__(self) -> str:
        return (
            f"DistributedDataContainer({len(self)} of {self._source.n} samples, {self._where()}, "
            f"shuffle={self._shuffle}, seed={self._seed}, epoch={self._epoch})"
        )


def _plan(n: int, size: int, batch_size: int, drop_last: bool) -> tuple[int, int]:
    """Return `(batches, samples)` per rank per epoch: the same on every rank by construction."""
    if drop_last:
        batches = (n // size) // batch_size  # the smallest share's full batches
        return batches, batches * batch_size
    largest = -(-n // size)
    return -(-largest // batch_size), largest


def _epoch_indices(
    n: int, rank: int, size: int, samples: int, shuffle: bool, seed: int, epoch: int
) -> Index:
    """Return the `samples` global indices a rank serves in an epoch: its share, cut or padded."""
    share = shard_indices(n, rank, size, shuffle=shuffle, seed=seed, epoch=epoch)
    if samples <= len(share):
        return share[:samples]
    if len(share) > 0:
        return np.resize(share, samples)  # repeats the share's first samples
    # An empty share (n < size): take the global order's samples, starting at a rank-dependent
    # position so that the duplicates spread over the dataset.
    order = _global_order(n, shuffle, seed, epoch)
    return order[(rank + np.arange(samples)) % n]


class DistributedDataLoader(_Sharded):
    """Iterate over batches of this rank's share, the same number of batches on every rank.

    FluxMPI's `DataParallelDataLoader`. Batches keep the family of `data`: a NumPy, PyTorch, JAX or
    CuPy array gives batches of that family (gathered with one fancy index per batch, on the
    array's device); a tuple or dict of arrays gives tuples or dicts of batches; any other
    indexable dataset has its items collated: numbers and NumPy arrays stacked with NumPy, tensors
    with `torch.stack` (JAX and CuPy alike), tuples, lists and dicts field by field, strings kept
    as lists.

    Every rank yields the same number of batches, `len(loader)`, computed from the dataset size,
    the world size and `batch_size` alone, so a training loop with a collective per step cannot
    deadlock on uneven shares:

    - `drop_last=True`: every rank yields the full batches of the smallest share,
      `(n // size) // batch_size`; the rest of each share is skipped this epoch (with shuffling,
      different samples each epoch). When `batch_size` exceeds the smallest share, there are none.
    - `drop_last=False` (default): every rank yields `ceil(ceil(n / size) / batch_size)` batches
      of `ceil(n / size)` samples in all; a rank whose share is one sample short repeats the first
      sample of its share, as `torch.utils.data.DistributedSampler` pads (it pads from the
      dataset's start instead). The last batch may be short, but has the same size on every rank.
      When `n < size`, a rank with an empty share serves one sample, the global order's sample
      `rank % n`, so it still takes part in every step. Repeated samples weigh twice in the
      gradient, as with `DistributedSampler`.

    With `n = 0` every rank yields no batch. Iterating twice gives the same batches; call
    `set_epoch(e)` with the same `e` on every rank for a new order (with `shuffle=True`).

    Args:
        data: the whole dataset, the same on every rank (see `DistributedDataContainer`).
        batch_size: samples per batch on each rank, at least 1 (the global batch is
            `batch_size * dp.size()`).
        shuffle: permute the samples each epoch, identically on every rank (default False).
        seed: non-negative int seed of the permutation, the same on every rank (default 0).
        drop_last: skip samples that do not fill a batch on every rank (default False).

    Raises:
        NotInitializedError: before `dp.initialize()`.
        ValueError: for `batch_size < 1`, and as `DistributedDataContainer` does.
        TypeError: for a non-integer `batch_size`, and as `DistributedDataContainer` does.

    >>> import dataparallel as dp, numpy as np
    >>> _ = dp.initialize()  # a world of one here
    >>> loader = dp.DistributedDataLoader(np.arange(5), batch_size=2)
    >>> len(loader), [b.tolist() for b in loader]
    (3, [[0, 1], [2, 3], [4]])
    """

    def __init__(
        self,
        data: Tree,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        group: Group | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
            raise TypeError(
                f"batch_size must be an int, got {type(batch_size).__name__} {batch_size!r}."
            )
        if batch_size < 1:
            raise ValueError(
                f"batch_size={batch_size} must be at least 1: it is the number of samples per "
                "batch on each rank."
            )
        if not isinstance(drop_last, (bool, np.bool_)):
            raise TypeError(
                f"drop_last must be a bool, got {type(drop_last).__name__} {drop_last!r}."
            )
        super().__init__(data, shuffle, seed, "DistributedDataLoader", group)
        self._batch_size, self._drop_last = int(batch_size), bool(drop_last)
        self._batches, self._samples = _plan(
            self._source.n, self._size, self._batch_size, self._drop_last
        )

    @property
    def batch_size(self) -> int:
        """Samples per batch on this rank (the last batch may be shorter without `drop_last`)."""
        return self._batch_size

    @property
    def drop_last(self) -> bool:
        """Whether samples that do not fill a batch on every rank are skipped."""
        return self._drop_last

    def __len__(self) -> int:
        return self._batches

    def __iter__(self) -> Iterator[Tree]:
        idx = _epoch_indices(
            self._source.n,
            self._rank,
            self._size,
            self._samples,
            self._shuffle,
            self._seed,
            self._epoch,
        )
        return self._iterate(idx)

    def _iterate(self, idx: Index) -> Iterator[Tree]:
        bs = self._batch_size
        for b in range(self._batches):
            yield self._source.batch(idx[b * bs : (b + 1) * bs])

    def __repr__(self) -> str:
        return (
            f"DistributedDataLoader({self._batches} batches of {self._batch_size} from "
            f"{self._source.n} samples, {self._where()}, shuffle={self._shuffle}, "
            f"seed={self._seed}, epoch={self._epoch}, drop_last={self._drop_last})"
        )
