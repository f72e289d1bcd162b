"""Horovod's reducescatter (plain, grouped, async): `dp.reducescatter` on the process set.

Rank r of the set keeps `n // size` rows of each tensor, one more when `r < n % size` (Horovod's
split). `op`, `prescale_factor` and `postscale_factor` follow the allreduce's rules
(`_reductions.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from dataparallel.collectives import scatters
from dataparallel.horovod.torch import _handles
from dataparallel.horovod.torch._autograd import through
from dataparallel.horovod.torch._basics import Average, Sum
from dataparallel.horovod.torch._movement import allgather
from dataparallel.horovod.torch._process_sets import ProcessSet, global_process_set, group_of
from dataparallel.horovod.torch._reductions import (
    Codec,
    check_tensor,
    compress,
    copy_of,
    decompress,
    scaled,
    scaling,
)

__all__ = [
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "reducescatter",
    "reducescatter_async",
]


def _start_reducescatter(
    inputs: list[torch.Tensor], op: int, pre: float, post: float, ps: ProcessSet
) -> _handles.Started:
    group = group_of(ps)
    how = scaling(inputs, op, pre, post, ps.size() or 1)
    copies = [scaled(copy_of(t), how.pre) if how.pre else t.detach() for t in inputs]
    results = scatters.reducescatter(copies, op=how.op, scale=how.scale, group=group)
    return _handles.Done([scaled(r, how.post) for r in results])


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start a reduction of which each process keeps its part of the first axis."""
    check_tensor(tensor)

    def start() -> _handles.Started:
        started = _start_reducescatter([tensor], op, prescale_factor, postscale_factor, process_set)
        return _handles.Then(started, lambda out: out[0])

    return _handles.submit("reducescatter", name, start)


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Codec | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce `tensor` across the set; return this process's part of the first axis.

    Rank r of the set keeps `n // size` rows, one more when `r < n % size` (Horovod's split).
    """
    check_tensor(tensor)
    return grouped_reducescatter(
        [tensor], name, compression, op, process_set, prescale_factor, postscale_factor
    )[0]


def _scatter_grad(
    g: torch.Tensor, op: int, pre: float, post: float, ps: ProcessSet
) -> torch.Tensor:
    """Horovod's gradient of a reducescatter: the allgather of the parts' gradients, scaled."""
    grad = allgather(g, process_set=ps)
    factor = ((ps.size() or 1) if op == Sum else 1) * pre * post
    return grad * factor if factor != 1 else grad


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start a fused reducescatter of a list of tensors."""
    for t in tensors:
        check_tensor(t)
    listed = list(tensors)

    def start() -> _handles.Started:
        return _start_reducescatter(listed, op, prescale_factor, postscale_factor, process_set)

    return _handles.submit("reducescatter", name, start)


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: Codec | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Reducescatter a list of tensors in one fused call; return this process's parts."""
    for t in tensors:
        check_tensor(t)
    packed = [compress(compression, t) for t in tensors]
    pre, post, ps = prescale_factor, postscale_factor, process_set

    def forward(*ts: torch.Tensor) -> list[torch.Tensor]:
        start = partial(_start_reducescatter, list(ts), op, pre, post, ps)
        return list(_handles.blocking("reducescatter", name, start))

    def backward(*gs: torch.Tensor) -> list[torch.Tensor]:
        return [_scatter_grad(g, op, pre, post, ps) for g in gs]

    results = through(forward, backward, *[c for c, _ in packed])
    return [decompress(compression, r, ctx) for r, (_, ctx) in zip(results, packed, strict=True)]
