"""The public collectives over arrays, numbers and pytrees of them.

Every call has the same skeleton (`calls.py`): flatten the tree and identify each leaf's family and
dtype, check that every rank makes the same call, run the leaves through the fusion engine
(`fusion.Fusion`), and rebuild the tree. Mutable arrays are written in place and
returned; immutable values (JAX arrays, numbers) come back new: always use the return value.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from dataparallel import tree, world
from dataparallel.arrays import storage_dtype
from dataparallel.backends.base import Backend
from dataparallel.calls import (
    CallContext,
    Leaf,
    Request,
    check_root,
    context,
    fuse,
    leaf_of,
    leaves_of,
    log,
    results,
    run,
    verify,
)
from dataparallel.checks import check_scale, parse_op, reduction_error, verify_same_call
from dataparallel.fusion import Broadcast, Fusion, Reduction

__all__ = [
    "Request",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_gradients",
    "barrier",
    "broadcast",
    "broadcast_object",
    "iallreduce",
    "ibroadcast",
    "reduce",
    "synchronize",
    "wait_all",
]


def _start_reduction(
    x: Any,
    op: str,
    scale: float | None,
    backend: Backend | None,
    name: str,
    async_op: bool,
    root: int | None = None,
) -> tuple[Fusion, Callable[[], Any], CallContext]:
    ctx = context(backend)
    engine_op, average = parse_op(op)
    check_scale(scale)
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
    total = 1.0 if scale is None else scale
    if average:
        total /= ctx.backend.size
    action = Reduction(engine_op, None if total == 1 else total, root)
    return (*run(ctx, collective, flat, leaves, action, async_op), ctx)


def allreduce(
    x: Any, op: str = "sum", *, scale: float | None = None, backend: Backend | None = None
) -> Any:
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
    fusion.finalize()
    return finish()


def iallreduce(
    x: Any, op: str = "sum", *, scale: float | None = None, backend: Backend | None = None
) -> Request:
    """Start `allreduce` without blocking; `Request.wait()` returns its result.

    Leaves are still packed into buckets and the buckets sent at once, so the communication
    overlaps with whatever the caller does until `wait()`.
    """
    fusion, finish, ctx = _start_reduction(x, op, scale, backend, "x", async_op=True)
    return Request(fusion, finish, ctx.pending)


def reduce(
    x: Any,
    op: str = "sum",
    *,
    root: int = 0,
    scale: float | None = None,
    backend: Backend | None = None,
) -> Any:
    """Reduce `x` across all ranks into `root`; the other ranks get their own values back."""
    fusion, finish, _ = _start_reduction(x, op, scale, backend, "x", async_op=False, root=root)
    fusion.finalize()
    return finish()


def allreduce_gradients(grads: Any, op: str = "avg", *, backend: Backend | None = None) -> Any:
    """Allreduce a gradient tree with fusion, averaging by default.

    Averaging follows Lux, Flashlight and Horovod; `op="sum"` reproduces FluxMPI, whose users scale
    the loss by `1 / size()` themselves.
    """
    fusion, finish, _ = _start_reduction(grads, op, None, backend, "grads", async_op=False)
    fusion.finalize()
    return finish()


def _start_broadcast(
    x: Any, root: int, backend: Backend | None, async_op: bool
) -> tuple[Fusion, Callable[[], Any], CallContext]:
    ctx = context(backend)
    check_root(root, ctx.backend)
    flat = tree.flatten(x, "x")
    leaves = leaves_of(flat)
    collective = "ibroadcast" if async_op else "broadcast"
    verify(ctx, collective, flat, leaves, {"root": root})
    return (*run(ctx, collective, flat, leaves, Broadcast(root), async_op), ctx)


def broadcast(x: Any, *, root: int = 0, backend: Backend | None = None) -> Any:
    """Give every rank `root`'s values of `x` (an array, a number, or a pytree of them)."""
    fusion, finish, _ = _start_broadcast(x, root, backend, async_op=False)
    fusion.finalize()
    return finish()


def ibroadcast(x: Any, *, root: int = 0, backend: Backend | None = None) -> Request:
    """Start `broadcast` without blocking; `Request.wait()` returns its result."""
    fusion, finish, ctx = _start_broadcast(x, root, backend, async_op=True)
    return Request(fusion, finish, ctx.pending)


def wait_all(requests: list[Request] | None = None) -> list[Any]:
    """Wait for `requests`, or for every request this process has in flight; return the results.

    Flashlight's `syncDistributed`: afterwards every non-blocking collective has completed.
    """
    if requests is None:
        requests = list(world.current().pending)
    return [request.wait() for request in requests]


def allgather(x: Any, *, backend: Backend | None = None) -> Any:
    """Concatenate every rank's arrays along the first axis, in rank order.

    The first axis may differ between ranks; the other axes and the dtype must match. Numbers and
    0-d arrays count as one row each, so they gather into a 1-D array of `size()` items.
    Results are new arrays of each leaf's family (NumPy arrays for numbers).
    """
    ctx = context(backend)
    b = ctx.backend
    flat = tree.flatten(x, "x")
    leaves = leaves_of(flat)
    rows = [leaf.shape[0] if leaf.shape else 1 for leaf in leaves]
    verify(ctx, "allgather", flat, leaves, {}, first_axis=False)
    log(ctx, f"allgather leaves={len(leaves)}")
    gathered_rows = np.empty(b.size * len(leaves), np.int64)
    if leaves:
        b.allgatherv(np.array(rows, np.int64), gathered_rows, [len(leaves)] * b.size)
    every_rows = gathered_rows.reshape(b.size, len(leaves))
    out = []
    for i, leaf in enumerate(leaves):
        rest = leaf.shape[1:]
        host = np.ascontiguousarray(leaf.family.work(leaf.value)[0]).reshape(-1)
        row_bytes = storage_dtype(leaf.dtype).itemsize * int(np.prod(rest, dtype=np.int64))
        counts = [int(every_rows[r, i]) * row_bytes for r in range(b.size)]
        received = np.empty(sum(counts), np.uint8)
        b.allgatherv(host.view(np.uint8), received, counts)
        gathered = received.view(storage_dtype(leaf.dtype)).reshape(-1, *rest)
        out.append(leaf.family.new(leaf.value, gathered))
    return tree.unflatten(flat.spec, out)


def broadcast_object(obj: Any, *, root: int = 0, backend: Backend | None = None) -> Any:
    """Return `root`'s `obj` (anything picklable) on every rank."""
    ctx = context(backend)
    check_root(root, ctx.backend)
    if ctx.settings.check:
        verify_same_call(ctx.backend, {"collective": "broadcast_object", "root": root})
    return ctx.backend.broadcast_object(obj, root)


def allgather_object(obj: Any, *, backend: Backend | None = None) -> list[Any]:
    """Return the list of every rank's `obj` (anything picklable), in rank order."""
    ctx = context(backend)
    if ctx.settings.check:
        verify_same_call(ctx.backend, {"collective": "allgather_object"})
    return ctx.backend.allgather_object(obj)


def barrier(*, backend: Backend | None = None) -> None:
    """Block until every rank has reached the barrier."""
    ctx = context(backend)
    if ctx.settings.check:
        verify_same_call(ctx.backend, {"collective": "barrier"})
    ctx.backend.barrier()


_OBJECTS = ("keep", "broadcast")


def _torch_kind(x: Any) -> str | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if isinstance(x, torch.nn.Module):
        return "module"
    if isinstance(x, torch.optim.Optimizer):
        return "optimizer"
    return None


def synchronize(
    x: Any, *, root: int = 0, objects: str = "keep", backend: Backend | None = None
) -> Any:
    """Make every rank hold `root`'s state: parameters, model state, optimizer state.

    Array and number leaves (bool and NumPy scalars included) are broadcast in fused buckets;
    `None` stays `None`; other leaves (strings, objects) are kept as each rank has them, or
    broadcast by pickling with `objects="broadcast"`. A `torch.nn.Module` gets its parameters and
    buffers broadcast in place; a `torch.optim.Optimizer` its state and hyper-parameters, including
    state it has not created yet on the other ranks.

    Args:
        x: a pytree, a `torch.nn.Module` or a `torch.optim.Optimizer` (or a tree holding them).
        root: the rank whose state wins (default 0).
        objects: `"keep"` (default) or `"broadcast"`, for leaves that are not numbers or arrays.
        backend: the engine to use (default: the active one).

    Returns:
        `x` with root's values (use the return value: JAX arrays and numbers come back new).
    """
    if objects not in _OBJECTS:
        raise ValueError(f"objects={objects!r} is not one of {_OBJECTS}.")
    ctx = context(backend)
    check_root(root, ctx.backend)
    flat = tree.flatten(x, "x")
    values: list[Any] = list(flat.leaves)
    arrays: list[Leaf] = []
    others: list[int] = []
    framework: list[int] = []
    for i, value in enumerate(flat.leaves):
        if _torch_kind(value) is not None:
            framework.append(i)
            continue
        try:
            arrays.append(leaf_of(flat, i))
        except TypeError:
            others.append(i)
    verify(
        ctx,
        "synchronize",
        flat,
        arrays,
        {"root": root, "objects": objects, "object leaves": others},
    )
    log(ctx, f"synchronize root={root} arrays={len(arrays)} objects={len(others)}")
    fusion = fuse(ctx, arrays, Broadcast(root), async_op=False)
    fusion.finalize()
    synced = iter(results(arrays, ctx.backend.rank != root))
    others_set = set(others)
    for i in range(len(values)):
        if i not in others_set and i not in framework:
            values[i] = next(synced)
    if objects == "broadcast" and others:
        received = ctx.backend.broadcast_object([values[i] for i in others], root)
        for i, value in zip(others, received, strict=True):
            values[i] = value
    if framework:
        dp_torch = importlib.import_module("dataparallel.torch")
        for i in framework:
            values[i] = dp_torch.synchronize_torch(values[i], root=root, backend=ctx.backend)
    return tree.unflatten(flat.spec, values)
