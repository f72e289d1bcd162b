"""Reductions: `allreduce`, `iallreduce`, `reduce`, `allreduce_gradients`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from dataparallel.arrays import tree
from dataparallel.arrays.actions import Reduction
from dataparallel.arrays.compression import wire_dtype
from dataparallel.arrays.fusion import Fusion
from dataparallel.arrays.nan import FLOATING, has_nan, nan_mask, set_nan
from dataparallel.arrays.replay import Replay
from dataparallel.backends.base import Backend, Handle, ReduceOp
from dataparallel.collectives import _replays
from dataparallel.collectives._call import (
    CallContext,
    Leaf,
    agree,
    check_root,
    context,
    inline_fits,
    leaves_of,
    prepared,
    run,
    stage,
)
from dataparallel.collectives._fast import NOT_FAST, fast_allreduce
from dataparallel.collectives.requests import Request
from dataparallel.groups import Group, backend_of
from dataparallel.protocol import reduction, reduction_error
from dataparallel.types import Op, Tree

__all__ = ["allreduce", "allreduce_gradients", "iallreduce", "reduce"]


def _start_reduction(
    x: Tree,
    op: str,
    scale: float | None,
    backend: Backend | None,
    name: str,
    async_op: bool,
    root: int | None = None,
    compression: Any = None,
) -> tuple[Handle, Callable[[], Any], CallContext]:
    ctx = context(backend)
    collective = ("i" if async_op else "") + ("allreduce" if root is None else "reduce")
    wire: str | None = None

    def prepare() -> tuple[tree.Flat, list[Leaf], Reduction, dict[str, Any]]:
        nonlocal wire
        wire = wire_dtype(compression)
        rank = None if root is None else check_root(root, ctx.backend)
        action = reduction(op, scale, ctx.backend.size, rank)
        flat = tree.flatten(x, name)
        leaves = leaves_of(flat)
        for leaf in leaves:
            error = reduction_error(leaf.dtype, op, scale)
            if error is not None:
                raise TypeError(f"{flat.path(leaf.index)}: {error}")
        stage(leaves)
        scale_arg = None if scale is None else float(scale)  # 2 and 2.0 are the same call
        args = {"op": op, "scale": scale_arg} | ({"root": rank} if rank is not None else {})
        if wire is not None:
            args["compression"] = wire
        return flat, leaves, action, args

    flat, leaves, action, args = prepared(ctx, collective, prepare)
    inline = wire is None and inline_fits(ctx, leaves)  # compressed values never go inline
    nans = None
    if not inline and action.op in (ReduceOp.MIN, ReduceOp.MAX) and ctx.backend.size > 1:
        nans = prepared(ctx, collective, lambda: _local_nans(leaves))

    def replay(flagged: bool) -> Replay:  # what a rank that has joined (dp.join) sends instead
        masks = None
        if flagged and nans is not None:
            floating = [leaf for leaf in leaves if leaf.dtype in FLOATING]
            masks = _replays.nan_masks(ctx, floating, async_op)
        return _replays.fused(ctx, action, leaves, async_op, inline, then=masks)

    rows, any_nan = agree(
        ctx,
        collective,
        flat,
        leaves,
        args,
        inline=inline,
        flag=None if nans is None else bool(nans),
        replay=replay,
    )
    if any_nan:  # some rank has a NaN: every rank also reduces where its NaNs are
        return (*_nan_preserving(ctx, collective, flat, leaves, action, async_op, wire), ctx)
    return (*run(ctx, collective, flat, leaves, action, async_op, rows, wire), ctx)


def _host_values(leaf: Leaf) -> np.ndarray:
    work = leaf.work
    return work if type(work) is np.ndarray else leaf.family.to_host(leaf.value)


def _local_nans(leaves: list[Leaf]) -> list[Leaf]:
    """Return the floating leaves that hold a NaN on this rank."""
    return [
        leaf
        for leaf in leaves
        if leaf.dtype in FLOATING and has_nan(_host_values(leaf), leaf.dtype)
    ]


def _nan_preserving(
    ctx: CallContext,
    collective: str,
    flat: tree.Flat,
    leaves: list[Leaf],
    action: Reduction,
    async_op: bool,
    wire: str | None,
) -> tuple[Handle, Callable[[], Any]]:
    """Run a min/max reduction, then write NaN wherever any rank had one (see `arrays.nan`)."""
    floating = [leaf for leaf in leaves if leaf.dtype in FLOATING]
    masks = [nan_mask(_host_values(leaf), leaf.dtype) for leaf in floating]
    fusion, finish = run(ctx, collective, flat, leaves, action, async_op, compression=wire)
    mask_fusion = _fuse_masks(ctx, masks, async_op)

    def finish_with_nan() -> Any:
        mask_fusion.wait()
        if action.root is None or action.root == ctx.backend.rank:
            for leaf, mask in zip(floating, masks, strict=True):
                if type(leaf.work) is np.ndarray:
                    set_nan(leaf.work, leaf.dtype, mask)
                else:  # a device leaf: its reduction has landed already
                    host = leaf.family.to_host(leaf.value)
                    set_nan(host, leaf.dtype, mask)
                    leaf.family.from_host(leaf.value, host)
        return finish()

    return _Both(fusion, mask_fusion), finish_with_nan


def _fuse_masks(ctx: CallContext, masks: list[np.ndarray], async_op: bool) -> Fusion:
    fusion = Fusion(
        ctx.backend,
        Reduction(ReduceOp.MAX),
        bucket_bytes=ctx.settings.bucket_bytes,
        async_op=async_op,
        pool=ctx.buffers,
    )
    for mask in masks:
        fusion.add(mask, "uint8")
    fusion.flush()
    return fusion


class _Both:
    """Two collectives in flight, waited for together."""

    def __init__(self, first: Handle, second: Handle) -> None:
        self.first, self.second = first, second

    def wait(self) -> None:
        self.first.wait()
        self.second.wait()

    def test(self) -> bool:
        return self.first.test() and self.second.test()


def allreduce(
    x: Tree,
    op: Op = "sum",
    *,
    scale: float | None = None,
    backend: Backend | None = None,
    group: Group | None = None,
    compression: Any = None,
) -> Tree:
    """Reduce `x` element-wise across all ranks; every rank gets the result.

    Args:
        x: an array (NumPy, PyTorch, JAX, CuPy), a number, or a pytree of them.
        op: `"sum"` (default), `"prod"`, `"min"`, `"max"` or `"avg"` (sum divided by `size()`).
        scale: multiply the result by this afterwards (Flashlight's `allReduce(x, scale)`).
        backend: the engine to use (default: the active one).
        group: run among the ranks of this `dp.new_group` group (default: the world).
        compression: `dp.Compression.fp16` or `.bf16`: floating leaves travel (and are reduced)
            as 16-bit floats and come back in their own dtype; default: none.

    Returns:
        `x`'s structure with reduced leaves: mutable arrays written in place, others new.

    Raises:
        TypeError: a leaf is not numeric, or `"avg"`/a non-integral `scale` meets an integer leaf.
        CollectiveMismatchError: ranks passed different structures, shapes, dtypes or ops.

    >>> import numpy as np, dataparallel as dp
    >>> _ = dp.initialize("single")
    >>> dp.allreduce({"w": np.ones(2), "n": 3.0}, op="avg")
    {'w': array([1., 1.]), 'n': 3.0}
    """
    if backend is None and group is None and compression is None:
        result = fast_allreduce(x, op, scale)
        if result is not NOT_FAST:
            return result
    fusion, finish, _ = _start_reduction(
        x, op, scale, backend_of(backend, group), "x", async_op=False, compression=compression
    )
    fusion.wait()
    return finish()


def iallreduce(
    x: Tree,
    op: Op = "sum",
    *,
    scale: float | None = None,
    backend: Backend | None = None,
    group: Group | None = None,
    compression: Any = None,
) -> Request:
    """Start `allreduce` without blocking; `Request.wait()` returns its result.

    Leaves are still packed into buckets and the buckets sent at once, so the communication
    overlaps with whatever the caller does until `wait()`. `compression` as for `allreduce`.
    """
    fusion, finish, ctx = _start_reduction(
        x, op, scale, backend_of(backend, group), "x", async_op=True, compression=compression
    )
    return Request(fusion, finish, ctx.pending)


def reduce(
    x: Tree,
    op: Op = "sum",
    *,
    root: int = 0,
    scale: float | None = None,
    backend: Backend | None = None,
    group: Group | None = None,
) -> Tree:
    """Reduce `x` across all ranks into `root`; the other ranks get their own values back."""
    fusion, finish, _ = _start_reduction(
        x, op, scale, backend_of(backend, group), "x", async_op=False, root=root
    )
    fusion.wait()
    return finish()


def allreduce_gradients(
    grads: Tree,
    op: Op = "avg",
    *,
    backend: Backend | None = None,
    group: Group | None = None,
    compression: Any = None,
) -> Tree:
    """Allreduce a gradient tree with fusion, averaging by default.

    Averaging follows Lux, Flashlight and Horovod; `op="sum"` reproduces FluxMPI, whose users scale
    the loss by `1 / size()` themselves. `compression` as for `allreduce`.
    """
    fusion, finish, _ = _start_reduction(
        grads,
        op,
        None,
        backend_of(backend, group),
        "grads",
        async_op=False,
        compression=compression,
    )
    fusion.wait()
    return finish()
