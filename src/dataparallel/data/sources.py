"""Read a dataset of any form, one sample or one batch at a time, in the data's own family.

Array families (NumPy, PyTorch, JAX, CuPy) are detected without importing any framework
(`arrays.arrays.array_family`); a batch of an array is gathered with one fancy index on its
device, and items of other datasets are collated field by field. `dataparallel.data` builds
its container and loader on these sources.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Mapping

import numpy as np

from dataparallel.arrays.families import array_family
from dataparallel.types import Tree

__all__ = ["Index", "Source", "source"]

Index = np.ndarray[tuple[int, ...], np.dtype[np.int64]]

# Datasets, their arrays, samples and batches are all `Tree`s: an array of any family, a number,
# or a tuple/dict/namedtuple of them (or whatever a map-style dataset's items are); which one is
# decided at run time (`source`).


def _take(x: Tree, family: str, idx: Index) -> Tree:
    """Gather rows `idx` of array `x` with one fancy index, keeping its family and device."""
    if family == "torch":
        # torch warns on read-only NumPy memory (a share's indices are read-only): copy it.
        return x[sys.modules["torch"].tensor(np.asarray(idx), device=x.device)]
    if family == "cupy":
        return x[sys.modules["cupy"].asarray(idx)]
    return x[idx]  # NumPy and JAX index with a NumPy integer array directly.


def _stack(items: list[Tree], family: str | None) -> Tree:
    if family == "torch":
        return sys.modules["torch"].stack(items)
    if family == "jax":
        import jax.numpy as jnp

        return jnp.stack(items)
    if family == "cupy":
        return sys.modules["cupy"].stack(items)
    return np.stack([np.asarray(item) for item in items])


def _collate(items: list[Tree], path: str) -> Tree:
    """Stack a list of samples into a batch: arrays and numbers stacked, tuples/dicts per field."""
    first = items[0]
    family = array_family(first)
    if family is not None or isinstance(first, (bool, int, float, complex, np.generic)):
        try:
            return _stack(items, family)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ValueError(
                f"Cannot stack {path} of {len(items)} samples into a batch: {exc}. Fix: give "
                f"every sample's {path} the same shape and type, or batch the container "
                "yourself: torch.utils.data.DataLoader(dp.DistributedDataContainer(data), "
                "collate_fn=...)."
            ) from exc
    if isinstance(first, Mapping):
        keys = list(first)
        for item in items:
            if not isinstance(item, Mapping) or list(item) != keys:
                raise ValueError(
                    f"Cannot collate {path}: one sample has keys {keys}, another "
                    f"{list(item) if isinstance(item, Mapping) else type(item).__name__}. "
                    "Fix: return the same keys from every sample."
                )
        return {k: _collate([item[k] for item in items], f"{path}[{k!r}]") for k in keys}
    if isinstance(first, (tuple, list)):
        width = len(first)
        if any(not isinstance(item, (tuple, list)) or len(item) != width for item in items):
            raise ValueError(
                f"Cannot collate {path}: samples are sequences of different lengths. "
                "Fix: return the same number of fields from every sample."
            )
        fields = [_collate([item[i] for item in items], f"{path}[{i}]") for i in range(width)]
        if hasattr(first, "_fields"):  # a namedtuple keeps its type
            return type(first)(*fields)
        return type(first)(fields) if isinstance(first, list) else tuple(fields)
    if isinstance(first, (str, bytes)):
        return list(items)
    raise TypeError(
        f"Cannot collate {path} of type {type(first).__name__}: expected numbers, arrays "
        "(NumPy, PyTorch, JAX, CuPy), strings, or tuples/lists/dicts of them. Fix: return such "
        "values from the dataset, or batch the container yourself: "
        "torch.utils.data.DataLoader(dp.DistributedDataContainer(data), collate_fn=...)."
    )


# --- Sources: what the data is, how to read one item and one batch of it. ------------------------


class Source:
    n: int

    def item(self, i: int) -> Tree:
        raise NotImplementedError

    def batch(self, idx: Index) -> Tree:
        """Return samples `idx` as one batch in the data's own family."""
        raise NotImplementedError

    def slice(self, idx: Index) -> Tree:
        """Return samples `idx` for `container[a:b]`."""
        return self.batch(idx)


class _ArraySource(Source):
    def __init__(self, x: Tree, family: str, owner: str, where: str = "") -> None:
        if len(x.shape) == 0:
            raise ValueError(
                f"{owner} got a 0-d {family} array{where}, which has no first axis to split into "
                "samples. Fix: pass an array whose first axis indexes the samples."
            )
        self.x, self.family, self.n = x, family, int(x.shape[0])

    def item(self, i: int) -> Tree:
        return self.x[i]

    def batch(self, idx: Index) -> Tree:
        return _take(self.x, self.family, idx)


class _FieldsSource(Source):
    def __init__(self, data: Tree, owner: str) -> None:
        # What `build` makes of one value per field: a dict with these keys, a namedtuple, a tuple.
        self.keys: list[Hashable] | None = list(data) if isinstance(data, Mapping) else None
        self.named: type | None = type(data) if hasattr(data, "_fields") else None
        if self.keys is not None:
            values, names = [data[k] for k in self.keys], [repr(k) for k in self.keys]
        else:
            values, names = list(data), [f"[{i}]" for i in range(len(data))]
        self.fields = [
            _ArraySource(v, str(array_family(v)), owner, f" at {name}")
            for v, name in zip(values, names, strict=True)
        ]
        lengths = {name: f.n for name, f in zip(names, self.fields, strict=True)}
        if len(set(lengths.values())) > 1:
            kind = "dict" if self.keys is not None else "tuple"
            listed = ", ".join(f"{name}: {n}" for name, n in lengths.items())
            raise ValueError(
                f"{owner} got a {kind} of arrays with different first dimensions ({listed}), "
                "but each sample takes one row of every array. Fix: give every array the same "
                "number of rows."
            )
        self.n = self.fields[0].n

    def build(self, values: list[Tree]) -> Tree:
        if self.keys is not None:
            return dict(zip(self.keys, values, strict=True))
        return self.named(*values) if self.named is not None else tuple(values)

    def item(self, i: int) -> Tree:
        return self.build([f.item(i) for f in self.fields])

    def batch(self, idx: Index) -> Tree:
        return self.build([f.batch(idx) for f in self.fields])


class _SequenceSource(Source):
    def __init__(self, data: Tree) -> None:
        self.data, self.n = data, len(data)

    def item(self, i: int) -> Tree:
        return self.data[i]

    def batch(self, idx: Index) -> Tree:
        return _collate([self.data[int(i)] for i in idx], "sample")

    def slice(self, idx: Index) -> Tree:
        return [self.data[int(i)] for i in idx]


def source(data: Tree, owner: str) -> Source:
    """Classify `data` as an array, a tuple/dict of arrays, or an indexable dataset."""
    family = array_family(data)
    if family is not None:
        return _ArraySource(data, family, owner)
    is_fields = isinstance(data, tuple) and any(array_family(v) is not None for v in data)
    if isinstance(data, Mapping) or is_fields:
        values = list(data.values() if isinstance(data, Mapping) else data)
        keys = list(data) if isinstance(data, Mapping) else list(range(len(values)))
        for key, value in zip(keys, values, strict=True):
            if array_family(value) is None:
                where = f"[{key!r}]" if isinstance(data, Mapping) else f"[{key}]"
                raise TypeError(
                    f"{owner} got a {type(data).__name__} whose entry {where} is a "
                    f"{type(value).__name__}: a tuple or dict dataset must hold arrays (NumPy, "
                    "PyTorch, JAX, CuPy) with equal first dimension. Fix: convert it, e.g. "
                    "np.asarray(...)."
                )
        if not values:
            raise ValueError(f"{owner} got an empty dict: it has no arrays to take samples from.")
        return _FieldsSource(data, owner)
    if isinstance(data, (str, bytes)) or not (
        hasattr(type(data), "__len__") and hasattr(type(data), "__getitem__")
    ):
        fix = (
            "Fix: materialize an iterable with list(...), or shard an IterableDataset yourself "
            "with dp.rank() and dp.size()."
            if hasattr(data, "__iter__") and not isinstance(data, (str, bytes))
            else "Fix: pass one of those."
        )
        raise TypeError(
            f"{owner} expected a dataset: an array (NumPy, PyTorch, JAX, CuPy), a tuple or dict "
            "of arrays with equal first dimension, or an object with __len__ and __getitem__ "
            f"(a list, a torch Dataset); got {type(data).__name__}. {fix}"
        )
    return _SequenceSource(data)
