"""Reduce-scatter: `reducescatter`, a reduction each rank keeps a part of (its first axis)."""

from __future__ import annotations

import numpy as np

from dataparallel.arrays import tree
from dataparallel.arrays.actions import Scatter, reduction, reduction_error
from dataparallel.arrays.nan import FLOATING, has_nan, nan_mask
from dataparallel.arrays.replay import Replay
from dataparallel.backends.base import Backend, ReduceOp
from dataparallel.collectives import _replays, traced
from dataparallel.collectives._agree import Call, agree
from dataparallel.collectives._call import Leaf, context, leaves_of, prepared
from dataparallel.collectives._split import check_rows, host_work, run_split, scatter_masks
from dataparallel.groups import Group, backend_of
from dataparallel.types import Op, Tree

__all__ = ["reducescatter"]


def reducescatter(
    x: Tree,
    op: Op = "sum",
    *,
    scale: float | None = None,
    backend: Backend | None = None,
    group: Group | None = None,
) -> Tree:
    """Reduce `x` element-wise across all ranks; each rank keeps its part of the first axis.

    Every leaf of `n` rows is split as Horovod splits it: rank r keeps `n // size()` rows, one
    more when `r < n % size()`, in rank order (rank 0 gets the first rows). Leaves are packed into
    buckets per dtype, laid out rank by rank, so that one `Reduce_scatter` per bucket does all of
    them (docs/design.md).

    Args:
        x: an array (NumPy, PyTorch, JAX, CuPy) with at least one axis, or a pytree of them.
        op: `"sum"` (default), `"prod"`, `"min"`, `"max"` or `"avg"` (sum divided by `size()`).
        scale: multiply the result by this afterwards.
        backend: the engine to use (default: the active one).
        group: run among the ranks of this `dp.new_group` group (default: the world).

    Under `"min"` and `"max"`, NaN wins wherever any rank has one, as in `allreduce`.

    Returns:
        `x`'s structure with new arrays of each leaf's family, dtype and device, of shape
        `(rows of this rank, *leaf.shape[1:])`.

    Raises:
        ValueError: a leaf is a number or a 0-d array (it has no first axis to split).
        TypeError: a leaf is not numeric, or `"avg"`/a non-integral `scale` meets an integer leaf.
        CollectiveMismatchError: ranks passed different structures, shapes, dtypes, ops or scales.

    >>> import numpy as np, dataparallel as dp
    >>> _ = dp.initialize("single")
    >>> dp.reducescatter({"w": np.arange(3.0)}, op="avg")
    {'w': array([0., 1., 2.])}
    """
    if traced.is_traced(x):  # inside jax.jit: traced into the program
        return traced.call("reducescatter", x, backend_of(backend, group), op=op, scale=scale)
    ctx = context(backend_of(backend, group))

    def prepare() -> tuple[tree.Flat, list[Leaf], Scatter]:
        action = reduction(op, scale, ctx.backend.size)
        flat = tree.flatten(x, "x")
        leaves = leaves_of(flat)
        for leaf in leaves:
            error = reduction_error(leaf.dtype, op, scale)
            if error is not None:  # the path is spelled out only for the message: not cheap
                raise TypeError(f"{flat.path(leaf.index)}: {error}")
        check_rows("reducescatter", flat, leaves)
        return flat, leaves, Scatter(action.op, action.scale)

    flat, leaves, scatter = prepared(ctx, "reducescatter", prepare)
    scale_arg = None if scale is None else float(scale)  # 2 and 2.0 are the same call
    # min and max: every rank says whether it has a NaN; if one has, the masks of where go first.
    floating: list[Leaf] = []
    if scatter.op in (ReduceOp.MIN, ReduceOp.MAX) and ctx.backend.size > 1:
        floating = [leaf for leaf in leaves if leaf.dtype in FLOATING]
    masks = prepared(ctx, "reducescatter", lambda: _local_masks(floating)) if floating else None

    def replay(flagged: bool) -> Replay:  # for ranks that have joined, made only then
        split = _replays.split(ctx, scatter, leaves)
        return _replays.nan_scatter(ctx, floating, then=split) if flagged else split

    _, flagged = agree(
        Call(ctx, "reducescatter", flat, leaves, {"op": op, "scale": scale_arg}),
        flag=None if masks is None else masks[0],
        replay=replay,
    )
    nans: dict[int, np.ndarray] = {}
    if flagged and masks is not None:  # every rank reduce-scatters where its NaNs are, first
        pairs = zip(masks[1], floating, strict=True)
        shaped = [nan_mask(work, leaf.dtype).reshape(leaf.shape) for work, leaf in pairs]
        nans = scatter_masks(ctx, floating, shaped)
    return run_split(ctx, "reducescatter", flat, leaves, scatter, nans)


def _local_masks(floating: list[Leaf]) -> tuple[bool, list[np.ndarray]]:
    """Whether this rank holds a NaN in a floating leaf, and those leaves' host values."""
    works = [host_work(leaf) for leaf in floating]
    pairs = zip(works, floating, strict=True)
    return any(has_nan(work, leaf.dtype) for work, leaf in pairs), works
