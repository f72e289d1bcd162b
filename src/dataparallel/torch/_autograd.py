"""Differentiable collectives: `dp.torch.allreduce`, `allgather`, `broadcast`, `alltoall`, ....

Each is a `torch.autograd.Function` over the library's own collective (`dp.allreduce`, ...), so the
forward pass is the same call on the same engine, and the backward pass is another collective.
They take one tensor and return a new one (the input is never written), which carries the graph.
The gradients are the ones Horovod defines (`horovod/torch/mpi_ops.py`), so code ported from
`hvd.allreduce` and friends trains the same:

| forward | backward (`g`: the gradient of the output on this rank) |
| --- | --- |
| `allreduce(x, op, scale=s)`, `sum`/`avg` | `allreduce(g, op, scale=s)`: the linear map's adjoint |
| `allgather(x)` | `allreduce(g, "avg")`, then this rank's rows |
| `broadcast(x, root)` | `allreduce(g, "avg")` on the root, zeros elsewhere |
| `alltoall(x, splits)` | `alltoall(g, received_splits)`: the rows go back where they came from |
| `reducescatter(x, op, scale=s)` | `allgather(g * s * (size if op == "sum" else 1))` |

For `sum` and `avg` allreduces these are the exact gradients of the sum of every rank's loss. For
the others, Horovod's conventions hold: the gradients of `allgather` and `broadcast` are averaged
over ranks, and those of `reducescatter` are scaled by the group's size for `sum`. `min`, `max`
and `prod` allreduces have no gradient here: their backward raises.

Every rank must run the backward of the same collectives in the same order (autograd runs one
per forward call whose output the loss depends on), as every rank runs the forward ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias

import numpy as np
import torch

from dataparallel import world
from dataparallel.collectives import broadcasts, exchanges, gathers, reductions, scatters
from dataparallel.groups import Group
from dataparallel.types import Op

if TYPE_CHECKING:
    from dataparallel.torch._buckets import Compressing


class Ctx(Protocol):
    """The `ctx` autograd passes these Functions: what their forward keeps on it for backward."""

    op: Op
    scale: float | None
    group: Group | None
    compression: Compressing
    shape: torch.Size
    root: int
    received: list[int]

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None: ...


__all__ = ["Splits", "allgather", "allreduce", "alltoall", "broadcast", "reducescatter"]

# How many rows an alltoall sends each rank: `size()` non-negative ints, or None (equal parts).
Splits: TypeAlias = "Sequence[int] | np.ndarray | torch.Tensor | None"

# What a Function's backward returns: one gradient per input of forward (None: no gradient).
Grads: TypeAlias = "tuple[torch.Tensor | None, ...]"


def _tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"dp.torch.{name} takes a torch.Tensor, got {type(x).__module__}."
            f"{type(x).__qualname__}; use dp.{name} for other arrays and trees."
        )
    return x


def _allreduce(
    x: torch.Tensor, op: Op, scale: float | None, group: Group | None, compression: Compressing
) -> torch.Tensor:
    out = x.detach().clone(memory_format=torch.contiguous_format)
    result: torch.Tensor = reductions.allreduce(
        out, op, scale=scale, group=group, compression=compression
    )
    return result


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Ctx,
        x: torch.Tensor,
        op: Op,
        scale: float | None,
        group: Group | None,
        compression: Compressing,
    ) -> torch.Tensor:
        ctx.op, ctx.scale, ctx.group, ctx.compression = op, scale, group, compression
        return _allreduce(x, op, scale, group, compression)

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> Grads:
        op, scale, group, compression = ctx.op, ctx.scale, ctx.group, ctx.compression
        if op not in ("sum", "avg"):
            raise RuntimeError(
                f"dp.torch.allreduce(op={op!r}) has no gradient; only 'sum' and 'avg' "
                "allreduces are differentiable (detach the input, or reduce with 'sum'/'avg')."
            )
        return _allreduce(grad, op, scale, group, compression), None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    op: Op = "sum",
    *,
    scale: float | None = None,
    group: Group | None = None,
    compression: Compressing = None,
) -> torch.Tensor:
    """Return the reduction of `tensor` across ranks, as a new tensor that autograd sees through.

    Args:
        tensor: any torch tensor (CPU or CUDA).
        op: `"sum"` (default), `"avg"`, `"min"`, `"max"` or `"prod"` (the last three have no
            gradient).
        scale: multiply the result by this afterwards.
        group: reduce among the ranks of this `dp.new_group` only (default: the world).
        compression: `dp.Compression.fp16` or `.bf16` (forward and backward travel in 16 bits).

    The gradient is `allreduce(grad, op, scale=scale)`: Horovod's, and exact for `sum`/`avg`.

    >>> import torch, dataparallel as dp
    >>> _ = dp.initialize("single")
    >>> x = torch.ones(2, requires_grad=True)
    >>> dp.torch.allreduce(x, "avg").sum().backward()
    >>> x.grad
    tensor([1., 1.])
    """
    return _Allreduce.apply(_tensor("allreduce", tensor), op, scale, group, compression)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Ctx, x: torch.Tensor, group: Group | None) -> torch.Tensor:
        ctx.group, ctx.shape = group, x.shape
        result: torch.Tensor = gathers.allgather(x.detach(), group=group)
        return result

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> Grads:
        group, shape = ctx.group, ctx.shape
        reduced = _allreduce(grad, "avg", None, group, None)
        rows = shape[0] if len(shape) else 1
        every = gathers.allgather(torch.tensor([rows]), group=group)
        offset = int(every[: world.rank(group)].sum())
        return reduced.narrow(0, offset, rows).reshape(shape), None


def allgather(tensor: torch.Tensor, *, group: Group | None = None) -> torch.Tensor:
    """Return every rank's `tensor` concatenated along the first axis, differentiably.

    The first axis may differ between ranks. The gradient of this rank's rows is the average over
    ranks of the gradients of the gathered result, at those rows (Horovod's).
    """
    return _Allgather.apply(_tensor("allgather", tensor), group)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Ctx, x: torch.Tensor, root: int, group: Group | None) -> torch.Tensor:
        ctx.root, ctx.group = root, group
        out = x.detach().clone(memory_format=torch.contiguous_format)
        result: torch.Tensor = broadcasts.broadcast(out, root=root, group=group)
        return result

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> Grads:
        reduced = _allreduce(grad, "avg", None, ctx.group, None)
        if world.rank(ctx.group) != ctx.root:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None


def broadcast(tensor: torch.Tensor, root: int = 0, *, group: Group | None = None) -> torch.Tensor:
    """Return `root`'s `tensor` on every rank, as a new tensor, differentiably.

    `root` is a rank of `group` when one is given. The gradient is the average over ranks of the
    result's gradients on the root, and zeros on the other ranks (Horovod's).
    """
    return _Broadcast.apply(_tensor("broadcast", tensor), root, group)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Ctx, x: torch.Tensor, splits: Splits, group: Group | None
    ) -> tuple[torch.Tensor, list[int]]:
        result, received = exchanges.alltoall(x.detach(), splits=splits, group=group)
        ctx.received, ctx.group = received, group
        if isinstance(received, torch.Tensor):
            ctx.mark_non_differentiable(received)
        return result, received

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor, *_: object) -> Grads:
        back, _received = exchanges.alltoall(
            grad.contiguous(), splits=ctx.received, group=ctx.group
        )
        return back, None, None


def alltoall(
    tensor: torch.Tensor, splits: Splits = None, *, group: Group | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Send `splits[i]` rows of `tensor` to rank i; return the rows received and their splits.

    As `dp.alltoall` (default splits: equal parts), differentiably: the gradient goes back
    through an alltoall with the received splits.
    """
    result, received = _Alltoall.apply(_tensor("alltoall", tensor), splits, group)
    return result, received


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Ctx, x: torch.Tensor, op: Op, scale: float | None, group: Group | None
    ) -> torch.Tensor:
        ctx.op, ctx.scale, ctx.group = op, scale, group
        result: torch.Tensor = scatters.reducescatter(x.detach(), op=op, scale=scale, group=group)
        return result

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> Grads:
        op, scale, group = ctx.op, ctx.scale, ctx.group
        if op not in ("sum", "avg"):
            raise RuntimeError(
                f"dp.torch.reducescatter(op={op!r}) has no gradient; only 'sum' and 'avg' "
                "are differentiable."
            )
        factor = (1.0 if scale is None else float(scale)) * (
            world.size(group) if op == "sum" else 1
        )
        scaled = grad * factor if factor != 1 else grad
        return gathers.allgather(scaled, group=group), None, None, None


def reducescatter(
    tensor: torch.Tensor, op: Op = "sum", *, scale: float | None = None, group: Group | None = None
) -> torch.Tensor:
    """Reduce `tensor` across ranks and return this rank's rows, differentiably.

    As `dp.reducescatter` (the first `n % size` ranks get one row more). The gradient is the
    allgather of the result's gradients, times `scale`, times the group's size for `"sum"`
    (Horovod's).
    """
    return _Reducescatter.apply(_tensor("reducescatter", tensor), op, scale, group)
