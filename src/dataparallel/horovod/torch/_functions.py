"""Horovod's helpers over whole objects: parameters, optimizer state, picklable objects; and
the synchronization points `join` and `barrier`.

`broadcast_parameters` is one fused `dp.broadcast`; `broadcast_optimizer_state` is
`dp.synchronize(optimizer)` (hyper-parameters and per-parameter state, including state that
exists on the root only), after creating the state the way Horovod does when this process has
none yet; `broadcast_object` and `allgather_object` are dataparallel's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch

from dataparallel import training
from dataparallel.collectives import broadcasts, objects
from dataparallel.collectives.join import join as join_world
from dataparallel.horovod.torch import _handles
from dataparallel.horovod.torch._process_sets import (
    ProcessSet,
    global_process_set,
    group_of,
    root_in,
)
from dataparallel.horovod.torch._reductions import check_tensor

__all__ = [
    "allgather_object",
    "barrier",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "join",
]


_T = TypeVar("_T")


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Sequence[torch.Tensor | tuple[str, torch.Tensor]],
    root_rank: int,
) -> None:
    """Copy `root_rank`'s parameters into every process's, in place, in one fused broadcast.

    Args:
        params: `model.state_dict()`, `model.named_parameters()` (as a list), or a list of
            tensors (or of `(name, tensor)` pairs).
        root_rank: the rank whose values win.
    """
    if isinstance(params, dict):
        pairs = sorted(params.items())
    elif isinstance(params, list):
        pairs = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    tensors = [p for _, p in pairs]
    for t in tensors:
        check_tensor(t)
    _handles.blocking(
        "broadcast", None, lambda: _handles.Done(broadcasts.broadcast(tensors, root=root_rank))
    )


def _inner_step(optimizer: torch.optim.Optimizer) -> None:
    """Run the wrapped optimizer's own step, without reducing gradients."""
    inner = getattr(type(optimizer), "_hvd_inner_class", None)
    if inner is None:
        optimizer.step()
    else:
        inner.step(optimizer)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: torch.nn.Module | None = None
) -> None:
    """Make every process hold `root_rank`'s optimizer state (hyper-parameters included).

    As in Horovod, a process whose optimizer has no state yet creates it first by a step on zero
    gradients (sparse ones for `SparseAdam` and for sparse embeddings of `model`), which leaves
    those zero gradients in place.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state_dict()["state"]:
        sparse: set[int] = set()
        if model is not None:
            for m in model.modules():
                if isinstance(m, torch.nn.Embedding) and m.sparse:
                    sparse.update(id(p) for p in m.parameters())
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
                    if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse
                    ):
                        p.grad = p.grad.to_sparse()
        _inner_step(optimizer)
    _handles.blocking(
        "broadcast", None, lambda: _handles.Done(training.synchronize(optimizer, root=root_rank))
    )


def broadcast_object(
    obj: _T,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> _T:
    """Return `root_rank`'s `obj` (anything picklable) on every process of the set."""

    def start() -> _handles.Started:
        group = group_of(process_set)
        return _handles.Done(
            objects.broadcast_object(obj, root=root_in(process_set, root_rank), group=group)
        )

    return _handles.blocking("broadcast_object", None, start)


def allgather_object(
    obj: _T, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[_T]:
    """Return the list of every process's `obj` (anything picklable), in rank order."""
    return _handles.blocking(
        "allgather_object",
        None,
        lambda: _handles.Done(objects.allgather_object(obj, group=group_of(process_set))),
    )


def join(device: int = -1) -> int:
    """Tell the others this process has run out of data; return the rank that joined last.

    Until every process has joined, this one takes part in the others' reductions
    (allreduces, gradient reductions of `DistributedOptimizer`) with zeros, so they do not hang
    and averages divide by the whole world, as in Horovod (`dp.join`). Operations queued here
    are completed first. `device` is accepted for Horovod's signature.
    """
    _handles.wait_started()
    return join_world()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every process of the set has reached the barrier.

    Operations queued with `*_async` are not started by it (as in Horovod, a barrier does not
    wait for them).
    """
    objects.barrier(group=group_of(process_set))
