"""Reductions: `allreduce`, `iallreduce`, `reduce`, `allreduce_gradients`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dataparallel.backends.base import Backend
from dataparallel.checks import reduction, reduction_error
from dataparallel.collectives._call import CallContext, check_root, context, leaves_of, run, verify
from dataparallel.collectives.requests import Request
from dataparallel.engine import tree
from dataparallel.engine.fusion import Fusion
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
) -> tuple[Fusion, Callable[[list[Any]], Any], CallContext]:
    ctx = context(backend)
    action = reduction(op, scale, ctx.backend.size, root)
    flat = tree.flatten(x, name)
    leaves = leaves_of(flat)
    for leaf in leaves:
        error = reduction_error(leaf.dtype, op, scale)
        if error is not None:
            raise TypeError(f"{flat.path(leaf.index)}: {error}")
    collective = ("i" if async_op else "") + ("allreduce" if root is None else "reduce")
    if root is not None:
        check_root(root, ctx.backend)
    if ctx.settings.check and ctx.backend.size > 1:
        scale_arg = None if scale is None else float(scale)  # 2 and 2.0 are the same call
        args = {"op": op, "scale": scale_arg} | ({"root": root} if root is not None else {})
        verify(ctx, collective, flat, leaves, args)
    return (*run(ctx, collective, flat, leaves, action, async_op), ctx)


def allreduce(
    x: Tree, op: Op = "sum", *, scale: float | None = None, backend: Backend | None = None
) -> Tree:
    """Reduce `x` element-wise across all ranks; every rank gets the result.

    Args:
        x: an array (NumPy, PyTorch, JAX, CuPy), a number, or a pytree of them.
        op: `"sum"` (default), `"prod"`, `"min"`, `"max"` or `"avg"` (sum divided by `size()`).
        scale: multiply the result by this afterwards (Flashlight's `allReduce(x, scale)`).
        backend: the engine to use (default: the active one).

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
    fusion, finish, _ = _start_reduction(x, op, scale, backend, "x", async_op=False)
    return finish(fusion.wait())


def iallreduce(
    x: Tree, op: Op = "sum", *, scale: float | None = None, backend: Backend | None = None
) -> Request:
    """Start `allreduce` without blocking; `Request.wait()` returns its result.

    Leaves are still packed into buckets and the buckets sent at once, so the communication
    overlaps with whatever the caller does until `wait()`.
    """
    fusion, finish, ctx = _start_reduction(x, op, scale, backend, "x", async_op=True)
    return Request(fusion, finish, ctx.pending)


def reduce(
    x: Tree,
    op: Op = "sum",
    *,
    root: int = 0,
    scale: float | None = None,
    backend: Backend | None = None,
) -> Tree:
    """Reduce `x` across all ranks into `root`; the other ranks get their own values back."""
    fusion, finish, _ = _start_reduction(x, op, scale, backend, "x", async_op=False, root=root)
    return finish(fusion.wait())


def allreduce_gradients(grads: Tree, op: Op = "avg", *, backend: Backend | None = None) -> Tree:
    """Allreduce a gradient tree with fusion, averaging by default.

    Averaging follows Lux, Flashlight and Horovod; `op="sum"` reproduces FluxMPI, whose users scale
    the loss by `1 / size()` themselves.
    """
    fusion, finish, _ = _start_reduction(grads, op, None, backend, "grads", async_op=False)
    return finish(fusion.wait())
