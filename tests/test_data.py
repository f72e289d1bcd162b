"""Tests of `dataparallel.data`, passing at any world size (`pytest`, `mpiexec -n 3 ... pytest`).

Two kinds of test live here. Those on the real world compare what every rank got, gathered with
`dp.allgather_object` on plain Python values (gathered before asserting, so a failure on one rank
cannot leave the others waiting). Those on simulated worlds build one object per simulated rank,
with `dataparallel.data.loader.rank_and_size` patched, and check properties over all ranks at
once; they need no peer, so hypothesis can drive them.
"""

from __future__ import annotations

import pickle
from collections import namedtuple
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _jobs import run_job
from hypothesis import given, settings
from hypothesis import strategies as st

import dataparallel.world
from dataparallel.data import DistributedDataContainer, DistributedDataLoader, shard_indices
from dataparallel.data import loader as data_loader
from dataparallel.errors import NotInitializedError

SETTINGS = settings(max_examples=150, deadline=None, database=None)

Pair = namedtuple("Pair", ["x", "y"])


@pytest.fixture(scope="module", autouse=True)
def world() -> tuple[int, int]:
    """Initialize the world (MPI under mpiexec, a world of one otherwise); return (rank, size)."""
    dataparallel.world.initialize()
    return dataparallel.world.rank(), dataparallel.world.size()


def allgather(value: Any) -> list[Any]:
    """Return every rank's picklable `value`, in rank order."""
    return dataparallel.allgather_object(value)


def as_rank(rank: int, size: int, make: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Return `make(*args, **kwargs)` built as rank `rank` of a simulated world of `size` ranks."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(data_loader, "rank_and_size", lambda: (rank, size))
        return make(*args, **kwargs)


def plain(x: Any) -> Any:
    """Turn an item or batch of any family into nested Python values, for comparisons."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(plain(v) for v in x) if not hasattr(x, "_fields") else tuple(map(plain, x))
    if isinstance(x, (str, bytes)):
        return x
    return np.asarray(x).tolist()


# --- shard_indices: the pure split. ---------------------------------------------------------------


def check_partition(n: int, size: int, shuffle: bool, seed: int, epoch: int) -> None:
    shares = [
        shard_indices(n, r, size, shuffle=shuffle, seed=seed, epoch=epoch) for r in range(size)
    ]
    for share in shares:
        assert share.dtype == np.int64 and share.ndim == 1
    # Balanced: the first n % size ranks hold one more sample.
    assert [len(s) for s in shares] == [n // size + (r < n % size) for r in range(size)]
    # Disjoint and complete, in the global order each rank computes alone.
    order = np.random.default_rng((seed, epoch)).permutation(n) if shuffle else np.arange(n)
    np.testing.assert_array_equal(np.concatenate(shares), order)
    np.testing.assert_array_equal(np.sort(np.concatenate(shares)), np.arange(n))


@pytest.mark.parametrize("shuffle", [False, True])
def test_shares_are_balanced_disjoint_and_complete_for_every_small_case(shuffle: bool) -> None:
    for n in range(51):
        for size in range(1, 9):
            check_partition(n, size, shuffle, seed=7, epoch=n % 3)


@SETTINGS
@given(
    n=st.integers(0, 5000),
    size=st.integers(1, 64),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**63),
    epoch=st.integers(0, 10**6),
)
def test_shares_partition_any_dataset(
    n: int, size: int, shuffle: bool, seed: int, epoch: int
) -> None:
    check_partition(n, size, shuffle, seed, epoch)


def test_shuffle_depends_on_seed_and_epoch_only() -> None:
    def order(seed: int, epoch: int) -> list[int]:
        return np.concatenate(
            [shard_indices(100, r, 3, shuffle=True, seed=seed, epoch=epoch) for r in range(3)]
        ).tolist()

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1)
    assert order(1, 0) != order(2, 0)
    assert order(1, 0) != list(range(100))
    # Without shuffling, seed and epoch change nothing.
    assert shard_indices(10, 1, 3, seed=5, epoch=9).tolist() == [4, 5, 6]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"n": -1, "rank": 0, "size": 1}, ValueError, "n=-1 must be non-negative."),
        ({"n": 5, "rank": 0, "size": 0}, ValueError, "size=0 must be at least 1"),
        ({"n": 5, "rank": 3, "size": 3}, ValueError, "rank=3 is out of range for size=3"),
        ({"n": 5, "rank": 0, "size": 2.0}, TypeError, "size must be an int, got float 2.0."),
        ({"n": 5, "rank": 0, "size": 1, "shuffle": True, "seed": -1}, ValueError, "seed=-1"),
        ({"n": 5, "rank": 0, "size": 1, "shuffle": True, "epoch": -2}, ValueError, "epoch=-2"),
        (
            {"n": 5, "rank": 0, "size": 1, "shuffle": True, "seed": None},
            TypeError,
            "seed must be an int (it must be the same on every rank, so no fresh entropy)",
        ),
    ],
)
def test_shard_indices_rejects_bad_arguments(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        shard_indices(**kwargs)
    assert message in str(info.value)


# --- DistributedDataContainer on the real world. --------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 5, 17])
@pytest.mark.parametrize("shuffle", [False, True])
def test_container_shares_cover_the_dataset_across_ranks(
    world: tuple[int, int], n: int, shuffle: bool
) -> None:
    rank, size = world
    container = DistributedDataContainer([10 * i for i in range(n)], shuffle=shuffle, seed=3)
    container.set_epoch(2)
    local = list(container)
    shares = allgather(local)
    expected = shard_indices(n, rank, size, shuffle=shuffle, seed=3, epoch=2)
    assert local == [10 * int(i) for i in expected]
    assert len(container) == len(local) == n // size + (rank < n % size)
    # Each rank drew its permutation alone; together the shares are exactly that permutation.
    order = np.random.default_rng((3, 2)).permutation(n) if shuffle else np.arange(n)
    assert [x for share in shares for x in share] == [10 * int(i) for i in order]


def test_container_needs_an_initialized_world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataparallel.world, "_world", None)
    with pytest.raises(NotInitializedError, match=r"call dp\.initialize\(\) first"):
        DistributedDataContainer([1, 2, 3])
    with pytest.raises(NotInitializedError, match=r"call dp\.initialize\(\) first"):
        DistributedDataLoader([1, 2, 3], 2)


# --- DistributedDataContainer on simulated worlds. ------------------------------------------------


def datasets() -> dict[str, Callable[[int], Any]]:
    """Factories of a dataset of `n` samples, one per kind of input, with torch/jax when present."""
    out: dict[str, Callable[[int], Any]] = {
        "list": lambda n: [(i, float(i)) for i in range(n)],
        "numpy": lambda n: np.arange(2 * n).reshape(n, 2),
        "tuple": lambda n: (np.arange(n), np.arange(n) * 2.5),
        "dict": lambda n: {"x": np.arange(3 * n).reshape(n, 3), "y": np.arange(n)},
        "namedtuple": lambda n: Pair(np.arange(n), -np.arange(n)),
    }
    try:
        import torch

        out["torch"] = lambda n: torch.arange(n, dtype=torch.float32)
        out["TensorDataset"] = lambda n: torch.utils.data.TensorDataset(
            torch.arange(n), torch.arange(n) + 100
        )
    except ImportError:
        pass
    try:
        import jax.numpy as jnp

        out["jax"] = lambda n: jnp.arange(n)
    except ImportError:
        pass
    return out


def full_item(dataset: Any, i: int) -> Any:
    """Item `i` of the whole dataset, the way the container should serve it."""
    if isinstance(dataset, tuple):
        return (
            type(dataset)(*(v[i] for v in dataset))
            if hasattr(dataset, "_fields")
            else tuple(v[i] for v in dataset)
        )
    if isinstance(dataset, dict):
        return {k: v[i] for k, v in dataset.items()}
    return dataset[i]


@pytest.mark.parametrize("kind", list(datasets()))
@pytest.mark.parametrize("shuffle", [False, True])
def test_container_splits_every_kind_of_dataset(kind: str, shuffle: bool) -> None:
    for n in (0, 1, 4, 11):
        dataset = datasets()[kind](n)
        for size in (1, 2, 3, 5):
            served, order = [], []
            for r in range(size):
                c = as_rank(r, size, DistributedDataContainer, dataset, shuffle=shuffle)
                served += [plain(item) for item in c]
                order += c.indices.tolist()
            assert sorted(order) == list(range(n))
            assert served == [plain(full_item(dataset, i)) for i in order]


def test_container_items_keep_their_structure() -> None:
    x, y = np.arange(12).reshape(6, 2), np.arange(6) % 2
    row = container_of(x)[1]
    assert isinstance(row, np.ndarray) and row.tolist() == [2, 3]
    pair = container_of((x, y))[1]
    assert type(pair) is tuple and plain(pair) == ([2, 3], 1)
    named = container_of(Pair(x, y))[1]
    assert type(named) is Pair and plain(named.x) == [2, 3]
    record = container_of({"x": x, "y": y})[1]
    assert list(record) == ["x", "y"] and plain(record) == {"x": [2, 3], "y": 1}


def container_of(dataset: Any, **kwargs: Any) -> DistributedDataContainer:
    """A container on rank 0 of a world of one, whatever the real world is."""
    return as_rank(0, 1, DistributedDataContainer, dataset, **kwargs)


def test_container_items_keep_their_family() -> None:
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    assert isinstance(container_of(torch.ones(4, 2))[0], torch.Tensor)
    assert isinstance(container_of(jax.numpy.ones((4, 2)))[0], jax.Array)


def test_container_indexing_on_one_rank_of_three() -> None:
    c = as_rank(1, 3, DistributedDataContainer, list(range(10)))
    assert list(c) == [4, 5, 6] and c.indices.tolist() == [4, 5, 6]
    assert (c[0], c[-1], c[-3], c[np.int64(1)]) == (4, 6, 4, 5)
    assert c[1:] == [5, 6]  # a generic dataset's slice is a list of items
    with pytest.raises(IndexError) as info:
        c[3]
    assert str(info.value) == (
        "index 3 is out of range: rank 1 of 3 holds 3 samples (of 10 in the dataset)."
    )
    with pytest.raises(IndexError, match="index -4 is out of range"):
        c[-4]
    with pytest.raises(TypeError, match="indices must be integers or slices, not str"):
        c["a"]
    with pytest.raises(ValueError, match="read-only"):
        c.indices[0] = 0
    arrays = as_rank(1, 3, DistributedDataContainer, (np.arange(10), np.arange(10) * 2))
    xs, ys = arrays[::2]  # an array dataset's slice is a batch
    assert xs.tolist() == [4, 6] and ys.tolist() == [8, 12]


def test_container_set_epoch_reshuffles_only_when_shuffling() -> None:
    shuffled = as_rank(0, 2, DistributedDataContainer, np.arange(100), shuffle=True)
    fixed = as_rank(0, 2, DistributedDataContainer, np.arange(100))
    first = shuffled.indices.tolist()
    assert first == list(shuffled) == shard_indices(100, 0, 2, shuffle=True).tolist()
    shuffled.set_epoch(1)
    fixed.set_epoch(1)
    assert shuffled.epoch == 1 and shuffled.indices.tolist() != first
    assert fixed.indices.tolist() == list(range(50))
    shuffled.set_epoch(0)
    assert shuffled.indices.tolist() == first
    assert repr(shuffled) == (
        "DistributedDataContainer(50 of 100 samples, rank 0 of 2, shuffle=True, seed=0, epoch=0)"
    )


def test_container_and_loader_survive_pickling() -> None:
    # torch's DataLoader pickles its dataset for worker processes started with "spawn".
    dataset = {"x": np.arange(10), "pair": np.arange(10) * 2}
    for make in (DistributedDataContainer, lambda d, **kw: DistributedDataLoader(d, 3, **kw)):
        for data_ in (dataset, Pair(np.arange(10), np.ones(10)), [(i, -i) for i in range(10)]):
            obj = as_rank(1, 3, make, data_, shuffle=True)
            obj.set_epoch(2)
            copy = pickle.loads(pickle.dumps(obj))
            assert plain(list(copy)) == plain(list(obj)) and copy.epoch == 2


def test_torch_dataloader_over_the_container(world: tuple[int, int]) -> None:
    torch = pytest.importorskip("torch")
    rank, size = world
    x, y = np.arange(46, dtype=np.float32).reshape(23, 2), np.arange(23)
    container = DistributedDataContainer((x, y))
    share = shard_indices(23, rank, size)
    batches = list(torch.utils.data.DataLoader(container, batch_size=4))
    assert all(isinstance(xb, torch.Tensor) and isinstance(yb, torch.Tensor) for xb, yb in batches)
    np.testing.assert_array_equal(torch.cat([xb for xb, _ in batches]).numpy(), x[share])
    np.testing.assert_array_equal(torch.cat([yb for _, yb in batches]).numpy(), y[share])
    # A torch Dataset in, with torch's own shuffling on top of the split.
    dataset = torch.utils.data.TensorDataset(torch.arange(23))
    loader = torch.utils.data.DataLoader(DistributedDataContainer(dataset), 5, shuffle=True)
    served = sorted(int(v) for (batch,) in loader for v in batch)
    assert served == share.tolist()
    everything = allgather(served)
    assert sorted(v for part in everything for v in part) == list(range(23))


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: (np.zeros(10), np.zeros(9)),
            ValueError,
            "DistributedDataContainer got a tuple of arrays with different first dimensions "
            "([0]: 10, [1]: 9), but each sample takes one row of every array. Fix: give every "
            "array the same number of rows.",
        ),
        (
            lambda: {"x": np.zeros((10, 3)), "y": np.zeros(9)},
            ValueError,
            "different first dimensions ('x': 10, 'y': 9)",
        ),
        (
            lambda: np.float64(3.0),
            TypeError,
            "expected a dataset: an array (NumPy, PyTorch, JAX, CuPy), a tuple or dict of arrays "
            "with equal first dimension, or an object with __len__ and __getitem__ (a list, a "
            "torch Dataset); got float64.",
        ),
        (lambda: np.array(3.0), ValueError, "got a 0-d numpy array, which has no first axis"),
        (
            lambda: (np.zeros(3), np.array(1.0)),
            ValueError,
            "got a 0-d numpy array at [1], which has no first axis",
        ),
        (lambda: (i for i in range(3)), TypeError, "materialize an iterable with list(...)"),
        (lambda: "abc", TypeError, "got str."),
        (
            lambda: {"x": np.zeros(3), "y": [1, 2, 3]},
            TypeError,
            "got a dict whose entry ['y'] is a list: a tuple or dict dataset must hold arrays",
        ),
        (lambda: (np.zeros(3), [1, 2, 3]), TypeError, "got a tuple whose entry [1] is a list"),
        (lambda: {}, ValueError, "got an empty dict"),
        (
            lambda: DistributedDataContainer([1, 2]),
            TypeError,
            "got a DistributedDataContainer, which is already one rank's share: splitting it "
            "again would drop samples. Fix: pass the whole dataset to DistributedDataContainer.",
        ),
    ],
)
def test_container_rejects_what_it_cannot_split(
    make: Callable[[], Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        DistributedDataContainer(make())
    assert message in str(info.value)


def test_container_rejects_bad_options() -> None:
    with pytest.raises(TypeError, match="shuffle must be a bool, got str 'yes'"):
        DistributedDataContainer([1], shuffle="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"seed must be an int \(it must be the same on every"):
        DistributedDataContainer([1], seed=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="epoch=-1 must be non-negative"):
        DistributedDataContainer([1]).set_epoch(-1)


# --- DistributedDataLoader: batch counts, padding, families. --------------------------------------


def loaders(n: int, size: int, batch_size: int, **kwargs: Any) -> list[DistributedDataLoader]:
    return [
        as_rank(r, size, DistributedDataLoader, np.arange(n), batch_size, **kwargs)
        for r in range(size)
    ]


@SETTINGS
@given(
    n=st.integers(0, 120),
    size=st.integers(1, 9),
    batch_size=st.integers(1, 20),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    epoch=st.integers(0, 5),
)
def test_every_rank_yields_the_same_batches_count_and_sizes(
    n: int, size: int, batch_size: int, shuffle: bool, drop_last: bool, epoch: int
) -> None:
    per_rank = loaders(n, size, batch_size, shuffle=shuffle, drop_last=drop_last, seed=1)
    served, shapes = [], []
    for r, loader in enumerate(per_rank):
        loader.set_epoch(epoch)
        batches = [b.tolist() for b in loader]
        assert len(batches) == len(loader)
        assert all(len(b) == batch_size for b in batches[:-1])  # only the last may be short
        flat = [v for b in batches for v in b]
        share = shard_indices(n, r, size, shuffle=shuffle, seed=1, epoch=epoch).tolist()
        # A rank serves its share in order, then at most one sample again, from its share when
        # it has one.
        assert flat[: len(share)] == share[: len(flat)]
        extra = flat[len(share) :]
        assert len(extra) <= 1 and set(extra) <= set(share or range(n))
        served.append(flat)
        shapes.append([len(b) for b in batches])
    assert all(s == shapes[0] for s in shapes)  # the same batch count and sizes on every rank
    everything = [v for s in served for v in s]
    if drop_last:
        assert len(per_rank[0]) == (n // size) // batch_size
        assert all(sum(s) == len(s) * batch_size for s in shapes)
        assert len(set(everything)) == len(everything)  # no sample twice
    else:
        largest = -(-n // size)
        assert len(per_rank[0]) == -(-largest // batch_size)
        assert all(len(s) == largest for s in served)
        assert sorted(set(everything)) == list(range(n))  # every sample served


def test_last_batch_has_the_same_size_on_every_rank() -> None:
    # 10 samples on 3 ranks: shares of 4, 3, 3; ranks 1 and 2 repeat their first sample.
    per_rank = [[b.tolist() for b in loader] for loader in loaders(10, 3, 3)]
    assert per_rank == [[[0, 1, 2], [3]], [[4, 5, 6], [4]], [[7, 8, 9], [7]]]
    dropped = [[b.tolist() for b in loader] for loader in loaders(10, 3, 3, drop_last=True)]
    assert dropped == [[[0, 1, 2]], [[4, 5, 6]], [[7, 8, 9]]]


def test_ranks_with_nothing_serve_a_sample_of_the_dataset() -> None:
    per_rank = [[b.tolist() for b in loader] for loader in loaders(2, 5, 4)]
    assert per_rank == [[[0]], [[1]], [[0]], [[1]], [[0]]]
    assert [len(loader) for loader in loaders(2, 5, 4, drop_last=True)] == [0] * 5


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("dataset", [np.zeros((0, 3)), [], (np.zeros(0), np.zeros(0))])
def test_an_empty_dataset_gives_no_batch(dataset: Any, drop_last: bool) -> None:
    loader = DistributedDataLoader(dataset, 4, drop_last=drop_last, shuffle=True)
    assert len(loader) == 0 and list(loader) == []
    assert len(DistributedDataContainer(dataset)) == 0


@pytest.mark.matrix
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 10, 31])
@pytest.mark.parametrize("batch_size", [1, 3, 64])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_real_rank_yields_the_same_batches(
    world: tuple[int, int], n: int, batch_size: int, drop_last: bool
) -> None:
    rank, _ = world
    loader = DistributedDataLoader(np.arange(n), batch_size, drop_last=drop_last, shuffle=True)
    loader.set_epoch(4)
    batches = [b.tolist() for b in loader]
    everyone = allgather((len(loader), [len(b) for b in batches], batches))
    assert len({length for length, _, _ in everyone}) == 1
    assert len({tuple(sizes) for _, sizes, _ in everyone}) == 1
    assert everyone[rank][0] == len(everyone[rank][1])
    served = [v for _, _, bs in everyone for b in bs for v in b]
    if drop_last:
        assert len(set(served)) == len(served)
    else:
        assert sorted(set(served)) == list(range(n))


def test_loader_batches_keep_the_family_of_arrays() -> None:
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = np.arange(10, dtype=np.int8)
    assert all(isinstance(b, np.ndarray) and b.dtype == np.float32 for b in loader_of(x))
    for xb, yb in loader_of((x, y)):
        assert xb.dtype == np.float32 and yb.dtype == np.int8
    named = next(iter(loader_of(Pair(x, y))))
    assert type(named) is Pair and named.x.shape == (3, 2)
    record = next(iter(loader_of({"x": x, "y": y})))
    assert list(record) == ["x", "y"] and plain(record) == {"x": plain(x[:3]), "y": [0, 1, 2]}


def loader_of(dataset: Any, batch_size: int = 3, **kwargs: Any) -> DistributedDataLoader:
    """A loader on rank 0 of a world of one, whatever the real world is."""
    return as_rank(0, 1, DistributedDataLoader, dataset, batch_size, **kwargs)


def test_loader_batches_keep_the_family_of_torch_and_jax_arrays() -> None:
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    batch = next(iter(loader_of(torch.arange(10.0))))
    assert isinstance(batch, torch.Tensor) and batch.tolist() == [0.0, 1.0, 2.0]
    batch = next(iter(loader_of(jax.numpy.arange(10))))
    assert isinstance(batch, jax.Array) and batch.tolist() == [0, 1, 2]
    xb, yb = next(iter(loader_of((torch.ones(10, 2), np.arange(10)))))  # mixed families
    assert isinstance(xb, torch.Tensor) and isinstance(yb, np.ndarray)


def test_loader_collates_items_of_a_generic_dataset() -> None:
    ints = next(iter(loader_of(list(range(10)))))
    assert isinstance(ints, np.ndarray) and ints.tolist() == [0, 1, 2]
    rows = next(iter(loader_of([np.full(2, i, np.float32) for i in range(5)])))
    assert rows.dtype == np.float32 and rows.shape == (3, 2)
    pairs = next(iter(loader_of([(i, str(i)) for i in range(5)])))
    assert type(pairs) is tuple and pairs[0].tolist() == [0, 1, 2] and pairs[1] == ["0", "1", "2"]
    records = next(iter(loader_of([{"a": i, "b": [i, -i]} for i in range(5)])))
    assert plain(records) == {"a": [0, 1, 2], "b": [[0, 1, 2], [0, -1, -2]]}
    named = next(iter(loader_of([Pair(i, 2.0 * i) for i in range(5)])))
    assert type(named) is Pair and named.y.tolist() == [0.0, 2.0, 4.0]


def test_loader_collates_torch_and_jax_items_in_their_family() -> None:
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    dataset = torch.utils.data.TensorDataset(torch.arange(10), torch.ones(10, 2))
    xb, yb = next(iter(loader_of(dataset, 4)))
    assert isinstance(xb, torch.Tensor) and xb.tolist() == [0, 1, 2, 3] and yb.shape == (4, 2)
    batch = next(iter(loader_of([jax.numpy.ones(2) * i for i in range(4)])))
    assert isinstance(batch, jax.Array) and batch.shape == (3, 2)


def test_loader_gathers_an_array_batch_with_one_index_per_batch() -> None:
    class Counting(np.ndarray):
        calls = 0

        def __getitem__(self, index: Any) -> Any:
            type(self).calls += 1
            return super().__getitem__(index)

    x = np.arange(40).reshape(20, 2).view(Counting)
    loader = loader_of(x, batch_size=6)
    batches = list(loader)
    assert Counting.calls == len(batches) == 4
    assert np.asarray(batches[-1]).tolist() == [[36, 37], [38, 39]]


def test_loader_order_is_stable_until_set_epoch() -> None:
    shuffled = loader_of(np.arange(50), batch_size=8, shuffle=True, seed=11)
    first = [b.tolist() for b in shuffled]
    assert first == [b.tolist() for b in shuffled]
    assert sorted(v for b in first for v in b) == list(range(50))
    assert [v for b in first for v in b] != list(range(50))
    shuffled.set_epoch(1)
    assert shuffled.epoch == 1 and [b.tolist() for b in shuffled] != first
    in_order = loader_of(np.arange(50), batch_size=8)
    in_order.set_epoch(1)
    assert [v for b in in_order for v in b.tolist()] == list(range(50))
    assert (in_order.batch_size, in_order.drop_last, in_order.shuffle, in_order.seed) == (
        8,
        False,
        False,
        0,
    )
    assert repr(in_order) == (
        "DistributedDataLoader(7 batches of 8 from 50 samples, rank 0 of 1, shuffle=False, "
        "seed=0, epoch=1, drop_last=False)"
    )


def test_set_epoch_during_an_epoch_affects_the_next_one_only() -> None:
    loader = loader_of(np.arange(30), batch_size=10, shuffle=True)
    epoch0 = [b.tolist() for b in loader]
    batches = iter(loader)
    loader.set_epoch(1)
    assert [b.tolist() for b in batches] == epoch0


@pytest.mark.parametrize(
    ("batch_size", "error", "message"),
    [
        (0, ValueError, "batch_size=0 must be at least 1: it is the number of samples per batch"),
        (-3, ValueError, "batch_size=-3 must be at least 1"),
        (2.0, TypeError, "batch_size must be an int, got float 2.0."),
        (True, TypeError, "batch_size must be an int, got bool True."),
        (None, TypeError, "batch_size must be an int, got NoneType None."),
    ],
)
def test_loader_rejects_a_bad_batch_size(batch_size: Any, error: type[Exception], message: str):
    with pytest.raises(error) as info:
        DistributedDataLoader(np.arange(4), batch_size)
    assert message in str(info.value)


def test_loader_rejects_what_it_cannot_batch() -> None:
    with pytest.raises(TypeError, match="drop_last must be a bool, got int 1"):
        DistributedDataLoader([1], 1, drop_last=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="already one rank's share"):
        DistributedDataLoader(DistributedDataContainer(np.arange(4)), 2)
    with pytest.raises(ValueError, match=r"different first dimensions \(\[0\]: 4, \[1\]: 3\)"):
        DistributedDataLoader((np.zeros(4), np.zeros(3)), 2)
    with pytest.raises(TypeError) as info:
        list(loader_of([object()] * 4))
    assert str(info.value).startswith(
        "Cannot collate sample of type object: expected numbers, arrays (NumPy, PyTorch, JAX, "
        "CuPy), strings, or tuples/lists/dicts of them."
    )
    with pytest.raises(ValueError, match=r"Cannot stack sample\['x'\] of 3 samples into a batch"):
        list(loader_of([{"x": np.zeros(i + 1)} for i in range(3)]))
    with pytest.raises(ValueError, match="one sample has keys"):
        list(loader_of([{"x": 1}, {"y": 2}, {"x": 3}]))
    with pytest.raises(ValueError, match="sequences of different lengths"):
        list(loader_of([(1, 2), (3,), (4, 5)]))


def test_importing_and_using_the_module_loads_no_framework() -> None:
    script = (
        "import sys, numpy as np\n"
        "import dataparallel.data as d, dataparallel.data.loader as dl\n"
        "dl.rank_and_size = lambda: (0, 1)\n"
        "list(d.DistributedDataLoader(np.arange(10), 3, shuffle=True))\n"
        "list(d.DistributedDataLoader([(1, 2.0)] * 5, 2))\n"
        "list(d.DistributedDataContainer({'x': np.ones(3)}))\n"
        "print(sorted(m for m in ('torch', 'jax', 'jaxlib', 'cupy') if m in sys.modules))\n"
    )
    result = run_job(["-c", script], launcher="python")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
