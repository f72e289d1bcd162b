"""Reductions: `allreduce`, `iallreduce`, `reduce`, `allreduce_gradients`."""

from __future__ import annotations

from dataparallel.arrays.compression import Compressor
from dataparallel.backends.base import Backend
from dataparallel.collectives import _plans, traced
from dataparallel.collectives._call import context
from dataparallel.collectives.requests import Request
from dataparallel.groups import Group, backend_of
from dataparallel.types import Op, TreeT
from dataparallel.world import current

__all__ = ["allreduce", "allreduce_gradients", "iallreduce", "reduce"]


def allreduce(
    x: TreeT,
    op: Op = "sum",
    *,
    scale: float | None = None,
    backend: Backend | None = None,
    group: Group | None = None,
    compression: Compressor | type[Compressor] | None = None,
) -> TreeT:
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
    if traced.is_traced(x):  # inside jax.jit: traced into the program
        engine = backend_of(backend, group)
        return traced.call("allreduce", x, engine, op=op, scale=scale, compression=compression)
    # The world itself when no backend or group is named: the commonest call, by the shortest way.
    ctx = current() if backend is None and group is None else context(backend_of(backend, group))
    handle, finish = _plans.start(ctx, "allreduce", x, "x", op, scale, compression=compression)
    handle.wait()
    return finish()


def iallreduce(
    x: TreeT,
    op: Op = "sum",
    *,
    scale: float | None = None,
    backend: Backend | None = None,
    group: Group | None = None,
    compression: Compressor | type[Compressor] | None = None,
) -> Request[TreeT]:
    """Start `allreduce` without blocking; `Request.wait()` returns its result.

    Leaves are still packed into buckets and the buckets sent at once, so the communication
    overlaps with whatever the caller does until `wait()`. `compression` as for `allreduce`.
    """
    ctx = context(backend_of(backend, group))
    handle, finish = _plans.start(
        ctx, "iallreduce", x, "x", op, scale, compression=compression, async_op=True
    )
    return Request(handle, finish, ctx.pending)


def reduce(
    x: TreeT,
    op: Op = "sum",
    *,
    root: int = 0,
    scale: float | None = None,
    backend: Backend | None = None,
    group: Group | None = None,
) -> TreeT:
    """Reduce `x` across all ranks into `root`; the other ranks get their own values back."""
    if traced.is_traced(x):  # inside jax.jit: traced into the program
        engine = backend_of(backend, group)
        return traced.call("reduce", x, engine, op=op, root=root, scale=scale)
    ctx = context(backend_of(backend, group))
    handle, finish = _plans.start(ctx, "reduce", x, "x", op, scale, root=root)
    handle.wait()
    return finish()


def allreduce_gradients(
    grads: TreeT,
    op: Op = "avg",
    *,
    backend: Backend | None = None,
    group: Group | None = None,
    compression: Compressor | type[Compressor] | None = None,
) -> TreeT:
    """Allreduce a gradient tree with fusion, averaging by default.

    Averaging follows Lux, Flashlight and Horovod; `op="sum"` reproduces FluxMPI, whose users scale
    the loss by `1 / size()` themselves. `compression` as for `allreduce`.
    """
    ctx = context(backend_of(backend, group))
    handle, finish = _plans.start(
        ctx, "allreduce", grads, "grads", op, None, compression=compression
    )
    handle.wait()
    return finish()
