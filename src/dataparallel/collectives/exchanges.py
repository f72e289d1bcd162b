"""All-to-all: `alltoall`, rows of every rank's arrays sent to the ranks they are meant for."""

from __future__ import annotations

import numbers

import numpy as np

from dataparallel.arrays import tree
from dataparallel.arrays.actions import Exchange
from dataparallel.backends.base import Backend
from dataparallel.collectives import traced
from dataparallel.collectives._agree import Call, agree
from dataparallel.collectives._call import Leaf, context, leaves_of, prepared
from dataparallel.collectives._split import check_rows, run_split
from dataparallel.groups import Group, backend_of
from dataparallel.types import Tree

__all__ = ["alltoall"]


def alltoall(
    x: Tree,
    splits: object = None,
    *,
    backend: Backend | None = None,
    group: Group | None = None,
) -> tuple[Tree, list[int]]:
    """Send `splits[i]` rows of `x` to rank i; return the rows received and how many came from whom.

    Horovod's `alltoall`: rank r's result is the concatenation, in rank order, of the rows every
    rank sent to r; `received_splits[i]` is how many came from rank i. The first axis may differ
    between ranks; the other axes and the dtype must match.

    A tree is routed as records: its leaves are columns of the same rows, so every leaf must have
    the same first axis, one `splits` applies to all of them, and they travel in one call (leaves
    that need different splits take one call each).

    Args:
        x: an array (NumPy, PyTorch, JAX, CuPy) with at least one axis, or a pytree of them.
        splits: the rows to send to each rank, in rank order: `size()` non-negative integers
            summing to the first axis (a list, tuple, or 1-D integer array or tensor). Default:
            equal parts (the first axis must then divide by `size()`).
        backend: the engine to use (default: the active one).
        group: run among the ranks of this `dp.new_group` group (default: the world).

    Returns:
        `(result, received_splits)`: `x`'s structure with new arrays of each leaf's family, dtype
        and device, of shape `(sum(received_splits), *leaf.shape[1:])`, and a list of `size()`
        ints.

    Raises:
        ValueError: a leaf without a first axis, leaves whose first axes differ, or `splits` of
            the wrong length, negative, or not summing to the first axis (or, by default, a first
            axis that does not divide by `size()`).
        TypeError: `splits` holds something other than integers.
        CollectiveMismatchError: ranks passed different structures, dtypes, or shapes past the
            first axis.

    >>> import numpy as np, dataparallel as dp
    >>> _ = dp.initialize("single")
    >>> dp.alltoall(np.arange(3), splits=[3])
    (array([0, 1, 2]), [3])
    """
    if traced.is_traced(x):  # inside jax.jit: traced into the program (equal splits)
        return traced.call("alltoall", x, backend_of(backend, group), splits=splits)
    ctx = context(backend_of(backend, group))
    b = ctx.backend

    def prepare() -> tuple[tree.Flat, list[Leaf], list[int]]:
        flat = tree.flatten(x, "x")
        leaves = leaves_of(flat)
        check_rows("alltoall", flat, leaves)
        return flat, leaves, _parse_splits(splits, _common_rows(flat, leaves), b.size)

    flat, leaves, sends = prepared(ctx, "alltoall", prepare)
    agree(Call(ctx, "alltoall", flat, leaves, {}, first_axis=False))
    received = np.empty(b.size, np.int64)
    b.alltoallv(np.array(sends, np.int64), [1] * b.size, received, [1] * b.size)
    got = [int(n) for n in received]
    action = Exchange(tuple(sends), tuple(got))
    return run_split(ctx, "alltoall", flat, leaves, action), got


def _common_rows(flat: tree.Flat, leaves: list[Leaf]) -> int:
    """Return the first axis every leaf shares (0 for a tree without leaves)."""
    if not leaves:
        return 0
    rows = leaves[0].shape[0]
    for leaf in leaves[1:]:
        if leaf.shape[0] != rows:
            raise ValueError(
                f"alltoall routes the leaves of a tree as columns of the same rows, so they "
                f"need the same first axis: {flat.path(leaves[0].index)} has {rows} rows, "
                f"{flat.path(leaf.index)} has {leaf.shape[0]}. Call alltoall once per group of "
                "leaves that share their rows."
            )
    return rows


def _parse_splits(splits: object, rows: int, size: int) -> list[int]:
    """Return `splits` as `size` ints summing to `rows`, or raise saying what is wrong."""
    if splits is None:
        if rows % size:
            raise ValueError(
                f"alltoall: the first axis ({rows} rows) does not divide into {size} equal "
                "parts; pass splits=[...], the rows to send to each rank."
            )
        return [rows // size] * size
    values = splits.tolist() if hasattr(splits, "tolist") else splits
    if not isinstance(values, (list, tuple)):
        raise TypeError(
            f"alltoall: splits must be a sequence of {size} integers (one per rank), "
            f"got {type(splits).__name__}."
        )
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
    if bad:
        raise TypeError(
            f"alltoall: splits must hold integers (rows to send to each rank), got {bad[0]!r} "
            f"({type(bad[0]).__name__}) in {values!r}."
        )
    sends = [int(v) for v in values]
    if len(sends) != size:
        raise ValueError(
            f"alltoall: splits={sends} has {len(sends)} entries, but the world has {size} ranks: "
            "give one count per rank."
        )
    if any(n < 0 for n in sends):
        raise ValueError(f"alltoall: splits={sends} has a negative count; counts are rows, >= 0.")
    if sum(sends) != rows:
        raise ValueError(
            f"alltoall: splits={sends} sums to {sum(sends)}, but the first axis has {rows} rows: "
            "every row goes to exactly one rank."
        )
    return sends
